"""E4M3 values in the quantized GEMM kernels on every GPU.

Triton's E4M3 type (`tl.float8e4nv`) compiles only for compute capability 8.9 and up (Ada, Hopper and
later): on 8.0 (A100) a kernel that so much as reinterprets bytes as it is refused ("type fp8e4nv not
supported in this architecture"). There the bytes are decoded with integer arithmetic instead
(`triton_kv_store.decode_e4m3`, the FP8 KV cache's decoder), to the same float32 values.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ember_engine.model.triton_kv_store import decode_e4m3


def fp8_types_on(cc: tuple[int, int] | None) -> bool:
    """Whether Triton's E4M3 type compiles on a GPU of compute capability `cc` (8.9 and up; None, the
    interpreter, emulates it)."""
    return cc is None or cc >= (8, 9)


@triton.jit
def e4m3(byte, NATIVE: tl.constexpr):
    """E4M3 bytes -> float32: through Triton's E4M3 type where `NATIVE` (`fp8_types_on`), else with
    integer arithmetic."""
    if NATIVE:  # noqa: SIM108 (a constexpr branch in the kernel)
        value = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        value = decode_e4m3(byte)
    return value
