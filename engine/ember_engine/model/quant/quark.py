"""AMD Quark checkpoints (`quant_method: quark`), as Quark's `export_safetensors` writes them in Hugging
Face's form: what the "amd/...-FP8" and "...-FP8-KV" downloads are.

The config gives each layer a weight, input and output spec: `layer_quant_config` (the first of its
shell-style patterns that matches the layer's name), else `layer_type_quant_config`, else
`global_quant_config`; `exclude` lists names and patterns left in full precision. Run here: E4M3
(`fp8_e4m3`) symmetric weights with a static scale per tensor or per output channel (`weight`,
`weight_scale`), and inputs either not quantized (`w8a16-fp8`), in E4M3 with a calibrated scale per tensor
(`input_scale`, static `fp8`) or in E4M3 per token as the model runs (`per_channel` over axis 1, Quark's
"ptpc_fp8" scheme: `fp8`). An output spec is taken only where `kv_cache_quant_config` names the layer: it is
the FP8 KV cache's scale (`k_proj.output_scale`, `v_proj.output_scale`), used with `kv_cache_dtype` fp8.
Layers whose specs differ from each other (mixed precision), other data types (int8, int4, MX formats),
and weights stored unquantized (`weight_format` other than `real_quantized`) are refused by name.
"""

from __future__ import annotations

import fnmatch
import json
from typing import Any

from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import QuantSpec

METHOD = "quark"
FP8 = "fp8_e4m3"


def _tensor_spec(spec: dict[str, Any] | None, what: str, where: str) -> str | None:
    """One tensor's spec as ember's name for it: None (not quantized), "tensor" or "channel" (weights,
    static), "static" or "token" (inputs); anything else refused."""
    if spec is None:
        return None
    dtype, qscheme, axis = spec.get("dtype"), spec.get("qscheme"), spec.get("ch_axis")
    dynamic, symmetric = bool(spec.get("is_dynamic")), spec.get("symmetric", True)
    kinds: dict[tuple[Any, ...], str | None] = {
        (FP8, "per_tensor", None, False): "tensor" if what == "weight" else "static",
        (FP8, "per_channel", 0, False): "channel" if what == "weight" else None,
        (FP8, "per_channel", 1, True): "token" if what == "input_tensors" else None,
    }
    kind = kinds.get((dtype, qscheme, axis, dynamic))
    if kind is None or not symmetric:
        supported = (
            "fp8_e4m3 per_tensor or per_channel (ch_axis 0), static, symmetric"
            if what == "weight"
            else "fp8_e4m3 per_tensor static, or per_channel over ch_axis 1 dynamic (per token), symmetric"
        )
        raise UnsupportedQuantizationError(
            f"quark checkpoint: {where}{what} {dtype} {qscheme} (ch_axis {axis}, dynamic={dynamic}, "
            f"symmetric={symmetric}) is not supported; supported: {supported}"
        )
    return kind


def _layer(config: dict[str, Any], where: str) -> tuple[str | None, str | None]:
    """A layer config's (weight kind, input kind)."""
    if config.get("bias") is not None:
        raise UnsupportedQuantizationError(f"quark checkpoint: {where}bias quantization is not supported")
    weight = _tensor_spec(config.get("weight"), "weight", where)
    if weight is None:
        raise UnsupportedQuantizationError(
            f"quark checkpoint: {where}quantizes no weights; supported: fp8_e4m3 weights"
        )
    return weight, _tensor_spec(config.get("input_tensors"), "input_tensors", where)


def parse(qc: dict[str, Any]) -> QuantSpec:
    export = qc.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized":
        raise UnsupportedQuantizationError(
            f"quark checkpoint: weight_format {export.get('weight_format')!r} is not supported; supported: "
            "real_quantized"
        )
    kinds = _layer(qc.get("global_quant_config") or {}, "")
    kv_layers = (qc.get("kv_cache_quant_config") or {}).keys()
    for section in ("layer_quant_config", "layer_type_quant_config"):
        for pattern, config in (qc.get(section) or {}).items():
            if _layer(config, f"{section} {pattern!r}: ") != kinds:
                raise UnsupportedQuantizationError(
                    f"quark checkpoint: {section} gives {pattern!r} its own scheme (mixed precision); "
                    "supported: one scheme for every quantized layer"
                )
            if config.get("output_tensors") is not None and pattern not in kv_layers:
                raise UnsupportedQuantizationError(
                    f"quark checkpoint: {section} quantizes {pattern!r}'s outputs; supported: the KV "
                    "cache's (kv_cache_quant_config)"
                )
    if (qc.get("global_quant_config") or {}).get("output_tensors") is not None:
        raise UnsupportedQuantizationError(
            "quark checkpoint: output quantization of every layer is not supported"
        )
    exclude = qc.get("exclude") or []
    if not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        raise UnsupportedQuantizationError(
            f"quark checkpoint: exclude must be a list of names, found {exclude!r}"
        )
    ignore = tuple("re:" + fnmatch.translate(e) for e in exclude)
    inputs = kinds[1]  # the weights' scales, per tensor or channel, load as either
    if inputs is None:
        return QuantSpec("w8a16-fp8", METHOD, group_size=0, ignore=ignore)
    return QuantSpec("fp8", METHOD, group_size=0, static_input=inputs == "static", ignore=ignore)


def check_kv_scheme(qc: dict[str, Any]) -> None:
    """Refuse, by name, a KV-cache spec an FP8 cache cannot take the checkpoint's scales for: E4M3 with a
    static scale per tensor is what Quark's kv_cache_scheme "fp8" writes."""
    for pattern, config in (qc.get("kv_cache_quant_config") or {}).items():
        out = config.get("output_tensors") or {}
        if (out.get("dtype"), out.get("qscheme"), bool(out.get("is_dynamic"))) != (FP8, "per_tensor", False):
            raise ValueError(
                f"quark checkpoint: KV-cache spec of {pattern!r} ({json.dumps(out, sort_keys=True)}) is not "
                "supported with kv_cache_dtype fp8; supported: fp8_e4m3 per_tensor, static"
            )
