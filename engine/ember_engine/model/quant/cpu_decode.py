"""The CPU's quantized-weight loops, compiled (numba): fp8 weights decoded a block of rows at a time for a
float32 matmul, and int4 weights unpacked to int8 for `cpu_int8`'s exact int8 matmul. They run where
torch's own operations go one element at a time or through several whole-weight passes; the options live
in this file because numba's cache knows a function by its file's contents.

fp8 (E4M3). The weights stay one byte each in memory. A block of rows is decoded into a float32 scratch
that stays in the cache, each value times its channel's or tile's scale, then multiplied by torch's float32
matmul. torch's own E4M3 -> float conversion, and its `_scaled_mm` on a CPU, convert one element at a time:
on an 8192 x 2048 weight that took 45 and 95 ms a call where a float32 matmul of the same size takes 4. The
decoder builds each value's float32 bits with integer operations only, so the loop vectorises; NaN bytes
decode to NaN and -0 to -0. Arithmetic: y = (q_x * s_x) @ (q_w * s_w)^T, each side's E4M3 values times
its scales (per token, or per token and group of columns, for the activations; per output channel or per
tile for the weights) rounded once to float32, the products summed in float32: the dequantized product
transformers + compressed-tensors computes for these checkpoints.

int4 (w4a16). The packed weight (two values a byte) is unpacked to int8 and multiplied through `cpu_int8`
(torch's exact int8 matmul on the activations' int8 digits, group by group, or the widened weight for a
small projection): the weight is never widened to float32 in full and the activations keep float32
precision. Unpacking with tensor operations, then dequantizing to float32, took 115 ms a call for one
8192 x 2048 weight at batch 1; the loop unpacks it in about 1.4 ms.
"""

from __future__ import annotations

import threading

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant import cpu_int8
from ember_engine.sample.cpu_kernels import float_of_bits

# Weight rows decoded per fp8 matmul call: this many bytes of float32 scratch, about a core's L2 cache.
SCRATCH_BYTES = 1 << 21


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, error_model="numpy")(fn)


@_compiled
def _decode(src, scale, out):
    """out[i, j] = the E4M3 value of byte src[i, j] times scale[i, j // group], group = columns / groups.

    A byte is sign | exponent e (4 bits) | mantissa m (3 bits). Normal (e > 0): 2^(e - 7) * (1 + m / 8),
    whose float32 bits are the byte's low 7 bits shifted to the mantissa's top plus 120 in the exponent.
    Subnormal (e = 0): m * 2^-9, whose leading bit p (0, 1 or 2) sets the exponent. 0x7F is NaN."""
    rows, cols = src.shape
    groups = scale.shape[1]
    group = cols // groups
    for i in range(rows):
        for g in range(groups):
            s = scale[i, g]
            bs = src[i, g * group : (g + 1) * group]
            os = out[i, g * group : (g + 1) * group]
            for j in range(bs.shape[0]):
                b = np.int32(bs[j])
                mag = b & np.int32(0x7F)
                m = mag & np.int32(7)
                p = np.int32(m >= 2) + np.int32(m >= 4)
                sub = ((p + np.int32(118)) << np.int32(23)) | ((m - (np.int32(1) << p)) << (np.int32(23) - p))
                sub = sub if m > 0 else np.int32(0)
                bits = (mag << np.int32(20)) + np.int32(120 << 23) if mag >= 8 else sub
                bits = np.int32(0x7FC00000) if mag == 0x7F else bits
                os[j] = float_of_bits(((b & np.int32(0x80)) << np.int32(24)) | bits) * s  # type: ignore[call-arg]


_local = threading.local()


def _scratch(numel: int) -> tuple[torch.Tensor, np.ndarray]:
    """This thread's float32 scratch of at least `numel` elements (as a tensor and as its numpy view)."""
    have = getattr(_local, "scratch", None)
    if have is None or have[0].numel() < numel:
        t = torch.empty(numel, dtype=torch.float32)
        have = _local.scratch = (t, t.numpy())
    return have


def _as_grid(scale: torch.Tensor, rows: int) -> np.ndarray:
    """A scale as float32 [rows, groups] (a per-row scale [rows] or [rows, 1] has one group)."""
    groups = scale.shape[-1] if scale.dim() == 2 else 1
    return scale.detach().to(torch.float32).reshape(rows, groups).contiguous().numpy()


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """E4M3 values [r, k] times their scales ([r], [r, 1] or [r, k / group]) as float32 [r, k]."""
    r, k = q.shape
    out = torch.empty(r, k, dtype=torch.float32)
    _decode(q.contiguous().view(torch.uint8).numpy(), _as_grid(scale, r), out.numpy())
    return out


def fp8_matmul(
    xq: torch.Tensor, x_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """(xq * x_scale) @ (w * w_scale)^T in float32, [m, n]: xq [m, k] and w [n, k] E4M3 (CPU tensors),
    each with a scale per row or per row and group of columns."""
    m, k = xq.shape
    n = w.shape[0]
    x = fp8_dequantize(xq, x_scale)
    wb = w.view(torch.uint8).numpy()
    ws = _as_grid(w_scale, n)
    rows = max(1, min(n, SCRATCH_BYTES // (4 * k)))
    scratch, scratch_np = _scratch(rows * k)
    yt = torch.empty(n, m, dtype=torch.float32)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        block = scratch_np[: (r1 - r0) * k].reshape(r1 - r0, k)
        _decode(wb[r0:r1], ws[r0:r1], block)
        torch.mm(scratch[: (r1 - r0) * k].view(r1 - r0, k), x.t(), out=yt[r0:r1])
    return yt.t() if m == 1 else yt.t().contiguous()


@_compiled
def _unpack(src, out):
    """out[i, 2j] = low nibble of src[i, j] - 8, out[i, 2j + 1] = high nibble - 8 (`schemes.pack_int4`)."""
    rows, cols = src.shape
    for i in range(rows):
        s = src[i]
        o = out[i]
        for j in range(cols):
            b = np.int32(s[j])
            o[2 * j] = np.int8((b & np.int32(15)) - np.int32(8))
            o[2 * j + 1] = np.int8((b >> np.int32(4)) - np.int32(8))


def int4_unpack(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [out, in / 2] -> int8 values [out, in] in [-8, 7]."""
    rows, cols = packed.shape
    out = torch.empty(rows, 2 * cols, dtype=torch.int8)
    _unpack(packed.contiguous().numpy(), out.numpy())
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] times the int4 weight (packed [out, in / 2], float32 scale [out, groups]), transposed:
    [n, out] in x's dtype, at float32 precision."""
    return cpu_int8.int8_matmul(x, int4_unpack(packed), scale)


def warm_up(scheme: str) -> None:
    """Compile `scheme`'s loop (or load it from numba's cache) before serving."""
    if scheme == "fp8":
        q = torch.zeros(2, 16, dtype=torch.float8_e4m3fn)
        fp8_matmul(q, torch.ones(2, 1), q, torch.ones(2, 2))
    elif scheme == "w4a16":
        int4_unpack(torch.zeros(1, 8, dtype=torch.uint8))
