"""NVFP4 weights (compressed-tensors' `nvfp4-pack-quantized`) with activations as they are (NVFP4A16) or
quantized to NVFP4 too (NVFP4, W4A4: `set_input_global`), or to FP8 E4M3 under a calibrated scale
(ModelOpt's W4A8_NVFP4_FP8: `set_input_scale`). The weights are held as the checkpoint holds
them, 4.5 bits a weight: two FP4 E2M1 values a byte (column 2j in the low nibble), an FP8 E4M3 scale per
output row and group of 16 input columns, and a global scale per output row (the checkpoint's per-tensor
one, kept per row so that merged q/k/v and gate/up parts keep theirs). A weight is its E2M1 value times
its group's scale divided by its row's global scale, in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ember_engine.model.quant import cpu_fp4, schemes
from ember_engine.model.quant.layer import QuantLinear, merged_input_scale, use_triton

GROUP = 16


class Fp4Linear(QuantLinear):
    scheme = "nvfp4a16"
    weight_packed: torch.Tensor
    weight_global: torch.Tensor
    input_global: torch.Tensor | None
    input_scale: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        if in_features % GROUP:
            raise schemes.UnsupportedQuantizationError(
                f"NVFP4: input size {in_features} is not a multiple of the group size {GROUP}"
            )
        self.group_size = GROUP
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        groups = in_features // GROUP
        self.register_buffer("weight_scale", torch.ones(out_features, groups, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_global", torch.ones(out_features, dtype=torch.float32))
        self.register_buffer("input_global", None)
        self.register_buffer("input_scale", None)

    def weight_data(self) -> torch.Tensor:
        return self.weight_packed

    def set_global_rows(self, start: int, rows: int, global_scale: torch.Tensor) -> None:
        """A checkpoint projection's global scale for output rows start.. (start + rows)."""
        self.weight_global.narrow(0, start, rows).fill_(global_scale.float().reshape(()).item())

    def set_input_global(self, value: torch.Tensor, name: str, smallest: bool = False) -> None:
        """A part's calibrated activation global scale (W4A4). The parts of a merged projection share its
        input and so one quantization of it: the largest of their global scales (compressed-tensors'), or
        with `smallest` the smallest (ModelOpt's, whose parts' input scales are these' reciprocals and
        the largest of them is taken)."""
        g = value.float().reshape(-1)
        if g.numel() != 1 or not torch.isfinite(g).all() or g.item() <= 0:
            raise schemes.UnsupportedQuantizationError(
                f"{name}: input_global_scale must be one positive finite number, found {g.tolist()[:4]}"
            )
        g = g.to(self.weight_global.device)
        if self.input_global is not None:
            g = (torch.minimum if smallest else torch.maximum)(self.input_global, g)
        self.input_global = g
        self.scheme = "nvfp4"

    def set_input_scale(self, scale: torch.Tensor, name: str) -> None:
        """A part's calibrated FP8 activation scale (W4A8_NVFP4_FP8); a merged projection's parts share the
        largest."""
        self.input_scale = merged_input_scale(self.input_scale, scale, name, self.weight_global.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_global is not None:  # W4A4: the activations as NVFP4 gives them, then multiplied
            x = schemes.fake_quantize_nvfp4(x, self.input_global).to(x.dtype)
        elif self.input_scale is not None:  # FP8 activations under their static scale, then multiplied
            xq, scale = schemes.quantize_activation_fp8_static(x, self.input_scale)
            x = (xq.float() * scale).to(x.dtype)
        if use_triton(x):
            from ember_engine.model.quant import triton_gemm

            return triton_gemm.fp4_matmul(x, self.weight_packed, self.weight_scale, self.weight_global, GROUP)
        if x.device.type == "cpu":
            return cpu_fp4.fp4_matmul(x, self.weight_packed, self.weight_scale, self.weight_global)
        return F.linear(x, self.dequantized(x.dtype))

    def group_scales(self) -> torch.Tensor:
        """Each group's float32 scale [out, in / 16]: its FP8 scale over its row's global scale."""
        return self.weight_scale.float() / self.weight_global[:, None]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        values = schemes.unpack_fp4(self.weight_packed)
        return (values * self.group_scales().repeat_interleave(GROUP, dim=1)).to(dtype)
