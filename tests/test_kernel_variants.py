"""Triton kernel variants: the engine launches every attention variant it can reach while starting, so a
long mixed serving run (prefill chunks, decodes at changing batch sizes, speculative queries) launches no
variant for the first time, i.e. compiles nothing. Kernels run in Triton's interpreter on CPU; the
launcher's ledger computes Triton's specialization key for each launch. The n-gram search (numba) is
compiled while starting too, and serving adds no signature to it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ember_engine import LLM, SamplingParams
from ember_engine.model.kernel_launch import LEDGER
from ember_engine.spec import ngram_proposer


def _variants() -> int:
    return sum(len(v) for v in LEDGER.variants.values())


def _triton_cache_entries() -> int | None:
    """On a GPU, the kernels Triton really compiled (its per-device caches); None in the interpreter."""
    if not torch.cuda.is_available():
        return None
    from ember_engine.model import triton_attention as ta
    from ember_engine.model import triton_kv_store

    kernels = (ta._attention_kernel, ta._merge_splits_kernel, triton_kv_store._store_kv_kernel)
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


def test_a_long_mixed_run_compiles_nothing_after_warm_up(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_ATTENTION", "triton")
    llm = LLM(
        str(tiny_model),
        max_model_len=1024,
        max_num_seqs=6,
        max_num_batched_tokens=48,  # long prompts arrive in chunks beside decodes
        speculative_method="ngram",
        speculative_adaptive=False,
    )
    warmed, compiled = LEDGER.compiles, _triton_cache_entries()
    searches = list(ngram_proposer._latest_match_end.signatures)  # the n-gram search, compiled (numba)
    assert searches
    assert _variants() > 0
    merge = LEDGER.variants.get("_merge_splits_kernel", set())
    assert {dict(key)["SPLITS_P2"] for key in merge} >= {2, 4}  # split-KV merges at each power of two
    phrase = list(range(40, 52))
    prompts = [
        phrase * 3,
        [7, 9, 11],
        list(range(100, 190)),
        [5] * 20,
        phrase * 2 + [3],
        list(range(300, 305)),
    ]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 4, 12, 25, 9, 18)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [30, 4, 12, 25, 9, 18]
    # A second wave at another batch size, one request alone at the end.
    llm.generate([list(range(60, 75))], [SamplingParams(temperature=0.0, max_tokens=6)], use_tqdm=False)
    assert LEDGER.compiles == warmed, "kernel variants first launched while serving"
    assert list(ngram_proposer._latest_match_end.signatures) == searches
    assert _triton_cache_entries() == compiled
