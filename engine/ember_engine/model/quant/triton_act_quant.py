"""Activation quantization for the quantized GEMMs on a GPU, one Triton launch each (CUDA; tests run it
under TRITON_INTERPRET=1).

`schemes.quantize_activation_fp8` and its kin are chains of torch operations (widen, abs, amax, clamp,
divide, clamp, convert), each a kernel launch of its own; at decode sizes those launches, not the bytes,
are most of their time. Here one program per row (or per row and group of columns) reads its values
twice, once for their largest magnitude and once to quantize them, and writes the quantized values and
the scale. The arithmetic is the torch reference's, bit for bit: the scale is the largest magnitude
(at least 1e-12, at most `ub` where it is set) over 448 (E4M3) or 127.5 (int8), each value is divided
by it with IEEE division (`tl.div_rn`: Triton's `/` is approximate on NVIDIA GPUs), E4M3 is encoded
with saturation at ±448 and ties to even (`triton_kv_store.encode_e4m3`, integer arithmetic), and int8
rounds half to even and saturates at -128 and 127. A NaN gives its row's (group's) scale NaN, as torch's
amax does, and an int8 value of 0, as torch's conversion does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember_engine.model.triton_kv_store import encode_e4m3

FP8, INT8 = 0, 1
_QMAX = {FP8: 448.0, INT8: 127.5}
_MAX_BLOCK = 1024


@triton.jit
def _is_nan(x):
    """From the bits, as `encode_e4m3` tests: no float comparison for a compiler to fold."""
    return (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    static_ptr,
    group,
    stride_xm,
    stride_qm,
    stride_sm,
    ub,
    QMAX: tl.constexpr,
    KIND: tl.constexpr,
    STATIC: tl.constexpr,
    CLAMP_UB: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    start = tl.program_id(1) * group
    x_row = x_ptr + row * stride_xm
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        nans = tl.zeros((BLOCK,), dtype=tl.int32)
        for k0 in range(start, start + group, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < start + group, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
            nans += _is_nan(x).to(tl.int32)
        largest = tl.max(amax, axis=0)
        if CLAMP_UB:
            largest = tl.minimum(largest, ub)
        scale = tl.div_rn(tl.maximum(largest, 1e-12), QMAX)
        # A GPU's maximum drops a NaN operand where torch's amax keeps it: a row (group) holding one gets
        # the reference's NaN scale, and so a NaN product, not a scale from its other values.
        scale = tl.where(tl.max(nans, axis=0) > 0, float("nan"), scale)
        tl.store(scale_ptr + row * stride_sm + tl.program_id(1), scale)
    for k0 in range(start, start + group, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < start + group
        v = tl.div_rn(tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32), scale)
        if KIND == 1:
            # NaN to 0, as torch converts it; then clamped so that adding and removing 1.5 * 2**23 rounds
            # to an integer, ties to even.
            v = tl.where(_is_nan(v), 0.0, v)
            v = tl.minimum(tl.maximum(v, -129.0), 128.0)
            v = (v + 12582912.0) - 12582912.0
            q = tl.minimum(tl.maximum(v, -128.0), 127.0).to(tl.int8)
        else:
            q = encode_e4m3(v)
        tl.store(q_ptr + row * stride_qm + offs, q, mask=mask)


def _quantize(
    x: torch.Tensor, kind: int, group: int = 0, static: torch.Tensor | None = None, ub: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.contiguous()
    m, k = x.shape
    group = group or k
    groups = k // group
    q = torch.empty(m, k, dtype=torch.uint8 if kind == FP8 else torch.int8, device=x.device)
    if static is not None:
        s = static.float().reshape(1).to(x.device)
        scale = s.reshape(1, 1).expand(m, 1)
    else:
        s = scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, groups)](
            x,
            q,
            scale if static is None else s,
            s,
            group,
            x.stride(0),
            q.stride(0),
            scale.stride(0) if static is None else 0,
            float(ub),
            QMAX=_QMAX[kind],
            KIND=kind,
            STATIC=static is not None,
            CLAMP_UB=bool(ub),
            BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(group)),
        )
    return (q.view(torch.float8_e4m3fn) if kind == FP8 else q), scale


def fp8_rows(x: torch.Tensor, ub: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`schemes.quantize_activation_fp8`: E4M3 per token, float32 scale [m, 1]."""
    return _quantize(x, FP8, ub=ub)


def fp8_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`schemes.quantize_activation_fp8_static`: E4M3 under one calibrated scale, [m, 1] of it."""
    return _quantize(x, FP8, static=scale)


def fp8_groups(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`schemes.quantize_activation_fp8_groups`: E4M3 per token and group, float32 scale [m, k / group]."""
    return _quantize(x, FP8, group=group_size)


def int8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`schemes.quantize_activation_int8`: int8 per token, float32 scale [m, 1]."""
    return _quantize(x, INT8)


def int8_static(x: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`schemes.quantize_activation_int8_static`: int8 under one calibrated scale, [m, 1] of it."""
    return _quantize(x, INT8, static=scale)
