"""`SpecDecoder`: speculative decoding as one object the engine calls at fixed points of a step.

plan (ask the scheduler for lookahead slots) → propose (fill the granted slots) → the target's forward →
verify (the exact rejection rule over each request's 1 + k rows) → trim (give back the slots of rejected
proposals) → stats (vLLM's spec_decode counters and the adaptive controller's measurements).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ember_engine.model import kv_quant
from ember_engine.model.memory import kv_block_bytes
from ember_engine.model.model_config import ModelConfig, resolve_dtype
from ember_engine.model.model_runner import ModelRunner
from ember_engine.sample.grammar import mask_draft_rows
from ember_engine.sample.mask_prefetch import MaskPrefetcher
from ember_engine.sample.rejection_sampler import rejection_sample
from ember_engine.sample.sampler import sample_probs, sampling_probs
from ember_engine.spec.proposers import DraftProposer, NgramProposer
from ember_engine.spec.spec_control import SpecController, updated_acceptance

if TYPE_CHECKING:
    from ember_engine.core.block_manager import BlockManager
    from ember_engine.core.config import EngineConfig
    from ember_engine.core.request import Request
    from ember_engine.core.scheduler import SchedulerOutput


@dataclass(slots=True)
class SpecStats:
    """Speculative decoding totals (vLLM's spec_decode counters)."""

    num_drafts: int = 0  # verifications of a request's proposals
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # accepted at proposal position j

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted_length(self) -> float | None:
        """Tokens a verification yields on average: the accepted proposals and the one sampled after."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def copy(self) -> SpecStats:
        return SpecStats(
            self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens, list(self.accepted_per_position)
        )


def _seeded_winners(target: torch.Tensor, requests: list[Request], seeded: list[bool]) -> torch.Tensor:
    """`target` with each seeded request's rows made one-hot on their exponential-race winner, drawn with
    the noise of the row's output position."""
    rows: list[int] = []
    seeds: list[int | None] = []
    gens: list[torch.Generator | None] = []
    start = 0
    for req, is_seeded in zip(requests, seeded, strict=True):
        n = 1 + len(req.spec_token_ids)
        if is_seeded:
            rows.extend(range(start, start + n))
            seeds.extend(req.noise_seed(j) for j in range(n))
            gens.extend([req.generator] * n)
        start += n
    index = torch.tensor(rows, device=target.device)
    winners = sample_probs(target.index_select(0, index), gens, seeds)
    one_hot = torch.nn.functional.one_hot(winners, target.shape[1]).to(target.dtype)
    return target.index_copy(0, index, one_hot)


def _tokenizer_data(path: Path) -> object:
    """A tokenizer.json's content, less its format version and its truncation and padding (the draft
    never encodes text)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(data, dict):
        for key in ("version", "truncation", "padding"):
            data.pop(key, None)
    return data


def draft_model_config(config: EngineConfig, target: ModelConfig, max_model_len: int) -> ModelConfig:
    """The draft model's config, checked against the target's: same vocabulary and tokenizer, room for
    every position the target may reach."""
    directory = str(config.draft_model)
    draft = ModelConfig.from_dir(directory)
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft_model: vocabulary size {draft.vocab_size} differs from the target's "
            f"{target.vocab_size}; the draft must share the target's tokenizer"
        )
    ours, theirs = (
        Path(config.tokenizer or config.model) / "tokenizer.json",
        Path(directory) / "tokenizer.json",
    )
    # Compared as data (vocabulary and ids, merges, added tokens, normalizer, pre-tokenizer...), not as
    # bytes: the same tokenizer saved with other whitespace or key order is the same tokenizer.
    if ours.exists() and theirs.exists() and _tokenizer_data(ours) != _tokenizer_data(theirs):
        raise ValueError("draft_model: its tokenizer.json differs from the target's")
    if draft.max_model_len(None) < max_model_len:
        raise ValueError(
            f"draft_model: it runs sequences of up to {draft.max_model_len(None)} tokens (max_position_embeddings"
            f" {draft.max_position_embeddings}, sliding_window {draft.sliding_window}), below max_model_len "
            f"{max_model_len}; lower max_model_len"
        )
    return draft


def draft_cache_bytes(config: EngineConfig, draft: ModelConfig) -> tuple[int, int]:
    """What a draft model adds to the memory plan: KV bytes per block, and its weights' bytes."""
    kv_dtype = kv_quant.cache_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype, draft))
    per_block = kv_block_bytes(draft, kv_dtype, config.block_size)
    weights = sum(f.stat().st_size for f in Path(str(config.draft_model)).glob("*.safetensors"))
    return per_block, weights


