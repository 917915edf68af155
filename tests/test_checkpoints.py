"""Test checkpoints look like downloaded ones: transformers loads them and their tokenizer round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ember_engine.tools.testmodel import checkpoint_digest, make_test_model

TEXT = 'def greet(name: str) -> str:\n    return f"héllo, {name} ✓"\n'
FILES = {
    "config.json",
    "model.safetensors",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.mark.parametrize(
    "size, low, high", [("tiny", 1_000_000, 2_000_000), ("small", 50_000_000, 100_000_000)]
)
def test_loads_in_transformers(size: str, low: int, high: int, request: pytest.FixtureRequest) -> None:
    path: Path = request.getfixturevalue(f"{size}_model")
    assert {p.name for p in path.iterdir()} >= FILES
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert low < sum(p.numel() for p in model.parameters()) < high
    config = json.loads((path / "config.json").read_text())
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT)["input_ids"]
    assert tok.decode(ids) == TEXT
    assert len(ids) < 0.6 * len(TEXT.encode())  # a trained vocabulary, not bytes
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, len(ids) + 4)


def test_chat_template_and_special_tokens(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for special in ["<|bos|>", "<|user|>", "<|assistant|>", "<|end|>"]:
        assert tok.convert_tokens_to_ids(special) in ids
    assert tok.eos_token == "<|eos|>" and tok.bos_token == "<|bos|>"
    generation = json.loads((tiny_model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids("<|end|>")]


def test_deterministic(tmp_path: Path, tiny_model: Path) -> None:
    again = make_test_model(tmp_path / "again", size="tiny")
    assert checkpoint_digest(again) == checkpoint_digest(tiny_model)
    other_seed = make_test_model(tmp_path / "seed1", size="tiny", seed=1)
    assert checkpoint_digest(other_seed) != checkpoint_digest(tiny_model)
