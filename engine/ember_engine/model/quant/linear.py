"""Linear layers over quantized weights, drop-in replacements for the model's `nn.Linear`s.

Weights and scales are buffers in the canonical forms of `schemes.py`; a bias, where the model has one,
stays a parameter in the model dtype. CUDA inputs go to the Triton kernels (`triton_gemm.py`); the CPU
path runs compiled loops and torch (`cpu_decode.py`, `cpu_int4.py`): at decode batch sizes one loop reads each weight
byte once and multiplies its value with the activations in float32 (fp8 activations quantized per token,
per token and group, or with a checkpoint's static scale, then decoded); above them `w8a16` takes the exact int8 matmul on the activations
split into int8 digits (`cpu_int8.py`), `fp8` a float32 matmul over weight rows decoded a block at a time,
and `w4a16` its weight unpacked to int8 for the int8 matmul. bf16 activations with one w8a16 scale per
channel take torch's int8 weight-pack matmul at every batch size. Other devices without Triton take
torch's scaled matmul (fp8) or the dequantized product. `EMBER_QUANT_GEMM=triton` or `=torch` overrides
the choice.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from ember_engine.model.quant import cpu_decode, cpu_int4, schemes


def _use_triton(x: torch.Tensor) -> bool:
    mode = os.environ.get("EMBER_QUANT_GEMM", "")
    if mode == "torch":
        return False
    return mode == "triton" or x.is_cuda


class QuantLinear(nn.Module):
    """y = x W^T (+ b) with W held quantized. Subclasses set the scheme and the buffers."""

    scheme = ""
    weight_scale: torch.Tensor

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        # GPTQ act-order: the input columns' order the weight's columns are held in (None: as given), and
        # the checkpoint projection that set it (every part of a merged projection must agree).
        self.input_order: torch.Tensor | None = None
        self._order_from: str | None = None

    def set_input_order(self, order: torch.Tensor | None, name: str) -> None:
        if self._order_from is not None:
            same = (order is None and self.input_order is None) or (
                order is not None
                and self.input_order is not None
                and torch.equal(order, self.input_order.cpu())
            )
            if not same:
                raise schemes.UnsupportedQuantizationError(
                    f"{name}: its g_idx orders the input columns unlike {self._order_from}'s, with which it is "
                    "merged (they share an input); not supported"
                )
            return
        self._order_from = name
        self.input_order = None if order is None else order.to(self.weight_scale.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        y = self.matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the scheme stands for, [out, in], its columns in input_order where that is set."""
        raise NotImplementedError

    def set_rows(self, start: int, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Place a projection's canonical weight and scale at output rows start.. (merged projections)."""
        n = weight.shape[0]
        self.weight_data().narrow(0, start, n).copy_(weight)
        self.weight_scale.narrow(0, start, n).copy_(scale.reshape(self.weight_scale[start : start + n].shape))

    def weight_data(self) -> torch.Tensor:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"{self.scheme}, in={self.in_features}, out={self.out_features}, bias={self.bias is not None}"


class Fp8Linear(QuantLinear):
    """E4M3 weight with a scale per output channel; activations quantized per token at run time, or, once
    `set_input_scale` has given it a checkpoint's calibrated scale, with that scale for every token."""

    scheme = "fp8"
    weight: torch.Tensor
    input_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("input_scale", None)

    def weight_data(self) -> torch.Tensor:
        return self.weight

    def set_input_scale(self, scale: torch.Tensor, name: str) -> None:
        """A part's calibrated activation scale. The parts of a merged projection share its input, so
        they share one scale: the largest of theirs, which saturates none of them (vLLM's rule too)."""
        value = scale.float().reshape(-1)
        if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
            raise schemes.UnsupportedQuantizationError(
                f"{name}: input_scale must be one positive finite number (static per tensor), "
                f"found {value.tolist()[:4]}"
            )
        value = value.to(self.weight_scale.device)
        self.input_scale = value if self.input_scale is None else torch.maximum(self.input_scale, value)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.fp8_matmul(x, self.weight, self.weight_scale, self.input_scale)
        if self.input_scale is not None:
            xq, x_scale = schemes.quantize_activation_fp8_static(x, self.input_scale)
        else:
            xq, x_scale = schemes.quantize_activation_fp8(x)
        if x.device.type == "cpu":
            return cpu_decode.fp8_matmul(xq, x_scale, self.weight, self.weight_scale).to(x.dtype)
        n, k = self.weight.shape
        if x.device.type == "cuda" and (n % 16 or k % 16):
            # cuBLAS's FP8 matmul takes only sizes divisible by 16: the same product, dequantized.
            return ((xq.float() * x_scale) @ self.dequantized().t()).to(x.dtype)
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale.contiguous(), scale_b=self.weight_scale[None, :], out_dtype=x.dtype
        )

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)