class SpecDecoder:
    def __init__(self, proposer: DraftProposer | NgramProposer, config: EngineConfig, max_model_len: int):
        self.proposer = proposer
        self.num_speculative_tokens = config.speculative_tokens
        self.controller = SpecController(config.speculative_tokens, config.adaptive)
        self.max_model_len = max_model_len
        self.stats = SpecStats(accepted_per_position=[0] * config.speculative_tokens)

    @classmethod
    def build(
        cls,
        config: EngineConfig,
        draft_config: ModelConfig | None,
        max_model_len: int,
        num_blocks: int,
    ) -> SpecDecoder | None:
        """The decoder the configuration asks for (None when speculation is off). A draft model's KV cache
        has the target's block count, so the block manager's tables serve both."""
        proposer: DraftProposer | NgramProposer
        if draft_config is not None:
            runner = ModelRunner(
                config, draft_config, max_model_len, config.draft_model, num_blocks=num_blocks
            )
            proposer = DraftProposer(runner)
        elif config.speculation == "ngram":
            proposer = NgramProposer(*config.ngram_range)
        else:
            return None
        return cls(proposer, config, max_model_len)

    @property
    def enabled(self) -> bool:
        return self.controller.enabled

    # -- before the forward ---------------------------------------------------------------------------

    def plan(self, running: list[Request]) -> bool:
        """Set each running request's lookahead for the scheduler; False when not speculating this step."""
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        k = self.controller.lookahead(decoding)
        for req in running:
            req.spec_lookahead = self._request_lookahead(req, k) if k else 0
        return k > 0

    def _request_lookahead(self, req: Request, k: int) -> int:
        p = req.params
        # Verification samples every position from the same distribution, so position-dependent sampling
        # (penalties, min_tokens' suppression, bad words), logit biases, allowed tokens and per-token
        # logprobs stay on the plain path.
        if p.logprobs is not None or p.penalized or p.logit_bias or p.allowed_token_ids or p.bad_words:
            return 0
        if req.num_output_tokens < p.min_tokens:
            return 0
        k = self.controller.request_lookahead(k, req.recent_acceptance, req.num_draft_tokens)
        # Room for k proposals and the token after them, within max_tokens and the model length.
        room = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
        return max(0, min(k, room))

    def propose(self, batch: SchedulerOutput) -> list[Request]:
        """Fill in proposals for the requests the scheduler gave lookahead slots, and shrink each one's
        scheduled tokens to what was proposed; returns those requests."""
        granted = [
            (i, req, n - 1)
            for i, (req, n) in enumerate(zip(batch.requests, batch.num_tokens, strict=True))
            if req.num_tokens - req.num_computed_tokens == 1 and n > 1
        ]
        if not granted:
            return []
        self.proposer.propose([(req, k) for _, req, k in granted])
        for i, req, _ in granted:
            batch.num_tokens[i] = 1 + len(req.spec_token_ids)
        return [req for _, req, _ in granted]

    # -- after the forward ----------------------------------------------------------------------------

    def verify(
        self, logits: torch.Tensor, requests: list[Request], prefetched: MaskPrefetcher | None = None
    ) -> list[list[int]]:
        """The exact rejection rule over each request's 1 + k rows of target logits: each request's kept
        proposals and the token sampled after them. Records acceptance. `prefetched`: where the rows'
        grammar masks were started before the forward pass."""
        row_params = [r.params for r in requests for _ in range(1 + len(r.spec_token_ids))]
        dev = logits.device
        # Structured output: a proposal the grammar forbids has probability 0 and so is rejected.
        masks = None if prefetched is None else prefetched.verifying(requests)
        if masks is not None:
            logits = masks.apply(logits)
        else:
            logits = mask_draft_rows(
                logits, [r.grammar for r in requests], [r.spec_token_ids for r in requests]
            )
        greedy_rows = [i for i, p in enumerate(row_params) if p.greedy]
        random_rows = [i for i, p in enumerate(row_params) if not p.greedy]
        if not random_rows:
            target = logits  # greedy verification reads only the argmax
        else:
            target = torch.zeros_like(logits)
            if greedy_rows:
                index = torch.tensor(greedy_rows, device=dev)
                target[index, logits[index].argmax(dim=-1)] = 1.0
            index = torch.tensor(random_rows, device=dev)
            target[index] = sampling_probs(logits[index], [row_params[i] for i in random_rows])
        draft_probs = None
        if any(r.draft_probs is not None for r in requests):
            # A request without q (its proposals were certain) gets one-hot rows on its proposals.
            vocab = logits.shape[1]
            parts = []
            for r in requests:
                if r.draft_probs is not None:
                    parts.append(r.draft_probs)
                else:
                    ids = torch.tensor(r.spec_token_ids, device=dev)
                    parts.append(torch.nn.functional.one_hot(ids, vocab).to(logits.dtype))
            draft_probs = torch.cat(parts)
        # A seeded sampled request is verified like a greedy one, against the token its own position-keyed
        # noise picks from p at each row: the rows' winners are exactly what plain sampling would emit.
        seeded = [not r.params.greedy and r.seed is not None for r in requests]
        if any(seeded):
            target = _seeded_winners(target, requests, seeded)
        kept = rejection_sample(
            target,
            [r.spec_token_ids for r in requests],
            draft_probs,
            [r.params.greedy or s for r, s in zip(requests, seeded, strict=True)],
            [None if s else r.generator for r, s in zip(requests, seeded, strict=True)],
        )
        for req, tokens in zip(requests, kept, strict=True):
            self._record_acceptance(req, len(tokens) - 1)
        return kept

    def _record_acceptance(self, req: Request, accepted: int) -> None:
        drafted = len(req.spec_token_ids)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        req.recent_acceptance = updated_acceptance(req.recent_acceptance, drafted, accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_position[j] += 1

    def trim(self, proposed: list[Request], block_manager: BlockManager) -> None:
        """Forget the step's proposals; the slots of rejected ones go back to the free queue's front."""
        for req in proposed:
            req.spec_token_ids, req.draft_probs = [], None
            if not req.finished:
                block_manager.trim(req, req.num_tokens)

    def record_step(self, batch_size: int, spec_ran: bool, tokens: int, seconds: float) -> None:
        """A step in which every request was decoding: the adaptive controller's measurement."""
        self.controller.record(batch_size, spec_ran, tokens, seconds)

    def reset(self) -> None:
        """Forget warm-up traffic: counters to zero and the controller's measurements (first-call costs)."""
        self.stats = SpecStats(accepted_per_position=[0] * self.num_speculative_tokens)
        self.controller.buckets.clear()
