"""The E5M2 KV cache (`kv_cache_dtype="fp8_e5m2"`, vLLM's name): the option, decoding and encoding every
byte as torch does, attention close to the full-precision cache's, and the engine's greedy output
unchanged by prefix caching, preemption, speculative decoding and the Triton path.
The Triton store against the torch path's bytes and attention over the cache against attention over its
dequantized values are in `test_fp8_kv_attention.py`, its quality on the trained pair in
`test_fp8_kv_engine.py`. Triton runs in its CPU interpreter here and compiled where a GPU is present."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl
from test_attention import MIXED, make_batch
from test_engine_greedy import GREEDY, PROMPTS

from ember_engine import LLM, SamplingParams
from ember_engine.model import kv_quant, triton_attention, triton_kv_store
from ember_engine.model.attention import paged_attention_reference, store_kv, store_kv_reference
from ember_engine.model.kernel_launch import launch
from ember_engine.model.memory import kv_block_bytes
from ember_engine.server import serve

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E5M2 = torch.float8_e5m2


@pytest.fixture
def use_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EMBER_ATTENTION", "triton")


def test_the_option_makes_an_e5m2_cache(tiny_model: Path) -> None:
    runner = LLM(str(tiny_model), kv_cache_dtype="fp8_e5m2", num_kv_blocks=16).engine.runner
    assert runner.kv_dtype == E5M2 == runner.kv_cache.dtype
    assert all(layer.k_cache.dtype == E5M2 for layer in runner.model.attention_layers())
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])
    assert serve.engine_config(args).kv_cache_dtype == "fp8_e5m2"


def test_the_cache_holds_as_many_blocks_as_e4m3(tiny_model: Path) -> None:
    memory = 3 << 20
    e4m3 = LLM(str(tiny_model), kv_cache_memory=memory, kv_cache_dtype="fp8").engine.runner
    e5m2 = LLM(str(tiny_model), kv_cache_memory=memory, kv_cache_dtype="fp8_e5m2").engine.runner
    assert (
        e5m2.block_bytes() == kv_block_bytes(e5m2.model_config, E5M2, e5m2.block_size) == e4m3.block_bytes()
    )
    assert e5m2.num_blocks == e4m3.num_blocks == memory // e5m2.block_bytes()


def test_reference_store_saturates_and_rounds_to_nearest_even() -> None:
    values = torch.tensor([1.0, 1.125, 1.375, 6e4, -6e4, 2.0**-17, 3 * 2.0**-17, 3.0])
    key = values.view(8, 1, 1)
    k_cache = torch.zeros(2, 4, 1, 1, dtype=E5M2)
    v_cache = torch.zeros(2, 4, 1, 1, dtype=E5M2)
    store_kv_reference(key, key * 2, k_cache, v_cache, torch.arange(8), k_scale=1.0, v_scale=2.0)
    # 1.125 lies halfway between 1.0 and 1.25 (even: 1.0); 1.375 between 1.25 and 1.5 (even: 1.5); 6e4
    # saturates at 57344 rather than becoming inf; 2**-17 is halfway between 0 and the smallest subnormal
    # 2**-16 (even: 0); 3 * 2**-17 rounds to 2 * 2**-16.
    expected = [1.0, 1.0, 1.5, 57344.0, -57344.0, 0.0, 2.0**-15, 3.0]
    assert k_cache.flatten().float().tolist() == expected
    assert v_cache.flatten().float().tolist() == expected  # values twice as large, scale 2


def test_triton_codecs_are_torch_for_every_byte_and_nan() -> None:
    @triton.jit
    def roundtrip(src_ptr, dst_ptr, enc_ptr):
        idx = tl.arange(0, 256)
        value = triton_kv_store.decode_e5m2(tl.load(src_ptr + idx))
        tl.store(dst_ptr + idx, value)
        tl.store(enc_ptr + idx, triton_kv_store.encode_e5m2(value))

    every = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(256, device=DEVICE)
    encoded = torch.empty(256, dtype=torch.uint8, device=DEVICE)
    launch(roundtrip, (1,), every, out, encoded)
    expected = every.view(E5M2).float()
    assert torch.equal(out.isnan(), expected.isnan())
    known = ~expected.isnan()
    assert torch.equal(out[known], expected[known])  # ±inf (0x7c, 0xfc) included
    assert torch.equal(out[known].signbit(), expected[known].signbit())
    # Finite values encode to their own byte; inf saturates; NaN becomes torch's NaN byte, sign kept.
    finite = expected.isfinite()
    assert torch.equal(encoded[finite], every[finite])
    assert encoded[0x7C].item() == 0x7B and encoded[0xFC].item() == 0xFB
    nan_bytes = out.isnan()
    assert torch.equal(encoded[nan_bytes], out[nan_bytes].to(E5M2).view(torch.uint8))


def test_e5m2_attention_stays_close_to_full_precision_and_further_than_e4m3(use_triton: None) -> None:
    """Unit-variance keys and values, scale 1: E5M2 keeps 2 mantissa bits (a relative error of at most
    2**-3 per element, E4M3's 2**-4); over the batch the largest error stays under 0.3 and the mean under
    0.04, and E5M2's mean error is larger than E4M3's."""
    full = make_batch(MIXED, block_size=16, head_dim=40, device=DEVICE, seed=5)
    store_kv(full.key, full.value, full.k_cache, full.v_cache, full.slot_mapping)
    expected = paged_attention_reference(*full.attention_args())[: full.num_tokens]
    mean_errors = {}
    for dtype in (E5M2, torch.float8_e4m3fn):
        b = make_batch(MIXED, block_size=16, head_dim=40, device=DEVICE, seed=5)
        b.k_cache, b.v_cache = (
            kv_quant.quantize(b.k_cache, 1.0, dtype),
            kv_quant.quantize(b.v_cache, 1.0, dtype),
        )
        store_kv(b.key, b.value, b.k_cache, b.v_cache, b.slot_mapping)
        triton_out = triton_attention.paged_attention(*b.attention_args())[: b.num_tokens]
        reference_out = paged_attention_reference(*b.attention_args())[: b.num_tokens]
        torch.testing.assert_close(triton_out, reference_out, atol=1e-4, rtol=1e-4)
        err = (triton_out - expected).abs()
        assert 0 < err.max().item() < 0.3
        mean_errors[dtype] = err.mean().item()
    assert mean_errors[torch.float8_e4m3fn] < mean_errors[E5M2] < 0.04


def greedy_e5m2(model: Path, prompts: list, params: SamplingParams = GREEDY, **options: object) -> tuple:
    llm = LLM(str(model), kv_cache_dtype="fp8_e5m2", **options)
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)], llm


def test_prefix_caching_and_preemption_leave_e5m2_output_unchanged(tiny_model: Path) -> None:
    reference = greedy_e5m2(tiny_model, PROMPTS, max_num_seqs=1, enable_prefix_caching=False)[0]
    llm = LLM(str(tiny_model), kv_cache_dtype="fp8_e5m2", max_num_seqs=1, num_kv_blocks=400)
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    hits = llm.engine.stats().prefix_cache_hits
    assert [list(o.token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    assert llm.engine.stats().prefix_cache_hits > hits > 0
    out, llm = greedy_e5m2(tiny_model, PROMPTS, num_kv_blocks=60, max_num_batched_tokens=256)
    assert out == reference and llm.engine.scheduler.num_preemptions > 0


def test_a_draft_model_shares_the_e5m2_cache_and_changes_nothing(tiny_model: Path) -> None:
    prompts = ["def fibonacci(n):", "x = 1\ny = 2\nx = 1\ny ="]
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    plain, _ = greedy_e5m2(tiny_model, prompts, params)
    out, llm = greedy_e5m2(
        tiny_model, prompts, params, draft_model=str(tiny_model), speculative_adaptive=False
    )
    assert out == plain
    stats = llm.engine.stats()
    assert stats.spec is not None and stats.spec.acceptance_rate == 1.0  # the target as its own draft
    assert llm.engine.spec.proposer.runner.kv_cache.dtype == E5M2  # type: ignore[union-attr]


def test_the_triton_path_gives_the_torch_path_output(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts, params = [PROMPTS[3], PROMPTS[8]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    monkeypatch.setenv("EMBER_ATTENTION", "torch")
    expected, _ = greedy_e5m2(tiny_model, prompts, params)
    monkeypatch.setenv("EMBER_ATTENTION", "triton")
    assert greedy_e5m2(tiny_model, prompts, params, max_model_len=256)[0] == expected
