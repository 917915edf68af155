"""ModelOpt's W4A8_AWQ held at the size its file has: 4-bit codes, and for each output row and group of
input columns the 16 E4M3 values its codes stand for; FP8 activations under the checkpoint's calibrated
input scale (`w4a8-fp8`).

ModelOpt quantizes a weight twice: to int4 v in [-8, 7] with a scale s_g per row and group of 128, then
v * s_g to E4M3 under one scale s2 per tensor (`weight_scale_2`), and multiplies E4M3(v * s_g / s2) * s2
with its FP8 activations. A group's code c = v + 8 thus stands for one of 16 E4M3 values, worked out at
load by the same float32 arithmetic (`modelopt._w4a8_weight`): every path computes with the very E4M3
weights of the export. Held: half a byte a weight for the codes, 16 bytes a group of 128 for its values
(an eighth of a byte a weight) and s2 per row, 0.63 bytes a weight where E4M3 weights take 1.
"""

from __future__ import annotations

import torch

from ember_engine.model.quant import cpu_w4a8, schemes
from ember_engine.model.quant.layer import QuantLinear, merged_input_scale, use_triton

CODES = 16


class W4Fp8Linear(QuantLinear):
    """y = (x quantized to E4M3 under `input_scale`) @ (table[row, group, code] * weight_scale[row])^T."""

    scheme = "w4a8-fp8"
    weight_packed: torch.Tensor
    weight_table: torch.Tensor
    input_scale: torch.Tensor | None

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, group_size: int
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if not group_size or in_features % group_size or group_size % 2:
            raise schemes.UnsupportedQuantizationError(
                f"w4a8-fp8: input size {in_features} is not a multiple of the group size {group_size}"
            )
        self.group_size = group_size
        groups = in_features // group_size
        # codes two a byte, column 2j in the low nibble (`schemes.pack_int4` of the int4 values)
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        # each row's and group's E4M3 value of each code (code c: int4 value c - 8), over weight_scale
        table = torch.zeros(out_features, groups, CODES, dtype=torch.float8_e4m3fn)
        self.register_buffer("weight_table", table)
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("input_scale", None)

    def weight_data(self) -> torch.Tensor:
        return self.weight_packed

    def set_rows(self, start: int, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """`weight`: int4 values as int8 [rows, in], packed here; `scale`: their rows' tables, E4M3 [rows,
        groups, 16]."""
        rows = weight.shape[0]
        if tuple(scale.shape) != (rows, *self.weight_table.shape[1:]) or scale.dtype != torch.float8_e4m3fn:
            raise schemes.UnsupportedQuantizationError(
                f"w4a8-fp8: E4M3 tables {scale.dtype} {list(scale.shape)} for {rows} rows; expected "
                f"{[rows, *self.weight_table.shape[1:]]}"
            )
        self.weight_packed.narrow(0, start, rows).copy_(schemes.pack_int4(weight))
        self.weight_table.narrow(0, start, rows).copy_(scale)

    def set_outer_rows(self, start: int, rows: int, outer: torch.Tensor) -> None:
        """A part's per-tensor `weight_scale_2`, for its rows start.. (a merged projection's parts differ)."""
        self.weight_scale.narrow(0, start, rows).fill_(float(outer.float().reshape(())))

    def set_input_scale(self, scale: torch.Tensor, name: str) -> None:
        """A part's calibrated activation scale; a merged projection's parts share the largest."""
        self.input_scale = merged_input_scale(self.input_scale, scale, name, self.weight_scale.device)

    def e4m3_weight(self) -> torch.Tensor:
        """The E4M3 weight [out, in] the codes stand for (before weight_scale)."""
        codes = schemes.unpack_int4(self.weight_packed).long() + 8  # [out, in]
        groups = torch.arange(self.in_features, device=codes.device) // self.group_size
        flat = self.weight_table.view(torch.uint8).reshape(self.out_features, -1)
        return flat.gather(1, groups[None, :] * CODES + codes).view(torch.float8_e4m3fn)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is None:
            raise schemes.UnsupportedQuantizationError("w4a8-fp8: no input_scale was loaded for this layer")
        if use_triton(x):
            from ember_engine.model.quant import triton_act_quant, triton_gemm, triton_gemm_config

            xq, _ = triton_act_quant.fp8_static(x, self.input_scale)
            n = self.out_features
            return triton_gemm.run_gemm(
                xq.view(torch.uint8),
                self.weight_packed,
                self.weight_table.view(torch.uint8).reshape(n, -1),  # a row's tables, group after group
                n,
                triton_gemm_config.W4_FP8,
                group=self.group_size,
                x_scale=(self.weight_scale * self.input_scale.reshape(())).contiguous(),  # per column
                out_dtype=x.dtype,
            )
        xq, x_scale = schemes.quantize_activation_fp8_static(x, self.input_scale)
        if x.device.type == "cpu":
            return cpu_w4a8.matmul(xq, x_scale, self.weight_packed, self.weight_table, self.weight_scale).to(
                x.dtype
            )
        return ((xq.float() * x_scale) @ self.dequantized().t()).to(x.dtype)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.e4m3_weight().float() * self.weight_scale[:, None]).to(dtype)
