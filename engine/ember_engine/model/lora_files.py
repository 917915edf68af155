"""A LoRA adapter as PEFT saves it: `adapter_config.json` and `adapter_model.safetensors`.

Each adapted projection `W` holds two factors, `lora_A` [r, in] and `lora_B` [out, r]; the adapted layer
computes `W x + s * B (A x)` with `s = lora_alpha / r` (`lora_alpha / sqrt(r)` under rsLoRA), `r` and the
alpha per module where `rank_pattern` / `alpha_pattern` say so. What ember cannot apply exactly is refused
by name rather than dropped: DoRA, adapter biases, `modules_to_save` (a trained copy of a whole layer),
trained token rows, activated LoRA and the other variants in `_UNSERVED`, and adapted modules other than
the seven projections of a decoder layer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ember_engine.model.model_config import ModelConfig

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's key: an optional "base_model.model." then the module, `lora_A`/`lora_B`, an optional adapter name.
_KEY = re.compile(
    r"(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])(?:\.[\w-]+)?\.weight"
)


class AdapterError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Factors:
    """One adapted projection: `a` [r, in] and `b` [out, r], the scaling already folded into `b`."""

    layer: int
    projection: str  # one of PROJECTIONS
    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    name: str
    factors: list[Factors]


def projection_shape(config: ModelConfig, projection: str) -> tuple[int, int]:
    """(out, in) of a projection of the unsplit model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, h),
        "k_proj": (kv, h),
        "v_proj": (kv, h),
        "o_proj": (h, q),
        "gate_proj": (i, h),
        "up_proj": (i, h),
        "down_proj": (h, i),
    }[projection]


def _pattern_value(patterns: object, module: str) -> object:
    """PEFT's per-module override: the first pattern that matches the module's name or a dotted tail of it."""
    if not isinstance(patterns, dict):
        return None
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module):
            return value
    return None


# Options that change what an adapted model computes beyond `W x + s B A x`: each must be unset (or false).
_UNSERVED = {
    "use_dora": "DoRA adapters are not served (their magnitude vector rescales the base weight)",
    "lora_bias": "adapters that train a bias on lora_B are not served",
    "modules_to_save": "whole trained copies of layers are not served",
    "trainable_token_indices": "trained embedding rows are not served",
    "fan_in_fan_out": "is for Conv1D (GPT-2) layers; Llama-family projections are Linear",
    "alora_invocation_tokens": "activated LoRA (applied only after its invocation tokens) is not served",
    "layer_replication": "adapters that replicate base layers are not served",
    "target_parameters": "adapters of bare parameters (not Linear modules) are not served",
    "use_qalora": "QA-LoRA (its input pooled by groups) is not served",
    "use_bdlora": "block-diagonal LoRA is not served",
    "arrow_config": "Arrow routing among adapters is not served",
}


def _check_config(name: str, cfg: dict[str, object]) -> None:
    def refuse(field: str, why: str) -> None:
        raise AdapterError(f"LoRA adapter {name!r}: {field}: {why}")

    if cfg.get("peft_type", "LORA") != "LORA":
        refuse("peft_type", f"{cfg.get('peft_type')!r} is not served; only LORA adapters are")
    for option, why in _UNSERVED.items():
        if cfg.get(option):
            refuse(option, f"{cfg[option]!r}: {why}")
    if cfg.get("bias", "none") != "none":
        refuse("bias", f"{cfg.get('bias')!r}: adapters that train biases are not served, only bias 'none'")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        refuse("lora_alpha", f"must be a number, got {alpha!r}")


def read_adapter(name: str, path: str | Path, config: ModelConfig) -> AdapterFiles:
    """The adapter's factors, checked against the base model's shapes; AdapterError naming what is wrong."""
    root = Path(path)
    cfg_file, weights = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not cfg_file.is_file():
        raise AdapterError(f"LoRA adapter {name!r}: {cfg_file} not found (a PEFT adapter directory has one)")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"LoRA adapter {name!r}: {cfg_file} is not JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"LoRA adapter {name!r}: {cfg_file} is not a JSON object")
    _check_config(name, cfg)
    if not weights.is_file():
        other = ", ".join(p.name for p in root.glob("adapter_model.*")) or "none"
        raise AdapterError(
            f"LoRA adapter {name!r}: {weights} not found (files there: {other}); "
            "the weights are read from safetensors"
        )
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    modules: dict[tuple[int, str], str] = {}
    with safe_open(str(weights), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            m = _KEY.fullmatch(key)
            if m is None or m.group(3) not in PROJECTIONS:
                raise AdapterError(
                    f"LoRA adapter {name!r}: tensor {key!r} adapts no projection served "
                    f"(served: {', '.join(PROJECTIONS)} of the decoder layers)"
                )
            layer = int(m.group(2))
            if layer >= config.num_layers:
                raise AdapterError(
                    f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}; the model has {config.num_layers}"
                )
            where = (layer, m.group(3))
            modules[where] = m.group(1)
            halves.setdefault(where, {})[m.group(4)] = f.get_tensor(key)
    factors = []
    use_rslora = bool(cfg.get("use_rslora"))
    for (layer, proj), pair in sorted(halves.items()):
        module = modules[(layer, proj)]
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"LoRA adapter {name!r}: {module} has no {missing} weight")
        a, b = pair["A"], pair["B"]
        out, inp = projection_shape(config, proj)
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (r, inp) or tuple(b.shape) != (out, r):
            raise AdapterError(
                f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; "
                f"this model needs [r, {inp}] and [{out}, r] (an adapter trained on another model?)"
            )
        alpha = _pattern_value(cfg.get("alpha_pattern"), module)
        alpha = cfg.get("lora_alpha", 8) if alpha is None else alpha
        assert isinstance(alpha, (int, float))
        scaling = alpha / (math.sqrt(r) if use_rslora else r)
        factors.append(Factors(layer, proj, a.float(), b.float() * scaling))
    if not factors:
        raise AdapterError(f"LoRA adapter {name!r}: {weights} holds no LoRA weights")
    return AdapterFiles(name, factors)
