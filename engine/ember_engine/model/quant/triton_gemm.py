"""Triton GEMM kernels for the quantized layers (CUDA; tests run them under TRITON_INTERPRET=1).

One kernel shape serves every scheme: a program computes a [BLOCK_M, BLOCK_N] tile of y = x W^T,
walking K in BLOCK_K steps with a float32 accumulator. The weight tile is loaded in its stored form and
widened in registers, so only the quantized bytes cross memory:
- w8a16 and w4a16: int8, or two int4 a byte (unpacked by shift and mask), scaled per (channel, group);
- fp8: activations quantized per token (or with a checkpoint's static scale) beforehand, in one launch
  (`triton_act_quant`, as are w8a8's and block-scaled fp8's); E4M3 × E4M3 dots where the device has
  them (compute capability ≥ 8.9), else both decoded by integer arithmetic (`triton_fp8`), scales applied
  after the K loop; w4a8-fp8 the same, each 4-bit code's E4M3 byte loaded from its row's group's table;
- block-scaled fp8 (and MXFP8): activations quantized per token and group; the same dots, each BLOCK_K
  step (in one group) scaled by its activation and weight scales as added;
- nvfp4a16 and nvfp4: two E2M1 values a byte, decoded from their bits, scaled per group of 16, each
  group's scale its E4M3 byte over the row's global scale (passed as x_scale); nvfp4's activations come
  quantized and dequantized (`schemes.fake_quantize_nvfp4`), with no FP4 dots;
- w8a8: int8 activations per token; int8 dots with int32 sums (exact), both scales after the K loop;
- w8a16-fp8: E4M3 weight bytes widened in registers and scaled as w8a16's are, the activations as they are;
- bnb-nf4, bnb-fp4 and codebook (MXFP4's activations come as nvfp4's do): two 4-bit codes a byte, each
  looked up in the layer's 16-value table (passed as x_scale) and scaled per block as w4a16's are.

Where a K step lies in one group of scales (groups of 32 columns or more: int8, int4, the 4-bit codes,
fp8 weight-only), the step's values are multiplied as they are and its sums scaled per column (int4, int8
and E4M3 values are exact in bf16 and fp16; a code table's values are rounded to the activations' dtype);
nvfp4's groups of 16 are scaled value by value before the dot. float32 activations are multiplied in
float32 (`input_precision="ieee"`), not in TF32. Tiles: `triton_gemm_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ember_engine.model.quant import triton_act_quant as act
from ember_engine.model.quant.schemes import quantize_activation_mx
from ember_engine.model.quant.triton_fp8 import e4m3 as _e4m3
from ember_engine.model.quant.triton_gemm_config import (
    CODEBOOK,
    FP4,
    FP8,
    FP8_BLOCK,
    FP8_WEIGHT,
    INT4,
    INT8,
    W8A8,
    capability,
    kernel_options,
)


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """a @ b with float32 sums; float32 operands multiplied in full float32 (`IEEE`), as torch's float32
    matmul does by default, not rounded to TF32 by the tensor cores."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _nibble_value(nibble, table_ptr, WEIGHT: tl.constexpr):
    """The weight a 4-bit field stands for: int4 (offset by 8), E2M1 (nvfp4), or its entry in the
    layer's 16-value table (the 4-bit codes)."""
    if WEIGHT == 1:
        return nibble - 8
    elif WEIGHT == 6:
        return tl.load(table_ptr + nibble)
    else:  # E2M1: twice the value is m (exponent 0) or (2 + m) << (exponent - 1)
        e = (nibble >> 1) & 3
        m = nibble & 1
        twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
        return tl.where((nibble & 8) != 0, -twice, twice).to(tl.float32) * 0.5


