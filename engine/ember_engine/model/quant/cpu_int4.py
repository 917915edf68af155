"""int4 (w4a16) matmul on the CPU: the packed weight (two values a byte) is unpacked to int8 by a compiled
loop (numba), then multiplied through `cpu_int8` (torch's exact int8 matmul on the activations' int8
digits, group by group, or the widened weight for a small projection). The weight is never widened to
float32 in full and the activations keep float32 precision.

Unpacking with torch's tensor operations, then dequantizing to float32, took 115 ms a call for one
8192 x 2048 weight at batch 1; the loop unpacks it in about 1.4 ms. The options live in this file because
numba's cache knows a function by its file's contents.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from ember_engine.model.quant import cpu_int8


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, error_model="numpy")(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True, error_model="numpy")(fn)


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


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [out, in / 2] -> int8 values [out, in] in [-8, 7]."""
    rows, cols = packed.shape
    out = torch.empty(rows, 2 * cols, dtype=torch.int8)
    _unpack(packed.contiguous().numpy(), out.numpy())
    return out


def matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [n, in] times the int4 weight (packed [out, in / 2], float32 scale [out, groups]), transposed:
    [n, out] in x's dtype, at float32 precision."""
    return cpu_int8.int8_matmul(x, unpack(packed), scale)


def warm_up() -> None:
    """Compile the unpacking loop (or load it from numba's cache) before serving."""
    unpack(torch.zeros(1, 8, dtype=torch.uint8))
