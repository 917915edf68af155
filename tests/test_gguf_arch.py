"""GGUF files of the other architectures ember runs, and Llama 3.1's rotary scaling (`rope_freqs.weight`):
each written by `gguf_build.py` as llama.cpp's converter writes that architecture (Qwen2's q, k and v
biases, Qwen3's q and k norms, q and k rows not permuted; Llama 3.1's per-frequency factors), from a model
transformers made. The oracles: transformers' own GGUF loading of the same file, and the source model
itself."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from script_runs import run_script
from test_architectures import COMMON, LLAMA3_ROPE
from test_engine_greedy import hf_greedy
from test_quant_modelopt import _forward
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from ember_engine import LLM, SamplingParams

CONFIGS = {
    "llama3-rope": lambda: LlamaConfig(**COMMON, rope_scaling=LLAMA3_ROPE),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    # transformers' GGUF loading takes Qwen3's head size from its config's default (128), not from the
    # file's key_length: the size real Qwen3 models have
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=128, tie_word_embeddings=False),
}


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path):  # type: ignore[no-untyped-def]
    """name -> preset -> the GGUF file; each source model's logits are in its oracle.pt."""
    out: dict[str, dict[str, Path]] = {}
    for name, make in CONFIGS.items():
        src = tmp_path_factory.mktemp(name) / "model"
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make()).to(torch.float32)
        with torch.no_grad():
            for p in model.parameters():  # spread the logits so greedy choices are not near-ties
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        model.save_pretrained(src)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tiny_model / f, src / f)
        build = Path(__file__).with_name("gguf_build.py")
        for preset in ("F32", "Q8_0"):
            dst = src.parent / preset
            run_script(build, src, dst, preset)
            out.setdefault(name, {})[preset] = dst / "model.gguf"
    return out


def _worst(runner, oracle_logits, prompts) -> float:  # type: ignore[no-untyped-def]
    return max(
        (_forward(runner, p) - t).abs().max().item() / (t.max() - t.min()).item()
        for p, t in zip(prompts, oracle_logits, strict=True)
    )


@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
@pytest.mark.parametrize("preset", ["F32", "Q8_0"])
def test_qwen_files_compute_what_transformers_computes(name: str, preset: str, files) -> None:  # type: ignore[no-untyped-def]
    path = files[name][preset]
    oracle = torch.load(path.with_name("oracle.pt"))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    assert (
        runner.model_config.architecture == {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[name]
    )
    assert (runner.quant and runner.quant.scheme) == (None if preset == "F32" else "w8a16")
    assert _worst(runner, oracle["logits"], oracle["prompts"]) <= 1e-5
    if preset == "F32":  # and the source model's own
        assert _worst(runner, oracle["source_logits"], oracle["prompts"]) <= 1e-5
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [g.token_ids for g in llm.generate(oracle["prompts"][:6], params, use_tqdm=False)]
    assert got == oracle["greedy"]


def test_llama_3_1_rotary_scaling_from_rope_freqs(files) -> None:  # type: ignore[no-untyped-def]
    """transformers' GGUF loading leaves rope_freqs.weight out (its logits are not the source model's);
    ember applies it, and computes the source model's logits and greedy tokens."""
    path = files["llama3-rope"]["F32"]
    oracle = torch.load(path.with_name("oracle.pt"))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    factors = runner.model_config.rope_freq_factors
    assert factors is not None and min(factors) == 1.0 and max(factors) == LLAMA3_ROPE["factor"]
    assert any(1.0 < f < LLAMA3_ROPE["factor"] for f in factors)  # the blended band, too
    assert _worst(runner, oracle["source_logits"], oracle["prompts"]) <= 1e-5
    unscaled = max(
        (t - s).abs().max().item() / (s.max() - s.min()).item()
        for t, s in zip(oracle["logits"], oracle["source_logits"], strict=True)
    )
    assert unscaled > 1e-3  # what leaving the factors out costs: far above the bound
    source = AutoModelForCausalLM.from_pretrained(path.parent.parent / "model", dtype=torch.float32).eval()
    expected = hf_greedy(source, oracle["prompts"][:3], 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert [g.token_ids for g in llm.generate(oracle["prompts"][:3], params, use_tqdm=False)] == expected
