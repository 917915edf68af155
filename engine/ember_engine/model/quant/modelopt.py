"""ModelOpt (NVIDIA Model Optimizer) checkpoints, as its `export_hf_checkpoint` writes them: what the
"nvidia/...-FP8" downloads are.

The config comes in two forms. Since ModelOpt 0.29 `config.json` holds a `quantization_config` with
`quant_method: modelopt`, `quant_algo`, `ignore` (the modules left unquantized) and, for an FP8 KV
cache, `kv_cache_scheme`. Earlier exports wrote only `hf_quant_config.json`, whose `quantization` holds
`quant_algo`, `kv_cache_quant_algo` and `exclude_modules`; it is read where `config.json` has no
`quantization_config`. Either is given to the rest of the engine as one dict with `quant_method:
modelopt` (`read_legacy`).

Algorithms run (each projection's `weight` with its `weight_scale`; FP8's in E4M3 [out, in], scales
float32):
- FP8: one weight scale per tensor and a calibrated `input_scale` per tensor (static activations);
- FP8_PER_CHANNEL_PER_TOKEN: a weight scale per output channel, activations quantized per token as the
  model runs;
- FP8_PB_WO: a weight scale per tile of 128 x 128, `weight_scale` [row tiles, 1, column tiles, 1] (a
  projection of one tile: one number), activations as they are (`w8a16-fp8`), as ModelOpt simulates it
  (vLLM quantizes its activations per token and group of 128 columns);
- W4A16_NVFP4: `weight` two FP4 E2M1 values a byte (column 2j in the low nibble), an E4M3
  `weight_scale` per group of 16 input columns and a float32 `weight_scale_2` per tensor that multiplies
  it, activations as they are (`nvfp4a16`: compressed-tensors' NVFP4A16, whose global scale divides,
  is its reciprocal);
- NVFP4: W4A16_NVFP4's weights, and activations quantized to NVFP4 as the model runs (per token and
  group of 16 columns, under the projection's calibrated `input_scale`, amax / (6 * 448)): `nvfp4`,
  compressed-tensors' NVFP4, whose `input_global_scale` is the reciprocal; the q/k/v (gate/up) parts of a
  merged projection take the largest of their input scales, as vLLM takes them;
- W8A16 (INT8_WEIGHT_ONLY_CFG): int8 `weight` with a float32 `weight_scale` per output channel,
  activations as they are (`w8a16`);
- W4A16_AWQ (INT4_AWQ_CFG, and INT4_BLOCKWISE_WEIGHT_ONLY_CFG without AWQ's smoothing): `weight` two int4
  values a byte along the output (row 2r in the low nibble, 2r + 1 in the high, two's complement), a
  float32 `weight_scale` per output row and group of 128 input columns (`w4a16`), and where the export
  could not fold AWQ's smoothing into the layer before, a `pre_quant_scale` per input column that the
  input is multiplied by first (`QuantLinear.set_input_smooth`);
- MXFP8 (MXFP8_DEFAULT_CFG): an E4M3 `weight` with an E8M0 `weight_scale` (bytes, 2^(e - 127)) per output
  row and group of 32 input columns, activations quantized to MXFP8 as the model runs under ModelOpt's
  scale, the smallest power of two at least max|x| / 448 (block-scaled `fp8`, `mxfp8-fit` inputs);
- MIXED_PRECISION (what `mtq.auto_quantize` exports, or a config that quantizes layers differently):
  `quantized_layers` gives each quantized projection its own algorithm of these; a projection it does not
  list stays in full precision (`mixed`, each group's projections named).
- W8A8_SQ_PER_CHANNEL (INT8_SMOOTHQUANT_CFG): int8 `weight` with a float32 `weight_scale` per output
  channel, activations quantized to int8 under the projection's calibrated `input_scale` (amax / 127,
  values beyond it saturating at -128 and 127) after SmoothQuant's `pre_quant_scale` per input column
  (`w8a8`, static input scales, `QuantLinear.set_input_smooth`);
- W4A8_AWQ (W4A8_AWQ_BETA_CFG): W4A16_AWQ's int4 values and group scales, each weight's value then
  rounded to E4M3 under a float32 `weight_scale_2` per tensor, as ModelOpt quantizes it twice; FP8
  activations under the calibrated `input_scale`, after AWQ's `pre_quant_scale` where the export kept it.
  Held as its 4-bit codes and, for each row and group of 128, the 16 E4M3 values they stand for
  (`w4a8-fp8`: 5 bits a weight; `w4a8_linear.py`).
- W4A8_NVFP4_FP8 (W4A8_NVFP4_FP8_CFG): NVFP4's weights with an E4M3 scale per group of 32 input columns
  (held for each of its two groups of 16) under a `weight_scale_2` of amax / 448, activations quantized to
  E4M3 under the projection's calibrated `input_scale` (`nvfp4a16` with static FP8 inputs,
  `Fp4Linear.set_input_scale`);
- NVFP4_AWQ (NVFP4 after AWQ's smoothing): NVFP4's tensors, and a `pre_quant_scale` per input column
  where the export did not fold the factors into the layer before (o_proj's; `nvfp4`).
A W4A16_AWQ or W4A8_AWQ export with zero points (`has_zero_point`) is refused by name, and so, saying
why (`REFUSED`), are MXFP4 (`mxfp4`) and W4A8_MXFP4_FP8 exports.

Excluded modules are written as names or wildcards ("model.layers.1.mlp*"); a projection is left in full
precision where an entry is its name, matches it as a shell-style wildcard (`fnmatch`) or, for an entry
without wildcards, is part of its name (older exports list module paths a model's wrapper may prefix).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from pathlib import Path
from typing import Any

import torch

from ember_engine.model.quant.schemes import UnsupportedQuantizationError, e8m0_scales
from ember_engine.model.quant.spec import QuantSpec, config_file

METHOD = "modelopt"
LEGACY_FILE = "hf_quant_config.json"
BLOCK = 128  # FP8_PB_WO's tile side
ALGOS = {
    "FP8": QuantSpec("fp8", METHOD, group_size=0, static_input=True),
    "FP8_PER_CHANNEL_PER_TOKEN": QuantSpec("fp8", METHOD, group_size=0),
    "FP8_PB_WO": QuantSpec("w8a16-fp8", METHOD, group_size=BLOCK, block_rows=BLOCK),
    "W4A16_NVFP4": QuantSpec("nvfp4a16", METHOD, group_size=16, num_bits=4),
    "NVFP4": QuantSpec("nvfp4", METHOD, group_size=16, num_bits=4, static_input=True),
    "W8A16": QuantSpec("w8a16", METHOD, group_size=0),
    "W4A16_AWQ": QuantSpec("w4a16", METHOD, group_size=128, num_bits=4),
    "MXFP8": QuantSpec("fp8", METHOD, group_size=32, block_rows=1, input_quant="mxfp8-fit"),
    # NVFP4 after AWQ's smoothing: its pre_quant_scale where the export keeps one
    "NVFP4_AWQ": QuantSpec("nvfp4", METHOD, group_size=16, num_bits=4, static_input=True),
    # NVFP4's weights (weight_scale_2 amax / 448) with FP8 activations under a calibrated scale
    "W4A8_NVFP4_FP8": QuantSpec("nvfp4a16", METHOD, group_size=16, num_bits=4, static_input=True),
    "W8A8_SQ_PER_CHANNEL": QuantSpec("w8a8", METHOD, group_size=0, static_input=True),
    # int4 values in groups of 128, each times its group's scale, rounded to E4M3 under weight_scale_2:
    # held as codes and each group's 16 E4M3 values (`canonical`, `w4a8_linear.py`)
    "W4A8_AWQ": QuantSpec("w4a8-fp8", METHOD, group_size=128, num_bits=4, static_input=True),
}
# Algorithms ModelOpt exports that are refused, with the reason the error gives
REFUSED = {
    "MXFP4": (
        "ModelOpt writes it both where MXFP4 activations were simulated (MXFP4_DEFAULT_CFG) and where the "
        "activations stay as they are (MXFP4_MLP_WEIGHT_ONLY_CFG), and nothing in the export says which; "
        "compressed-tensors' MXFP4 and MXFP4A16 say"
    ),
    "W4A8_MXFP4_FP8": (
        "its FP8 activations take one scale per tensor as the model runs (the export has no input_scale), "
        "which would make each request's output depend on the others batched with it"
    ),
}
AWQ_GROUP = 128  # W4A16_AWQ's and W4A8_AWQ's input columns per weight scale
W4A8_NVFP4_GROUP = 32  # W4A8_NVFP4_FP8's input columns per E4M3 weight scale (NVFP4's are 16)
GROUPS = {"W4A8_NVFP4_FP8": W4A8_NVFP4_GROUP}  # where the spec's group_size is not it
KV_ALGOS = ("FP8",)
MIXED = "MIXED_PRECISION"


def read_legacy(model_dir: str | Path) -> dict[str, Any] | None:
    """An older export's `hf_quant_config.json`, as a `quantization_config` (None where there is none)."""
    found = config_file(model_dir, LEGACY_FILE)
    if found is None:
        return None
    path, raw = found
    if not isinstance(raw, dict) or not isinstance(raw.get("quantization"), dict):
        raise UnsupportedQuantizationError(
            f"{path}: a ModelOpt config needs a 'quantization' object (quant_algo, exclude_modules)"
        )
    return {"quant_method": METHOD, **raw}


