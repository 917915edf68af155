"""An FP8 KV cache's bytes read on the CPU: one compiled loop (numba; the options live in this file
because numba's cache knows a function by its file's contents) looks each byte up in its format's table
of 256 float32 values. On 4M bytes (2-core machine): 0.95 ms, against 2.6 to 3.7 for the same table through
torch's `index_select` and 8.4 for torch's own E4M3 conversion, which goes an element at a time on a CPU.
"""

from __future__ import annotations

import torch
from numba import njit
from torch import Tensor


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no writable cache location: compile in each process instead
        return njit(cache=False, nogil=True)(fn)


@_compiled
def _look_up(src, table, out):
    for i in range(src.shape[0]):
        out[i] = table[src[i]]


def decode(raw: Tensor, table: Tensor) -> Tensor:
    """`table[raw]` as float32, raw a CPU uint8 tensor of any shape, table 256 float32 values."""
    src = raw.contiguous().reshape(-1)
    out = torch.empty(src.shape[0], dtype=torch.float32)
    _look_up(src.numpy(), table.numpy(), out.numpy())
    return out.view(raw.shape)
