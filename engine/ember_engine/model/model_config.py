"""What the engine needs from a Hugging Face `config.json`, checked up front."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    torch_dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Per rotary frequency, the number its angle is divided by (a GGUF file's rope_freqs.weight, Llama 3.1's
    # scaling as llama.cpp stores it); None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    # Attention within the last this many tokens (Mistral's `sliding_window`, Qwen2's with
    # `use_sliding_window`), where some layer uses it and it is shorter than the positions; None: none.
    sliding_window: int | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: a model directory needs a Hugging Face config.json")
        raw = json.loads(path.read_text())
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
        rope_scaling = raw.get("rope_scaling")
        rope_theta = raw.get("rope_theta", 10000.0)
        if isinstance(raw.get("rope_parameters"), dict):  # the newer spelling of the same settings
            params = raw["rope_parameters"]
            rope_theta = params.get("rope_theta", rope_theta)
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        activation = raw.get("hidden_act", "silu")
        if activation not in ("silu", "swish"):  # the same function, as transformers maps them
            raise UnsupportedModelError(f"hidden_act {activation!r} is not supported; supported: silu")
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in ("default", "llama3"):
                raise UnsupportedModelError(f"unsupported rope_scaling type {kind!r}; supported: llama3")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama and Mistral say so in attention_bias.
            attention_bias=arch == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            torch_dtype=_DTYPES.get(
                str(raw.get("torch_dtype") or raw.get("dtype") or "float32"), torch.float32
            ),
            eos_token_ids=_eos_ids(Path(model_dir), raw),
            bos_token_id=raw.get("bos_token_id"),
            rope_freq_factors=_freq_factors(raw, rope_scaling, head_dim),
            sliding_window=_sliding_window(raw, arch),
        )

    def max_model_len(self, requested: int | None) -> int:
        """The longest sequence to run: `requested` (a ValueError past the model's limit), else that limit.
        A sliding window limits it too: ember attends over whole sequences, which is the same as attending
        within the window only up to the window's length."""
        limit = self.max_position_embeddings
        why = f"the model's limit of {limit}"
        if self.sliding_window is not None:
            limit = self.sliding_window
            why = (
                f"the model's sliding window of {limit} tokens (ember attends over whole sequences, which is "
                "the same only up to the window)"
            )
        if requested is not None and requested > limit:
            raise ValueError(f"max_model_len: {requested} exceeds {why}")
        return requested or limit


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    """The window a layer attends within, as transformers reads it: `sliding_window` where
    `use_sliding_window` is not false (Qwen2 and Qwen3 default it false), for the layers `layer_types`
    marks (or, for Qwen, from `max_window_layers` on); None where no layer uses one shorter than the
    positions."""
    window = raw.get("sliding_window")
    qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
    if not isinstance(window, int) or not raw.get("use_sliding_window", not qwen):
        return None
    layers = raw.get("layer_types")
    if isinstance(layers, list):
        used = "sliding_attention" in layers
    else:
        used = not qwen or raw.get("max_window_layers", 28) < raw["num_hidden_layers"]
    return window if used and window < raw.get("max_position_embeddings", 4096) else None


def _freq_factors(
    raw: dict[str, Any], rope_scaling: dict[str, Any] | None, head_dim: int
) -> tuple[float, ...] | None:
    factors = raw.get("rope_freq_factors")
    if factors is None:
        return None
    if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) != "default":
        raise UnsupportedModelError(
            "rope_freq_factors and rope_scaling both scale the rotary frequencies; give one"
        )
    if len(factors) != head_dim // 2:
        raise UnsupportedModelError(
            f"rope_freq_factors: {len(factors)} given, one per rotary frequency ({head_dim // 2})"
        )
    return tuple(float(f) for f in factors)


def _eos_ids(model_dir: Path, raw: dict[str, Any]) -> tuple[int, ...]:
    # generation_config.json is what `generate` obeys; config.json is the fallback.
    gen_path = model_dir / "generation_config.json"
    eos = json.loads(gen_path.read_text()).get("eos_token_id") if gen_path.exists() else None
    if eos is None:
        eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def resolve_dtype(name: str, config: ModelConfig) -> torch.dtype:
    if name == "auto":
        return config.torch_dtype
    if name not in _DTYPES:
        raise ValueError(f"dtype: unknown {name!r}; choose auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]
