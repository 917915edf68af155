"""compressed-tensors' `quantization_config` (`quant_method: compressed-tensors`, what llm-compressor
writes): the scheme each config group describes, and which linear layers hold it.

Formats: `float-quantized` (FP8 `weight` + `weight_scale`, per channel, tensor or block), `pack-quantized`
(`weight_packed` int32 words + `weight_scale` + `weight_shape`, 4- or 8-bit), `int-quantized` (int8
`weight` + `weight_scale`), `naive-quantized` (their common base; FP8 weight-only among others),
`nvfp4-pack-quantized`, and `mxfp4-pack-quantized` and `mxfp8-quantized` (`canonical_mx`). A config
whose groups hold different schemes is mixed precision: its format is `mixed-precision` with each group naming its own (or, where they share one, that format), and each layer
takes the group compressed-tensors gives it (`QuantSpec.layer_spec`). Beside the groups: `transform_config`
(rotations folded into the weights need nothing; those at a layer's input or output as the model runs are
read here and applied by `rotations.py`) and `sparsity_config` (dense storage only).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch

from ember_engine.model.quant.schemes import E2M1_VALUES, UnsupportedQuantizationError, e8m0_scales
from ember_engine.model.quant.spec import OnlineRotation, QuantSpec

FORMATS = (
    "float-quantized",
    "pack-quantized",
    "int-quantized",
    "naive-quantized",
    "nvfp4-pack-quantized",
    "mxfp4-pack-quantized",
    "mxfp8-quantized",
)
MIXED = "mixed-precision"
# The OCP microscaling formats: (bits, llm-compressor's weight-only preset, what runs it)
MX = {"mxfp4-pack-quantized": (4, "MXFP4A16", "codebook"), "mxfp8-quantized": (8, "MXFP8A16", "w8a16-fp8")}


def name_list(field: str, value: Any) -> tuple[str, ...]:
    """A config's list of module names or patterns (absent: none)."""
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UnsupportedQuantizationError(
            f"quantization_config: {field} must be a list of names, got {value!r}"
        )
    return tuple(value)


# Where a transform applies: the weight locations are folded into the weights when a checkpoint is saved;
# input and output are applied as the model runs (`rotations.py`); the others (attention's queries, the KV
# cache) ember does not apply.
FOLDED = ("weight_input", "weight_output")
ONLINE = ("input", "output")
# Transform types whose run-time matrix is a Hadamard one, scaled by 1/sqrt(n)
HADAMARD = ("hadamard", "random-hadamard")
PRECISIONS = ("torch.float64", "torch.float32", "torch.float16", "torch.bfloat16")


def online_rotations(qc: dict[str, Any]) -> tuple[OnlineRotation, ...]:
    """The rotations a config's `transform_config` applies as the model runs (llm-compressor's QuIP,
    SpinQuant's R4); what ember cannot apply is refused by name. Transforms folded into the weights need
    nothing."""
    transforms = (qc.get("transform_config") or {}).get("config_groups") or {}
    found = []
    for name, group in transforms.items():
        for apply in group.get("apply") or []:
            location = apply.get("location")
            if location in FOLDED:
                continue
            what = (
                f"compressed-tensors: transform_config group {name!r} ({group.get('type')}) at {location!r}"
            )
            if location not in ONLINE:
                raise UnsupportedQuantizationError(
                    f"{what} is not supported; supported: rotations of a linear layer's {' or '.join(ONLINE)} "
                    f"as the model runs, and transforms folded into the weights ({', '.join(FOLDED)})"
                )
            if group.get("type") not in HADAMARD:
                raise UnsupportedQuantizationError(
                    f"{what}: type not supported; supported: {', '.join(HADAMARD)}"
                )
            if group.get("randomize"):
                raise UnsupportedQuantizationError(f"{what}: randomize (permuted matrices) is not supported")
            precision = group.get("precision", "torch.float32")
            if precision not in PRECISIONS:
                raise UnsupportedQuantizationError(
                    f"{what}: precision {precision!r} is not supported; supported: {', '.join(PRECISIONS)}"
                )
            head_dim = group.get("head_dim")
            found.append(
                OnlineRotation(
                    name,
                    location,
                    bool(apply.get("inverse")),
                    int(head_dim) if head_dim else None,
                    precision,
                    name_list("targets", apply.get("targets")),
                    name_list("ignore", apply.get("ignore")),
                )
            )
    return tuple(found)


