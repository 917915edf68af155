"""4-bit codebook weights on the CPU (bitsandbytes NF4 and FP4): loops compiled with numba (the options
live in this file because numba's cache knows a function by its file's contents).

A byte holds two 4-bit codes, column 2j in its low nibble; a weight is `table[code]` (16 float32 values)
times its block's scale (one float32 per output row and block of `block` input columns). Decode batches
(up to `CODEBOOK_FUSED_ROWS` activation rows) never widen the weight in memory: for one row each block's
products are summed and scaled as the codes are read; for more, each weight row is decoded once into a
float32 row (which stays in the core's cache) and multiplied with every activation row. Larger batches
decode a block of weight rows into a float32 scratch for torch's float32 matmul (`cpu_decode.blocked`).
Either way y = x @ (table[codes] * scale)^T in float32, the activations as they are.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant.cpu_decode import blocked

CODEBOOK_FUSED_ROWS = 8
FAST = {"reassoc", "contract"}


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


@_compiled
def _decode_row(src, table, scale, i, even, odd):
    """even[j], odd[j] = row i's byte j's low and high values, each times its block's scale."""
    per = src.shape[1] // scale.shape[1]  # bytes per block
    for g in range(scale.shape[1]):
        s = scale[i, g]
        for j in range(per * g, per * g + per):
            b = np.int32(src[i, j])
            even[j] = table[b & np.int32(15)] * s
            odd[j] = table[b >> np.int32(4)] * s


@_compiled
def _times_row(src, table, scale, xe, xo, out):
    """One activation row (as its even and odd columns): out[0, i] = sum over blocks of the block's scale
    times its sum of products. Each block's values are looked up into a small buffer first and then
    multiplied (1.75x faster than looking up inside the product loop: the products vectorize)."""
    per = src.shape[1] // scale.shape[1]
    even = np.empty(per, dtype=np.float32)
    odd = np.empty(per, dtype=np.float32)
    for i in range(src.shape[0]):
        total = np.float32(0)
        for g in range(scale.shape[1]):
            base = per * g
            for j in range(per):
                b = np.int32(src[i, base + j])
                even[j] = table[b & np.int32(15)]
                odd[j] = table[b >> np.int32(4)]
            acc = np.float32(0)
            for j in range(per):
                acc += even[j] * xe[0, base + j] + odd[j] * xo[0, base + j]
            total += acc * scale[i, g]
        out[0, i] = total


@_compiled
def _times_rows(src, table, scale, xe, xo, out):
    """out[r, i] = x[r] . (weight row i): each weight row decoded once, then multiplied with every row."""
    half = src.shape[1]
    even = np.empty(half, dtype=np.float32)
    odd = np.empty(half, dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, table, scale, i, even, odd)
        for r in range(xe.shape[0]):
            acc = np.float32(0)
            for j in range(half):
                acc += even[j] * xe[r, j] + odd[j] * xo[r, j]
            out[r, i] = acc


@_compiled
def _decode(src, table, scale, out):
    """out[i] = weight row i's float32 values."""
    half = src.shape[1]
    even = np.empty(half, dtype=np.float32)
    odd = np.empty(half, dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, table, scale, i, even, odd)
        row = out[i]
        for j in range(half):
            row[2 * j] = even[j]
            row[2 * j + 1] = odd[j]


def _operands(codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor) -> tuple:
    return (
        codes.contiguous().numpy(),
        table.float().contiguous().numpy(),
        scale.float().contiguous().numpy(),
    )


def dequantize(codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes [out, in / 2], table [16], block scales [out, in / block] -> the float32 weight [out, in]."""
    src, tab, sc = _operands(codes, table, scale)
    out = torch.empty(src.shape[0], 2 * src.shape[1], dtype=torch.float32)
    _decode(src, tab, sc, out.numpy())
    return out


def codebook_matmul(
    x: torch.Tensor, codes: torch.Tensor, table: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """x [m, in] times the codebook weight, transposed: [m, out] in x's dtype, computed in float32."""
    m, n = x.shape[0], codes.shape[0]
    xf = x.float()
    operands = _operands(codes, table, scale)
    if 0 < m <= CODEBOOK_FUSED_ROWS:
        out = np.empty((m, n), dtype=np.float32)
        xe, xo = xf[:, 0::2].contiguous().numpy(), xf[:, 1::2].contiguous().numpy()
        (_times_row if m == 1 else _times_rows)(*operands, xe, xo, out)
        return torch.from_numpy(out).to(x.dtype)
    src, tab, sc = operands
    return blocked(lambda rows, scales, out: _decode(rows, tab, scales, out), (src, sc), xf).to(x.dtype)


def warm_up() -> None:
    """Compile the loops (or load them from numba's cache) before serving."""
    for m in (1, 2, CODEBOOK_FUSED_ROWS + 1):
        codebook_matmul(
            torch.zeros(m, 4), torch.zeros(2, 2, dtype=torch.uint8), torch.ones(16), torch.ones(2, 1)
        )
