"""GPTQ and AWQ checkpoints: their `quantization_config` and their tensors, decoded into the engine's
canonical forms (`schemes.py`).

- GPTQ (`quant_method: gptq`, what GPTQModel and AutoGPTQ write; "...-GPTQ-Int4" downloads): `qweight`
  (4- or 8-bit values packed into int32 words along the input dimension), `qzeros` (zero points packed
  along the output dimension; `checkpoint_format` `gptq` stores each less one, word by word, `gptq_v2`
  as it is), `scales` [groups, out] and `g_idx` (each input column's group). With `desc_act` (act-order)
  the groups are not runs of columns: the columns are put in group order at load and each projection's
  input is gathered into that order (`QuantLinear.input_order`). GPTQModel's `dynamic` overrides leave
  modules in full precision or store them in another format (a group of their own, `dynamic_rules`), and
  `lm_head: true` quantizes the LM head too.
- AWQ (`quant_method: awq`, `version: gemm`; "...-AWQ" downloads): `qweight` [in, out / 8] and `qzeros`,
  4-bit values packed along the output dimension in AWQ's interleaved order, and `scales` [groups, out].

The values are the signed ints of the compressed-tensors forms (each less the midpoint) and run as w4a16
/ w8a16; 4-bit values with zero points of their own (GPTQ `sym: false`, AWQ `zero_point: true`) keep
them beside the scales, one int8 per group and output channel (`Int4Linear.weight_zero`).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch

from ember_engine.model.quant import schemes
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import GPTQ_FORMATS, Decoded, QuantSpec, config_file

# Configs older exports keep in a file of their own, beside a config.json without one: AutoGPTQ's (GPTQModel
# writes a copy too, with its `quant_method`) and AutoAWQ's.
LEGACY_FILES = ("quantize_config.json", "quant_config.json")
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: field k of a word holds column _AWQ_ORDER[k]


def read_legacy(model_dir: str | Path) -> dict[str, Any] | None:
    """An older export's own config file, as a `quantization_config` (None where there is none), as vLLM
    reads these files: one without a `quant_method` is AutoAWQ's where it spells its fields AutoAWQ's way
    (`w_bit`, `q_group_size`), else AutoGPTQ's (bits, group_size, desc_act, sym)."""
    for name in LEGACY_FILES:
        found = config_file(model_dir, name)
        if found is None:
            continue
        path, raw = found
        if not isinstance(raw, dict):
            raise UnsupportedQuantizationError(f"{path}: a GPTQ or AWQ config must be a JSON object")
        method = "awq" if "w_bit" in raw or "q_group_size" in raw else "gptq"
        return {"quant_method": method, **raw}
    return None


def parse_gptq(qc: dict[str, Any]) -> QuantSpec:
    """A GPTQ config's scheme: its base format, and where GPTQModel's `dynamic` overrides store some
    modules in other formats, scheme "mixed" with a group for each (`dynamic_rules`)."""
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in GPTQ_FORMATS:
        raise UnsupportedQuantizationError(
            f"gptq: checkpoint_format {fmt!r} is not supported; supported: {', '.join(GPTQ_FORMATS)}"
        )
    base = _gptq_format(fmt, {f: qc.get(f, d) for f, d in _STORED.items()}, "gptq")
    ignore, overrides = dynamic_rules(qc, formats=True)
    ignore += _left_in_blocks(qc.get("modules_in_block_to_quantize"))
    groups = tuple(
        dataclasses.replace(_gptq_format(fmt, fields, f"gptq: dynamic {key!r}"), targets=(pattern,))
        for key, pattern, fields in overrides
    )
    if not groups:
        return dataclasses.replace(base, ignore=ignore)
    return QuantSpec("mixed", fmt, groups=(*groups, base), ignore=ignore)


def _left_in_blocks(listed: Any) -> tuple[str, ...]:
    """AutoGPTQ's and GPTQModel's `modules_in_block_to_quantize`: each decoder layer's quantized
    projections, named within the layer ("self_attn.q_proj"), in lists (one per step of the layer's
    quantization) or one list. The layers' other projections are in full precision: an "re:" pattern for
    `QuantSpec.ignore` (none where the field is absent or empty: every projection quantized)."""
    if not listed:
        return ()
    flat = (
        [n for part in listed for n in (part if isinstance(part, list) else [part])]
        if isinstance(listed, list)
        else []
    )
    if not flat or not all(isinstance(n, str) and n for n in flat):
        raise UnsupportedQuantizationError(
            f"gptq: modules_in_block_to_quantize must be a list of module names (or of lists of them), "
            f"got {listed!r}"
        )
    names = "|".join(re.escape(n) for n in flat)
    return (rf"re:(?:.*\.)?layers\.\d+\.(?!(?:.*\.)?(?:{names})$)",)


