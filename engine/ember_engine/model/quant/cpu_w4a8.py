"""`w4a8-fp8` on the CPU (`w4a8_linear.py`): loops compiled with numba (the options live in this file
because numba's cache knows a function by its file's contents).

A weight row is decoded into a float32 row, group by group: the group's 16 E4M3 values (bytes, decoded
by `cpu_decode.e4m3`) into a small table, then each byte's two codes looked up. Decode batches (up to
`W4A8_FUSED_ROWS` activation rows) multiply each decoded row, which stays in the core's cache, with every
activation row; larger ones decode a block of rows for torch's float32 matmul (`cpu_decode.blocked`).
Either way y = (q_x * s_x) @ (e4m3 * s2)^T in float32, the product transformers and ModelOpt's simulation
compute, the activations E4M3 under their static scale, then decoded.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant.cpu_decode import E4M3_UNIT, blocked, e4m3, fp8_dequantize

W4A8_FUSED_ROWS = 8
FAST = {"reassoc", "contract"}


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


@_compiled
def _decode_row(src, table, i, scale, values, row):
    """row[:] = weight row i's values times `scale`: each group's 16 E4M3 bytes table[i, g] decoded into
    `values`, then byte j's low and high codes looked up for columns 2j and 2j + 1."""
    groups = table.shape[1]
    per = src.shape[1] // groups  # bytes a group
    for g in range(groups):
        for c in range(16):
            values[c] = e4m3(np.int32(table[i, g, c])) * scale
        base = g * per
        for j in range(per):
            b = np.int32(src[i, base + j])
            row[2 * (base + j)] = values[b & 15]
            row[2 * (base + j) + 1] = values[b >> 4]


@_compiled
def _times_rows(src, table, scale, x, out):
    """out[r, i] = x[r] . (weight row i) * scale[i]: each weight row decoded once, then multiplied with
    every activation row."""
    values = np.empty(16, dtype=np.float32)
    row = np.empty(x.shape[1], dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, table, i, E4M3_UNIT, values, row)
        s = scale[i]
        for r in range(x.shape[0]):
            acc = np.float32(0)
            for j in range(row.shape[0]):
                acc += row[j] * x[r, j]
            out[r, i] = acc * s


@_compiled
def _decode(src, table, scale, out):
    """out[i] = weight row i's float32 values times scale[i]."""
    values = np.empty(16, dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, table, i, scale[i] * E4M3_UNIT, values, out[i])


def matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, packed: torch.Tensor, table: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """(xq * x_scale) @ (table's E4M3 values of the codes * scale per row)^T in float32 [m, n]: xq [m, k]
    E4M3 with x_scale [m, 1]; codes two a byte, packed [n, k / 2]; table [n, groups, 16] E4M3."""
    x = fp8_dequantize(xq, x_scale)
    m, n = x.shape[0], packed.shape[0]
    weight = (
        packed.contiguous().numpy(),
        table.contiguous().view(torch.uint8).numpy(),
        scale.float().numpy(),
    )
    if 0 < m <= W4A8_FUSED_ROWS:
        out = np.empty((m, n), dtype=np.float32)
        _times_rows(*weight, x.numpy(), out)
        return torch.from_numpy(out)
    return blocked(_decode, weight, x)


def warm_up() -> None:
    """Compile the loops (or load them from numba's cache) before serving."""
    table = torch.zeros(2, 1, 16, dtype=torch.float8_e4m3fn)
    for m in (1, W4A8_FUSED_ROWS + 1):
        xq = torch.zeros(m, 4, dtype=torch.float8_e4m3fn)
        matmul(xq, torch.ones(m, 1), torch.zeros(2, 2, dtype=torch.uint8), table, torch.ones(2))
