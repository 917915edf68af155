"""bitsandbytes checkpoints (`quant_method: bitsandbytes`; what transformers saves for a model loaded with
a `BitsAndBytesConfig`): their `quantization_config` and their tensors. 4-bit (`load_in_4bit`, the
"...-bnb-4bit" downloads) is decoded into the form `CodebookLinear` runs; 8-bit (`load_in_8bit`,
"...-bnb-8bit") is an int8 `weight` and its rows' absolute maxima `SCB`, run by `LlmInt8Linear`.

A projection's `weight` holds its values flattened in row-major order, two 4-bit codes a byte (the first
in the high nibble), in blocks of `blocksize` (64) values with one absolute maximum each. A value is
`quant_map[code] * absmax[block]`, `quant_map` the 16 values of NF4 or of bitsandbytes' own FP4. With
double quantization (`bnb_4bit_use_double_quant`) `absmax` is itself one byte a block: its value is
`nested_quant_map[byte] * nested_absmax[block // nested_blocksize] + nested_offset`, in float32. The
rest (block sizes, the offset, the shape) is JSON in the `quant_state.bitsandbytes__nf4` (or `__fp4`)
tensor's bytes. The loader hands these tensors over under flat suffixes (`flat_suffix`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.model.quant.spec import Decoded, QuantSpec

BLOCK = 64  # what transformers' BitsAndBytesConfig quantizes with (it has no option for another)
QUANT_TYPES = ("nf4", "fp4")
# The element type the packed codes are stored as (`bnb_4bit_quant_storage`; bfloat16 for FSDP training):
# the same bytes whatever it is.
STORAGE = {"uint8": torch.uint8, "int8": torch.int8, "bfloat16": torch.bfloat16, "float16": torch.float16}
STORAGE["float32"] = torch.float32

# checkpoint suffix after ".weight." -> the suffix the collector files it under
_SUFFIXES = {
    "absmax": "weight_absmax",
    "quant_map": "weight_quant_map",
    "nested_absmax": "weight_nested_absmax",
    "nested_quant_map": "weight_nested_quant_map",
    "quant_state.bitsandbytes__nf4": "weight_quant_state",
    "quant_state.bitsandbytes__fp4": "weight_quant_state",
}


def flat_suffix(name: str) -> str:
    """`...q_proj.weight.absmax` -> `...q_proj.weight_absmax` (one dot between module and tensor, as the
    loader splits names); other names as they are."""
    head, sep, tail = name.partition(".weight.")
    if sep and tail in _SUFFIXES:
        return f"{head}.{_SUFFIXES[tail]}"
    return name


def parse_bnb(qc: dict[str, Any]) -> QuantSpec:
    if qc.get("load_in_8bit") or qc.get("_load_in_8bit"):
        if qc.get("llm_int8_has_fp16_weight"):
            raise UnsupportedQuantizationError(
                "bitsandbytes: llm_int8_has_fp16_weight keeps the weights in float16 (for training); supported: "
                "int8 weights (false)"
            )
        threshold = qc.get("llm_int8_threshold", 6.0)
        if not isinstance(threshold, int | float) or threshold < 0:
            raise UnsupportedQuantizationError(
                f"bitsandbytes: llm_int8_threshold {threshold!r} is not supported; supported: a number >= 0"
            )
        return QuantSpec(
            "bnb-int8", "bitsandbytes-8bit", group_size=0, num_bits=8, outlier_threshold=float(threshold)
        )
    if not (qc.get("load_in_4bit") or qc.get("_load_in_4bit")):
        raise UnsupportedQuantizationError("bitsandbytes: neither load_in_4bit nor load_in_8bit is set")
    kind = qc.get("bnb_4bit_quant_type", "fp4")
    if kind not in QUANT_TYPES:
        raise UnsupportedQuantizationError(
            f"bitsandbytes: bnb_4bit_quant_type {kind!r} is not supported; supported: {', '.join(QUANT_TYPES)}"
        )
    storage = qc.get("bnb_4bit_quant_storage", "uint8")
    if storage not in STORAGE:
        raise UnsupportedQuantizationError(
            f"bitsandbytes: bnb_4bit_quant_storage {storage!r} is not supported; supported: {', '.join(STORAGE)}"
        )
    return QuantSpec(
        f"bnb-{kind}",
        "bitsandbytes",
        group_size=BLOCK,
        num_bits=4,
        zero_points=False,
        nested=bool(qc.get("bnb_4bit_use_double_quant")),
    )


def quant_state(raw: torch.Tensor, what: str) -> dict[str, Any]:
    try:
        state = json.loads(bytes(raw.to(torch.uint8).reshape(-1).tolist()))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnsupportedQuantizationError(f"{what}: its quant_state is not JSON ({e})") from e
    if not isinstance(state, dict):
        raise UnsupportedQuantizationError(f"{what}: its quant_state is not a JSON object")
    return state


def decode_bnb(spec: QuantSpec, tensors: dict[str, torch.Tensor], what: str) -> Decoded:
    """One projection -> (codes [out, in / 2] uint8, column 2j in the low nibble as the engine's 4-bit
    layers hold them; float32 absmax [out, in / blocksize]; None). The code table is the layer's
    (`CodebookLinear.set_code`)."""
    state = quant_state(tensors["weight_quant_state"], what)
    kind, block = state.get("quant_type"), state.get("blocksize")
    if f"bnb-{kind}" != spec.scheme:
        raise UnsupportedQuantizationError(
            f"{what}: quant_type {kind!r} in a checkpoint of bnb_4bit_quant_type {spec.scheme[4:]!r}"
        )
    if block != spec.group_size:
        raise UnsupportedQuantizationError(
            f"{what}: blocksize {block!r} is not supported; supported: {spec.group_size}"
        )
    shape = state.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(s, int) for s in shape)):
        raise UnsupportedQuantizationError(f"{what}: quant_state shape {shape!r} is not a 2-d weight's")
    out, inp = shape
    if inp % block:
        raise UnsupportedQuantizationError(
            f"{what}: input size {inp} is not a multiple of the blocksize {block} (a block would span two "
            "rows); not supported"
        )
    data = tensors["weight"]
    if data.dtype not in STORAGE.values() or data.numel() * data.element_size() * 2 != out * inp:
        raise UnsupportedQuantizationError(
            f"{what}: weight {list(data.shape)} ({data.dtype}) does not hold {out} x {inp} 4-bit codes"
        )
    data = data.contiguous().view(torch.uint8)  # the stored bytes, in order
    absmax = _absmax(spec, tensors, state, what, out * inp // block)
    high_first = data.reshape(out, inp // 2)
    codes = ((high_first >> 4) | (high_first << 4)).contiguous()  # the engine's order: low nibble first
    return codes, absmax.reshape(out, inp // block), None


def _absmax(
    spec: QuantSpec, tensors: dict[str, torch.Tensor], state: dict[str, Any], what: str, blocks: int
) -> torch.Tensor:
    absmax = tensors["weight_absmax"].reshape(-1)
    if absmax.numel() != blocks:
        raise UnsupportedQuantizationError(f"{what}: {absmax.numel()} absmax values for {blocks} blocks")
    if not spec.nested:
        if absmax.dtype != torch.float32:
            raise UnsupportedQuantizationError(f"{what}: absmax in {absmax.dtype}; supported: float32")
        return absmax
    nested_block = state.get("nested_blocksize")
    nested_absmax = tensors["weight_nested_absmax"].float().reshape(-1)
    table = tensors["weight_nested_quant_map"].float().reshape(-1)
    offset = state.get("nested_offset")
    if absmax.dtype != torch.uint8 or table.numel() != 256 or not isinstance(offset, (int, float)):
        raise UnsupportedQuantizationError(
            f"{what}: double quantization needs uint8 absmax, a 256-value nested_quant_map and a "
            f"nested_offset; found {absmax.dtype}, {table.numel()} values, {offset!r}"
        )
    if (
        not isinstance(nested_block, int)
        or nested_block <= 0
        or nested_absmax.numel() != -(-blocks // nested_block)
    ):
        raise UnsupportedQuantizationError(
            f"{what}: nested_blocksize {nested_block!r} and {nested_absmax.numel()} nested_absmax values "
            f"do not cover {blocks} blocks"
        )
    scale = nested_absmax.repeat_interleave(nested_block)[:blocks]
    return table[absmax.long()] * scale + torch.tensor(offset, dtype=torch.float32)


def decode_int8(tensors: dict[str, torch.Tensor], what: str) -> Decoded:
    """An 8-bit projection: its int8 weight [out, in] and its rows' absolute maxima [out] (float32)."""
    weight, scb = tensors["weight"], tensors["SCB"]
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise UnsupportedQuantizationError(
            f"{what}: an 8-bit weight must be int8 [out, in], found {weight.dtype}"
        )
    if scb.numel() != weight.shape[0]:
        raise UnsupportedQuantizationError(f"{what}: {scb.numel()} SCB values for {weight.shape[0]} rows")
    return weight, scb.float().reshape(-1), None
