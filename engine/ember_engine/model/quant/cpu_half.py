"""Float16 bits to float32 inside numba's loops (`half_to_float`), and what the CPU numba compiles for can
do (`target_has`). The E4M3 and FP4 decoders (`cpu_decode.e4m3`, `cpu_fp4`) move a value's bits into a
float16's, which converts to float32 exactly in one vector instruction where the CPU has it (F16C on x86,
always on AArch64); without it (numba's `generic` x86-64 target, which images set through
NUMBA_CPU_NAME for portable caches) LLVM would call a library function numba's JIT does not have
(`__extendhfsf2`) and abort the process, so the conversion is built from integer operations there.
Numba's cache knows a compiled loop by its own file: after a change here, clear the cache
(NUMBA_CACHE_DIR, or the package's `__pycache__`) so the loops that inline these are compiled again."""

from __future__ import annotations

import platform

import numpy as np
import torch
from llvmlite import ir
from numba import config, njit, types
from numba.extending import intrinsic


def target_has(feature: str) -> bool:
    """Whether the code numba compiles may use an x86 `feature` ("f16c", "avx512f"): numba's JIT takes the
    features NUMBA_CPU_FEATURES names (none for NUMBA_CPU_NAME=generic) or else the host's."""
    features = getattr(config, "CPU_FEATURES", None)
    if features is None:
        import llvmlite.binding as llvm

        features = llvm.get_host_cpu_features().flatten()
    return f"+{feature}" in features.split(",")


# Whether LLVM converts float16 to float32 with an instruction: always on AArch64, on x86 with F16C (every
# x86-64 CPU since 2012, but not numba's `generic` target), where otherwise it would call a library
# function the JIT does not have (`__extendhfsf2`) and abort the process.
NATIVE_HALF = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686") or target_has("f16c")


def _half_bits_to_float(builder, bits):
    """IR for the float16 value of the low 16 bits of int32 `bits` as float32, with integer operations:
    a normal value's exponent rebased from 15 to 127 (infinities and NaNs kept all ones, the NaN payload
    kept), zero and subnormals as their mantissa times 2^-24 (exact in float32), the sign put back."""
    i32, f32 = ir.IntType(32), ir.FloatType()

    def n(v: int) -> ir.Constant:
        return ir.Constant(i32, v)

    sign = builder.shl(builder.and_(bits, n(0x8000)), n(16))
    exponent = builder.and_(builder.lshr(bits, n(10)), n(0x1F))
    mantissa = builder.and_(bits, n(0x3FF))
    wide = builder.select(builder.icmp_unsigned("==", exponent, n(31)), n(255), builder.add(exponent, n(112)))
    normal = builder.or_(builder.or_(sign, builder.shl(wide, n(23))), builder.shl(mantissa, n(13)))
    small = builder.fmul(builder.uitofp(mantissa, f32), ir.Constant(f32, 2.0**-24))
    small = builder.or_(builder.bitcast(small, i32), sign)
    return builder.bitcast(builder.select(builder.icmp_unsigned("==", exponent, n(0)), small, normal), f32)


@intrinsic
def half_to_float(typingctx, bits):
    """The float16 whose bits are the low 16 of the int32 `bits`, as float32 (exact; one vector conversion
    instruction where the CPU has one, as x86-64 CPUs since 2012 and AArch64 do; integer operations where
    it has not: `NATIVE_HALF`)."""

    def codegen(context, builder, signature, args):
        if not NATIVE_HALF:
            return _half_bits_to_float(builder, args[0])
        half = builder.bitcast(builder.trunc(args[0], ir.IntType(16)), ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(types.int32), codegen


@njit(cache=False)
def _halves(bits, out):
    for i in range(bits.shape[0]):
        out[i] = half_to_float(np.int32(bits[i]))  # type: ignore[call-arg]


def halves_to_float(bits: torch.Tensor) -> torch.Tensor:
    """`half_to_float` of each of int32 `bits` (a check of the conversion the loops compile)."""
    out = torch.empty(bits.shape[0], dtype=torch.float32)
    _halves(bits.to(torch.int32).contiguous().numpy(), out.numpy())
    return out