def _fields(qc: dict[str, Any]) -> tuple[str, list[str], str | None]:
    """(quant_algo upper-cased, excluded modules, KV-cache algorithm or None) of either form."""
    legacy = qc.get("quantization")
    if isinstance(legacy, dict):
        algo, exclude, kv = (
            legacy.get("quant_algo"),
            legacy.get("exclude_modules"),
            legacy.get("kv_cache_quant_algo"),
        )
    else:
        algo, exclude = qc.get("quant_algo"), qc.get("ignore")
        scheme = qc.get("kv_cache_scheme")
        kv = None
        if isinstance(scheme, dict):
            kind, bits, dynamic = scheme.get("type"), scheme.get("num_bits"), bool(scheme.get("dynamic"))
            kv = (
                "FP8"
                if (kind, bits, dynamic) == ("float", 8, False)
                else f"{kind} {bits}-bit dynamic={dynamic}"
            )
    if not algo:
        raise UnsupportedQuantizationError("modelopt checkpoint: its quantization config names no quant_algo")
    if exclude is None:
        exclude = []
    if not (isinstance(exclude, list) and all(isinstance(e, str) for e in exclude)):
        raise UnsupportedQuantizationError(
            f"modelopt checkpoint: the excluded modules must be a list of names, found {exclude!r}"
        )
    return str(algo).upper(), exclude, None if kv is None else str(kv).upper()


