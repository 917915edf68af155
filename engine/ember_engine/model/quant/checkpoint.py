"""Quantized checkpoints: which scheme a `quantization_config` describes, and its tensors decoded into the
engine's canonical forms (`schemes.py`).

Formats read:
- compressed-tensors (what llm-compressor writes; `quant_method: compressed-tensors`): its config read by
  `compressed_tensors.py` (mixed precision included), its tensors decoded here. Symmetric weights, but
  W4A16_ASYM's zero points; activations dynamic per token (FP8, int8) or static per tensor (FP8) or none.
- Hugging Face `fp8` (`quant_method: fp8`): FP8 `weight` with `weight_scale_inv` per tensor or per channel,
  or per tile of `weight_block_size` [rows, columns] (block-scaled: the tiles' scales are kept, and
  activations are quantized per token and group of `columns` input columns).
- fbgemm FP8 (`quant_method: fbgemm_fp8`, Meta's "…-FP8" Llama releases): FP8 `weight` with a
  `weight_scale` [out, 1] per channel; activations per token, a token's largest magnitude taken as at most
  `activation_scale_ub`.
- GPTQ and AWQ (`quant_method: gptq`, `awq`): read by `gptq.py`.
- bitsandbytes 4- and 8-bit (`quant_method: bitsandbytes`): read by `bnb.py`.
- ModelOpt (`quant_method: modelopt`, or an older export's `hf_quant_config.json`): read by
  `modelopt.py`; FP8 `weight` with `weight_scale` per tensor, channel or 128 x 128 tile, static
  `input_scale` or none; NVFP4 weights, and activations. `modelopt.canonical` gives their tensors
  compressed-tensors' forms.
- AMD Quark (`quant_method: quark`): read by `quark.py`; FP8 `weight` with `weight_scale` per tensor or
  channel, static `input_scale` or none.
- GGUF (a `.gguf` file, described as a model directory by `model/gguf/directory.py`, `quant_method: gguf`): the
  projections of the types `gguf.KEPT` lists, decoded by `model/gguf/blocks.py`, as `w8a16` and `w4a16`.
Anything else is refused by name, with what is supported.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from ember_engine.core.config import CHECKPOINT_METHODS, QUANT_SCHEMES
from ember_engine.model.quant import bnb, compressed_tensors, gptq, modelopt, quark, schemes
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import GPTQ_FORMATS, Decoded, QuantSpec
from ember_engine.model.quant.tensor_checks import packed_as_said, words


def read_quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    """`config.json`'s `quantization_config`; where it has none, its `compression_config` (what older
    llm-compressor releases wrote, as vLLM reads it), then an older ModelOpt export's
    `hf_quant_config.json` (`modelopt.read_legacy`), then older AutoGPTQ's `quantize_config.json` or
    AutoAWQ's `quant_config.json` (`gptq.read_legacy`)."""
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text()) if path.exists() else {}
    qc = raw.get("quantization_config")
    if isinstance(qc, dict):
        return qc
    # Only compressed-tensors wrote the older key, without a quant_method where it held sparsity alone.
    older = raw.get("compression_config")
    if isinstance(older, dict):
        return {"quant_method": "compressed-tensors", **older}
    return modelopt.read_legacy(model_dir) or gptq.read_legacy(model_dir)


def weights_quantized(qc: dict[str, Any]) -> bool:
    """False for a compressed-tensors config with no config groups: one that quantizes only the KV cache
    (a `kv_cache_scheme`: llm-compressor's output for a KV-cache-only recipe), or that describes only
    sparsity (a pruned model stored dense)."""
    return not (qc.get("quant_method") == "compressed-tensors" and not qc.get("config_groups"))


