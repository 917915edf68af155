"""FP8 E4M3 weights with FP8 activations: per-channel (or per-tensor) weight scales with per-token or
static activation scales, and block-scaled weights with activations scaled per token and group; and FP8
weights with activations as they are (`w8a16-fp8`, weight-only)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_engine.model.quant import cpu_decode, schemes
from ember_engine.model.quant.layer import QuantLinear, merged_input_scale, use_triton


class Fp8Linear(QuantLinear):
    """E4M3 weight with a scale per output channel; activations quantized per token at run time (with
    `activation_ub`, fbgemm_fp8's bound, a token's largest magnitude taken as at most it), or, once
    `set_input_scale` has given it a checkpoint's calibrated scale, with that scale for every token."""

    scheme = "fp8"
    weight: torch.Tensor
    input_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("input_scale", None)
        self.activation_ub = 0.0

    def weight_data(self) -> torch.Tensor:
        return self.weight

    def set_input_scale(self, scale: torch.Tensor, name: str) -> None:
        """A part's calibrated activation scale; a merged projection's parts share the largest."""
        self.input_scale = merged_input_scale(self.input_scale, scale, name, self.weight_scale.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.fp8_matmul(
                x, self.weight, self.weight_scale, self.input_scale, self.activation_ub
            )
        if self.input_scale is not None:
            xq, x_scale = schemes.quantize_activation_fp8_static(x, self.input_scale)
        else:
            xq, x_scale = schemes.quantize_activation_fp8(x, self.activation_ub)
        if x.device.type == "cpu":
            return cpu_decode.fp8_matmul(xq, x_scale, self.weight, self.weight_scale).to(x.dtype)
        n, k = self.weight.shape
        if x.device.type == "cuda" and (n % 16 or k % 16):
            # cuBLAS's FP8 matmul takes only sizes divisible by 16: the same product, dequantized.
            return ((xq.float() * x_scale) @ self.dequantized().t()).to(x.dtype)
        return torch._scaled_mm(
            xq,
            self.weight.t(),
            scale_a=x_scale.contiguous(),
            scale_b=self.weight_scale[None, :],
            out_dtype=x.dtype,
        )

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)


class Fp8WeightOnlyLinear(Fp8Linear):
    """E4M3 weight with a scale per output channel, or per output row and group of `group_size` input
    columns (each row holding its tile's scale: ModelOpt's block-scaled FP8_PB_WO), and activations as
    they are (compressed-tensors' FP8 weights without input activations, vLLM's W8A16-FP8):
    y = x @ (q_w * s_w)^T in float32."""

    scheme = "w8a16-fp8"

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int = 0
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.group_size = group_size
        if group_size:
            if in_features % group_size:
                raise schemes.UnsupportedQuantizationError(
                    f"w8a16-fp8: input size {in_features} is not a multiple of the block's {group_size} "
                    "columns"
                )
            self.weight_scale = torch.ones(out_features, in_features // group_size, dtype=torch.float32)

    def set_input_scale(self, scale: torch.Tensor, name: str) -> None:
        raise schemes.UnsupportedQuantizationError(f"{name}: an input_scale for weight-only FP8")

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.fp8_weight_matmul(x, self.weight, self.weight_scale, self.group_size)
        if x.device.type == "cpu":
            return cpu_decode.fp8_times(x.float(), self.weight, self.weight_scale).to(x.dtype)
        return F.linear(x, self.dequantized(x.dtype))

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if not self.group_size:
            return super().dequantized(dtype)
        scale = self.weight_scale.repeat_interleave(self.group_size, dim=1)
        return (self.weight.float() * scale).to(dtype)


class Fp8BlockLinear(QuantLinear):
    """Block-scaled FP8 (Hugging Face's `weight_block_size` checkpoints, MXFP8): E4M3 weight [out, in] with a
    scale per (output row, group of `group_size` input columns), each row holding its tile's scale;
    activations quantized per token and group at run time, to a scale of the group's largest magnitude
    over 448, or (`input_quant` mxfp8, mxfp8-fit: MXFP8) to a power of two (`schemes.quantize_activation_mx`).
    y = sum over groups of (x_g . w_g) * x_scale_g * w_scale_g."""

    scheme = "fp8"
    weight: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if in_features % group_size:
            raise schemes.UnsupportedQuantizationError(
                f"fp8: input size {in_features} is not a multiple of the block's {group_size} columns"
            )
        self.group_size = group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer(
            "weight_scale", torch.ones(out_features, in_features // group_size, dtype=torch.float32)
        )

    def weight_data(self) -> torch.Tensor:
        return self.weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.fp8_block_matmul(
                x, self.weight, self.weight_scale, self.group_size, self.input_quant
            )
        if self.input_quant:  # MXFP8's
            xq, x_scale = schemes.quantize_activation_mx(x, *schemes.MX_INPUTS[self.input_quant])
        else:
            xq, x_scale = schemes.quantize_activation_fp8_groups(x, self.group_size)
        if x.device.type == "cpu":
            return cpu_decode.fp8_matmul(xq, x_scale, self.weight, self.weight_scale).to(x.dtype)
        xd = xq.float() * x_scale.repeat_interleave(self.group_size, dim=1)
        return (xd @ self.dequantized().t()).to(x.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.weight_scale.repeat_interleave(self.group_size, dim=1)
        return (self.weight.float() * scale).to(dtype)
