"""FP8 KV-cache scales computed at load, for a checkpoint that carries none: one K and one V scale per
layer from a calibration forward, so that the cache's bytes depend on what the keys and values look like
relative to each other, not on their absolute size."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_greedy import PROMPTS

from ember_engine import LLM, SamplingParams
from ember_engine.model import kv_quant
from ember_engine.model.model_runner import Chunk

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def reparametrized(src: Path, dst: Path, k: float, v: float) -> Path:
    """The same function with keys `k` times and values `v` times as large: the query projection is divided
    by k (scores unchanged; RoPE is linear) and the output projection by v."""
    shutil.copytree(src, dst)
    t = load_file(str(src / "model.safetensors"))
    for name in list(t):
        for proj, factor in (("q_proj", 1 / k), ("k_proj", k), ("v_proj", v), ("o_proj", 1 / v)):
            if name.endswith(f"self_attn.{proj}.weight"):
                t[name] = t[name] * factor
    save_file(t, str(dst / "model.safetensors"))
    return dst


def logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    chunk = Chunk(list(range(-(-len(prompt) // llm.engine.runner.block_size))), 0, prompt, len(prompt))
    return llm.engine.runner.forward([chunk])


def stored_range(llm: LLM) -> tuple[float, float]:
    """The largest |stored E4M3 value| over the cache's K halves and over its V halves."""
    cache = llm.engine.runner.kv_cache.float().abs()
    return cache[0].max().item(), cache[1].max().item()


@pytest.mark.parametrize(("k", "v"), [(1000.0, 1e-3), (1e-3, 1000.0)])
def test_the_fp8_cache_is_indifferent_to_the_size_of_keys_and_values(
    tiny_model: Path, tmp_path: Path, k: float, v: float
) -> None:
    # Keys of thousands would saturate at ±448 and values of thousandths fall among E4M3's subnormals
    # (steps of 2^-9) with any fixed scale of the usual size; computed scales follow them.
    big = reparametrized(tiny_model, tmp_path / "m", k, v)
    prompts = PROMPTS[5:10]

    def error(llm: LLM, full: list[torch.Tensor]) -> float:
        """The mean |logit - full precision's| over the prompts' positions."""
        return sum(
            (logits(llm, p) - f).abs().mean().item() for p, f in zip(prompts, full, strict=True)
        ) / len(full)

    full = [logits(LLM(str(tiny_model)), p) for p in prompts]
    assert error(LLM(str(big)), full) < 1e-4  # the same function in full precision
    plain, scaled = LLM(str(tiny_model), kv_cache_dtype="fp8"), LLM(str(big), kv_cache_dtype="fp8")
    cost = error(plain, full)  # the cache's rounding, about 0.06 on this random-weight model
    assert 0 < cost < 0.1
    assert error(scaled, full) < 1.25 * cost
    layers = zip(
        plain.engine.runner.model.attention_layers(),
        scaled.engine.runner.model.attention_layers(),
        strict=True,
    )
    for a, b in layers:
        assert b.k_scale == pytest.approx(a.k_scale * k, rel=1e-2)
        assert b.v_scale == pytest.approx(a.v_scale * v, rel=1e-2)
    assert plain.generate(PROMPTS[:4], GREEDY, use_tqdm=False)[0].token_ids == (
        scaled.generate(PROMPTS[:4], GREEDY, use_tqdm=False)[0].token_ids
    )


def test_served_keys_and_values_use_the_range_without_saturating(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), kv_cache_dtype="fp8", enable_prefix_caching=False)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for top in stored_range(llm):
        # The calibration's largest value is stored at FP8_MAX / HEADROOM; served text stays well inside
        # the range and well above the subnormals (below 2^-6).
        assert kv_quant.FP8_MAX / kv_quant.KV_SCALE_HEADROOM / 4 < top < kv_quant.FP8_MAX


def test_computed_scales_are_the_same_on_every_load(tiny_model: Path) -> None:
    def scales(**options: object) -> list[tuple[float, float]]:
        llm = LLM(str(tiny_model), kv_cache_dtype="fp8", **options)
        return [(a.k_scale, a.v_scale) for a in llm.engine.runner.model.attention_layers()]

    first = scales()
    assert all(k != 1.0 and v != 1.0 for k, v in first)
    # Neither the engine's seed nor the cache's size nor the step's token budget enters, nor the longest
    # sequence: below the calibration's 32 tokens each of these cut its sequences short, and the scales
    # (so the bytes stored, and greedy text) moved.
    assert first == scales(seed=7) == scales(num_kv_blocks=3, max_num_batched_tokens=48)
    assert first == scales(max_num_batched_tokens=16) == scales(num_kv_blocks=1)
    assert first == scales(max_model_len=20) == scales(block_size=8, num_kv_blocks=3)


def test_the_model_dtype_cache_ignores_scales(tiny_model: Path) -> None:
    runner = LLM(str(tiny_model)).engine.runner
    assert all(a.k_scale == a.v_scale == 1.0 for a in runner.model.attention_layers())


def test_a_checkpoint_scale_is_kept_and_only_the_missing_one_computed(
    tiny_model: Path, tmp_path: Path
) -> None:
    shutil.copytree(tiny_model, tmp_path / "m")
    t = load_file(str(tiny_model / "model.safetensors"))
    layers = LLM(str(tiny_model), kv_cache_dtype="fp8").engine.runner.model.attention_layers()
    t.update({f"model.layers.{i}.self_attn.k_scale": torch.tensor(0.25 + i) for i in range(len(layers))})
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    partial = LLM(str(tmp_path / "m"), kv_cache_dtype="fp8").engine.runner.model.attention_layers()
    assert [a.k_scale for a in partial] == [0.25 + i for i in range(len(layers))]
    assert all(a.checkpoint_scales == {"k"} for a in partial)
    # Layer 0's values do not depend on any key scale: computed as without the checkpoint's.
    assert partial[0].v_scale == layers[0].v_scale != 1.0


def test_weights_that_give_no_finite_keys_are_refused(tiny_model: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_model, tmp_path / "m")
    t = load_file(str(tiny_model / "model.safetensors"))
    t["model.layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(t, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(
        ValueError, match=r"largest of an attention layer's keys is nan; the checkpoint's weights"
    ):
        LLM(str(tmp_path / "m"), kv_cache_dtype="fp8")
