"""Prompt logprobs (`SamplingParams.prompt_logprobs`): each prompt token's logprob, rank and the top k are
transformers' on the same checkpoint (log_softmax of its logits at the position before), whatever the
chunking, prefix caching (a request collecting them reads no cached block), samples per prompt or
preemption."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.core.outputs import Logprob, RequestOutput

K = 4
LENGTHS = [1, 2, 17, 40, 130, 300]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(99)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in LENGTHS]
    prompts.append([*prompts[-1][:200], 7, 8, 9])  # most of it a prefix another prompt cached
    return prompts


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[torch.Tensor]:
    """transformers' log-probabilities [len - 1, vocab]: row i is token i + 1's distribution."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.inference_mode():
        return [model(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in PROMPTS]


def _check(prompt: list[int], entries: list[Logprob | None] | None, theirs: torch.Tensor, k: int) -> None:
    assert entries is not None and len(entries) == len(prompt)
    assert entries[0] is None  # the first token has no tokens before it
    for i, entry in enumerate(entries[1:]):
        assert entry is not None
        row = theirs[i]
        assert entry.token_id == prompt[i + 1]
        assert abs(entry.logprob - row[prompt[i + 1]].item()) <= 1e-4, (i, entry.logprob)
        # rank and top k as transformers' (within float32 rounding: a near-tie may order either way)
        ranked = row.sort(descending=True).values
        assert entry.rank is not None and abs(ranked[entry.rank - 1] - row[prompt[i + 1]]) <= 1e-4
        assert len(entry.top) == k
        assert torch.allclose(torch.tensor([v for _, v in entry.top]).float(), ranked[:k], atol=1e-4)
        assert all(abs(row[t] - v) <= 1e-4 for t, v in entry.top)


@pytest.mark.parametrize(
    "options",
    [
        dict(),
        dict(max_num_batched_tokens=32),  # every long prompt in several chunks
        dict(max_num_batched_tokens=100, block_size=8, enable_prefix_caching=False),
        # proposals (the target as its own draft) after the prefill: the sampled rows follow the prompt's
        dict(max_num_batched_tokens=64, draft_model="TARGET", speculative_adaptive=False),
    ],
    ids=["whole", "chunked-32", "chunked-no-cache", "speculative"],
)
def test_prompt_logprobs_are_transformers(
    tiny_model: Path, reference: list[torch.Tensor], options: dict
) -> None:  # type: ignore[type-arg]
    options = {k: str(tiny_model) if v == "TARGET" else v for k, v in options.items()}
    llm = LLM(str(tiny_model), dtype="float32", **options)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    llm.generate(PROMPTS[-2:-1], SamplingParams(temperature=0.0, max_tokens=1))  # its prefix now cached
    outs = llm.generate(PROMPTS, params)
    for prompt, out, theirs in zip(PROMPTS, outs, reference, strict=True):
        _check(prompt, out.prompt_logprobs, theirs, K)
        assert out.num_cached_tokens == 0  # nothing read from the cache
    # Without the field: no prompt logprobs, and the cache is read again.
    plain = llm.generate(PROMPTS[-1:], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert plain[0].prompt_logprobs is None
    if options.get("enable_prefix_caching", True):
        assert plain[0].num_cached_tokens > 0
    # The generated tokens are those of the same request without prompt logprobs.
    again = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in again]


def test_each_sample_of_a_prompt_carries_the_prompt_s_logprobs(
    tiny_model: Path, reference: list[torch.Tensor]
) -> None:
    llm = LLM(str(tiny_model), dtype="float32")
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=4, prompt_logprobs=0)
    (out,) = llm.generate(PROMPTS[3:4], params)
    assert len(out.outputs) == 3
    _check(PROMPTS[3], out.prompt_logprobs, reference[3], 0)


def test_a_request_preempted_during_its_prefill_keeps_one_entry_per_token(
    tiny_model: Path, reference: list[torch.Tensor]
) -> None:
    """With too few KV blocks for every request at once, requests are preempted and computed again from
    the start: the entries they already had are neither lost nor made twice."""
    llm = LLM(str(tiny_model), dtype="float32", num_kv_blocks=40, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, prompt_logprobs=2)
    outs: list[RequestOutput] = llm.generate(PROMPTS * 2, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for prompt, out, theirs in zip(PROMPTS * 2, outs, reference * 2, strict=True):
        _check(prompt, out.prompt_logprobs, theirs, 2)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_out_of_range_are_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"^prompt_logprobs: must be an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_two_tensor_parallel_ranks_give_one_rank_s_prompt_logprobs(
    tiny_model: Path, reference: list[torch.Tensor]
) -> None:
    """Every rank computes the logits rows a chunk asks for (its share of the vocabulary), rank 0 gathers
    them: prompt logprobs with 2 ranks are transformers', in chunks too."""
    llm = LLM(str(tiny_model), dtype="float32", tensor_parallel_size=2, max_num_batched_tokens=64)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for prompt, out, theirs in zip(PROMPTS, outs, reference, strict=True):
        _check(prompt, out.prompt_logprobs, theirs, K)
