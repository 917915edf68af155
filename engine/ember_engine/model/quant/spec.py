"""What a quantized model runs: its scheme, the checkpoint format its tensors come in, and their groups."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ember_engine.model.quant import schemes

# One projection decoded: its canonical weight, its scales, and its zero points where it has its own.
Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

GPTQ_FORMATS = ("gptq", "gptq_v2")
GPTQ_TENSORS = frozenset({"qweight", "qzeros", "scales"})


@dataclass(frozen=True, slots=True)
class OnlineRotation:
    """One rotation a compressed-tensors `transform_config` applies as the model runs (`rotations.py`)."""

    group: str
    location: str  # input | output (of the linear layers it targets)
    inverse: bool  # the matrix transposed
    head_dim: int | None  # rotates blocks of this many columns; None: the whole width
    precision: str  # the dtype it is computed in, as the config names it ("torch.float64")
    targets: tuple[str, ...]
    ignore: tuple[str, ...]

    def applies_to(self, name: str) -> bool:
        return not any(_matches(name, p) for p in self.ignore) and any(
            _matches(name, t) for t in self.targets
        )


@dataclass(frozen=True, slots=True)
class QuantSpec:
    # fp8 | w8a16 | w4a16 | w8a8 | bnb-nf4 | from a checkpoint only: w8a16-fp8, nvfp4a16, nvfp4, bnb-fp4,
    # bnb-int8, codebook (GGUF's lattice i-quants, MXFP4A16 and MXFP4), mixed (see groups)
    scheme: str
    # online | float-quantized | pack-quantized | int-quantized | naive-quantized | nvfp4-pack-quantized |
    # hf-fp8 | fbgemm_fp8 | modelopt | quark | gguf | gptq | gptq_v2 | awq | bitsandbytes |
    # bitsandbytes-8bit | mixed-precision (a compressed-tensors config of scheme mixed: each group has its
    # own format; a mixed GPTQ one keeps gptq or gptq_v2)
    format: str
    group_size: int = schemes.DEFAULT_GROUP_SIZE  # input columns per scale (fp8: 0 unless block-scaled)
    num_bits: int = 8
    block_rows: int = 0  # block-scaled fp8: output rows per tile of the checkpoint's scales
    act_order: bool = False  # GPTQ desc_act: groups given by g_idx, not by runs of columns
    # w4a16 with zero points of its own (GPTQ sym: false, AWQ zero_point: true, compressed-tensors
    # W4A16_ASYM), one per group
    zero_points: bool = False
    float_zeros: bool = False  # zero points of any real value (GGUF Q4_K: dmin m / (d s)), held in float32
    # a calibrated activation scale per projection: fp8's static per-tensor scale (compressed-tensors' FP8
    # preset), in place of per-token scales taken at run time; nvfp4's global scale (NVFP4, W4A4)
    static_input: bool = False
    nested: bool = False  # bitsandbytes double quantization: each block's absmax is itself quantized
    # bitsandbytes 8-bit (LLM.int8()): input columns with a value at or above it run unquantized
    outlier_threshold: float = 0.0
    # The inputs quantized at run time where the weight scheme otherwise leaves them as they are (``: not):
    # mxfp4, mxfp8 (compressed-tensors' MXFP4 and MXFP8: per token and group of 32 columns under
    # power-of-two scales, to E2M1 or E4M3), mxfp8-fit (ModelOpt's MXFP8: the same under its rule for the
    # scale, `schemes.quantize_activation_mx`), fp8, int8 (W4AFP8 and W4A8: w4a16's weights, the inputs
    # per token to E4M3 or int8)
    input_quant: str = ""
    # fbgemm_fp8's activation_scale_ub: a token's largest magnitude is taken as at most this (0: unbounded)
    activation_ub: float = 0.0
    # Which of the checkpoint's linear layers hold the scheme (compressed-tensors' `targets` and `ignore`:
    # a module name, "re:" and a pattern matched from its start, or a class name, "Linear"); the others
    # are in full precision.
    targets: tuple[str, ...] = ("Linear",)
    ignore: tuple[str, ...] = ()
    # scheme "mixed" (compressed-tensors' config groups of different schemes, GPTQModel's `dynamic` overrides
    # of the stored format): each group's own spec, with its own targets
    groups: tuple[QuantSpec, ...] = ()
    # compressed-tensors' rotations at run time (each layer's found by `OnlineRotation.applies_to`)
    rotations: tuple[OnlineRotation, ...] = ()

    def layer_spec(self, name: str) -> QuantSpec | None:
        """The scheme the checkpoint's linear layer `name` (e.g. "model.layers.0.self_attn.q_proj") holds,
        None where it is in full precision. Of a mixed checkpoint's groups, the one compressed-tensors
        gives it: its targets matched by name before by class ("Linear"), an exact name before a "re:"
        pattern, patterns in their sorted order; a target in two groups belongs to the later one."""
        if any(_matches(name, p) for p in self.ignore):
            return None
        if not self.groups:
            return self if any(_matches(name, t) for t in self.targets) else None
        owner = {t: g for g in self.groups for t in g.targets}
        by_name = [
            t for t in sorted(owner, key=lambda t: ("re:" in t, t)) if t != "Linear" and _matches(name, t)
        ]
        chosen = by_name[0] if by_name else "Linear" if "Linear" in owner else None
        return None if chosen is None else owner[chosen]

    def quantizes(self, name: str) -> bool:
        return self.layer_spec(name) is not None

    def members(self) -> tuple[QuantSpec, ...]:
        """The schemes a model runs: a mixed checkpoint's groups, else this one."""
        return self.groups or (self,)

    @property
    def prequantized(self) -> bool:
        return self.format != "online"

    def required(self) -> frozenset[str]:
        """The tensor suffixes one projection needs before it can be decoded."""
        # a weight and its scales, and a calibrated input scale where the inputs have one
        scaled = frozenset({"weight", "weight_scale"}) | ({"input_scale"} if self.static_input else set())
        return {
            "float-quantized": scaled,
            "pack-quantized": frozenset({"weight_packed", "weight_scale", "weight_shape"})
            | ({"weight_zero_point"} if self.zero_points else set()),
            "int-quantized": scaled,
            "naive-quantized": scaled,
            "mxfp4-pack-quantized": frozenset({"weight_packed", "weight_scale"}),
            "mxfp8-quantized": frozenset({"weight", "weight_scale"}),
            "nvfp4-pack-quantized": frozenset({"weight_packed", "weight_scale", "weight_global_scale"})
            | ({"input_global_scale"} if self.static_input else set()),
            "hf-fp8": frozenset({"weight", "weight_scale_inv"})
            | ({"input_scale"} if self.static_input else set()),
            "fbgemm_fp8": frozenset({"weight", "weight_scale"}),
            "quark": scaled,
            "gguf": frozenset({"weight", "weight_scale"})
            | ({"weight_zero"} if self.zero_points else set())
            | ({"weight_quant_map"} if self.scheme == "codebook" else set()),
            # weight_scale_2: NVFP4's per-tensor scale over its group scales; W4A8_AWQ's E4M3 scale
            "modelopt": scaled
            | ({"weight_scale_2"} if self.scheme in ("nvfp4a16", "nvfp4", "w4a8-fp8") else set()),
            "gptq": GPTQ_TENSORS | ({"g_idx"} if self.act_order else set()),
            "gptq_v2": GPTQ_TENSORS | ({"g_idx"} if self.act_order else set()),
            "awq": GPTQ_TENSORS,
            "bitsandbytes-8bit": frozenset({"weight", "SCB"}),
            "bitsandbytes": frozenset({"weight", "weight_absmax", "weight_quant_map", "weight_quant_state"})
            | ({"weight_nested_absmax", "weight_nested_quant_map"} if self.nested else set()),
        }[self.format]


def _matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern in (name, "Linear")


def config_file(model_dir: str | Path, name: str) -> tuple[Path, Any] | None:
    """A quantization config a checkpoint keeps in a file of its own beside `config.json` (older
    exports'), parsed: (its path, its JSON), or None where there is no such file."""
    path = Path(model_dir) / name
    if not path.exists():
        return None
    try:
        return path, json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise schemes.UnsupportedQuantizationError(f"{path}: not JSON ({e})") from e
