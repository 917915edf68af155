"""Integer weights: int8 with float activations (w8a16), int8 with int8 activations (w8a8), and int4
in groups, with a checkpoint's zero points where it has them (w4a16)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_engine.model.quant import cpu_decode, cpu_int4, schemes
from ember_engine.model.quant.layer import QuantLinear, merged_input_scale, use_triton


class _ZeroPoints(QuantLinear):
    """A layer whose weight may have a zero point per group: (value - zero) * scale. `weight_zero` None:
    symmetric. The product takes them off the symmetric one (`less_zero_points`)."""

    weight_zero: torch.Tensor | None
    group_size: int
    _zero_times_scale: torch.Tensor | None = None

    def set_zero_rows(self, start: int, zero: torch.Tensor) -> None:
        """Zero points ([rows, groups]) for output rows start.."""
        if self.weight_zero is None:
            raise schemes.UnsupportedQuantizationError(f"{self.scheme}: zero points for a symmetric layer")
        self.weight_zero.narrow(0, start, zero.shape[0]).copy_(zero)
        self._zero_times_scale = None

    def _less_zero_points(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.weight_zero is None:
            return y
        if self._zero_times_scale is None:
            self._zero_times_scale = self.weight_zero.float() * self.weight_scale
        return less_zero_points(x, y, self._zero_times_scale, self.group_size)


class Int8Linear(_ZeroPoints):
    """int8 weights with a scale per output channel (`group_size` 0) or per group of input columns, and
    with `zero_points` a float32 zero point per group: the weight is (value - zero) * scale (GGUF's 5-bit
    types with a minimum, and q/k/v parts of different types held alike)."""

    scheme = "w8a16"
    weight: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group_size: int = 0,
        zero_points: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if group_size and in_features % group_size:
            raise schemes.UnsupportedQuantizationError(
                f"w8a16: input size {in_features} is not a multiple of the group size {group_size}"
            )
        self.group_size = group_size or in_features
        groups = in_features // self.group_size
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=torch.float32))
        zeros = torch.zeros(out_features, groups, dtype=torch.float32) if zero_points else None
        self.register_buffer("weight_zero", zeros)

    def weight_data(self) -> torch.Tensor:
        return self.weight

    def set_rows(self, start: int, weight: torch.Tensor, scale: torch.Tensor) -> None:
        super().set_rows(start, weight, scale)
        self._zero_times_scale = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._less_zero_points(x, self._symmetric(x))

    def _symmetric(self, x: torch.Tensor) -> torch.Tensor:
        """x times (value * scale), the zero points left out."""
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.int8_matmul(x, self.weight, self.weight_scale, self.group_size)
        if x.device.type != "cpu":
            return F.linear(x, self.dequantized(x.dtype, zeros=False))
        if x.dtype == torch.bfloat16 and self.group_size == self.in_features:
            # torch's int8 weight-pack matmul, fast for bf16 activations; float32 scales are applied to
            # its output, so they are not rounded to bf16.
            ones = torch.ones(self.out_features, dtype=x.dtype, device=x.device)
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight, ones)
            return (y.float() * self.weight_scale.reshape(-1)).to(x.dtype)
        return cpu_decode.int8_matmul(x, self.weight, self.weight_scale)

    def dequantized(self, dtype: torch.dtype = torch.float32, zeros: bool = True) -> torch.Tensor:
        values = self.weight.float()
        if zeros and self.weight_zero is not None:
            values = values - self.weight_zero.repeat_interleave(self.group_size, dim=1)
        return (values * self.weight_scale.repeat_interleave(self.group_size, dim=1)).to(dtype)


def less_zero_points(
    x: torch.Tensor, y: torch.Tensor, zero_times_scale: torch.Tensor, group: int
) -> torch.Tensor:
    """The product with zero points from the symmetric one: sum_i (v_i - z_g) s_g x_i = y - sum_g z_g s_g
    (the sum of x over group g)."""
    sums = x.float().reshape(x.shape[0], -1, group).sum(dim=-1)
    return (y.float() - sums @ zero_times_scale.t()).to(x.dtype)


class W8A8Linear(Int8Linear):
    """int8 weights with a scale per output channel, and int8 activations with a scale per token taken at
    run time (W8A8-INT8), or, once `set_input_scale` has given it a checkpoint's calibrated scale, with
    that scale for every token: y = (xq . q) * x_scale * w_scale, the dot products exact int32 sums
    (torch's int8 x int8 -> int32 matmul on the CPU, int8 dots in the Triton GEMM)."""

    scheme = "w8a8"
    input_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype, group_size=0)
        self.register_buffer("input_scale", None)

    def set_input_scale(self, scale: torch.Tensor, name: str) -> None:
        """A part's calibrated activation scale; a merged projection's parts share the largest."""
        self.input_scale = merged_input_scale(self.input_scale, scale, name, self.weight_scale.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x) and (not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 0)):
            from ember_engine.model.quant import triton_gemm  # int8 dots: compute capability 8.0 and up

            return triton_gemm.w8a8_matmul(x, self.weight, self.weight_scale, self.input_scale)
        if self.input_scale is not None:
            xq, x_scale = schemes.quantize_activation_int8_static(x, self.input_scale)
        else:
            xq, x_scale = schemes.quantize_activation_int8(x)
        if x.device.type == "cpu" and x.shape[0] > 0:
            sums = torch._int_mm(xq, self.weight.t())
            return (sums.float() * x_scale * self.weight_scale.reshape(1, -1)).to(x.dtype)
        return ((xq.float() * x_scale) @ self.dequantized().t()).to(x.dtype)


class Int4Linear(_ZeroPoints):
    scheme = "w4a16"
    weight_packed: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group_size: int = schemes.DEFAULT_GROUP_SIZE,
        zero_points: bool = False,
        float_zeros: bool = False,
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
        # (value - zero) * scale; int8, or float32 where they are any real number (GGUF Q4_K). None:
        # symmetric, every zero point 8.
        zero_dtype = torch.float32 if float_zeros else torch.int8
        zeros = torch.zeros(out_features, groups, dtype=zero_dtype) if zero_points else None
        self.register_buffer("weight_zero", zeros)

    def weight_data(self) -> torch.Tensor:
        return self.weight_packed

    def set_rows(self, start: int, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """`weight` is int4 values as int8 [rows, in]; they are packed here."""
        super().set_rows(start, schemes.pack_int4(weight), scale.float())
        self._zero_times_scale = None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_quant:
            x = schemes.fake_quantize_input(x, self.input_quant).to(x.dtype)
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            y = triton_gemm.int4_matmul(x, self.weight_packed, self.weight_scale, self.group_size)
        elif x.device.type == "cpu":  # the compiled loops take the zero points as they go
            return cpu_int4.int4_matmul(x, self.weight_packed, self.weight_scale, self.weight_zero)
        else:
            return F.linear(x, self.dequantized(x.dtype))
        return self._less_zero_points(x, y)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.weight_zero is None:
            return schemes.dequantize_int4(self.weight_packed, self.weight_scale, dtype)
        values = schemes.unpack_int4(self.weight_packed).float()
        zeros = self.weight_zero.float().repeat_interleave(self.group_size, dim=1)
        return ((values - zeros) * self.weight_scale.repeat_interleave(self.group_size, dim=1)).to(dtype)