def check_parts(qc: dict[str, Any]) -> tuple[OnlineRotation, ...]:
    """Refuse, by name, what a config asks beside its quantization that ember does not run: sparsity in a
    compressed storage format, and transforms it cannot apply (`online_rotations`). Sparsity stored dense
    needs nothing: the weights hold it. Returns the rotations to apply as the model runs."""
    rotations = online_rotations(qc)
    sparsity = qc.get("sparsity_config") or {}
    if sparsity and sparsity.get("format", "dense") != "dense":
        raise UnsupportedQuantizationError(
            f"compressed-tensors: sparsity_config format {sparsity.get('format')!r} "
            f"({sparsity.get('sparsity_structure')}) is not supported; supported: dense (the weights stored "
            "whole)"
        )
    return rotations


def parse(qc: dict[str, Any]) -> QuantSpec:
    """The scheme of a compressed-tensors config: one QuantSpec when every group holds the same scheme
    (their targets together), else scheme "mixed" with one QuantSpec per group, each with its own
    targets."""
    rotations = check_parts(qc)
    fmt = qc.get("format")
    if fmt not in (*FORMATS, MIXED):
        raise UnsupportedQuantizationError(
            f"compressed-tensors: format {fmt!r} is not supported; supported: {', '.join(FORMATS)}, {MIXED}"
        )
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantizationError("compressed-tensors: config_groups is empty")
    ignore = name_list("ignore", qc.get("ignore"))
    specs = []
    for name, group in groups.items():
        where = "compressed-tensors: " + (f"config group {name!r}: " if len(groups) > 1 else "")
        own = group.get("format") or (None if fmt == MIXED else fmt)
        if own is None:
            raise UnsupportedQuantizationError(
                f"compressed-tensors: config group {name!r} names no format, which a {MIXED} config needs; "
                f"supported: {', '.join(FORMATS)}"
            )
        if own not in FORMATS:
            raise UnsupportedQuantizationError(
                f"{where}format {own!r} is not supported; supported: {', '.join(FORMATS)}"
            )
        spec = _group_scheme(group.get("weights") or {}, group.get("input_activations"), own, where)
        targets = name_list("targets", group.get("targets"))
        specs.append(dataclasses.replace(spec, targets=targets, ignore=ignore))
    every_target = tuple(dict.fromkeys(t for s in specs for t in s.targets))
    if len({dataclasses.replace(s, targets=()) for s in specs}) == 1:
        return dataclasses.replace(specs[0], targets=every_target, rotations=rotations)
    return QuantSpec(
        "mixed", MIXED, groups=tuple(specs), targets=every_target, ignore=ignore, rotations=rotations
    )