def ignore_patterns(exclude: list[str]) -> tuple[str, ...]:
    """`QuantSpec.ignore` entries ("re:" patterns) equivalent to ModelOpt's excluded modules."""
    patterns = []
    for entry in exclude:
        patterns.append("re:" + fnmatch.translate(entry))
        if not any(c in entry for c in "*?["):
            patterns.append(f"re:.*{re.escape(entry)}")
    return tuple(patterns)


def parse(qc: dict[str, Any]) -> QuantSpec:
    algo, exclude, _ = _fields(qc)
    ignore = ignore_patterns(exclude)
    if algo != MIXED:
        legacy = qc.get("quantization")
        sizes = {legacy.get("group_size")} if isinstance(legacy, dict) else {qc.get("group_size")}
        for group in (qc.get("config_groups") or {}).values():
            sizes.add(((group or {}).get("weights") or {}).get("group_size"))
        _no_zero_points(legacy if isinstance(legacy, dict) else qc, algo, "")
        return dataclasses.replace(_algo_spec(algo, sizes - {None}, ""), ignore=ignore)
    layers = (qc.get("quantization") or qc).get("quantized_layers")
    if not (isinstance(layers, dict) and layers and all(isinstance(c, dict) for c in layers.values())):
        raise UnsupportedQuantizationError(
            f"modelopt checkpoint: {MIXED} needs quantized_layers, each layer's config, found {layers!r}"
        )
    names: dict[str, list[str]] = {}
    for name, config in layers.items():
        algo = str(config.get("quant_algo", "")).upper()
        _algo_spec(algo, {config.get("group_size")} - {None}, f"{name}: ")
        _no_zero_points(config, algo, f"{name}: ")
        names.setdefault(algo, []).append(name)
    groups = tuple(
        dataclasses.replace(_algo_spec(algo, set(), ""), targets=tuple(sorted(members)), ignore=ignore)
        for algo, members in sorted(names.items())
    )
    return QuantSpec("mixed", METHOD, group_size=0, targets=(), ignore=ignore, groups=groups)


