"""w4a16 on the CPU: loops compiled (numba; the options live in this file because numba's cache knows a
function by its file's contents), and `cpu_decode`'s fused product.

Decode batches (up to `INT4_FUSED_ROWS` activation rows) go through one loop that reads each packed byte
once and multiplies its two nibbles, less 8, with the activations' even and odd columns, a group of 128
columns at a time, each group's sum (less its zero point times the group's sum of the activations, for a
checkpoint with zero points) times its scale: the weight is never widened. Larger batches, bound by
arithmetic rather than by weight bytes, decode a block of weight rows at a time to float32 ((value - zero)
* scale, in a cache-sized scratch) for torch's float32 matmul (`cpu_decode.blocked`). Either way y = x @
((q_w - z_w) * s_w)^T in float32, the activations at float32 precision. On one 8192 x 2048 weight at
batch 1, unpacking with tensor operations, then dequantizing to float32, took 115 ms a call, the fused
loop 2.3. On a 4096 x 14336 weight (two cores, median of 5) the blocked decode took 18 ms at 16 rows, 45
at 64 and 160 at 256, where unpacking to int8 for the group-by-group int8 matmul took 47, 88 and 1000,
and float32's matmul 29, 64 and 181.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant.cpu_decode import as_grid, blocked, fused

# Activation rows up to which the fused loop is faster than the blocked decode: on a 4096 x 14336 weight
# in groups of 128 on two cores (median of 5), 14.6 ms against 17.5 at 8 rows (the blocked decode 18.7
# at 9). (Against the earlier path above it, unpacking for the int8 matmul, on an 8192 x 2048 weight: 7.4
# ms against 7.0-7.4 at 8 rows, 11.1 against 8.1 at 12.)
INT4_FUSED_ROWS = 8
_NO_ZEROS = np.zeros((0, 0), dtype=np.int8)  # what the fused loops get for a symmetric weight
FAST = {"reassoc", "contract"}


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


@_compiled
def _nibbles_times_row(src, scale, zero, xe, xo, xsum, out):
    """int4: out[0, i] = sum over groups of scale[i, g] * (the group's sum of (low nibble - 8) * xe +
    (high nibble - 8) * xo, less zero[i, g] * xsum[0, g]), where xe and xo hold x's even and odd columns
    (byte j holds columns 2j, 2j + 1) and xsum x's sum over each group. `zero` (a checkpoint's zero points,
    each less 8) may have no rows: symmetric, nothing subtracted."""
    zeros = zero.shape[0] > 0
    cols = src.shape[1]
    groups = scale.shape[1]
    group = cols // groups
    for i in range(src.shape[0]):
        total = np.float32(0)
        for g in range(groups):
            lo = g * group
            bs = src[i, lo : lo + group]
            e0 = xe[0, lo : lo + group]
            o0 = xo[0, lo : lo + group]
            acc = np.float32(0)
            for j in range(group):
                b = np.int32(bs[j])
                acc += np.float32((b & 15) - 8) * e0[j] + np.float32((b >> 4) - 8) * o0[j]
            if zeros:
                acc -= np.float32(zero[i, g]) * xsum[0, g]
            total += acc * scale[i, g]
        out[0, i] = total


@_compiled
def _nibbles_times_rows(src, scale, zero, xe, xo, xsum, out):
    """`_nibbles_times_row` for activation rows in chunks of four, as `cpu_decode._fp8_times_rows`."""
    zeros = zero.shape[0] > 0
    cols = src.shape[1]
    groups = scale.shape[1]
    group = cols // groups
    for i in range(src.shape[0]):
        for c in range(0, xe.shape[0], 4):
            t0 = t1 = t2 = t3 = np.float32(0)
            for g in range(groups):
                lo = g * group
                bs = src[i, lo : lo + group]
                e0 = xe[c, lo : lo + group]
                e1 = xe[c + 1, lo : lo + group]
                e2 = xe[c + 2, lo : lo + group]
                e3 = xe[c + 3, lo : lo + group]
                o0 = xo[c, lo : lo + group]
                o1 = xo[c + 1, lo : lo + group]
                o2 = xo[c + 2, lo : lo + group]
                o3 = xo[c + 3, lo : lo + group]
                a0 = a1 = a2 = a3 = np.float32(0)
                for j in range(group):
                    b = np.int32(bs[j])
                    lo4 = np.float32((b & 15) - 8)
                    hi4 = np.float32((b >> 4) - 8)
                    a0 += lo4 * e0[j] + hi4 * o0[j]
                    a1 += lo4 * e1[j] + hi4 * o1[j]
                    a2 += lo4 * e2[j] + hi4 * o2[j]
                    a3 += lo4 * e3[j] + hi4 * o3[j]
                if zeros:
                    z = np.float32(zero[i, g])
                    a0 -= z * xsum[c, g]
                    a1 -= z * xsum[c + 1, g]
                    a2 -= z * xsum[c + 2, g]
                    a3 -= z * xsum[c + 3, g]
                s = scale[i, g]
                t0 += a0 * s
                t1 += a1 * s
                t2 += a2 * s
                t3 += a3 * s
            out[c, i] = t0
            out[c + 1, i] = t1
            out[c + 2, i] = t2
            out[c + 3, i] = t3


@_compiled
def _nibbles_decode(src, scale, zero, out):
    """out[i, 2j] and out[i, 2j + 1] = (low and high nibble of src[i, j], each less 8, less zero[i, g]) times
    scale[i, g] for the group g of their columns; `zero` as `_nibbles_times_row`'s."""
    zeros = zero.shape[0] > 0
    rows, cols = src.shape
    groups = scale.shape[1]
    group = cols // groups  # bytes a group
    for i in range(rows):
        for g in range(groups):
            s = scale[i, g]
            z = np.float32(zero[i, g]) if zeros else np.float32(0)
            bs = src[i, g * group : (g + 1) * group]
            os = out[i, 2 * g * group : 2 * (g + 1) * group]
            for j in range(group):
                b = np.int32(bs[j])
                os[2 * j] = (np.float32((b & 15) - 8) - z) * s
                os[2 * j + 1] = (np.float32((b >> 4) - 8) - z) * s