def _group_scheme(weights: dict[str, Any], acts: dict[str, Any] | None, fmt: str, where: str) -> QuantSpec:
    """One config group's scheme, from its weights, input activations and format (`where` leads every
    refusal)."""
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    what = f"{kind} {bits}-bit weights, strategy {strategy!r}"
    if fmt == "nvfp4-pack-quantized":
        return _nvfp4(weights, acts, where)
    if fmt in MX:
        return _mx(fmt, weights, acts, where)
    if not weights.get("symmetric", True):
        if (kind, bits, strategy, fmt) != ("int", 4, "group", "pack-quantized") or acts:
            raise UnsupportedQuantizationError(
                f"{where}asymmetric {what} are not supported; supported: asymmetric int 4-bit per group "
                "(pack-quantized, W4A16_ASYM)"
            )
        return QuantSpec("w4a16", fmt, group_size=int(weights["group_size"]), num_bits=4, zero_points=True)
    if kind == "float" and bits == 8 and strategy in ("channel", "tensor"):
        if not acts:  # weight-only (vLLM's W8A16-FP8)
            return QuantSpec("w8a16-fp8", fmt, group_size=0)
        static = acts.get("dynamic") is False and acts.get("strategy") == "tensor"
        if not static and not (acts.get("dynamic") and acts.get("strategy") == "token"):
            raise UnsupportedQuantizationError(
                f"{where}FP8 input activations {acts.get('strategy')!r} (dynamic={acts.get('dynamic')}) are "
                "not supported; supported: dynamic per token, static per tensor"
            )
        if (acts.get("type"), acts.get("num_bits"), acts.get("symmetric", True)) != ("float", 8, True):
            raise UnsupportedQuantizationError(
                f"{where}FP8 weights with input activations {acts.get('type')} {acts.get('num_bits')}-bit "
                f"(symmetric={acts.get('symmetric')}) are not supported; supported: float 8-bit, symmetric"
            )
        return QuantSpec("fp8", fmt, group_size=0, static_input=static)
    if kind == "float" and bits == 8 and strategy == "block":
        block = weights.get("block_structure")
        if isinstance(block, str) and re.fullmatch(r"\d+x\d+", block):  # the older "ROWSxCOLUMNS"
            block = [int(n) for n in block.split("x")]
        if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
            raise UnsupportedQuantizationError(
                f"{where}FP8 weights in {block!r} blocks: block_structure must be [rows, columns]"
            )
        columns = block[1]
        if columns % 16:  # a K step of the GPU GEMM lies within one block, the narrowest step 16 columns
            raise UnsupportedQuantizationError(
                f"{where}FP8 weights in {block!r} blocks: columns per block must be a multiple of 16"
            )
        if not (
            acts
            and acts.get("dynamic")
            and acts.get("strategy") == "group"
            and acts.get("group_size") == columns
        ):
            raise UnsupportedQuantizationError(
                f"{where}FP8 weights in {block} blocks with input activations {acts!r} are not supported; "
                "supported: dynamic per group of the block's columns"
            )
        return QuantSpec("fp8", fmt, group_size=int(block[1]), block_rows=int(block[0]))
    if acts and kind == "int" and bits == 8 and strategy in ("channel", "tensor"):
        got = (acts.get("type"), acts.get("num_bits"), acts.get("strategy"), acts.get("symmetric", True))
        static = acts.get("dynamic") is False and got[2] == "tensor"
        if got[:2] + got[3:] != ("int", 8, True) or not (
            static or (acts.get("dynamic") and got[2] == "token")
        ):
            raise UnsupportedQuantizationError(
                f"{where}int8 weights with input activations {got[0]} {got[1]}-bit, strategy {got[2]!r} "
                f"(dynamic={acts.get('dynamic')}, symmetric={got[3]}) are not supported; supported: int "
                "8-bit, symmetric, dynamic per token or static per tensor (W8A8, w8a8)"
            )
        return QuantSpec("w8a8", fmt, group_size=0, num_bits=8, static_input=static)
    if acts and kind == "int" and bits == 4 and strategy == "group":
        got = (acts.get("type"), acts.get("num_bits"), acts.get("strategy"), acts.get("symmetric", True))
        if got not in (("float", 8, "token", True), ("int", 8, "token", True)) or not acts.get("dynamic"):
            raise UnsupportedQuantizationError(
                f"{where}int4 weights with input activations {got[0]} {got[1]}-bit, strategy {got[2]!r} "
                f"(dynamic={acts.get('dynamic')}, symmetric={got[3]}) are not supported; supported: float or "
                "int 8-bit, dynamic per token, symmetric (W4AFP8, W4A8)"
            )
        quant = "fp8" if got[0] == "float" else "int8"
        return QuantSpec("w4a16", fmt, group_size=int(weights["group_size"]), num_bits=4, input_quant=quant)
    if acts:
        raise UnsupportedQuantizationError(
            f"{where}quantized activations with {what} are not supported; supported: fp8 (W8A8-FP8), w8a8 "
            "(int8 per channel with int8 activations), w4a16 with fp8 or int8 per token (W4AFP8, W4A8)"
        )
    if kind == "int" and bits == 8 and strategy in ("channel", "tensor"):
        return QuantSpec("w8a16", fmt, group_size=0, num_bits=8)
    if kind == "int" and bits == 8 and strategy == "group":
        return QuantSpec("w8a16", fmt, group_size=int(weights["group_size"]), num_bits=8)
    if kind == "int" and bits == 4 and strategy == "group":
        return QuantSpec("w4a16", fmt, group_size=int(weights["group_size"]), num_bits=4)
    raise UnsupportedQuantizationError(
        f"{where}{what} are not supported; supported: FP8 per channel/tensor/block (fp8), int8 per channel "
        "(w8a16), int4 per group (w4a16)"
    )


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _float_weights(
    weights: dict[str, Any], fmt: str, bits: int, strategy: str, group: int, preset: str, where: str
) -> None:
    """Refuse, by name, a format's weights other than symmetric float `bits`-bit in `strategy`, groups of
    `group`."""
    got = (weights.get("type"), weights.get("num_bits"), weights.get("strategy"), weights.get("group_size"))
    if got != ("float", bits, strategy, group) or not weights.get("symmetric", True):
        raise UnsupportedQuantizationError(
            f"{where}{fmt} with {got[0]} {got[1]}-bit weights, strategy {got[2]!r}, groups of {got[3]} "
            f"(symmetric={weights.get('symmetric', True)}) is not supported; supported: float {bits}-bit, "
            f"{strategy}, groups of {group}, symmetric ({preset})"
        )