class Fp8BlockLinear(QuantLinear):
    """Block-scaled FP8 (Hugging Face's `weight_block_size` checkpoints): E4M3 weight [out, in] with a scale
    per (output row, group of `group_size` input columns), each row holding its tile's scale; activations
    quantized per token and group at run time. y = sum over groups of (x_g . w_g) * x_scale_g * w_scale_g."""

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
        if _use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.fp8_block_matmul(x, self.weight, self.weight_scale, self.group_size)
        xq, x_scale = schemes.quantize_activation_fp8_groups(x, self.group_size)
        if x.device.type == "cpu":
            return cpu_decode.fp8_matmul(xq, x_scale, self.weight, self.weight_scale).to(x.dtype)
        xd = xq.float() * x_scale.repeat_interleave(self.group_size, dim=1)
        return (xd @ self.dequantized().t()).to(x.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.weight_scale.repeat_interleave(self.group_size, dim=1)
        return (self.weight.float() * scale).to(dtype)


class Int8Linear(QuantLinear):
    """int8 weights with a scale per output channel (`group_size` 0) or per group of input columns."""

    scheme = "w8a16"
    weight: torch.Tensor

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int = 0
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if group_size and in_features % group_size:
            raise schemes.UnsupportedQuantizationError(
                f"w8a16: input size {in_features} is not a multiple of the group size {group_size}"
            )
        self.group_size = group_size or in_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer(
            "weight_scale", torch.ones(out_features, in_features // self.group_size, dtype=torch.float32)
        )

    def weight_data(self) -> torch.Tensor:
        return self.weight

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.int8_matmul(x, self.weight, self.weight_scale, self.group_size)
        if x.device.type != "cpu":
            return F.linear(x, self.dequantized(x.dtype))
        if x.dtype == torch.bfloat16 and self.group_size == self.in_features:
            # torch's int8 weight-pack matmul, fast for bf16 activations; float32 scales are applied to
            # its output, so they are not rounded to bf16.
            ones = torch.ones(self.out_features, dtype=x.dtype, device=x.device)
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, ones)
            return (y.float() * self.weight_scale.reshape(-1)).to(x.dtype)
        return cpu_decode.int8_matmul(x, self.weight, self.weight_scale)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        scale = self.weight_scale.repeat_interleave(self.group_size, dim=1)
        return (self.weight.float() * scale).to(dtype)


class Int4Linear(QuantLinear):
    scheme = "w4a16"
    weight_packed: torch.Tensor
    weight_zero: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group_size: int = schemes.DEFAULT_GROUP_SIZE,
        zero_points: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if in_features % group_size or group_size % 2:
            raise schemes.UnsupportedQuantizationError(
                f"w4a16: input size {in_features} is not a multiple of the group size {group_size}"
            )
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=torch.float32))
        # A checkpoint's own zero points (GPTQ sym: false, AWQ), each less 8, one per group: the weight is
        # (value - zero) * scale. None: symmetric, every zero point 8.
        zeros = torch.zeros(out_features, groups, dtype=torch.int8) if zero_points else None
        self.register_buffer("weight_zero", zeros)
        self._zero_times_scale: torch.Tensor | None = None

    def weight_data(self) -> torch.Tensor:
        return self.weight_packed

    def set_rows(self, start: int, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """`weight` is int4 values as int8 [rows, in]; they are packed here."""
        super().set_rows(start, schemes.pack_int4(weight), scale.float())
        self._zero_times_scale = None

    def set_zero_rows(self, start: int, zero: torch.Tensor) -> None:
        """A checkpoint's zero points (each less 8, int8 [rows, groups]) for output rows start.."""
        if self.weight_zero is None:
            raise schemes.UnsupportedQuantizationError("w4a16: zero points for a symmetric layer")
        self.weight_zero.narrow(0, start, zero.shape[0]).copy_(zero)
        self._zero_times_scale = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if _use_triton(x):
            from ember_engine.model.quant import triton_gemm

            y = triton_gemm.int4_matmul(x, self.weight_packed, self.weight_scale, self.group_size)
        elif x.device.type == "cpu":
            y = cpu_int4.int4_matmul(x, self.weight_packed, self.weight_scale)
        else:
            return F.linear(x, self.dequantized(x.dtype))
        if self.weight_zero is None:
            return y
        # sum_i (v_i - z_g) s_g x_i = (the symmetric product) - sum_g z_g s_g (sum of x over group g).
        if self._zero_times_scale is None:
            self._zero_times_scale = self.weight_zero.float() * self.weight_scale
        sums = x.float().reshape(x.shape[0], -1, self.group_size).sum(dim=-1)
        return (y.float() - sums @ self._zero_times_scale.t()).to(x.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.weight_zero is None:
            return schemes.dequantize_int4(self.weight_packed, self.weight_scale, dtype)
        values = schemes.unpack_int4(self.weight_packed).float()
        zeros = self.weight_zero.float().repeat_interleave(self.group_size, dim=1)
        return ((values - zeros) * self.weight_scale.repeat_interleave(self.group_size, dim=1)).to(dtype)


LAYERS: dict[str, type[QuantLinear]] = {"fp8": Fp8Linear, "w8a16": Int8Linear, "w4a16": Int4Linear}


def make_layer(
    scheme: str,
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    group_size: int,
    zero_points: bool = False,
) -> QuantLinear:
    """`group_size`: input columns per scale (w4a16; w8a16 and fp8, where 0 means one scale per output
    channel; fp8 with groups is block-scaled). `zero_points`: a w4a16 checkpoint's own, one per group."""
    if schemes.check_scheme(scheme) == "w4a16":
        return Int4Linear(in_features, out_features, bias, dtype, group_size, zero_points)
    if scheme == "w8a16":
        return Int8Linear(in_features, out_features, bias, dtype, group_size)
    if group_size:
        return Fp8BlockLinear(in_features, out_features, bias, dtype, group_size)
    return Fp8Linear(in_features, out_features, bias, dtype)


def quantize_linear(linear: nn.Linear, scheme: str, group_size: int) -> QuantLinear:
    """A full-precision layer's quantized counterpart (online quantization; fp8 with `group_size` in
    square tiles of that side)."""
    w = linear.weight.detach()
    layer = make_layer(
        scheme, linear.in_features, linear.out_features, linear.bias is not None, w.dtype, group_size
    )
    layer.to(w.device)
    quantize = {
        "fp8": lambda t: _fp8_blocks(t, group_size) if group_size else schemes.quantize_fp8(t),
        "w8a16": lambda t: schemes.quantize_int8(t, group_size),
        "w4a16": lambda t: schemes.quantize_int4(t, group_size),
    }[scheme]
    q, scale = quantize(w)
    layer.set_rows(0, q, scale)
    if linear.bias is not None and layer.bias is not None:
        layer.bias.data.copy_(linear.bias.detach())
    return layer


def _fp8_blocks(w: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = schemes.quantize_fp8_blocks(w, (side, side))
    return q, schemes.block_scales_per_row(scale, w.shape[0], side)
