"""The plain (non-speculative) rows of a step: the persistent sampling state's view of the batch plus the
inputs that vary per step, gathered only for the rows they concern."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember_engine.core.outputs import Logprob
from ember_engine.core.request import Request
from ember_engine.sample.mask_prefetch import MaskPrefetcher
from ember_engine.sample.sampler import Sampler, SamplerOutput
from ember_engine.sample.sampling_state import SamplingState


def sample_plain(
    sampler: Sampler,
    state: SamplingState,
    logits: torch.Tensor,
    requests: Sequence[Request],
    prefetched: MaskPrefetcher | None = None,
) -> SamplerOutput:
    """One token per request (one row of `logits` each), read before this step's token is appended:
    min_tokens' suppression, the grammar states of structured-output rows, and each seeded row's noise seed
    (its output position's, the seed speculation would use for the same token). `prefetched`: the grammar
    masks started before the forward pass."""
    view = state.view(requests, Request.sampling_inputs)
    suppress = {i: ids for i in view.suppress_rows if (ids := requests[i].suppressed_token_ids())}
    grammars = {i: g for i in view.grammar_rows if (g := requests[i].grammar) is not None}
    seeds = {i: s for i in view.seeded_rows if (s := requests[i].noise_seed(0)) is not None}
    masks = None
    if prefetched is not None and grammars:
        masks = prefetched.masks([grammars.get(i) for i in range(len(requests))])
    return sampler.sample(logits, state, view, suppress, grammars, seeds, masks)


def row_logprob(out: SamplerOutput, row: int) -> Logprob | None:
    """The row's logprobs, when it asked for them."""
    if out.logprobs is None or out.top_logprobs is None or out.logprobs[row] is None:
        return None
    value = out.logprobs[row]
    assert value is not None
    return Logprob(out.token_ids[row], value, out.top_logprobs[row])
