"""The engine loop: admit requests, step the scheduler and model, turn tokens into outputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ember_engine.block_manager import BlockManager, PrefixCacheStats
from ember_engine.config import EngineConfig
from ember_engine.detokenizer import Detokenizer
from ember_engine.model_config import ModelConfig, resolve_dtype
from ember_engine.model_runner import ModelRunner, kv_block_bytes
from ember_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ember_engine.proposers import DraftProposer, NgramProposer
from ember_engine.rejection_sampler import rejection_sample
from ember_engine.request import Request
from ember_engine.sampler import Sampler, SamplingRow, make_generator, sampling_probs
from ember_engine.sampling_params import SamplingParams
from ember_engine.scheduler import Scheduler, SchedulerOutput
from ember_engine.spec_control import SpecController, updated_acceptance
from ember_engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sample:
    """One of a request's n samples, with its text state."""

    request: Request
    detok: Detokenizer
    logprobs: list[Logprob] | None
    emitted_tokens: int = 0


@dataclass(slots=True)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    pending: list[Request] = field(default_factory=list)  # siblings admitted after the first's prefill

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.request.finished for s in self.samples)


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


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    last_step_seconds: float  # wall time of the latest step
    last_batch_size: int  # requests in it
    last_batch_tokens: int  # tokens in it
    num_steps: int  # steps run so far
    spec: SpecStats | None = None  # a copy; None without speculative decoding
    spec_enabled: bool = False  # the adaptive controller's latest decision


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.model)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len: {config.max_model_len} exceeds the model's limit of {limit}")
        self.max_model_len = config.max_model_len or limit
        draft_config = self._draft_config() if config.speculation == "draft" else None
        extra_block_bytes = reserved = 0
        if draft_config is not None:
            extra_block_bytes = kv_block_bytes(
                draft_config, resolve_dtype(config.dtype, draft_config), config.block_size
            )
            reserved = sum(f.stat().st_size for f in Path(str(config.draft_model)).glob("*.safetensors"))
        self.runner = ModelRunner(
            config,
            self.model_config,
            self.max_model_len,
            extra_block_bytes=extra_block_bytes,
            reserved_bytes=reserved,
        )
        self.sampler = Sampler()
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.max_model_len:
            log.warning(
                "KV cache holds %d tokens; max_model_len lowered from %d", capacity, self.max_model_len
            )
            self.max_model_len = capacity
        self.proposer: DraftProposer | NgramProposer | None = None
        if draft_config is not None:
            draft_runner = ModelRunner(
                config,
                draft_config,
                self.max_model_len,
                config.draft_model,
                num_blocks=self.runner.num_blocks,
            )
            self.proposer = DraftProposer(draft_runner)
        elif config.speculation == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        self.spec_controller = (
            SpecController(config.num_speculative_tokens, config.speculative_adaptive)
            if self.proposer is not None
            else None
        )
        self.spec_stats = SpecStats(accepted_per_position=[0] * config.num_speculative_tokens)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy
        )
        self.groups: dict[str, _Group] = {}
        self._group_of: dict[Request, _Group] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self._last_step = (0.0, 0, 0)
        self.num_steps = 0

    def _draft_config(self) -> ModelConfig:
        """The draft model's config, checked against the target's: same vocabulary and tokenizer, room for
        every position the target may reach."""
        directory = str(self.config.draft_model)
        draft = ModelConfig.from_dir(directory)
        if draft.vocab_size != self.model_config.vocab_size:
            raise ValueError(
                f"draft_model: vocabulary size {draft.vocab_size} differs from the target's "
                f"{self.model_config.vocab_size}; the draft must share the target's tokenizer"
            )
        ours, theirs = Path(self.config.model) / "tokenizer.json", Path(directory) / "tokenizer.json"
        if ours.exists() and theirs.exists() and ours.read_bytes() != theirs.read_bytes():
            raise ValueError("draft_model: its tokenizer.json differs from the target's")
        if draft.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"draft_model: max_position_embeddings {draft.max_position_embeddings} is below "
                f"max_model_len {self.max_model_len}; lower max_model_len"
            )
        return draft

    # -- requests -------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request; raises ValueError (naming the field) for one that can never be served."""
        params = params or SamplingParams()
        params.validate()
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = self.check_prompt(token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples = []
        for i in range(params.n):
            req = Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                params=params,
                eos_token_ids=self.model_config.eos_token_ids,
                max_tokens=max_tokens,
                priority=priority,
                arrival_time=arrival,
                cache_salt=cache_salt,
                generator=(
                    None
                    if params.seed is None
                    else make_generator(_child_seed(params.seed, i), self.runner.device)
                ),
                parent_id=request_id,
                index=i,
            )
            detok = Detokenizer(self.tokenizer, token_ids, params)
            samples.append(_Sample(req, detok, [] if params.logprobs is not None else None))
        group = _Group(request_id, text, token_ids, samples)
        self.groups[request_id] = group
        for s in samples:
            self._group_of[s.request] = group
        # With a prefix cache, siblings wait for the first sample's prefill and then share its blocks.
        first, rest = samples[0].request, [s.request for s in samples[1:]]
        self.scheduler.add(first)
        if self.config.enable_prefix_caching:
            group.pending = rest
        else:
            for req in rest:
                self.scheduler.add(req)

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """The request's effective max_tokens; ValueError naming the field if it can never be served.
        Reads only configuration, so any thread may call it."""
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary (size {vocab})")
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within max_model_len {limit}")
        if params.max_tokens is None:
            return limit - n
        if n + params.max_tokens > limit:
            raise ValueError(
                f"max_tokens: prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len {limit}"
            )
        return params.max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (finish_reason "abort" for
        samples still running), or None if it is unknown or already done."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        group.pending.clear()
        for s in group.samples:
            self.scheduler.abort(s.request)
            self._group_of.pop(s.request, None)
        return self._make_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    # -- a step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an update for every request that produced text or finished."""
        start = time.perf_counter()
        speculate = self._plan_speculation()
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        all_decoding = True
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            all_decoding = all_decoding and req.num_tokens - req.num_computed_tokens == 1
        proposed = self._propose(batch) if speculate else []
        result = self.runner.execute(batch)
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            req.num_computed_tokens += n - len(req.spec_token_ids)
            self.block_manager.cache_full_blocks(req)
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        generated = self.generation_tokens
        if result.logits is not None:
            self._sample(result.logits, result.sampled, now, touched)
        for req in proposed:
            req.spec_token_ids, req.draft_probs = [], None
            if not req.finished:
                self.block_manager.trim(req, req.num_tokens)
        outputs = [self._make_output(g) for g in touched.values()]
        elapsed = time.perf_counter() - start
        self._last_step = (elapsed, len(batch), batch.total_tokens)
        self.num_steps += 1
        if self.spec_controller is not None and all_decoding:
            # A step in which nobody got proposals ran plainly, whatever the decision was.
            spec_ran = bool(proposed)
            self.spec_controller.record(len(batch), spec_ran, self.generation_tokens - generated, elapsed)
        for g in touched.values():
            if g.finished:
                self.groups.pop(g.request_id, None)
                for s in g.samples:
                    self._group_of.pop(s.request, None)
        return outputs

    def _sample(
        self, logits: torch.Tensor, sampled: list[Request], now: float, touched: dict[str, _Group]
    ) -> None:
        """Turn the step's logits into tokens: plain sampling for requests without proposals (one row each),
        verification for the others (1 + proposals rows each)."""
        plain_rows: list[int] = []
        spec_rows: list[int] = []
        plain: list[Request] = []
        spec: list[Request] = []
        row = 0
        for req in sampled:
            n = 1 + len(req.spec_token_ids)
            if n == 1:
                plain_rows.append(row)
                plain.append(req)
            else:
                spec_rows.extend(range(row, row + n))
                spec.append(req)
            row += n
        if plain:
            rows = logits if not spec else logits[torch.tensor(plain_rows, device=logits.device)]
            # The rows read each request's output so far (penalties, min_tokens): this step's token is
            # appended only after sampling.
            out = self.sampler(rows, [self._sampling_row(r) for r in plain])
            for k, req in enumerate(plain):
                sample = self._sample_of(req)
                if sample.logprobs is not None and out.logprobs is not None and out.top_logprobs is not None:
                    sample.logprobs.append(Logprob(out.token_ids[k], out.logprobs[k], out.top_logprobs[k]))
                self._emit(req, [out.token_ids[k]], 0, now, touched)
        if spec:
            rows = logits if not plain else logits[torch.tensor(spec_rows, device=logits.device)]
            for req, tokens in zip(spec, self._verify(rows, spec), strict=True):
                self._record_acceptance(req, len(tokens) - 1)
                self._emit(req, tokens, len(tokens) - 1, now, touched)

    def _sample_of(self, req: Request) -> _Sample:
        return self._group_of[req].samples[req.index]

    def _emit(
        self, req: Request, tokens: list[int], num_accepted: int, now: float, touched: dict[str, _Group]
    ) -> None:
        """Append a request's new tokens, the first `num_accepted` of them verified proposals whose KV the
        step already wrote; stops early when one of them ends the request."""
        group = self._group_of[req]
        sample = group.samples[req.index]
        for j, token in enumerate(tokens):
            self._append_token(req, sample, token, now)
            if req.finished:
                break
            if j < num_accepted:
                req.num_computed_tokens += 1
        if not req.finished:
            if num_accepted:
                self.block_manager.cache_full_blocks(req)
            # The draft's KV past the accepted tokens belongs to rejected proposals.
            req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
        touched[group.request_id] = group
        if group.pending and req.index == 0:
            for sibling in group.pending:
                self.scheduler.add(sibling, front=True)
            group.pending = []

    # -- speculative decoding -------------------------------------------------------------------------

    def _plan_speculation(self) -> bool:
        """Ask the scheduler for lookahead slots for this step's decodes; False when not speculating."""
        if self.spec_controller is None:
            return False
        running = self.scheduler.running
        decoding = sum(1 for r in running if r.num_tokens - r.num_computed_tokens == 1)
        k = self.spec_controller.lookahead(decoding)
        for req in running:
            req.spec_lookahead = self._request_lookahead(req, k) if k else 0
        return k > 0

    def _request_lookahead(self, req: Request, k: int) -> int:
        p = req.params
        # Verification samples every position from the same distribution, so position-dependent sampling
        # (penalties, min_tokens' suppression) and per-token logprobs stay on the plain path.
        if p.logprobs is not None or p.penalized or req.num_output_tokens < p.min_tokens:
            return 0
        assert self.spec_controller is not None
        k = self.spec_controller.request_lookahead(k, req.recent_acceptance, req.num_draft_tokens)
        # Room for k proposals and the token after them, within max_tokens and the model length.
        room = min(req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens)
        return max(0, min(k, room))

    def _propose(self, batch: SchedulerOutput) -> list[Request]:
        """Fill in proposals for the requests given lookahead slots; returns those requests."""
        granted = [
            (i, req, n - 1)
            for i, (req, n) in enumerate(zip(batch.requests, batch.num_tokens, strict=True))
            if req.num_tokens - req.num_computed_tokens == 1 and n > 1
        ]
        if not granted:
            return []
        assert self.proposer is not None
        self.proposer.propose([(req, k) for _, req, k in granted])
        for i, req, _ in granted:
            batch.num_tokens[i] = 1 + len(req.spec_token_ids)
        return [req for _, req, _ in granted]

    def _verify(self, logits: torch.Tensor, requests: list[Request]) -> list[list[int]]:
        """The exact rejection rule over each request's 1 + k rows of target logits."""
        row_params = [r.params for r in requests for _ in range(1 + len(r.spec_token_ids))]
        dev = logits.device
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
        return rejection_sample(
            target,
            [r.spec_token_ids for r in requests],
            draft_probs,
            [r.params.greedy for r in requests],
            [r.generator for r in requests],
        )

    def _record_acceptance(self, req: Request, accepted: int) -> None:
        drafted = len(req.spec_token_ids)
        req.num_draft_tokens += drafted
        req.num_accepted_tokens += accepted
        req.recent_acceptance = updated_acceptance(req.recent_acceptance, drafted, accepted)
        s = self.spec_stats
        s.num_drafts += 1
        s.num_draft_tokens += drafted
        s.num_accepted_tokens += accepted
        for j in range(accepted):
            s.accepted_per_position[j] += 1

    def _sampling_row(self, req: Request) -> SamplingRow:
        p = req.params
        suppress: list[int] = []
        if req.num_output_tokens < p.min_tokens:
            suppress = [*p.stop_token_ids, *([] if p.ignore_eos else req.eos_token_ids)]
        return SamplingRow(p, req.prompt_token_ids, req.output_token_ids, req.generator, suppress)

    def _append_token(self, req: Request, sample: _Sample, token: int, now: float) -> None:
        req.all_token_ids.append(token)
        self.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            self.prompt_tokens += req.num_prompt_tokens
        req.last_token_time = now
        p = req.params
        # Below min_tokens nothing may end the request (the sampler already kept EOS and stop ids out).
        may_stop = req.num_output_tokens >= p.min_tokens
        reason: str | None = None
        if may_stop and token in p.stop_token_ids:
            reason, req.stop_reason = "stop", token
        elif may_stop and not p.ignore_eos and token in req.eos_token_ids:
            reason = "stop"
        else:
            stop = sample.detok.append(token, detect_stop=may_stop)
            if stop is not None:
                reason, req.stop_reason = "stop", stop
            elif req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
        if reason is not None:
            sample.detok.flush()
            self.scheduler.finish(req, reason)

    def _make_output(self, group: _Group) -> RequestOutput:
        outs = []
        for s in group.samples:
            req = s.request
            new_ids = req.output_token_ids[s.emitted_tokens :]
            s.emitted_tokens = req.num_output_tokens
            outs.append(
                CompletionOutput(
                    index=req.index,
                    text=s.detok.text,
                    token_ids=req.output_token_ids,
                    delta_text=s.detok.take_delta(req.finished),
                    delta_token_ids=new_ids,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    logprobs=s.logprobs,
                )
            )
        first = group.samples[0].request
        metrics = RequestMetrics(
            arrival_time=first.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=first.first_token_time,
            last_token_time=first.last_token_time,
            num_prompt_tokens=first.num_prompt_tokens,
            num_generation_tokens=sum(s.request.num_output_tokens for s in group.samples),
            num_cached_tokens=first.num_prompt_cached_tokens,
            num_preemptions=sum(s.request.num_preemptions for s in group.samples),
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            outputs=outs,
            finished=group.finished,
            num_cached_tokens=first.num_prompt_cached_tokens,
            metrics=metrics,
        )

    def reset_counters(self) -> None:
        """Forget warm-up traffic: counters to zero, prefix cache emptied."""
        self.prompt_tokens = self.generation_tokens = 0
        self.scheduler.num_preemptions = 0
        self.block_manager.reset_prefix_cache()
        self.block_manager.stats = PrefixCacheStats()
        self.spec_stats = SpecStats(accepted_per_position=[0] * self.config.num_speculative_tokens)
        if self.spec_controller is not None:
            self.spec_controller.buckets.clear()  # warm-up steps carry first-call costs

    def stats(self) -> EngineStats:
        bm, s = self.block_manager, self.spec_stats
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage,
            num_kv_blocks=bm.num_blocks,
            prefix_cache_queries=bm.stats.queries,
            prefix_cache_hits=bm.stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens,
            last_step_seconds=self._last_step[0],
            last_batch_size=self._last_step[1],
            last_batch_tokens=self._last_step[2],
            num_steps=self.num_steps,
            spec=None
            if self.spec_controller is None
            else SpecStats(
                s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position)
            ),
            spec_enabled=self.spec_controller is not None and self.spec_controller.enabled,
        )


def _child_seed(seed: int, index: int) -> int:
    # Distinct, reproducible streams for the n samples of one seeded request.
    return (seed + index * 0x9E3779B1) % (1 << 63)
