"""Greedy decoding is token-for-token identical to transformers' `generate` on the same checkpoint,
whatever the batching, chunking, prefix caching or preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams

MAX_NEW = 16
LENGTHS = [1, 2, 3, 7, 15, 16, 17, 31, 33, 64, 100, 129, 200, 257, 380, 500]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in LENGTHS]
    # Prompts sharing a long prefix (several full blocks) with each other and with an earlier prompt.
    shared = prompts[-1][:300]
    prompts += [shared + torch.randint(10, 4000, (n,), generator=g).tolist() for n in (5, 40, 77)]
    prompts.append(prompts[12][:150])  # a strict prefix of another prompt
    return prompts


PROMPTS = _prompts()


def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """A transformers model's greedy tokens after each prompt, one prompt at a time, `max_new` each
    whatever they are (no end-of-sequence stop)."""
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(
                torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0
            )
            out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    return hf_greedy(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), PROMPTS, MAX_NEW)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)

CASES = {
    "batch-1": dict(max_num_seqs=1),
    "batch-4": dict(max_num_seqs=4),
    "all-at-once": dict(max_num_seqs=256, max_num_batched_tokens=8192),
    "chunked-32": dict(max_num_batched_tokens=32),
    "chunked-100-block-8": dict(max_num_batched_tokens=100, block_size=8),
    "no-prefix-cache": dict(enable_prefix_caching=False),
}


@pytest.mark.parametrize("options", CASES.values(), ids=CASES.keys())
def test_matches_transformers(tiny_model: Path, reference: list[list[int]], options: dict) -> None:
    llm = LLM(str(tiny_model), **options)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)


def test_prefix_cache_hits_change_nothing(tiny_model: Path, reference: list[list[int]]) -> None:
    # Room for every prompt's blocks at once, so nothing is evicted between the two passes.
    llm = LLM(str(tiny_model), max_num_seqs=1, num_kv_blocks=400)
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0  # the shared-prefix prompts hit the first one's blocks
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == reference
    after = llm.engine.stats()
    # The second pass finds every prompt's full blocks (all but the last token must be computed).
    expected = sum(((len(p) - 1) // 16) * 16 for p in PROMPTS)
    assert after.prefix_cache_hits - stats.prefix_cache_hits == expected
    assert after.prefix_cache_queries - stats.prefix_cache_queries == sum(len(p) for p in PROMPTS)
    assert sum(o.num_cached_tokens for o in again) == expected


def test_preemption_keeps_output_exact(tiny_model: Path, reference: list[list[int]]) -> None:
    # 60 blocks of 16 tokens: far less than all requests need at once, so running ones get preempted.
    long_params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    llm = LLM(str(tiny_model), num_kv_blocks=60, max_num_batched_tokens=256)
    outs = llm.generate(PROMPTS, long_params, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.usage == 0.0  # everything released at the end
