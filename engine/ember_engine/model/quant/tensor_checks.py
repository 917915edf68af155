"""What a projection's tensors in a quantized checkpoint must be before they are placed in its layer, and
the errors that name them as the file does: scales that are numbers, `pack-quantized` words as many as the
config says, and the message for any other shape the config's layer cannot hold."""

from __future__ import annotations

import torch

from ember_engine.model.quant.layer import QuantLinear
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import QuantSpec

_SCALES = ("weight_scale", "weight_scale_inv", "weight_global_scale", "weight_scale_2")
_BNB_NAMES = {"weight_absmax": "weight.absmax", "weight_nested_absmax": "weight.nested_absmax"}


def finite_scales(tensors: dict[str, torch.Tensor], projection: str) -> None:
    """Scales that are numbers: a NaN or infinite one would make every output of the layer NaN."""
    # compressed-tensors' and Hugging Face's names (ModelOpt's renamed to them), GPTQ's and AWQ's, and
    # bitsandbytes' (its state flattened: `weight.absmax` as `weight_absmax`)
    for key in (*_SCALES, "scales", "weight_absmax", "weight_nested_absmax", "SCB"):
        scale = tensors.get(key)
        if scale is not None and scale.is_floating_point() and not bool(torch.isfinite(scale.float()).all()):
            bad = scale.float().reshape(-1)
            at = int((~torch.isfinite(bad)).nonzero()[0])
            raise UnsupportedQuantizationError(
                f"{projection}.{in_file(key)}: not finite ({bad[at].item()} at flat index {at} of "
                f"{list(scale.shape)})"
            )


def in_file(suffix: str) -> str:
    """A tensor's own name as a checkpoint holds it (bitsandbytes' state is read flattened)."""
    return _BNB_NAMES.get(suffix, suffix)


def misfit(
    spec: QuantSpec, tensors: dict[str, torch.Tensor], projection: str, layer: QuantLinear, e: Exception
) -> str:
    """The error of tensors the config's layer could not take (`e`, torch's), naming what was given."""
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in sorted(tensors.items()) if v.dim())
    grouping = f", groups of {spec.group_size}" if spec.group_size else ""
    return (
        f"{projection}: the checkpoint's tensors ({shapes}) do not fit its config's {spec.scheme}{grouping} "
        f"for a layer of {layer.in_features} inputs ({e})"
    )


def words(values: int, bits: int) -> int:
    return -(-values * bits // 32)


def packed_as_said(t: torch.Tensor, shape: list[int], name: str, spec: QuantSpec) -> None:
    """`pack-quantized` words as many as the config's bits and the weight_shape make."""
    if list(t.shape) != shape:
        raise UnsupportedQuantizationError(
            f"{name}: {list(t.shape)} int32 words, where {spec.num_bits}-bit values packed 32 / "
            f"{spec.num_bits} a word need {shape} (the config's num_bits and the weight_shape)"
        )