def resolve(model_dir: str | Path, requested: str | None) -> QuantSpec | None:
    """The scheme to run: the checkpoint's own when it is quantized (`requested` may name it, or the
    checkpoint's `quant_method`, as vLLM takes it: gptq_marlin and awq_marlin for gptq and awq; anything
    else is an error), else `requested` applied at load, else None (full precision)."""
    qc = read_quantization_config(model_dir)
    if qc is not None and not weights_quantized(qc):
        # sparsity or transforms beside a KV-cache scheme, or alone
        if compressed_tensors.check_parts(qc):
            raise UnsupportedQuantizationError(
                "compressed-tensors: transform_config rotates layers as the model runs, but no config group "
                "quantizes them; ember applies run-time rotations to quantized layers only"
            )
        qc = None
    if qc is None:
        if requested is None:
            return None
        if requested in CHECKPOINT_METHODS:
            raise UnsupportedQuantizationError(
                f"quantization: {requested!r} names a quantized checkpoint's method, but {_named(model_dir)} is not "
                f"quantized; to quantize it at load: {', '.join(schemes.SCHEMES)}"
            )
        schemes.check_scheme(requested)
        if requested == "bitsandbytes":  # NF4 in blocks of 64, as bitsandbytes quantizes at load
            return QuantSpec(schemes.LAYER_SCHEME[requested], "online", group_size=bnb.BLOCK, num_bits=4)
        # Online: fp8 and int8 per output channel, int4 in groups of 128.
        group = schemes.DEFAULT_GROUP_SIZE if requested == "w4a16" else 0
        return QuantSpec(requested, "online", group_size=group, num_bits=4 if requested == "w4a16" else 8)
    spec = parse_quantization_config(qc)
    method = str(qc.get("quant_method"))
    own = {method} | ({f"{method}_marlin"} if method in ("gptq", "awq") else set())
    own |= set() if spec.groups else {spec.scheme}
    if method == modelopt.METHOD and spec.scheme in ("nvfp4", "nvfp4a16"):
        own.add("modelopt_fp4")  # vLLM's name for ModelOpt's FP4 checkpoints
    if requested is not None and requested not in own:
        if requested not in CHECKPOINT_METHODS:
            schemes.check_scheme(requested)
        layers = sorted({g.scheme for g in spec.groups})
        how = f"{method}: {' and '.join(layers)} by layer" if layers else method
        taken = sorted(n for n in own if n in QUANT_SCHEMES + CHECKPOINT_METHODS)  # what `quantization` takes
        raise UnsupportedQuantizationError(
            f"quantization: {requested!r} requested, but {_named(model_dir)} is already quantized as {spec.scheme!r} "
            f"({how}); it runs in that scheme: give {' or '.join(taken)}, or no quantization"
        )
    return spec


def _named(model_dir: str | Path) -> str | Path:
    """The model as the user gave it, for a message: a GGUF model runs from a directory made of its file."""
    config = Path(model_dir) / "config.json"
    return json.loads(config.read_text()).get("gguf_file", model_dir) if config.exists() else model_dir


def parse_quantization_config(qc: dict[str, Any]) -> QuantSpec:
    """The scheme a `quantization_config` describes, and which linear layers hold it."""
    if qc.get("quant_method") == "compressed-tensors":
        return compressed_tensors.parse(qc)
    if qc.get("quant_method") == modelopt.METHOD:
        return modelopt.parse(qc)
    if qc.get("quant_method") == quark.METHOD:
        return quark.parse(qc)
    if qc.get("quant_method") == "gguf":
        from ember_engine.model import gguf

        return gguf.parse(qc)
    spec = _scheme(qc)
    # The LM head stays as it is but where a GPTQ config says `lm_head: true`.
    head = () if qc.get("quant_method") == "gptq" and qc.get("lm_head") else ("lm_head",)
    return dataclasses.replace(spec, ignore=(*spec.ignore, *_ignored(qc), *head))


def _ignored(qc: dict[str, Any]) -> tuple[str, ...]:
    """`QuantSpec.ignore` for the formats other than compressed-tensors (their scheme covers every linear
    layer but these): Hugging Face fp8's, fbgemm_fp8's and AWQ's `modules_to_not_convert` and bitsandbytes'
    `llm_int8_skip_modules` (a module is left out where an entry, a pattern, matches the start of its
    name, or where its name ends with the entry, as transformers reads them); GPTQModel's `dynamic` for AWQ
    ("-:" patterns, `gptq.dynamic_rules`; GPTQ's own are read by `gptq.parse_gptq`)."""
    method = qc.get("quant_method")
    if method in ("fp8", "fbgemm_fp8", "awq", "bitsandbytes"):
        field = "llm_int8_skip_modules" if method == "bitsandbytes" else "modules_to_not_convert"
        left_out = compressed_tensors.name_list(field, qc.get(field))
        ignore = tuple(p for m in left_out for p in (f"re:{m}", f"re:.*{re.escape(m)}$"))
        if method == "fp8":  # AutoFP8's and vLLM's field: whole module names
            ignore += compressed_tensors.name_list("ignored_layers", qc.get("ignored_layers"))
        return ignore + (gptq.dynamic_rules(qc)[0] if method == "awq" else ())
    return ()


