"""The FP8 KV cache in the engine: the option and its refusal, the cache's size at a fixed memory,
scales from a checkpoint llm-compressor wrote, and prefix caching, preemption and speculative decoding
leaving greedy output unchanged with the same FP8 cache."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_engine_greedy import GREEDY, PROMPTS

from ember_engine import LLM, SamplingParams
from ember_engine.model.memory import kv_block_bytes
from ember_engine.model.model_runner import Chunk
from ember_engine.server import serve

FP8 = torch.float8_e4m3fn


def greedy_fp8(model: Path, prompts: list, params: SamplingParams = GREEDY, **options: object) -> tuple:
    llm = LLM(str(model), kv_cache_dtype="fp8", **options)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.token_ids) for o in outs], llm


@pytest.fixture(scope="module")
def fp8_reference(tiny_model: Path) -> list[list[int]]:
    """One request at a time, no prefix cache, no preemption."""
    return greedy_fp8(tiny_model, PROMPTS, max_num_seqs=1, enable_prefix_caching=False)[0]


def test_an_unknown_kv_cache_dtype_is_refused_by_name(tiny_model: Path) -> None:
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype: unsupported 'int8'; supported: auto, fp8, fp8_e4m3, fp8_e5m2$"
    ):
        LLM(str(tiny_model), kv_cache_dtype="int8")
    # vLLM's name for the E4M3 cache
    assert (
        LLM(str(tiny_model), kv_cache_dtype="fp8_e4m3", num_kv_blocks=16).engine.runner.kv_dtype
        == torch.float8_e4m3fn
    )


def test_the_serve_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8"])
    assert serve.engine_config(args).kv_cache_dtype == "fp8"
    assert serve.engine_config(parser.parse_args(["--model", "m"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "m", "--kv-cache-dtype", "e5m2"])
    err = capsys.readouterr().err
    assert re.search(
        r"--kv-cache-dtype: invalid choice: 'e5m2' \(choose from '?auto'?, '?fp8'?, '?fp8_e4m3'?, '?fp8_e5m2'?\)",
        err,
    ), err


@pytest.mark.parametrize(("dtype", "ratio"), [("float32", 4), ("bfloat16", 2)])
def test_the_fp8_cache_holds_more_blocks_in_the_same_memory(tiny_model: Path, dtype: str, ratio: int) -> None:
    memory = 3 << 20
    full = LLM(str(tiny_model), dtype=dtype, kv_cache_memory=memory).engine.runner
    fp8 = LLM(str(tiny_model), dtype=dtype, kv_cache_memory=memory, kv_cache_dtype="fp8").engine.runner
    assert full.kv_cache.dtype == getattr(torch, dtype) and fp8.kv_cache.dtype == FP8
    per_block = kv_block_bytes(fp8.model_config, FP8, fp8.block_size)
    assert fp8.block_bytes() == per_block and full.block_bytes() == ratio * per_block
    assert fp8.num_blocks == memory // per_block
    assert fp8.num_blocks >= ratio * full.num_blocks
    assert fp8.kv_cache.numel() * fp8.kv_cache.element_size() <= memory
    assert all(layer.k_cache.dtype == FP8 for layer in fp8.model.attention_layers())


def test_prefix_cache_hits_leave_fp8_output_unchanged(tiny_model: Path, fp8_reference: list) -> None:
    llm = LLM(str(tiny_model), kv_cache_dtype="fp8", max_num_seqs=1, num_kv_blocks=400)
    first = [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    hits = llm.engine.stats().prefix_cache_hits
    assert hits > 0
    again = [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert llm.engine.stats().prefix_cache_hits > hits
    assert first == again == fp8_reference


def test_preemption_leaves_fp8_output_unchanged(tiny_model: Path, fp8_reference: list) -> None:
    out, llm = greedy_fp8(tiny_model, PROMPTS, num_kv_blocks=60, max_num_batched_tokens=256)
    assert out == fp8_reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.usage == 0.0


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_speculative_decoding_leaves_fp8_output_unchanged(tiny_model: Path, method: str) -> None:
    prompts = [
        "def fibonacci(n):",
        "import os\nimport sys\nimport os\nimport sys\n",
        "x = 1\ny = 2\nx = 1\ny =",
    ]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain, _ = greedy_fp8(tiny_model, prompts, params)
    options: dict = {"draft_model": str(tiny_model)} if method == "draft" else {"speculative_method": "ngram"}
    # A small cache: requests are also preempted and recomputed, proposals' slots included.
    out, llm = greedy_fp8(tiny_model, prompts, params, speculative_adaptive=False, num_kv_blocks=8, **options)
    assert out == plain
    stats = llm.engine.stats()
    assert stats.spec is not None and stats.spec.num_drafts > 0
    assert stats.num_preemptions > 0
    if method == "draft":
        assert stats.spec.acceptance_rate == 1.0  # the target as its own draft, both caches FP8
        draft_runner = llm.engine.spec.proposer.runner  # type: ignore[union-attr]
        assert draft_runner.kv_cache.dtype == FP8


def test_the_triton_path_gives_the_torch_path_output(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, params = [PROMPTS[3], PROMPTS[8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("EMBER_ATTENTION", "torch")  # named: on a GPU the default is already Triton
    expected, _ = greedy_fp8(tiny_model, prompts, params)
    monkeypatch.setenv("EMBER_ATTENTION", "triton")
    assert greedy_fp8(tiny_model, prompts, params, max_model_len=256)[0] == expected


def test_scales_come_from_an_llm_compressor_checkpoint(quantized_model: Callable[..., Path]) -> None:
    path = quantized_model("tiny", "FP8_KV", "kv_scales_build.py")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = [name for name in f.keys() if name.endswith(("k_scale", "v_scale"))]  # noqa: SIM118
        scales = {name: float(f.get_tensor(name)) for name in names}
    llm = greedy_fp8(path, PROMPTS[:6])[1]
    layers = llm.engine.runner.model.attention_layers()
    assert len(scales) == 2 * len(layers)
    for i, layer in enumerate(layers):
        assert layer.k_scale == scales[f"model.layers.{i}.self_attn.k_scale"] != 1.0
        assert layer.v_scale == scales[f"model.layers.{i}.self_attn.v_scale"] != 1.0
    # The same checkpoint with the cache in the model's dtype: next-token logits over a 380-token prompt
    # differ only by the cache's rounding (measured: at most 4.3 % of the logits' range on this
    # random-weight model).
    auto = LLM(str(path)).engine.runner
    assert auto.kv_cache.dtype == torch.float32
    prompt = PROMPTS[9]
    chunk = [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
    full, fp8 = auto.forward(chunk), llm.engine.runner.forward(chunk)
    assert full is not None and fp8 is not None
    err = (fp8 - full).abs().max().item() / (full.max() - full.min()).item()
    assert 0 < err < 0.08


@pytest.mark.parametrize(
    ("name", "value", "error"),
    [
        (
            "model.layers.0.self_attn.k_scale",
            torch.ones(4),
            r"supported: one scale per layer, or one per KV head",
        ),
        ("model.layers.1.self_attn.v_scale", torch.tensor(-1.0), r"must be a positive finite number"),
        ("model.layers.99.self_attn.k_scale", torch.tensor(0.5), r"no such attention layer"),
    ],
)
def test_bad_kv_scales_are_refused_by_name(
    tiny_model: Path, tmp_path: Path, name: str, value: torch.Tensor, error: str
) -> None:
    from safetensors.torch import load_file, save_file

    for f in tiny_model.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_model / "model.safetensors"))
    save_file({**tensors, name: value}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"{re.escape(repr(name))}.*{error}|{error}.*{re.escape(name)}"):
        LLM(str(tmp_path), kv_cache_dtype="fp8")


def test_a_kv_cache_only_checkpoint_runs_its_weights_unquantized(
    quantized_model: Callable[..., Path], tiny_model: Path, tmp_path: Path
) -> None:
    # llm-compressor's output for a recipe with only kv_cache_scheme: no config groups, format "dense".
    path = quantized_model("tiny", "KV", "kv_scales_build.py")
    config = json.loads((path / "config.json").read_text())
    assert config["quantization_config"]["config_groups"] == {}
    runner = LLM(str(path), kv_cache_dtype="fp8").engine.runner
    assert runner.quant is None and runner.kv_cache.dtype == FP8
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for i, layer in enumerate(runner.model.attention_layers()):
            assert layer.k_scale == float(f.get_tensor(f"model.layers.{i}.self_attn.k_scale"))
            assert layer.v_scale == float(f.get_tensor(f"model.layers.{i}.self_attn.v_scale"))
            assert layer.checkpoint_scales == {"k", "v"}
    # The weights are the plain model's.
    plain = LLM(str(tiny_model)).engine.runner.model.state_dict()
    assert all(torch.equal(t, plain[name]) for name, t in runner.model.state_dict().items())
    # A KV scheme whose scales an FP8 cache cannot use is refused by name.
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    config["quantization_config"]["kv_cache_scheme"]["strategy"] = "channel"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"kv_cache_scheme: float 8-bit, strategy 'channel'.*not supported.*'attn_head'"
    ):
        LLM(str(tmp_path), kv_cache_dtype="fp8")
    assert LLM(str(tmp_path)).engine.runner.kv_cache.dtype == torch.float32  # unused without an FP8 cache


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_the_trained_pair_keeps_its_quality_with_an_fp8_cache(kv_cache_dtype: str) -> None:
    """Teacher-forced over three 512-token windows of the packaged target's held-out text: perplexity
    within 1 % and the same next-token argmax at 97 % of positions or more (measured: E4M3 within 0.1 %,
    and 0.986 to 0.998; E5M2 within 0.2 %, and 0.980 to 0.988). Greedy 64-token agreement is measured by
    `ember bench quant` (README)."""
    from ember_engine.bench.quant import held_out
    from ember_engine.tools.spec_pair import packaged_pair

    target = packaged_pair()[0]
    text = held_out(target)
    windows = [text[start : start + 513] for start in (0, 5000, 20000)]

    def logits(**options: object) -> list[torch.Tensor]:
        runner = LLM(str(target), **options).engine.runner
        blocks = list(range(512 // runner.block_size))
        out = [runner.forward([Chunk(blocks, 0, w[:-1].tolist(), num_logits=512)]) for w in windows]
        return [x for x in out if x is not None]

    full, fp8 = logits(), logits(kv_cache_dtype=kv_cache_dtype)
    assert len(full) == len(fp8) == len(windows)
    for w, a, b in zip(windows, full, fp8, strict=True):
        nll_full = torch.nn.functional.cross_entropy(a, w[1:]).item()
        nll_fp8 = torch.nn.functional.cross_entropy(b, w[1:]).item()
        assert abs(nll_fp8 - nll_full) < 0.01  # perplexity ratio within e**±0.01
        assert (a.argmax(-1) == b.argmax(-1)).float().mean().item() >= 0.97
        assert not torch.equal(a, b)  # the cache really is quantized