def _no_zero_points(config: dict[str, Any], algo: str, where: str) -> None:
    if config.get("has_zero_point"):
        raise UnsupportedQuantizationError(
            f"modelopt checkpoint: {where}{algo} with zero points (has_zero_point) is not supported; "
            "supported: symmetric"
        )


def _algo_spec(algo: str, group_sizes: set[Any], where: str) -> QuantSpec:
    """The spec of one algorithm (`where`: the layer it is for, in a mixed config), its group sizes checked."""
    if algo not in ALGOS:
        why = f" ({REFUSED[algo]})" if algo in REFUSED else ""
        raise UnsupportedQuantizationError(
            f"modelopt checkpoint: {where}quant_algo {algo!r} is not supported{why}; supported: "
            f"{', '.join(ALGOS)}" + ("" if where else f", {MIXED}")
        )
    spec = ALGOS[algo]
    group = GROUPS.get(algo, spec.group_size)
    if (spec.num_bits == 4 or spec.input_quant) and group_sizes - {group}:
        raise UnsupportedQuantizationError(
            f"modelopt checkpoint: {where}{algo} in groups of {sorted(group_sizes - {group})[0]} is "
            f"not supported; supported: groups of {group}"
        )
    return spec


def canonical(spec: QuantSpec, tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """One projection's tensors in the names and shapes the compressed-tensors forms have: FP8_PB_WO's
    `weight_scale` as [row tiles, column tiles]; W4A16_NVFP4's and NVFP4's as NVFP4A16's and NVFP4's
    (`weight_packed`, `weight_global_scale`, the reciprocal of `weight_scale_2`, and NVFP4's
    `input_global_scale`, the reciprocal of `input_scale`)."""
    if spec.scheme in ("nvfp4a16", "nvfp4"):
        fp4 = {
            "weight_packed": tensors["weight"],
            "weight_scale": tensors["weight_scale"],
            "weight_global_scale": 1.0 / tensors["weight_scale_2"].float(),
        }
        if spec.scheme == "nvfp4a16" and spec.static_input:  # W4A8_NVFP4_FP8
            fp4["input_scale"] = tensors["input_scale"]  # its FP8 activations' static scale
            scale, columns = tensors["weight_scale"], tensors["weight"].shape[1] * 2
            if scale.dim() != 2 or scale.shape[1] * W4A8_NVFP4_GROUP != columns:
                raise UnsupportedQuantizationError(
                    f"{name}: W4A8_NVFP4_FP8's weight_scale {list(scale.shape)} for {columns} input columns is "
                    f"not one scale per row and group of {W4A8_NVFP4_GROUP}"
                )
            # each scale of a group of 32 held for its two groups of 16: the same product
            fp4["weight_scale"] = scale.repeat_interleave(W4A8_NVFP4_GROUP // 16, dim=1)
        if spec.scheme == "nvfp4":
            scale = tensors["input_scale"].float().reshape(-1)
            if scale.numel() != 1 or not torch.isfinite(scale).all() or scale.item() <= 0:
                raise UnsupportedQuantizationError(
                    f"modelopt checkpoint: NVFP4's input_scale must be one positive finite number, found "
                    f"{scale.tolist()[:4]}"
                )
            fp4["input_global_scale"] = 1.0 / scale
        return fp4
    if spec.scheme == "w4a16":
        return {**tensors, "weight": _awq_values(tensors, "W4A16_AWQ", name)}
    if spec.scheme == "w4a8-fp8":
        return _w4a8_weight(tensors, name)
    if spec.input_quant == "mxfp8-fit":
        return {**tensors, "weight_scale": e8m0_scales(tensors["weight_scale"], name)}
    if not spec.block_rows:
        return tensors
    scale = tensors["weight_scale"]
    out, inp = tensors["weight"].shape
    tiles = (-(-out // spec.block_rows), -(-inp // spec.group_size))
    if scale.dim() == 4 and scale.shape[1] == scale.shape[3] == 1:
        scale = scale.reshape(scale.shape[0], scale.shape[2])
    elif scale.numel() == 1 and tiles == (1, 1):
        scale = scale.reshape(1, 1)
    return {**tensors, "weight_scale": scale}


def _awq_values(tensors: dict[str, torch.Tensor], algo: str, name: str) -> torch.Tensor:
    """An AWQ export's int4 values as int8 [out, in]: two a byte along the output (row 2r in the low
    nibble), two's complement; its `weight_scale` checked to be one per row and group of 128."""
    packed = tensors["weight"]
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise UnsupportedQuantizationError(
            f"modelopt checkpoint: {algo}'s weight must be bytes [out / 2, in], two int4 values each, "
            f"found {packed.dtype} {list(packed.shape)}"
        )
    scale = tensors["weight_scale"]
    if scale.dim() != 2 or scale.shape[1] * AWQ_GROUP != packed.shape[1]:
        raise UnsupportedQuantizationError(  # config.json's form names no group size: 128 is taken
            f"{name}: {algo}'s weight_scale {list(scale.shape)} for {packed.shape[1]} input columns is "
            f"not one scale per row and group of {AWQ_GROUP}; supported: groups of {AWQ_GROUP}"
        )
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)
    return nibbles - 16 * (nibbles >= 8).to(torch.int8)


def _w4a8_weight(tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """W4A8_AWQ's weight as `w4a8-fp8` holds it: ModelOpt quantizes each weight to int4 in its group of
    128 and that value again to E4M3 under one scale per tensor (`weight_scale_2`), so the product runs on
    E4M3(value x group scale / weight_scale_2) x weight_scale_2, with FP8 activations under the
    calibrated `input_scale`. Returned: the int4 values as int8 `weight` [out, in], each row's and group's
    E4M3 values of the 16 codes (code c: value c - 8) as `weight_scale` [out, groups, 16], worked out
    with the same float32 operations, and `weight_scale_2`."""
    values = _awq_values(tensors, "W4A8_AWQ", name)
    outer = tensors["weight_scale_2"].float().reshape(-1)
    if outer.numel() != 1 or not torch.isfinite(outer).all() or outer.item() <= 0:
        raise UnsupportedQuantizationError(
            f"{name}: W4A8_AWQ's weight_scale_2 must be one positive finite number, found {outer.tolist()[:4]}"
        )
    codes = torch.arange(-8, 8, dtype=torch.float32)
    table = (codes * tensors["weight_scale"].float()[:, :, None] / outer).clamp(-448, 448)
    rest = {k: v for k, v in tensors.items() if k not in ("weight", "weight_scale", "weight_scale_2")}
    return {
        **rest,
        "weight": values,
        "weight_scale": table.to(torch.float8_e4m3fn),
        "weight_scale_2": outer.reshape(()),
    }


def check_kv_scheme(qc: dict[str, Any]) -> None:
    """Refuse, by name, a KV-cache algorithm an FP8 cache cannot take the checkpoint's scales for (FP8
    with a static scale per layer is what ModelOpt's FP8_KV_CFG writes: `k_proj.k_scale`, `v_proj.v_scale`)."""
    kv = _fields(qc)[2]
    if kv is not None and kv not in KV_ALGOS:
        raise ValueError(
            f"modelopt checkpoint: KV-cache quantization {kv} is not supported with kv_cache_dtype fp8; "
            f"supported: {', '.join(KV_ALGOS)} (static, one scale per layer)"
        )
