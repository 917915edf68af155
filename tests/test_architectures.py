"""Each supported architecture, written by transformers itself, decodes exactly as transformers does."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from ember_engine import LLM, SamplingParams

COMMON = dict(
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
CONFIGS = {
    "llama3-rope-scaling": lambda: LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE),
    "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    "qwen2-qkv-bias": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3-qk-norm": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
}


def _save(config, tiny_model: Path, out: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        for p in model.parameters():  # spread the logits so greedy choices are not near-ties
            p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    # A small shard size forces the sharded layout (model.safetensors.index.json).
    model.save_pretrained(out, safe_serialization=True, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny_model / name, out / name)
    return model


PROMPTS = [[5, 17, 300, 12, 9], list(range(40, 140)), [2000]]


@pytest.mark.parametrize("name", CONFIGS)
def test_greedy_matches_transformers(name: str, tiny_model: Path, tmp_path: Path) -> None:
    model = _save(CONFIGS[name](), tiny_model, tmp_path / name)
    assert (tmp_path / name / "model.safetensors.index.json").exists()
    expected = hf_greedy(model, PROMPTS, 10)
    llm = LLM(str(tmp_path / name), max_num_batched_tokens=48)
    got = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [g.token_ids for g in got] == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_as_accurate_as_transformers(
    dtype: torch.dtype, tiny_model: Path, tmp_path: Path
) -> None:
    """Half precision cannot match exactly; ember's error against float32 arithmetic on the same weights
    must be no larger than transformers' own half-precision error (with some slack)."""
    model = _save(CONFIGS["llama-tied"](), tiny_model, tmp_path / "half", dtype=dtype)
    prompt = PROMPTS[1]
    with torch.inference_mode():
        half = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        truth = torch.log_softmax(model.float()(torch.tensor([prompt])).logits[0, -1], dim=-1)
    name = str(dtype).removeprefix("torch.")
    llm = LLM(str(tmp_path / "half"), dtype=name)
    assert llm.engine.runner.kv_cache.dtype == dtype
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)[0]
    lp = out.logprobs[0]  # type: ignore[index]
    assert lp.token_id == int(truth.argmax())
    tokens = [t for t, _ in lp.top]
    ours = torch.tensor([v for _, v in lp.top])
    our_err = (ours - truth[tokens]).abs().max().item()
    their_err = (half[tokens] - truth[tokens]).abs().max().item()
    assert our_err <= 2 * their_err + 0.02, (our_err, their_err)


# Sliding-window attention (each token sees the last `sliding_window` tokens): ember attends over whole
# sequences, the same up to the window's length, so such a model runs sequences up to the window.
WINDOWED = {
    "mistral-window": lambda: MistralConfig(**COMMON, sliding_window=64),
    "qwen2-window": lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=64, max_window_layers=0, tie_word_embeddings=False
    ),
}


@pytest.mark.parametrize("name", WINDOWED)
def test_a_sliding_window_model_runs_sequences_up_to_its_window(
    name: str, tiny_model: Path, tmp_path: Path
) -> None:
    """The window was not read: sequences past it decoded unlike transformers, silently (Mistral-7B-v0.1's
    window is 4096 of its 32768 positions)."""
    model = _save(WINDOWED[name](), tiny_model, tmp_path / name)
    llm = LLM(str(tmp_path / name), max_num_batched_tokens=48)
    assert llm.engine.max_model_len == 64
    prompts = [PROMPTS[0], list(range(40, 90))]  # 50 tokens + 10 generated: within the window
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [g.token_ids for g in got] == hf_greedy(model, prompts, 10)
    with pytest.raises(
        ValueError, match=r"max_model_len: 65 exceeds the model's sliding window of 64 tokens"
    ):
        LLM(str(tmp_path / name), max_model_len=65)


def test_an_inactive_window_changes_nothing(tiny_model: Path, tmp_path: Path) -> None:
    """Qwen2 configs carry a sliding_window with use_sliding_window false (or no layer using it)."""
    for name, config in (
        (
            "off",
            Qwen2Config(**COMMON, use_sliding_window=False, sliding_window=64, tie_word_embeddings=False),
        ),
        (
            "no-layer",
            Qwen2Config(
                **COMMON,
                use_sliding_window=True,
                sliding_window=64,
                max_window_layers=2,
                tie_word_embeddings=False,
            ),
        ),
        ("wider", MistralConfig(**COMMON, sliding_window=4096)),
    ):
        _save(config, tiny_model, tmp_path / name)
        assert LLM(str(tmp_path / name)).engine.max_model_len == 512, name


def test_an_activation_other_than_silu_is_refused_by_name(tiny_model: Path, tmp_path: Path) -> None:
    """`hidden_act` was not read: a gelu model ran as silu, its output wrong."""
    _save(LlamaConfig(**COMMON, hidden_act="gelu"), tiny_model, tmp_path / "gelu")
    with pytest.raises(ValueError, match=r"hidden_act 'gelu' is not supported; supported: silu"):
        LLM(str(tmp_path / "gelu"))
