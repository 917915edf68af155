"""NVFP4 weights on the CPU: loops compiled (numba; the options live in this file because numba's cache
knows a function by its file's contents).

A byte holds two FP4 E2M1 values, column 2j in its low nibble: bit 3 the sign, bits 2-1 the exponent,
bit 0 the mantissa, worth 0, 0.5, 1, 1.5, 2, 3, 4 or 6. The loops decode a nibble through a float16 with
its bits (`_e2m1`, as `cpu_decode.e4m3` does for E4M3) and scale it by its group's scale: the group's E4M3
byte decoded and divided by its row's global scale, as the layer's `group_scales` computes it.

Decode batches (up to `FP4_FUSED_ROWS` activation rows) never widen the weight in memory: one row's
products are taken over the whole input in one loop, then summed by group and scaled; for more rows each
weight row is decoded and scaled once into a float32 row (which stays in the core's cache) and multiplied
with every activation row. Larger batches decode a block of weight rows into a float32 scratch for
torch's float32 matmul. Either way y = x @ (v_w * s_w)^T in float32, the activations as they are. On one
8192 x 2048 weight (two cores, best of 7): 3.9 ms at one row (float32's matmul 3.8), 8.5 ms at four
(9.1), 15.8 at 32 (12.7); w4a16's loops took 2.3, 3.7 and 15.0 in the same run (a scale there covers 128
columns, here 16). The first loops, a branch per nibble and a group of 16 columns at a time, took 17 ms
at one row.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant.cpu_decode import E4M3_UNIT, blocked, e4m3
from ember_engine.model.quant.cpu_half import half_to_float

FP4_FUSED_ROWS = 8
FAST = {"reassoc", "contract"}


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


# `_e2m1` gives a nibble's value over this; the loops fold it into the scales (a power of two: exact).
E2M1_UNIT = np.float32(2.0**14)


@_compiled
def _e2m1(nibble):
    """The E2M1 value of a nibble (int32 in [0, 16)) divided by `E2M1_UNIT`, as float32, exact: the sign
    moved to a float16's top bit and the exponent and mantissa to the low bits of its exponent and the top
    of its mantissa make a float16 worth exactly 2^-14 of the value, the subnormal 0.5 included, which
    converts to float32 in one vector instruction (`cpu_half.half_to_float`)."""
    bits = ((nibble & np.int32(8)) << np.int32(12)) | ((nibble & np.int32(7)) << np.int32(9))
    return half_to_float(bits)  # type: ignore[call-arg]


@_compiled
def _row_scales(scale, gscale, i, out):
    """out[g] = row i's group g scale (its E4M3 byte over the row's global scale) times E2M1_UNIT."""
    for g in range(scale.shape[1]):
        out[g] = e4m3(np.int32(scale[i, g])) * (E4M3_UNIT * E2M1_UNIT) / gscale[i]


@_compiled
def _buffers(groups, half):
    """Scratch for one weight row: its group scales, and its even and odd columns' values."""
    return (
        np.empty(groups, dtype=np.float32),
        np.empty(half, dtype=np.float32),
        np.empty(half, dtype=np.float32),
    )


@_compiled
def _decode_row(src, scale, gscale, i, s, even, odd):
    """even[j], odd[j] = row i's byte j's low and high values, each times its group's scale (s[j // 8],
    written here by `_row_scales`)."""
    _row_scales(scale, gscale, i, s)
    for g in range(s.shape[0]):
        f = s[g]
        for j in range(8 * g, 8 * g + 8):
            b = np.int32(src[i, j])
            even[j] = _e2m1(b & np.int32(15)) * f
            odd[j] = _e2m1(b >> np.int32(4)) * f


@_compiled
def _fp4_times_row(src, scale, gscale, xe, xo, out):
    """One activation row (x as its even and odd columns): out[0, i] = sum over groups g of row i's scale
    s[g] times the group's sum of the products, the products of the whole row taken first in one long
    loop."""
    half = src.shape[1]
    s, ev, od = _buffers(scale.shape[1], half)
    for i in range(src.shape[0]):
        _row_scales(scale, gscale, i, s)
        for j in range(half):
            b = np.int32(src[i, j])
            ev[j] = _e2m1(b & np.int32(15)) * xe[0, j]
            od[j] = _e2m1(b >> np.int32(4)) * xo[0, j]
        total = np.float32(0)
        for g in range(s.shape[0]):
            acc = np.float32(0)
            for j in range(8 * g, 8 * g + 8):
                acc += ev[j] + od[j]
            total += acc * s[g]
        out[0, i] = total


@_compiled
def _fp4_times_rows(src, scale, gscale, xe, xo, out):
    """out[r, i] = x[r] . (weight row i), x given as its even and odd columns: each weight row decoded
    once into two float32 halves (they stay in the core's cache), then multiplied with every row."""
    half = xe.shape[1]
    s, even, odd = _buffers(scale.shape[1], half)
    for i in range(src.shape[0]):
        _decode_row(src, scale, gscale, i, s, even, odd)
        for r in range(xe.shape[0]):
            acc = np.float32(0)
            for j in range(half):
                acc += even[j] * xe[r, j] + odd[j] * xo[r, j]
            out[r, i] = acc


@_compiled
def _decode(src, scale, gscale, out):
    """out[i] = weight row i's float32 values, each times its group's scale (E4M3 scale bytes [rows,
    groups] over global scales [rows])."""
    half = src.shape[1]
    s, even, odd = _buffers(scale.shape[1], half)
    for i in range(src.shape[0]):
        _decode_row(src, scale, gscale, i, s, even, odd)
        row = out[i]
        for j in range(half):
            row[2 * j] = even[j]
            row[2 * j + 1] = odd[j]


def _operands(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> tuple:
    return (
        packed.contiguous().numpy(),
        scale.contiguous().view(torch.uint8).numpy(),
        global_scale.float().contiguous().numpy(),
    )


def dequantize(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Packed bytes [out, in / 2], E4M3 group scales [out, in / group] and global scales [out] -> the
    float32 weight [out, in]."""
    src, scales, gscale = _operands(packed, scale, global_scale)
    out = torch.empty(src.shape[0], 2 * src.shape[1], dtype=torch.float32)
    _decode(src, scales, gscale, out.numpy())
    return out


def fp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """x [m, in] times the FP4 weight (packed [out, in / 2], E4M3 scales [out, groups], global scales
    [out]), transposed: [m, out] in x's dtype, computed in float32."""
    m = x.shape[0]
    n = packed.shape[0]
    xf = x.float()
    src, scales, gscale = _operands(packed, scale, global_scale)
    if 0 < m <= FP4_FUSED_ROWS:
        out = np.empty((m, n), dtype=np.float32)
        xe, xo = xf[:, 0::2].contiguous().numpy(), xf[:, 1::2].contiguous().numpy()
        (_fp4_times_row if m == 1 else _fp4_times_rows)(src, scales, gscale, xe, xo, out)
        return torch.from_numpy(out).to(x.dtype)
    return blocked(_decode, (src, scales, gscale), xf).to(x.dtype)


def warm_up() -> None:
    """Compile the loops (or load them from numba's cache) before serving: the fused ones for one and for
    several rows, and the larger batches' decoder."""
    for m in (1, 2, FP4_FUSED_ROWS + 1):
        fp4_matmul(
            torch.zeros(m, 16),
            torch.zeros(2, 8, dtype=torch.uint8),
            torch.ones(2, 1, dtype=torch.float8_e4m3fn),
            torch.ones(2),
        )