def _scheme(qc: dict[str, Any]) -> QuantSpec:
    method = qc.get("quant_method")
    if method == "fp8":
        activations = qc.get("activation_scheme", "dynamic")
        if activations not in ("dynamic", "static"):
            raise UnsupportedQuantizationError(
                f"fp8 checkpoint: activation_scheme {activations!r} is not supported; supported: dynamic, "
                "static (a calibrated scale per projection, without weight_block_size)"
            )
        block = qc.get("weight_block_size")
        if block is None:  # per tensor or channel; static: every token under the projection's input scale
            return QuantSpec("fp8", "hf-fp8", group_size=0, static_input=activations == "static")
        if activations == "static":
            raise UnsupportedQuantizationError(
                f"fp8 checkpoint: activation_scheme 'static' with weight_block_size {block!r} is not "
                "supported; supported: dynamic (per token and group of the block's columns)"
            )
        if not (
            isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise UnsupportedQuantizationError(
                f"fp8 checkpoint: weight_block_size {block!r} is not supported; supported: [rows, columns]"
            )
        if block[1] % 16:
            raise UnsupportedQuantizationError(
                f"fp8 checkpoint: weight_block_size {block!r}: columns per block must be a multiple of 16"
            )
        return QuantSpec("fp8", "hf-fp8", group_size=block[1], block_rows=block[0])
    if method == "fbgemm_fp8":  # transformers' default bound: 1200
        ub = qc.get("activation_scale_ub", 1200.0)
        if isinstance(ub, bool) or not isinstance(ub, (int, float)) or not 0 < ub < float("inf"):
            raise UnsupportedQuantizationError(
                f"fbgemm_fp8 checkpoint: activation_scale_ub must be a positive number, found {ub!r}"
            )
        return QuantSpec("fp8", "fbgemm_fp8", group_size=0, activation_ub=float(ub))
    if method in ("gptq", "awq"):
        return gptq.parse_gptq(qc) if method == "gptq" else gptq.parse_awq(qc)
    if method == "bitsandbytes":
        return bnb.parse_bnb(qc)
    raise UnsupportedQuantizationError(
        f"quantization_config: quant_method {method!r} is not supported; supported: compressed-tensors "
        f"({', '.join(compressed_tensors.FORMATS)}, {compressed_tensors.MIXED}), fp8, fbgemm_fp8, gptq, awq, "
        f"bitsandbytes (4- and 8-bit), {modelopt.METHOD} ({', '.join(modelopt.ALGOS)}), {quark.METHOD} (FP8)"
    )


def _decode_nvfp4(tensors: dict[str, torch.Tensor]) -> Decoded:
    """Packed E2M1 bytes and FP8 group scales as they are (the global scale goes to the layer apart)."""
    packed, scale, global_scale = (
        tensors["weight_packed"],
        tensors["weight_scale"],
        tensors["weight_global_scale"],
    )
    out, half = packed.shape
    shapes = (packed.dtype, scale.dtype, tuple(scale.shape))
    if shapes != (torch.uint8, torch.float8_e4m3fn, (out, 2 * half // 16)):
        raise UnsupportedQuantizationError(
            f"nvfp4 checkpoint: weight_packed {list(packed.shape)} ({packed.dtype}) needs uint8 and "
            f"weight_scale [{out}, {2 * half // 16}] in float8_e4m3fn, found {list(scale.shape)} ({scale.dtype})"
        )
    g = global_scale.float().reshape(-1)
    if g.numel() != 1 or not torch.isfinite(g).all() or g.item() <= 0:
        raise UnsupportedQuantizationError(
            f"nvfp4 checkpoint: weight_global_scale must be one positive finite number, found {g.tolist()[:4]}"
        )
    return packed, scale, None


def canonical(spec: QuantSpec, tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """One projection's tensors (`name`) in the forms `decode` and the layers take: ModelOpt's renamed as
    compressed-tensors' (`modelopt.canonical`), MX formats' with float32 scales (`compressed_tensors.canonical_mx`),
    the others as they are."""
    if spec.format == modelopt.METHOD:
        return modelopt.canonical(spec, tensors, name)
    if spec.format in compressed_tensors.MX:
        return compressed_tensors.canonical_mx(spec, tensors, name)
    return tensors


def decode(spec: QuantSpec, tensors: dict[str, torch.Tensor], what: str = "") -> Decoded:
    """One projection's checkpoint tensors -> (canonical weight, scale, zero points): FP8/int8 weight
    [out, in] and scale [out] (per channel), or [out, in / group] (grouped; block-scaled fp8: each row its
    tile's scales); for w4a16 int4 values as int8 [out, in] and scale [out, in / group]. Zero points
    (GPTQ and AWQ w4a16 only, else None) are [out, in / group] int8. A GPTQ act-order projection's columns
    come in group order (gptq.input_order). nvfp4a16: E2M1 bytes [out, in / 2] and E4M3 scales [out, in / 16]
    as the checkpoint holds them."""
    if spec.format in (*GPTQ_FORMATS, "awq"):
        return gptq.decode(spec, tensors, what)
    if spec.scheme in ("nvfp4a16", "nvfp4"):  # compressed-tensors', or ModelOpt's in their names
        return _decode_nvfp4(tensors)
    if spec.format in ("gguf", "mxfp4-pack-quantized"):  # `gguf.blocks.decode`'s, `canonical`'s forms
        return tensors["weight"], tensors["weight_scale"].float(), tensors.get("weight_zero")
    if spec.format == "bitsandbytes":
        return bnb.decode_bnb(spec, tensors, what)
    if spec.format == "bitsandbytes-8bit":
        return bnb.decode_int8(tensors, what)
    scale = tensors.get("weight_scale", tensors.get("weight_scale_inv"))
    assert scale is not None
    if spec.format == "pack-quantized":
        out, inp = (int(v) for v in tensors["weight_shape"].tolist())
        packed_as_said(
            tensors["weight_packed"], [out, words(inp, spec.num_bits)], f"{what}.weight_packed", spec
        )
        weight = schemes.unpack_int32(tensors["weight_packed"], spec.num_bits, inp)
        if spec.zero_points:  # packed along the output dimension: [out / 8, groups] words
            zp = tensors["weight_zero_point"]
            packed_as_said(
                zp, [words(out, spec.num_bits), scale.shape[-1]], f"{what}.weight_zero_point", spec
            )
            zero = schemes.unpack_int32(zp.t().contiguous(), spec.num_bits, out)
            return weight, scale.float(), zero.t().contiguous()
    else:
        weight = tensors["weight"]
        out, inp = weight.shape
        # int4 values one a byte
        int4 = spec.num_bits == 4 and not weight.is_floating_point()
        if int4 and bool(((weight < -8) | (weight > 7)).any()):
            raise UnsupportedQuantizationError(
                f"{what or spec.scheme}: int4 weights held one a byte must lie in [-8, 7], found "
                f"{int(weight.min())} to {int(weight.max())}"
            )
        if spec.scheme == "w4a8-fp8":  # int4 values, and each row's and group's E4M3 values of their codes
            return weight, scale, None
    if spec.block_rows:
        tiles = (-(-out // spec.block_rows), -(-inp // spec.group_size))
        if tuple(scale.shape) != tiles:
            raise UnsupportedQuantizationError(
                f"{spec.scheme} checkpoint: weight [{out}, {inp}] in blocks of [{spec.block_rows}, "
                f"{spec.group_size}] needs scales {list(tiles)}, found {list(scale.shape)}"
            )
        return weight, schemes.block_scales_per_row(scale, out, spec.block_rows), None
    groups = -(-inp // spec.group_size) if spec.group_size else 0
    if groups and list(scale.shape) != [out, groups]:
        raise UnsupportedQuantizationError(
            f"{what}.{'weight_scale' if 'weight_scale' in tensors else 'weight_scale_inv'}: "
            f"{list(scale.shape)} scales, where a [{out}, {inp}] weight in the config's groups of "
            f"{spec.group_size} needs [{out}, {groups}]"
        )
    per_channel = spec.scheme in ("fp8", "w8a16-fp8")  # scales [out]
    if not per_channel and scale.dim() == 2 and scale.shape[1] > 1:
        return weight, scale.float(), None  # grouped
    if scale.numel() not in (1, out):
        raise UnsupportedQuantizationError(
            f"{spec.scheme} checkpoint: {list(scale.shape)} scales for a [{out}, {inp}] weight; supported: "
            "one per tensor or per output channel"
            + (", or weight_block_size tiles" if spec.scheme == "fp8" else "")
        )
    if per_channel:
        return weight, scale.float().reshape(-1).expand(out).contiguous(), None
    return weight, scale.float().reshape(-1).expand(out).reshape(out, 1).contiguous(), None