def int4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None
) -> torch.Tensor:
    """x [m, in] times the int4 weight (packed [out, in / 2], float32 scale [out, groups], and a
    checkpoint's zero points, each less 8, int8 or float32 [out, groups], where it has them), transposed:
    [m, out] in x's dtype, at float32 precision: the fused loops up to `INT4_FUSED_ROWS` rows, the blocked
    decode for torch's float32 matmul above."""
    m, n = x.shape[0], packed.shape[0]
    xf = x.float()
    zeros = _NO_ZEROS if zero is None else zero.contiguous().numpy()
    weight = (packed.contiguous().numpy(), as_grid(scale, n), zeros)
    if not 0 < m <= INT4_FUSED_ROWS:
        return blocked(_nibbles_decode, weight, xf).to(x.dtype)
    groups = scale.shape[1]
    # a group's sum of x, for the zero points (none to take for a symmetric weight)
    xsum = xf[:, :0] if zero is None else xf.reshape(m, groups, -1).sum(dim=-1)
    y = fused(_nibbles_times_row, _nibbles_times_rows, m, n, weight, (xf[:, 0::2], xf[:, 1::2], xsum))
    return y.to(x.dtype)


def warm_up(float_zeros: bool = False) -> None:
    """Compile the loops (or load them from numba's cache) before serving: the fused ones for one and for
    several rows, and the larger batches' decode; with `float_zeros` each for float32 zero points too."""
    for m in (1, 2, INT4_FUSED_ROWS + 1):
        int4_matmul(torch.zeros(m, 16), torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1))
    for m in (1, 2, INT4_FUSED_ROWS + 1) if float_zeros else ():
        int4_matmul(
            torch.zeros(m, 16), torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1)
        )
