"""The engine loop: admit requests, step the scheduler and model, turn tokens into outputs."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ember_engine.block_manager import BlockManager, PrefixCacheStats
from ember_engine.config import EngineConfig
from ember_engine.detokenizer import Detokenizer
from ember_engine.model_config import ModelConfig
from ember_engine.model_runner import ModelRunner
from ember_engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ember_engine.request import Request
from ember_engine.sampler import Sampler, SamplingRow, make_generator
from ember_engine.sampling_params import SamplingParams
from ember_engine.scheduler import Scheduler
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
        self.runner = ModelRunner(config, self.model_config, self.max_model_len)
        self.sampler = Sampler()
        capacity = self.runner.num_blocks * config.block_size
        if capacity < self.max_model_len:
            log.warning(
                "KV cache holds %d tokens; max_model_len lowered from %d", capacity, self.max_model_len
            )
            self.max_model_len = capacity
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
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        result = self.runner.execute(batch)
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            req.num_computed_tokens += n
            self.block_manager.cache_full_blocks(req)
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        if result.logits is not None:
            # The rows read each request's output so far (penalties, min_tokens): this step's token is
            # appended only after sampling.
            out = self.sampler(result.logits, [self._sampling_row(r) for r in result.sampled])
            for k, req in enumerate(result.sampled):
                group = self._group_of[req]
                sample = group.samples[req.index]
                if sample.logprobs is not None and out.logprobs is not None and out.top_logprobs is not None:
                    sample.logprobs.append(Logprob(out.token_ids[k], out.logprobs[k], out.top_logprobs[k]))
                self._append_token(req, sample, out.token_ids[k], now)
                touched[group.request_id] = group
                if group.pending and req.index == 0:
                    for sibling in group.pending:
                        self.scheduler.add(sibling, front=True)
                    group.pending = []
        outputs = [self._make_output(g) for g in touched.values()]
        self._last_step = (time.perf_counter() - start, len(batch), batch.total_tokens)
        self.num_steps += 1
        for g in touched.values():
            if g.finished:
                self.groups.pop(g.request_id, None)
                for s in g.samples:
                    self._group_of.pop(s.request, None)
        return outputs

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

    def stats(self) -> EngineStats:
        bm = self.block_manager
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
        )


def _child_seed(seed: int, index: int) -> int:
    # Distinct, reproducible streams for the n samples of one seeded request.
    return (seed + index * 0x9E3779B1) % (1 << 63)
