"""Speculative proposers: what a request's next few tokens probably are, for the target to verify.

Both fill `request.spec_token_ids` (at most the lookahead the scheduler granted) and `request.draft_probs`
(the distribution each proposal was drawn from, or None when proposals are certain, as with n-gram lookup).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ember_engine.core.request import Request
from ember_engine.model.model_runner import Chunk, ModelRunner
from ember_engine.sample.sampler import sample_probs, sampling_probs
from ember_engine.spec.ngram_proposer import TokenArray, propose_ngram


class NgramProposer:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's suffix."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        # Compile the search before serving (a sequence longer than min_n, so that the search runs).
        propose_ngram(TokenArray().update([1] * (max_n + 2)), 1, min_n, max_n)

    def propose(self, requests: Sequence[tuple[Request, int]]) -> None:
        for req, k in requests:
            if req.token_array is None:
                req.token_array = TokenArray()
            ids = req.token_array.update(req.all_token_ids)
            req.spec_token_ids = propose_ngram(ids, k, self.min_n, self.max_n)
            req.draft_probs = None


class DraftProposer:
    """A smaller model with the target's tokenizer, run autoregressively for k tokens per request.

    Its KV cache has as many blocks as the target's and is addressed through the same block tables, so the
    block manager's allocation, prefix sharing, rollback and preemption hold for both caches at once. The
    first forward catches the draft up on every known token it has not seen (the target's accepted tokens,
    or a whole prompt), the next k-1 feed back its own proposals.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def propose(self, requests: Sequence[tuple[Request, int]]) -> None:
        active = list(requests)
        for req, _ in active:
            req.spec_token_ids = []
        # Step 0: catch up and propose the first token; step j feeds proposal j-1 at its position.
        chunks = [
            Chunk(req.block_ids, req.num_draft_computed, req.all_token_ids[req.num_draft_computed :], 1)
            for req, _ in active
        ]
        q_rows: dict[Request, list[torch.Tensor]] = {req: [] for req, _ in active}
        while active:
            logits = self.runner.forward(chunks)
            assert logits is not None
            tokens, probs = self._sample(logits, [req for req, _ in active])
            still: list[tuple[Request, int]] = []
            for i, (req, k) in enumerate(active):
                req.spec_token_ids.append(tokens[i])
                if probs is not None:
                    q_rows[req].append(probs[i])
                if len(req.spec_token_ids) < k:
                    still.append((req, k))
            active = still
            chunks = [
                Chunk(req.block_ids, req.num_tokens + len(req.spec_token_ids) - 1, req.spec_token_ids[-1:], 1)
                for req, _ in active
            ]
        for req, _ in requests:
            # Every known token, and every proposal but the last, now has draft KV.
            req.num_draft_computed = req.num_tokens + len(req.spec_token_ids) - 1
            rows = q_rows[req]
            req.draft_probs = torch.stack(rows) if rows and not req.params.greedy else None

    def _sample(
        self, logits: torch.Tensor, requests: Sequence[Request]
    ) -> tuple[list[int], torch.Tensor | None]:
        """Greedy requests take the draft's argmax; others sample from the draft's own sampling
        distribution q (same temperature and truncation as the target's), which verification needs."""
        if all(r.params.greedy for r in requests):
            return logits.argmax(dim=-1).tolist(), None
        probs = sampling_probs(logits, [r.params for r in requests])
        # A greedy request's generator is left alone: its draws must not depend on speculation.
        # A seeded request draws its proposal with the noise of that output position, the noise the target
        # verifies it with: its tokens are then the ones plain sampling would pick.
        drawn = sample_probs(
            probs,
            [None if r.params.greedy else r.generator for r in requests],
            [r.noise_seed(len(r.spec_token_ids)) for r in requests],
        )
        tokens = torch.where(
            torch.tensor([r.params.greedy for r in requests], device=logits.device),
            logits.argmax(dim=-1),
            drawn,
        )
        return tokens.tolist(), probs
