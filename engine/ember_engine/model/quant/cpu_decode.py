"""The CPU's quantized-weight loops, compiled (numba): `fp8` (E4M3 bytes) and `w8a16`'s (int8, for a single
activation row, and for a few where the scales are per group of columns), and the fused and blocked
products they share with `cpu_int4` (w4a16). They run where torch's own operations go one element at a
time: its E4M3 conversion and `_scaled_mm` on a CPU took 45 and 95 ms a call on an 8192 x 2048 weight,
where a float32 matmul takes 4. The options live in this file because numba's cache knows a function by
its file's contents.

Decode batches (up to `FP8_FUSED_ROWS` activation rows; for int8 one row, or `INT8_FUSED_ROWS` in groups)
go through one loop that reads each weight byte once, turns it into its value (E4M3 through a float16 with
the same bits, converted by an instruction, or with integer operations where the CPU has none:
`cpu_half`) and adds its products with every row into float32 sums, a group of input columns at a
time, each group's sums times its scale. The loops vectorise: each group is a slice, sums may be reassociated
(NaN and infinities keep their meaning), and up to four activation rows share every decoded value. They
run on the calling thread: handing half the weight rows to a second thread lost in the engine (the `small`
test model decoded 10-16 % slower at batch 1), torch's own threads still spinning for work between layers.

Larger batches (prefill) are bound by arithmetic, not by weight bytes: a block of weight rows is decoded
into a float32 scratch that stays in the cache, each value times its channel's, tile's or group's scale,
and multiplied with torch's float32 matmul (`blocked`). Either way the arithmetic is the dequantized
product transformers + compressed-tensors computes for these checkpoints, in float32: y = (q_x * s_x) @
(q_w * s_w)^T, the activations quantized per token (or per token and group of columns; int8 weights take
them as they are) and the weights scaled per output channel (or per tile or group).
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant import cpu_int8
from ember_engine.model.quant.cpu_half import half_to_float

# Weight rows decoded per blocked fp8 matmul call: this many bytes of float32 scratch, about a core's L2.
SCRATCH_BYTES = 1 << 21
# Activation rows up to which an fp8 product reads the weight bytes once in a fused loop; above, the
# blocked matmul, bound by arithmetic rather than by bytes, is faster. Measured on an 8192 x 2048 weight on
# two cores (best of 15): fused 7.5 ms against blocked 8.8 at 8 rows, 10.1 against 10.4 at 12, 12.8
# against 8.6 at 16. At one row the fused loop takes 1.4 ms, where float32's matmul takes 3.9.
FP8_FUSED_ROWS = 8
# Activation rows up to which an int8 product with a scale per group of columns takes the fused loop; above,
# the blocked matmul. On a 4096 x 14336 weight in groups of 128 on two cores (median of 5): fused 8.7 ms
# against blocked 10.6 and the digit split's 12.6 at four rows; 16.7, 15.8 and 16.6 at eight; blocked
# 17.2 against the split's 23.9 at 16, 44 against 85 at 64 and 150 against 993 at 256 (float32: 162).
# The split, one int8 matmul a group, wins only with few groups and rows (on 4096 x 1024 to 2048, 8 to 16
# groups, 11-26 % less time at 16 and 64 rows) and takes 1.5-1.6x the time at 256 there; the blocked
# decode takes at most 15 % more than float32's matmul (4096 x 512) and less on large weights.
INT8_FUSED_ROWS = 4
FAST = {"reassoc", "contract"}


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, fastmath=FAST, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, fastmath=FAST, error_model="numpy")(fn)


# `e4m3` gives a byte's value over this; the loops fold it into the scales (a power of two: exact).
E4M3_UNIT = np.float32(256.0)


@_compiled
def e4m3(byte):
    """The value of an E4M3 byte (int32 in [0, 256)) divided by `E4M3_UNIT`, as float32, exact. A byte is
    sign | exponent e (4 bits) | mantissa m (3 bits), worth 2^(e - 7) * (1 + m / 8), or m * 2^-9 for e = 0;
    the same bits moved into a float16 (sign to its top bit, e and m to the low bits of its exponent and
    the top of its mantissa) are worth exactly 2^-8 of that, subnormals included, and convert to float32 in
    one vector instruction (a table lookup would be a gather per value, and building float32 bits for the
    subnormals costs several operations more). 0x7F and 0xFF are NaN."""
    bits = ((byte & np.int32(0x80)) << np.int32(8)) | ((byte & np.int32(0x7F)) << np.int32(7))
    # Converted before the choice: written as one conditional expression the loops ran 1.4x slower.
    value = half_to_float(bits)  # type: ignore[call-arg,var-annotated]
    return np.float32(np.nan) if (byte & np.int32(0x7F)) == 0x7F else value


@_compiled
def _decode(src, scale, out):
    """out[i, j] = the E4M3 value of byte src[i, j] times scale[i, j // group], group = columns / groups."""
    rows, cols = src.shape
    groups = scale.shape[1]
    group = cols // groups
    for i in range(rows):
        for g in range(groups):
            s = scale[i, g] * E4M3_UNIT
            bs = src[i, g * group : (g + 1) * group]
            os = out[i, g * group : (g + 1) * group]
            for j in range(bs.shape[0]):
                os[j] = e4m3(np.int32(bs[j])) * s


@_compiled
def _fp8_times_row(src, scale, x, out):
    """out[0, i] = sum over groups g of scale[i, g] * (the E4M3 values of src[i, g-th columns] . x[0, g-th
    columns]), for every weight row i."""
    cols = src.shape[1]
    groups = scale.shape[1]
    group = cols // groups
    for i in range(src.shape[0]):
        total = np.float32(0)
        for g in range(groups):
            lo = g * group
            bs = src[i, lo : lo + group]
            x0 = x[0, lo : lo + group]
            acc = np.float32(0)
            for j in range(group):
                acc += e4m3(np.int32(bs[j])) * x0[j]
            total += acc * (scale[i, g] * E4M3_UNIT)
        out[0, i] = total


@_compiled
def _fp8_times_rows(src, scale, x, out):
    """`_fp8_times_row` for activation rows x [4c, cols] (c chunks of four), out [4c, weight rows]: each
    weight row is read from memory once and decoded once per chunk."""
    cols = src.shape[1]
    groups = scale.shape[1]
    group = cols // groups
    for i in range(src.shape[0]):
        for c in range(0, x.shape[0], 4):
            t0 = t1 = t2 = t3 = np.float32(0)
            for g in range(groups):
                lo = g * group
                bs = src[i, lo : lo + group]
                x0 = x[c, lo : lo + group]
                x1 = x[c + 1, lo : lo + group]
                x2 = x[c + 2, lo : lo + group]
                x3 = x[c + 3, lo : lo + group]
                a0 = a1 = a2 = a3 = np.float32(0)
                for j in range(group):
                    v = e4m3(np.int32(bs[j]))
                    a0 += v * x0[j]
                    a1 += v * x1[j]
                    a2 += v * x2[j]
                    a3 += v * x3[j]
                s = scale[i, g] * E4M3_UNIT
                t0 += a0 * s
                t1 += a1 * s
                t2 += a2 * s
                t3 += a3 * s
            out[c, i] = t0
            out[c + 1, i] = t1
            out[c + 2, i] = t2
            out[c + 3, i] = t3


@_compiled
def _int8_times_row(src, scale, x, out):
    """w8a16: `_fp8_times_row` for int8 weights src (each value as it is), one activation row."""
    cols = src.shape[1]
    groups = scale.shape[1]
    group = cols // groups
    for i in range(src.shape[0]):
        total = np.float32(0)
        for g in range(groups):
            lo = g * group
            bs = src[i, lo : lo + group]
            x0 = x[0, lo : lo + group]
            acc = np.float32(0)
            for j in range(group):
                acc += np.float32(bs[j]) * x0[j]
            total += acc * scale[i, g]
        out[0, i] = total


@_compiled
def _int8_times_rows(src, scale, x, out):
    """w8a16: `_fp8_times_rows` for int8 weights src (each value as it is)."""
    cols = src.shape[1]
    groups = scale.shape[1]
    group = cols // groups
    for i in range(src.shape[0]):
        for c in range(0, x.shape[0], 4):
            t0 = t1 = t2 = t3 = np.float32(0)
            for g in range(groups):
                lo = g * group
                bs = src[i, lo : lo + group]
                x0 = x[c, lo : lo + group]
                x1 = x[c + 1, lo : lo + group]
                x2 = x[c + 2, lo : lo + group]
                x3 = x[c + 3, lo : lo + group]
                a0 = a1 = a2 = a3 = np.float32(0)
                for j in range(group):
                    v = np.float32(bs[j])
                    a0 += v * x0[j]
                    a1 += v * x1[j]
                    a2 += v * x2[j]
                    a3 += v * x3[j]
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
def _int8_decode(src, scale, out):
    """out[i, j] = int8 src[i, j] times scale[i, j // group], group = columns / groups."""
    rows, cols = src.shape
    groups = scale.shape[1]
    group = cols // groups
    for i in range(rows):
        for g in range(groups):
            s = scale[i, g]
            bs = src[i, g * group : (g + 1) * group]
            os = out[i, g * group : (g + 1) * group]
            for j in range(bs.shape[0]):
                os[j] = np.float32(bs[j]) * s


def rows_of_four(x: torch.Tensor) -> np.ndarray:
    """x as float32 [m, k], rows padded with zeros to a multiple of four."""
    m, k = x.shape
    padded = torch.zeros(-(-m // 4) * 4, k, dtype=torch.float32)
    padded[:m] = x
    return padded.numpy()


def as_grid(scale: torch.Tensor, rows: int) -> np.ndarray:
    """A scale as float32 [rows, groups] (a per-row scale [rows] or [rows, 1] has one group)."""
    groups = scale.shape[-1] if scale.dim() == 2 else 1
    return scale.detach().to(torch.float32).reshape(rows, groups).contiguous().numpy()


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 values [r, k] times their scales ([r], [r, 1] or [r, k / group]) as float32 [r, k]."""
    r, k = q.shape
    out = torch.empty(r, k, dtype=torch.float32)
    _decode(q.contiguous().view(torch.uint8).numpy(), as_grid(scale, r), out.numpy())
    return out


_local = threading.local()


def scratch(numel: int) -> tuple[torch.Tensor, np.ndarray]:
    """This thread's float32 scratch of at least `numel` elements (as a tensor and as its numpy view)."""
    have = getattr(_local, "scratch", None)
    if have is None or have[0].numel() < numel:
        t = torch.empty(numel, dtype=torch.float32)
        have = _local.scratch = (t, t.numpy())
    return have


def fp8_matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """(xq * x_scale) @ (w * w_scale)^T in float32, [m, n]: xq [m, k] and w [n, k] E4M3 (CPU tensors),
    each with a scale per row or per row and group of columns."""
    return fp8_times(fp8_dequantize(xq, x_scale), w, w_scale)


def fp8_times(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x @ (w * w_scale)^T in float32, [m, n]: x float32 [m, k] (activations as they are, or an fp8 product's
    dequantized ones), w [n, k] E4M3 with a scale per row or per row and group of columns."""
    m, n = x.shape[0], w.shape[0]
    wb = w.contiguous().view(torch.uint8).numpy()
    ws = as_grid(w_scale, n)
    if 0 < m <= FP8_FUSED_ROWS:
        return fused(_fp8_times_row, _fp8_times_rows, m, n, (wb, ws), (x,))
    return blocked(_decode, (wb, ws), x)


def blocked(decode, weight: tuple[np.ndarray, ...], x: torch.Tensor) -> torch.Tensor:
    """x (float32 [m, k]) times a weight of n rows, transposed, [m, n] float32. The weight is held as
    arrays with a row each per weight row (its bytes, its scales); `decode(*those rows, out)` writes a
    block of rows' float32 values (about `SCRATCH_BYTES`, which stays in the cache) for torch's float32
    matmul."""
    m, k = x.shape
    n = weight[0].shape[0]
    rows = max(1, min(n, SCRATCH_BYTES // (4 * k)))
    buffer, buffer_np = scratch(rows * k)
    yt = torch.empty(n, m, dtype=torch.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        decode(*(a[r0:r1] for a in weight), buffer_np[: (r1 - r0) * k].reshape(r1 - r0, k))
        torch.mm(buffer[: (r1 - r0) * k].view(r1 - r0, k), x.t(), out=yt[r0:r1])
    return yt.t() if m == 1 else yt.t().contiguous()


def fused(one, four, m: int, n: int, weight: tuple, xs: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The fused product [m, n] of m activation rows (each of `xs` float32 [m, *]) with a weight of n rows:
    `one` for a single row, else `four` over the rows padded to chunks of four."""
    if m == 1:
        out = np.empty((1, n), dtype=np.float32)
        one(*weight, *(x.contiguous().numpy() for x in xs), out)
        return torch.from_numpy(out)
    padded = [rows_of_four(x) for x in xs]
    out = np.empty((padded[0].shape[0], n), dtype=np.float32)
    four(*weight, *padded, out)
    return torch.from_numpy(out[:m])


def int8_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [m, in] times the int8 `weight` [out, in] (float32 scale [out, groups]), transposed: [m, out] in
    x's dtype, at float32 precision. One row takes the fused loop, and so do up to `INT8_FUSED_ROWS` rows
    where the scales are per group; more rows go through `cpu_int8`'s digit split where the scales are per
    output channel (its int8 matmul gains more from each added row: on an 8192 x 2048 weight 1.5 against
    2.7 ms at one row, 2.9 against 2.5 at four, 8.0 against 3.2 at eight), and through the blocked decode
    for torch's float32 matmul where they are per group (the split would take one int8 matmul a group)."""
    m, n = x.shape[0], weight.shape[0]
    if m == 0:
        return x.new_zeros(0, n)
    if m > 1 and (scale.dim() == 1 or scale.shape[1] == 1):
        return cpu_int8.int8_matmul(x, weight, scale)
    arrays = (weight.contiguous().numpy(), as_grid(scale, n))
    if m <= INT8_FUSED_ROWS:
        y = fused(_int8_times_row, _int8_times_rows, m, n, arrays, (x.float(),))
    else:
        y = blocked(_int8_decode, arrays, x.float())
    return y.to(x.dtype)


def warm_up(scheme: str) -> None:
    """Compile `scheme`'s loops (or load them from numba's cache) before serving: the fused ones for one
    and for several rows, and the larger batches' loop."""
    if scheme == "fp8":
        w = torch.zeros(2, 16, dtype=torch.float8_e4m3fn)
        for m in (1, 2, FP8_FUSED_ROWS + 1):
            fp8_matmul(torch.zeros(m, 16, dtype=torch.float8_e4m3fn), torch.ones(m, 1), w, torch.ones(2, 2))
    elif scheme == "w8a16":
        int8_matmul(torch.zeros(1, 16), torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 1))
        for m in (2, INT8_FUSED_ROWS + 1):  # a scale per group
            int8_matmul(torch.zeros(m, 16), torch.zeros(2, 16, dtype=torch.int8), torch.ones(2, 2))