def _nvfp4(weights: dict[str, Any], acts: dict[str, Any] | None, where: str) -> QuantSpec:
    _float_weights(weights, "nvfp4-pack-quantized", 4, "tensor_group", 16, "NVFP4A16", where)
    if acts:
        got_acts = tuple(acts.get(f) for f in ("type", "num_bits", "strategy", "group_size", "dynamic"))
        if got_acts != ("float", 4, "tensor_group", 16, "local") or not acts.get("symmetric", True):
            raise UnsupportedQuantizationError(
                f"{where}NVFP4 weights with input activations {got_acts} are not supported; supported: none "
                "(NVFP4A16), or float 4-bit, tensor_group, groups of 16, dynamic 'local' with a calibrated "
                "global scale (NVFP4)"
            )
        return QuantSpec("nvfp4", "nvfp4-pack-quantized", group_size=16, num_bits=4, static_input=True)
    return QuantSpec("nvfp4a16", "nvfp4-pack-quantized", group_size=16, num_bits=4)


def _mx(fmt: str, weights: dict[str, Any], acts: dict[str, Any] | None, where: str) -> QuantSpec:
    """llm-compressor's MX presets: E2M1 weights two a byte, or E4M3 weights, under a power-of-two scale per
    group of 32 (E8M0: a byte e, the scale 2^(e - 127)); activations as they are (MXFP4A16, MXFP8A16) or
    quantized the same way at run time (MXFP4, MXFP8: `schemes.quantize_activation_mx`). MXFP4 runs as
    `codebook` (the 16 E2M1 values its table); MXFP8A16 as `w8a16-fp8`, MXFP8 as block-scaled `fp8`, each
    with a scale per row and group of 32."""
    bits, preset, scheme = MX[fmt]
    _float_weights(weights, fmt, bits, "group", 32, preset, where)
    if acts:
        got_acts = tuple(acts.get(f) for f in ("type", "num_bits", "strategy", "group_size", "dynamic"))
        # compressed-tensors takes power-of-two (E8M0) activation scales where scale_dtype is uint8; its
        # versions before scale_dtype existed did so for every float 4-bit group of 32
        power_of_two = acts.get("scale_dtype", "torch.uint8") == "torch.uint8"
        if (
            got_acts != ("float", bits, "group", 32, True)
            or not acts.get("symmetric", True)
            or not power_of_two
        ):
            raise UnsupportedQuantizationError(
                f"{where}MXFP{bits} weights with input activations {got_acts} (scale_dtype "
                f"{acts.get('scale_dtype')}, symmetric={acts.get('symmetric', True)}) are not supported; "
                f"supported: none ({preset}), or float {bits}-bit, group, groups of 32, dynamic, symmetric, "
                f"scale_dtype torch.uint8 ({preset[:-3]})"
            )
        if bits == 4:
            return QuantSpec(scheme, fmt, group_size=32, num_bits=4, input_quant="mxfp4")
        return QuantSpec("fp8", fmt, group_size=32, block_rows=1, input_quant="mxfp8")
    if bits == 4:
        return QuantSpec(scheme, fmt, group_size=32, num_bits=4)
    return QuantSpec(scheme, fmt, group_size=32, block_rows=1)


def canonical_mx(spec: QuantSpec, tensors: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """An MX projection's tensors in the forms its layer takes: its E8M0 scales as float32 powers of two;
    MXFP4's bytes as 4-bit codes (`weight`, column 2j in the low nibble, as compressed-tensors packs them)
    with the E2M1 values as their table (code 8 + k is -E2M1[k])."""
    scale = e8m0_scales(tensors["weight_scale"], name)
    if spec.format == "mxfp8-quantized":
        return {"weight": tensors["weight"], "weight_scale": scale}
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    return {"weight": tensors["weight_packed"], "weight_scale": scale, "weight_quant_map": table}
