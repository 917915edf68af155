"""4-bit codebook weights on the CPU (bitsandbytes NF4 and FP4, GGUF's lattice i-quants): loops compiled
with numba (the options live in this file because numba's cache knows a function by its file's contents).

A byte holds two 4-bit codes, column 2j in its low nibble; a weight is `table[code]` (16 float32 values)
times its block's scale (one float32 per output row and block of `block` input columns). The loops look a
whole byte up in a 256-entry table of value pairs (`pair_table`: the two float32 values side by side, one
64-bit entry), so one lookup gives two weights in column order. Decode batches (up to
`CODEBOOK_FUSED_ROWS` activation rows) never widen the weight in memory: for one row a weight row's
values are looked up into a buffer (a few KB), then each block's multiplied and summed, the sum times the
block's scale; for more, each weight row is decoded once into a float32 row (which stays in the core's
cache) and multiplied with every activation row. Larger batches decode a block of weight rows into a
float32 scratch for torch's float32 matmul (`cpu_decode.blocked`). Either way y = x @ (table[codes] *
scale)^T in float32, the activations as they are. On one 8192 x 2048 weight (best of 5; float32's matmul
3.3 ms at one row): at one row 16.2 ms looking each code up inside the product loop, 9.5 looking a block's
codes up first, 5.4 a byte at a time; at 4 rows 11.3 and 7.5, at 32 rows 24.1 and 18.1 (the last two
columns: code by code and byte by byte). Later, at one row (best of 7; float32's 2.8 ms), looking a whole
weight row's bytes up before the blocks' products rather than each block's just before its own: 3.8 ms
to 2.0 in blocks of 64 columns, 6.2 to 2.3 in blocks of 32 and 10.6 to 2.7 in blocks of 16.
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


def pair_table(table: torch.Tensor) -> torch.Tensor:
    """The 256 bytes' value pairs, (table[byte & 15], table[byte >> 4]) as float32 side by side, each pair
    one int64 (what the loops look up)."""
    byte = torch.arange(256, device=table.device)
    pairs = torch.stack([table.float()[byte & 15], table.float()[byte >> 4]], dim=1).contiguous()
    return pairs.view(torch.int64).reshape(256)


@_compiled
def _decode_row(src, pairs, scale, i, buf, row):
    """row[:] = weight row i's float32 values, each times its block's scale: a block's bytes looked up
    into buf (int64 scratch, one entry a byte of a block; it stays in L1), then scaled into the row.
    (Looking the whole row up first, then scaling, took twice as long: the scaling did not vectorize.)"""
    per = buf.shape[0]
    values = buf.view(np.float32)
    for g in range(scale.shape[1]):
        base = per * g
        for j in range(per):
            buf[j] = pairs[src[i, base + j]]
        s = scale[i, g]
        for j in range(2 * per):
            row[2 * base + j] = values[j] * s


@_compiled
def _times_row(src, pairs, scale, x, out):
    """One activation row: out[0, i] = sum over blocks of the block's scale times its sum of products, the
    weight row's bytes all looked up into a buffer first (one long loop), then each block's products (they
    vectorize). Looking a block's bytes up just before its products cost 2x to 4x more with blocks of 64 to
    16 columns: the short loops did not pay their way."""
    n = src.shape[1]
    per = n // scale.shape[1]  # bytes per block
    buf = np.empty(n, dtype=np.int64)
    values = buf.view(np.float32)
    for i in range(src.shape[0]):
        for j in range(n):
            buf[j] = pairs[src[i, j]]
        total = np.float32(0)
        for g in range(scale.shape[1]):
            base = 2 * per * g
            acc = np.float32(0)
            for j in range(2 * per):
                acc += values[base + j] * x[0, base + j]
            total += acc * scale[i, g]
        out[0, i] = total


@_compiled
def _times_rows(src, pairs, scale, x, out):
    """out[r, i] = x[r] . (weight row i): each weight row decoded once, then multiplied with every row."""
    buf = np.empty(src.shape[1] // scale.shape[1], dtype=np.int64)
    row = np.empty(x.shape[1], dtype=np.float32)
    for i in range(src.shape[0]):
        _decode_row(src, pairs, scale, i, buf, row)
        for r in range(x.shape[0]):
            acc = np.float32(0)
            for j in range(row.shape[0]):
                acc += row[j] * x[r, j]
            out[r, i] = acc


@_compiled
def _decode(src, pairs, scale, out):
    """out[i] = weight row i's float32 values."""
    buf = np.empty(src.shape[1] // scale.shape[1], dtype=np.int64)
    for i in range(src.shape[0]):
        _decode_row(src, pairs, scale, i, buf, out[i])


def dequantize(codes: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes [out, in / 2], `pair_table` [256], block scales [out, in / block] -> the float32 weight."""
    out = torch.empty(codes.shape[0], 2 * codes.shape[1], dtype=torch.float32)
    _decode(codes.contiguous().numpy(), pairs.numpy(), scale.float().contiguous().numpy(), out.numpy())
    return out


def codebook_matmul(
    x: torch.Tensor, codes: torch.Tensor, pairs: torch.Tensor, scale: torch.Tensor
) -> torch.Tensor:
    """x [m, in] times the codebook weight (codes [out, in / 2], `pair_table` [256], block scales),
    transposed: [m, out] in x's dtype, computed in float32."""
    m, n = x.shape[0], codes.shape[0]
    xf = x.float().contiguous()
    src, tab, sc = codes.contiguous().numpy(), pairs.numpy(), scale.float().contiguous().numpy()
    if 0 < m <= CODEBOOK_FUSED_ROWS:
        out = np.empty((m, n), dtype=np.float32)
        (_times_row if m == 1 else _times_rows)(src, tab, sc, xf.numpy(), out)
        return torch.from_numpy(out).to(x.dtype)
    return blocked(lambda rows, scales, out: _decode(rows, tab, scales, out), (src, sc), xf).to(x.dtype)


def warm_up() -> None:
    """Compile the loops (or load them from numba's cache) before serving."""
    pairs = pair_table(torch.ones(16))
    for m in (1, 2, CODEBOOK_FUSED_ROWS + 1):
        codebook_matmul(torch.zeros(m, 4), torch.zeros(2, 2, dtype=torch.uint8), pairs, torch.ones(2, 1))
