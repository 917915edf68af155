"""Which quantized layer each scheme runs (`make_layer`), and online quantization of a full-precision
`nn.Linear` into it (`quantize_linear`). The layers: `fp8_linear.py`, `int_linear.py`, `fp4_linear.py`,
`codebook_linear.py`, `w4a8_linear.py`; their base and the
choice of GPU and CPU paths: `layer.py`. `warm_up_cpu` compiles the CPU loops a model's schemes run."""

from __future__ import annotations

import torch
from torch import nn

from ember_engine.model.quant import schemes
from ember_engine.model.quant.codebook_linear import CodebookLinear
from ember_engine.model.quant.fp4_linear import Fp4Linear
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8Linear, Fp8WeightOnlyLinear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear, W8A8Linear
from ember_engine.model.quant.layer import QuantLinear
from ember_engine.model.quant.llm_int8_linear import LlmInt8Linear
from ember_engine.model.quant.spec import QuantSpec
from ember_engine.model.quant.w4a8_linear import W4Fp8Linear


def make_layer(
    scheme: str,
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    group_size: int,
    zero_points: bool = False,
    outlier_threshold: float = 0.0,
    float_zeros: bool = False,
    input_quant: str = "",
) -> QuantLinear:
    """`group_size`: input columns per scale (w4a16, w4a8-fp8; w8a16, fp8 and w8a16-fp8, where 0 means one scale
    per output channel; fp8 and w8a16-fp8 with groups are block-scaled; w8a8 takes 0 only).
    `zero_points`: a w4a16 checkpoint's own, one per group (int8, or with `float_zeros` float32: any real
    number); w8a16's are float32. `outlier_threshold`: bitsandbytes 8-bit's
    (LLM.int8()). `input_quant`: the inputs quantized at run time, where the scheme leaves them as they
    are (codebook: mxfp4; block-scaled fp8: mxfp8 or mxfp8-fit, in place of its own; w4a16: fp8 or int8
    per token)."""
    if input_quant:
        runs = {"codebook": ("mxfp4",), "fp8": ("mxfp8", "mxfp8-fit"), "w4a16": ("fp8", "int8")}
        if input_quant not in runs.get(scheme, ()) or not group_size:
            raise schemes.UnsupportedQuantizationError(
                f"{scheme}: inputs quantized to {input_quant} are not supported; supported: codebook with "
                "mxfp4, block-scaled fp8 with mxfp8 or mxfp8-fit, w4a16 with fp8 or int8"
            )
        layer = make_layer(scheme, in_features, out_features, bias, dtype, group_size)
        assert isinstance(layer, (CodebookLinear, Fp8BlockLinear, Int4Linear))
        layer.input_quant = input_quant
        return layer
    if scheme in ("bnb-nf4", "bnb-fp4", "codebook"):  # from a checkpoint only (the code table set at load)
        return CodebookLinear(in_features, out_features, bias, dtype, scheme, group_size)
    if scheme == "bnb-int8":  # from a checkpoint only
        return LlmInt8Linear(in_features, out_features, bias, dtype, outlier_threshold)
    if scheme == "w8a16-fp8":  # from a checkpoint only
        return Fp8WeightOnlyLinear(in_features, out_features, bias, dtype, group_size)
    if scheme in ("nvfp4a16", "nvfp4"):  # from a checkpoint only (nvfp4's activation scales set at load)
        return Fp4Linear(in_features, out_features, bias, dtype)
    if scheme == "w4a8-fp8":  # from a checkpoint only (ModelOpt's W4A8_AWQ)
        return W4Fp8Linear(in_features, out_features, bias, dtype, group_size)
    if schemes.check_scheme(scheme) == "w4a16":
        return Int4Linear(in_features, out_features, bias, dtype, group_size, zero_points, float_zeros)
    if scheme == "w8a16":
        return Int8Linear(in_features, out_features, bias, dtype, group_size, zero_points)
    if scheme == "w8a8":
        if group_size:
            raise schemes.UnsupportedQuantizationError(
                f"w8a8: weight scales per group of {group_size} input columns are not supported; supported: "
                "one per output channel"
            )
        return W8A8Linear(in_features, out_features, bias, dtype)
    if group_size:
        return Fp8BlockLinear(in_features, out_features, bias, dtype, group_size)
    return Fp8Linear(in_features, out_features, bias, dtype)


def quantize_linear(
    linear: nn.Linear, scheme: str, group_size: int, row_max: torch.Tensor | None = None
) -> QuantLinear:
    """A full-precision layer's quantized counterpart (online quantization; fp8 with `group_size` in
    square tiles of that side; "bitsandbytes" is NF4, `group_size` its block). `row_max` (per output row,
    with a scale per row): the largest magnitude of each whole row where this layer holds a part of its
    columns (a tensor-parallel rank's), so that the row's scale is the whole row's."""
    scheme = schemes.LAYER_SCHEME.get(scheme, scheme)
    w = linear.weight.detach()
    if row_max is not None:  # one more column holding the row's largest value sets the scale; then dropped
        w = torch.cat([w, row_max.to(w.dtype).reshape(-1, 1)], dim=1)
    layer = make_layer(
        scheme, linear.in_features, linear.out_features, linear.bias is not None, w.dtype, group_size
    )
    layer.to(w.device)
    quantize = {
        "fp8": lambda t: _fp8_blocks(t, group_size) if group_size else schemes.quantize_fp8(t),
        "w8a16": lambda t: schemes.quantize_int8(t, group_size),
        "w8a8": lambda t: schemes.quantize_int8(t),
        "w4a16": lambda t: schemes.quantize_int4(t, group_size),
        "bnb-nf4": lambda t: schemes.quantize_nf4(t, group_size),
    }[scheme]
    q, scale = quantize(w)
    if row_max is not None:
        q = q[:, :-1].contiguous()
    layer.set_rows(0, q, scale)
    if isinstance(layer, CodebookLinear):
        layer.set_code(torch.tensor(schemes.NF4_VALUES), "nf4")
    if linear.bias is not None and layer.bias is not None:
        layer.bias.data.copy_(linear.bias.detach())
    return layer


def _fp8_blocks(w: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, scale = schemes.quantize_fp8_blocks(w, (side, side))
    return q, schemes.block_scales_per_row(scale, w.shape[0], side)


def warm_up_cpu(spec: QuantSpec) -> None:
    """Compile the CPU loops of the schemes a model runs before serving (or read them from numba's
    cache)."""
    from ember_engine.model.quant import cpu_codebook, cpu_decode, cpu_fp4, cpu_int4, cpu_w4a8

    for scheme in dict.fromkeys(s.scheme for s in spec.members()):
        if scheme == "bnb-int8":
            continue  # torch's int8 matmul: nothing to compile
        if scheme == "w4a16":
            cpu_int4.warm_up(float_zeros=any(s.float_zeros for s in spec.members()))
        elif scheme in ("bnb-nf4", "bnb-fp4", "codebook"):
            cpu_codebook.warm_up()
        elif scheme in ("nvfp4a16", "nvfp4"):
            cpu_fp4.warm_up()
        elif scheme == "w4a8-fp8":
            cpu_w4a8.warm_up()
        else:
            cpu_decode.warm_up("fp8" if scheme == "w8a16-fp8" else scheme)