def _gptq_format(fmt: str, fields: dict[str, Any], where: str) -> QuantSpec:
    """The scheme of GPTQ weights stored with `fields` (bits, group_size, sym, desc_act)."""
    bits, group, asymmetric = fields["bits"], fields["group_size"], not fields["sym"]
    if bits not in (4, 8):
        raise UnsupportedQuantizationError(f"{where}: {bits}-bit weights are not supported; supported: 4, 8")
    if asymmetric and bits != 4:
        raise UnsupportedQuantizationError(
            f"{where}: asymmetric 8-bit weights (sym: false) are not supported; supported: sym: true, or 4 bits"
        )
    if not isinstance(group, int) or not (group > 0 or (group == -1 and bits == 8)):
        raise UnsupportedQuantizationError(
            f"{where}: group_size {group!r} is not supported with {bits}-bit weights; supported: a positive "
            "group size" + (", or -1 (per channel)" if bits == 8 else "")
        )
    return QuantSpec(
        "w4a16" if bits == 4 else "w8a16",
        fmt,
        group_size=max(group, 0),
        num_bits=bits,
        act_order=bool(fields["desc_act"]),
        zero_points=asymmetric,
    )


def parse_awq(qc: dict[str, Any]) -> QuantSpec:
    """An AWQ config's scheme; AutoAWQ's own names for its fields (`w_bit`, `q_group_size`) read as vLLM
    reads them."""
    bits, group = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size"))
    version = str(qc.get("version") or qc.get("checkpoint_format") or "gemm").lower()
    if version != "gemm":
        raise UnsupportedQuantizationError(f"awq: version {version!r} is not supported; supported: gemm")
    if bits != 4:
        raise UnsupportedQuantizationError(f"awq: {bits}-bit weights are not supported; supported: 4")
    if not isinstance(group, int) or group <= 0:
        raise UnsupportedQuantizationError(
            f"awq: group_size {group!r} is not supported; supported: a positive group size"
        )
    return QuantSpec(
        "w4a16", "awq", group_size=group, num_bits=4, zero_points=bool(qc.get("zero_point", True))
    )


# What a GPTQ `dynamic` override may change of how a module's tensors are stored, with the base config's
# defaults.
_STORED = {"bits": None, "group_size": None, "sym": True, "desc_act": False}


def dynamic_rules(
    qc: dict[str, Any], formats: bool = False
) -> tuple[tuple[str, ...], list[tuple[str, str, dict[str, Any]]]]:
    """GPTQModel's per-module `dynamic` overrides: ("re:" patterns for `QuantSpec.ignore`, and for each
    override of the stored format its key, its "re:" pattern and the format's fields). GPTQModel takes, for
    each module, the first pattern (in order) that matches its name from the start: "-:" before it leaves
    the module in full precision, "+:" or nothing applies the override's fields. Each pattern therefore
    takes only what no earlier positive pattern matched (a negative lookahead for each). An override of the
    stored format (bits, group size, symmetry, act-order) other than the base config's is refused by name
    unless `formats` (GPTQ: the module takes a group of that format); the other fields tune the calibration
    only."""
    method, dynamic = qc.get("quant_method"), qc.get("dynamic") or {}
    if not isinstance(dynamic, dict):
        raise UnsupportedQuantizationError(
            f"{method}: dynamic must be a mapping of patterns, got {dynamic!r}"
        )
    base = {f: qc.get(f, default) for f, default in _STORED.items()}
    ignore: list[str] = []
    overrides: list[tuple[str, str, dict[str, Any]]] = []
    earlier: list[str] = []
    for key, fields in dynamic.items():
        raw = key[2:] if key.startswith(("-:", "+:")) else key
        try:
            re.compile(raw)
        except re.error as e:
            raise UnsupportedQuantizationError(
                f"{method}: dynamic pattern {key!r} is not a regular expression: {e}"
            ) from e
        pattern = "re:" + "".join(f"(?!{p})" for p in earlier) + f"(?:{raw})"
        if key.startswith("-:"):
            ignore.append(pattern)
            continue
        changed = {f: v for f, v in (fields or {}).items() if f in _STORED and v != base[f]}
        if changed and not formats:
            raise UnsupportedQuantizationError(
                f"{method}: dynamic {key!r} sets {changed} for the modules it matches (base: "
                f"{ {f: base[f] for f in changed} }); per-module formats are not supported; supported: "
                "'-:' patterns (modules left in full precision) and overrides of calibration fields"
            )
        if changed:
            overrides.append((key, pattern, base | changed))
        earlier.append(raw)
    return tuple(ignore), overrides


