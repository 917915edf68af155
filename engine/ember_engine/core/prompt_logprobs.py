"""Prompt logprobs (`SamplingParams.prompt_logprobs`, vLLM's field; completions' `echo` with `logprobs`):
each prompt token's logprob under the model given the tokens before it, its rank, and the top k, from the
logits a prefill computes at every position of the prompt.

Only a prompt's first sample collects them (its siblings share the prompt). A request that still needs
them reads nothing from the prefix cache (a cached block's positions would not be computed, so their
logits would not exist), as vLLM skips the cache for such requests; it still registers its blocks for
others. Its prefill chunks want logits at every position: position p's row gives token p + 1's entry, and
the row at the last prompt token is the one sampled. A request preempted before its prefill ended is
computed again from the start, and the entries it already has are kept, not made twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ember_engine.core.outputs import Logprob
from ember_engine.core.request import Request

# Rows turned into logprobs at a time: a chunk of a long prompt holds [tokens, vocab] float32 logits, and
# the softmax's temporaries are bounded by this many rows.
_ROWS_AT_A_TIME = 256


@dataclass(slots=True)
class PromptRows:
    """One chunk's rows of the step's logits that belong to its request's prompt logprobs."""

    request: Request
    first_row: int  # of the step's logits: the row at the chunk's first position
    start: int  # that position
    count: int  # rows giving prompt tokens start + 1 .. start + count


def prompt_rows(req: Request, start: int, num_tokens: int, first_row: int) -> PromptRows | None:
    """The rows a chunk of `num_tokens` tokens from position `start` gives the request's prompt
    logprobs (its logits are wanted at every position), or None where it gives none."""
    if not req.collecting_prompt_logprobs:
        return None
    end = min(start + num_tokens, req.num_prompt_tokens - 1)  # the last prompt token predicts no prompt token
    return PromptRows(req, first_row, start, end - start) if end > start else None


def record(
    logits: torch.Tensor, parts: Sequence[PromptRows], sampled: Sequence[Request], first_rows: Sequence[int]
) -> torch.Tensor | None:
    """Append each part's new entries (in position order) to its request's `prompt_logprobs`; returns
    the sampled requests' rows of `logits` (1 + its proposals' each, from `first_rows`), in their order,
    or None where none was sampled."""
    for part in parts:
        _record(logits, part)
    if not sampled:
        return None
    index = [
        r
        for req, first in zip(sampled, first_rows, strict=True)
        for r in range(first, first + 1 + len(req.spec_token_ids))
    ]
    return logits[torch.tensor(index, dtype=torch.long, device=logits.device)]


def _record(logits: torch.Tensor, part: PromptRows) -> None:
    req = part.request
    entries = req.prompt_logprobs
    assert entries is not None and len(entries) > part.start  # computed from the start: no gap
    skip = max(0, len(entries) - 1 - part.start)  # positions whose token already has its entry
    k = req.params.prompt_logprobs or 0
    for at in range(skip, part.count, _ROWS_AT_A_TIME):
        stop = min(at + _ROWS_AT_A_TIME, part.count)
        rows = logits[part.first_row + at : part.first_row + stop].log_softmax(dim=-1)
        tokens = torch.tensor(
            req.prompt_token_ids[part.start + at + 1 : part.start + stop + 1], device=rows.device
        )
        chosen = rows.gather(1, tokens.unsqueeze(1))
        ranks = (rows > chosen).sum(dim=1) + 1  # 1 + how many tokens are likelier
        columns = [tokens.double(), chosen.squeeze(1).double(), ranks.double()]
        width = min(k, rows.shape[1])
        if width:
            top_values, top_ids = rows.topk(width, dim=-1)
            columns += [top_ids.double().T, top_values.double().T]
        # one transfer: float64 holds every token id, rank and float32 logprob exactly
        packed = torch.cat([c.reshape(-1, stop - at) for c in columns]).T.tolist()
        for line in packed:
            top = [(int(line[3 + i]), line[3 + width + i]) for i in range(width)]
            entries.append(Logprob(int(line[0]), line[1], top, int(line[2])))
