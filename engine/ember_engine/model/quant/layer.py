"""The base of the linear layers over quantized weights (`fp8_linear.py`, `int_linear.py`), drop-in
replacements for the model's `nn.Linear`s, and the choice between the GPU and CPU paths.

Weights and scales are buffers in the canonical forms of `schemes.py`; a bias, where the model has one,
stays a parameter in the model dtype. CUDA inputs go to the Triton kernels (`triton_gemm.py`); the CPU
path runs compiled loops and torch (`cpu_decode.py`, `cpu_int4.py`): at decode batch sizes one loop
reads each weight byte once and multiplies its value with the activations in float32 (fp8 activations
quantized per token, per token and group, or with a checkpoint's static scale, then decoded); above
them `w8a16` with a scale per channel takes the exact int8 matmul on the activations split into int8
digits (`cpu_int8.py`), and `fp8`, `w4a16` and `w8a16` in groups a float32 matmul over weight rows
decoded a block at a time; `w8a8` takes the int8 matmul on its int8 activations at every batch size.
bf16 activations with one w8a16 scale per channel take torch's int8 weight-pack matmul at every batch
size. Other devices without Triton take torch's scaled matmul (fp8) or the dequantized product.
`EMBER_QUANT_GEMM=triton` or `=torch` overrides the choice.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ember_engine.model.quant import schemes


def use_triton(x: torch.Tensor) -> bool:
    mode = os.environ.get("EMBER_QUANT_GEMM", "")
    if mode == "torch":
        return False
    return mode == "triton" or x.is_cuda


def merged_input_scale(
    current: torch.Tensor | None, scale: torch.Tensor, name: str, device: torch.device
) -> torch.Tensor:
    """A part's calibrated static activation scale, merged into the layer's: the parts of a merged
    projection share its input, so they share one scale, the largest of theirs, which saturates none of
    them (vLLM's rule too)."""
    value = scale.float().reshape(-1)
    if value.numel() != 1 or not torch.isfinite(value).all() or value.item() <= 0:
        raise schemes.UnsupportedQuantizationError(
            f"{name}: input_scale must be one positive finite number (static per tensor), "
            f"found {value.tolist()[:4]}"
        )
    value = value.to(device)
    return value if current is None else torch.maximum(current, value)


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
        # compressed-tensors' rotations at run time (`rotations.py`): of the input before the product, and
        # of the output after it
        self.input_rotation: nn.Module | None = None
        self.output_rotation: nn.Module | None = None
        # AWQ's smoothing, where a checkpoint keeps it (ModelOpt's `pre_quant_scale`): each input column
        # times its factor before the product; the parts that gave it (a merged layer's must all agree)
        self.input_smooth: torch.Tensor | None = None
        self._smooth_from: list[str] = []
        # The inputs quantized at run time where the scheme otherwise leaves them (`QuantSpec.input_quant`,
        # set by `linear.make_layer`): the codebook and w4a16 layers quantize and dequantize them first
        # (`schemes.fake_quantize_input`); block-scaled fp8 takes MXFP8's scales in place of its own.
        self.input_quant = ""

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

    def set_input_smooth(self, factors: torch.Tensor, name: str) -> None:
        """A part's smoothing factors [in] (a merged projection's parts share its input, so they must be the
        same factors)."""
        factors = factors.float().reshape(-1)
        if factors.numel() != self.in_features or not torch.isfinite(factors).all():
            raise schemes.UnsupportedQuantizationError(
                f"{name}: pre_quant_scale must hold {self.in_features} finite factors, one per input column, "
                f"found {factors.numel()}"
            )
        if self.input_smooth is not None and not torch.equal(factors, self.input_smooth.cpu()):
            raise schemes.UnsupportedQuantizationError(
                f"{name}: its pre_quant_scale differs from {self._smooth_from[0]}'s, with which it is merged "
                "(they share an input); not supported"
            )
        self.input_smooth = factors.to(self.weight_scale.device)
        self._smooth_from.append(name)

    def check_input_smooth(self, parts: list[str]) -> None:
        """Every part of a merged layer smoothed alike, or none (after loading)."""
        if self._smooth_from and len(set(self._smooth_from)) != len(parts):
            missing = sorted(set(parts) - set(self._smooth_from))
            raise schemes.UnsupportedQuantizationError(
                f"{', '.join(missing)}: no pre_quant_scale, where {self._smooth_from[0]}, with which it is "
                "merged (they share an input), has one; not supported"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.input_smooth is not None:
            x = (x * self.input_smooth).to(x.dtype)
        if self.input_rotation is not None:
            x = self.input_rotation(x)
        if self.input_order is not None:
            x = x.index_select(-1, self.input_order)
        y = self.matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias
        if self.output_rotation is not None:
            y = self.output_rotation(y)
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