def input_order(spec: QuantSpec, name: str, g_idx: torch.Tensor) -> torch.Tensor | None:
    """The order a GPTQ projection's input columns are put in so that its groups are runs of group_size
    columns (a stable sort by group), or None where they already are. Refused where a group does not
    hold exactly group_size columns."""
    g_idx = g_idx.to(torch.int64).reshape(-1)
    columns, size = g_idx.numel(), spec.group_size or g_idx.numel()
    if torch.equal(g_idx, torch.arange(columns) // size):
        return None
    counts = torch.bincount(g_idx, minlength=-(-columns // size)) if g_idx.min() >= 0 else None
    expected = torch.full((-(-columns // size),), size)
    expected[-1] = columns - size * (expected.numel() - 1)
    if counts is None or not torch.equal(counts, expected):
        raise UnsupportedQuantizationError(
            f"{name}: g_idx does not give each group {size} columns; not supported"
        )
    if not spec.act_order:
        raise UnsupportedQuantizationError(f"{name}: g_idx reorders the groups, but desc_act is false")
    return torch.sort(g_idx, stable=True).indices


def _zero_points(spec: QuantSpec, what: str, zeros: torch.Tensor) -> torch.Tensor | None:
    """A projection's zero points [out, groups] int8, each less the midpoint (what `zeros` [groups, out]
    holds, as unpack_int32 gives it), or None where it has none of its own. Without zero_points every
    zero point must be the midpoint."""
    if spec.zero_points:
        return zeros.t().contiguous()
    if torch.count_nonzero(zeros):
        raise UnsupportedQuantizationError(
            f"{what}.qzeros: zero points other than the midpoint (asymmetric weights) in a checkpoint that "
            "declares them symmetric"
        )
    return None


def _check_groups(
    spec: QuantSpec, what: str, out: int, inp: int, tensors: dict[str, torch.Tensor], zero_words: int
) -> None:
    """`qweight` and `qzeros` int32 words, `scales` one per group and output channel, `qzeros` a group's
    `zero_words` words: anything else would load into wrong answers (zero points for some columns only)
    or fail on a bare torch error."""
    for name in ("qweight", "qzeros"):
        if tensors[name].dtype != torch.int32:
            raise UnsupportedQuantizationError(
                f"{what}.{name}: {tensors[name].dtype} words, where {spec.format} packs {spec.num_bits}-bit "
                "values into torch.int32"
            )
    groups = -(-inp // spec.group_size) if spec.group_size else 1
    scales, zeros = tensors["scales"], tensors["qzeros"]
    if tuple(scales.shape) != (groups, out):
        raise UnsupportedQuantizationError(
            f"{what}.scales: a [{out}, {inp}] weight in groups of {spec.group_size or inp} needs scales "
            f"[{groups}, {out}]; found {list(scales.shape)}"
        )
    if tuple(zeros.shape) != (groups, zero_words):
        raise UnsupportedQuantizationError(
            f"{what}.qzeros: {list(zeros.shape)} words, where a [{out}, {inp}] weight in groups of "
            f"{spec.group_size or inp} needs [{groups}, {zero_words}] ({spec.num_bits}-bit zero points)"
        )


def _decode_gptq(spec: QuantSpec, tensors: dict[str, torch.Tensor], what: str) -> Decoded:
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    inp, out = qweight.shape[0] * 32 // spec.num_bits, qweight.shape[1]
    _check_groups(spec, what, out, inp, tensors, -(-out * spec.num_bits // 32))
    if spec.format == "gptq":
        # Stored less one, word by word (a zero point of 0 borrows from the next): adding one to every
        # field of each word, carries and all, gives them back, as GPTQModel reads this format.
        ones = sum(1 << k for k in range(0, 32, spec.num_bits))
        qzeros = schemes.as_int32(qzeros.to(torch.int64) + ones)
    # Both packings hold unsigned values from the low bits up; unpack_int32 gives each less the midpoint.
    weight = schemes.unpack_int32(qweight.t().contiguous(), spec.num_bits, inp)  # [out, in]
    zeros = schemes.unpack_int32(qzeros, spec.num_bits, out)  # [groups, out]
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        order = input_order(spec, what, g_idx)
        if order is not None:
            weight = weight[:, order].contiguous()
    # Scales and zero points are per group, whatever order its columns come in.
    return weight, scales.float().t().contiguous(), _zero_points(spec, what, zeros)


def _unpack_awq(packed: torch.Tensor, columns: int) -> torch.Tensor:
    """AWQ's GEMM packing: 8 4-bit values per int32 along the last dimension, nibble k of a word holding
    column _AWQ_ORDER[k] of its 8. Each value less 8, in column order."""
    values = schemes.unpack_int32(packed, 4, columns)
    out = torch.empty_like(values)
    for k, column in enumerate(_AWQ_ORDER):
        out[:, column::8] = values[:, k::8]
    return out


def _decode_awq(spec: QuantSpec, tensors: dict[str, torch.Tensor], what: str) -> Decoded:
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    inp, out = qweight.shape[0], qweight.shape[1] * 8
    _check_groups(spec, what, out, inp, tensors, -(-out // 8))
    weight = _unpack_awq(qweight, out).t().contiguous()  # [out, in]
    zeros = _unpack_awq(qzeros, out)  # [groups, out]
    return weight, scales.float().t().contiguous(), _zero_points(spec, what, zeros)


def decode(spec: QuantSpec, tensors: dict[str, torch.Tensor], what: str = "") -> Decoded:
    """One projection's tensors (projection `what`, as its errors name it) -> (values as int8 [out, in],
    each less the midpoint; scale [out, groups]; zero points [out, groups] int8, each less the midpoint,
    or None)."""
    what = what or spec.format
    return _decode_awq(spec, tensors, what) if spec.format == "awq" else _decode_gptq(spec, tensors, what)