@triton.jit
def _gemm_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    x_scale_ptr,
    y_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_xsm,
    stride_ym,
    GROUP: tl.constexpr,
    WEIGHT: tl.constexpr,
    FP8_DOT: tl.constexpr,
    FP8_TYPES: tl.constexpr,
    STEP_SCALE: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0,
        )
        wmask = mask_k[:, None] & mask_n[None, :]
        if WEIGHT == 4:
            # int8 x int8 dots with int32 sums (exact), widened to the float32 accumulator each step.
            q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0)
            acc += tl.dot(x, q, out_dtype=tl.int32).to(tl.float32)
        elif WEIGHT == 1 or WEIGHT == 5 or WEIGHT == 6:
            # Two weights a byte, column 2j of the step in the low nibble of its byte j and column 2j + 1
            # in the high one: each byte loaded once (contiguous, so the loads are vectors), its nibbles
            # multiplied with the step's even and odd activation columns.
            offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            bmask = (offs_j < K // 2)[:, None] & mask_n[None, :]
            ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_j[:, None]
            packed = tl.load(ptrs, mask=bmask, other=0).to(tl.int32)
            lo = _nibble_value(packed & 0xF, x_scale_ptr, WEIGHT)
            hi = _nibble_value((packed >> 4) & 0xF, x_scale_ptr, WEIGHT)
            x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
            if STEP_SCALE:
                s = tl.load(scale_ptr + offs_n * stride_sn + k0 // GROUP, mask=mask_n, other=0)
                part = _dot(x_even, lo.to(x.dtype), IEEE) + _dot(x_odd, hi.to(x.dtype), IEEE)
                acc += part * s[None, :]
            else:  # both nibbles of a byte lie in one group (groups are even)
                sptrs = scale_ptr + offs_n[None, :] * stride_sn + ((2 * offs_j) // GROUP)[:, None]
                s = tl.load(sptrs, mask=bmask, other=0)
                if WEIGHT == 5:  # E4M3 group scales (bytes) over the row's global scale
                    gs = tl.load(x_scale_ptr + offs_n, mask=mask_n, other=1.0)
                    s = _e4m3(s, FP8_TYPES) / gs[None, :]
                acc += _dot(x_even, (lo.to(tl.float32) * s).to(x.dtype), IEEE)
                acc += _dot(x_odd, (hi.to(tl.float32) * s).to(x.dtype), IEEE)
        elif WEIGHT == 0 or WEIGHT == 7:
            q = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0)
            if WEIGHT == 7:  # E4M3 bytes
                q = _e4m3(q, FP8_TYPES)
            if STEP_SCALE:
                # The step lies in one group: the values are multiplied as they are (in the activations'
                # dtype) and the step's sums scaled per column.
                s = tl.load(scale_ptr + offs_n * stride_sn + k0 // GROUP, mask=mask_n, other=0)
                acc += _dot(x, q.to(x.dtype), IEEE) * s[None, :]
            else:
                sptrs = scale_ptr + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None]
                s = tl.load(sptrs, mask=wmask, other=0)
                acc += _dot(x, (q.to(tl.float32) * s).to(x.dtype), IEEE)
        else:
            if WEIGHT == 8:  # each code's E4M3 byte in its row's and group's table of 16
                ptrs = w_ptr + offs_n[None, :] * stride_wn + (offs_k // 2)[:, None]
                code = (tl.load(ptrs, mask=wmask, other=0).to(tl.int32) >> ((offs_k % 2) * 4)[:, None]) & 0xF
                tptrs = scale_ptr + offs_n[None, :] * stride_sn + (offs_k // GROUP)[:, None] * 16 + code
                raw = tl.load(tptrs, mask=wmask, other=0)
            else:
                raw = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=wmask, other=0)
            if FP8_DOT:
                part = tl.dot(x.to(tl.float8e4nv, bitcast=True), raw.to(tl.float8e4nv, bitcast=True))
            else:  # E4M3 values are exact in TF32
                part = tl.dot(_e4m3(x, FP8_TYPES), _e4m3(raw, FP8_TYPES))
            if WEIGHT == 3:
                g = k0 // GROUP
                xs = tl.load(x_scale_ptr + offs_m * stride_xsm + g, mask=mask_m, other=0)
                ws = tl.load(scale_ptr + offs_n * stride_sn + g, mask=mask_n, other=0)
                acc += part * xs[:, None] * ws[None, :]
            else:
                acc += part
    if WEIGHT == 2 or WEIGHT == 4:
        acc = acc * tl.load(scale_ptr + offs_n, mask=mask_n, other=0)[None, :]
        acc = acc * tl.load(x_scale_ptr + offs_m, mask=mask_m, other=0)[:, None]
    if WEIGHT == 8:  # one scale per output column: its weight scale times the static input scale
        acc = acc * tl.load(x_scale_ptr + offs_n, mask=mask_n, other=0)[None, :]
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def run_gemm(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    n: int,
    weight: int,
    group: int = 1,
    x_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """y [M, n] = x [M, K] times weight kind `weight` held as `w` and `scale` (and `x_scale`), transposed."""
    x = x.contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    options = kernel_options(weight, m, n, group, x.dtype, capability(x.device))
    grid = (triton.cdiv(m, options["BLOCK_M"]), triton.cdiv(n, options["BLOCK_N"]))
    _gemm_kernel[grid](
        x,
        w,
        scale,
        x_scale if x_scale is not None else scale,
        y,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        scale.stride(0),
        x_scale.stride(0) if x_scale is not None else 0,
        y.stride(0),
        **options,
    )
    return y


def int8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] @ (int8 w [N, K] * scale [N, K / group_size])^T, in x's dtype."""
    return run_gemm(x, w, scale.float().contiguous(), w.shape[0], INT8, group=group_size)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """x [M, K] @ (int4 w [N, K] packed as [N, K / 2], scale [N, K / group_size])^T, in x's dtype."""
    return run_gemm(x, packed, scale.float().contiguous(), packed.shape[0], INT4, group=group_size)


def fp8_matmul(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    activation_ub: float = 0.0,
) -> torch.Tensor:
    """x [M, K] quantized to E4M3 per token (a token's largest magnitude taken as at most `activation_ub`
    where it is set; or with the static `input_scale` for every token), @ (E4M3 w [N, K] * scale [N])^T,
    in x's dtype."""
    if input_scale is None:
        xq, x_scale = act.fp8_rows(x, activation_ub)
    else:
        xq, x_scale = act.fp8_static(x, input_scale)
    return run_gemm(
        xq.view(torch.uint8),
        w.view(torch.uint8),
        scale.float().contiguous(),
        w.shape[0],
        FP8,
        x_scale=x_scale.reshape(-1).contiguous(),
        out_dtype=x.dtype,
    )


def fp4_matmul(
    x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ (E2M1 w [N, K] packed as [N, K / 2], times E4M3 scale [N, K / group_size] over global
    scale [N])^T, in x's dtype."""
    return run_gemm(
        x,
        packed,
        scale.contiguous().view(torch.uint8),
        packed.shape[0],
        FP4,
        group=group_size,
        x_scale=global_scale.float().contiguous(),
    )


def w8a8_matmul(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] quantized to int8 per token (or with the static `input_scale` for every token), @ (int8 w
    [N, K] * scale [N, 1])^T, in x's dtype."""
    if input_scale is None:
        xq, x_scale = act.int8_rows(x)
    else:
        xq, x_scale = act.int8_static(x, input_scale)
    return run_gemm(
        xq,
        w,
        scale.float().reshape(-1).contiguous(),
        w.shape[0],
        W8A8,
        x_scale=x_scale.reshape(-1).contiguous(),
        out_dtype=x.dtype,
    )


def fp8_block_matmul(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group_size: int, mx: str = ""
) -> torch.Tensor:
    """x [M, K] quantized per token and group of `group_size` columns to E4M3 (with `mx`, mxfp8 or
    mxfp8-fit, MXFP8's groups of 32 under power-of-two scales), @ (E4M3 w [N, K] * scale [N, K /
    group_size])^T, in x's dtype."""
    if mx:
        xq, x_scale = quantize_activation_mx(x, 8, fit=mx == "mxfp8-fit")
    else:
        xq, x_scale = act.fp8_groups(x, group_size)
    return run_gemm(
        xq.view(torch.uint8),
        w.view(torch.uint8),
        scale.float().contiguous(),
        w.shape[0],
        FP8_BLOCK,
        group=group_size,
        x_scale=x_scale.contiguous(),
        out_dtype=x.dtype,
    )


def codebook_matmul(
    x: torch.Tensor, packed: torch.Tensor, code: torch.Tensor, scale: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] @ (code[w] for 4-bit codes w [N, K] packed as [N, K / 2], times scale [N, K / group_size])^T,
    in x's dtype."""
    return run_gemm(
        x,
        packed,
        scale.float().contiguous(),
        packed.shape[0],
        CODEBOOK,
        group=group_size,
        x_scale=code.float().contiguous(),
    )


def fp8_weight_matmul(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group_size: int = 0
) -> torch.Tensor:
    """x [M, K] as it is @ (E4M3 w [N, K] * scale [N] or [N, K / group_size])^T, in x's dtype."""
    k = w.shape[1]
    scale = scale.float().reshape(w.shape[0], -1).contiguous()
    return run_gemm(x, w.view(torch.uint8), scale, w.shape[0], FP8_WEIGHT, group=group_size or k)
