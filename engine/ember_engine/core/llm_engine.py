"""The engine loop: admit requests, step the scheduler and model, turn tokens into outputs."""

from __future__ import annotations

import functools
import time
from collections.abc import Iterable

import torch

from ember_engine.core.block_manager import BlockManager, PrefixCacheStats
from ember_engine.core.config import EngineConfig
from ember_engine.core.output_processor import Group, OutputProcessor
from ember_engine.core.outputs import EngineStats, RequestOutput
from ember_engine.core.plain_sampling import row_logprob, sample_plain
from ember_engine.core.request import Request
from ember_engine.core.scheduler import Scheduler
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.distributed.workers import WorkerPool
from ember_engine.model.gguf import directory as gguf_dir
from ember_engine.model.lora import LoraSet, key_of, slot_of
from ember_engine.model.memory import fitted_max_model_len
from ember_engine.model.model_config import ModelConfig
from ember_engine.model.model_runner import ModelRunner
from ember_engine.model.parallel import SINGLE, check_tensor_parallel
from ember_engine.sample.grammar import GrammarCompiler
from ember_engine.sample.mask_prefetch import MaskPrefetcher, sampling_grammars
from ember_engine.sample.sampler import Sampler
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import SamplingState, upload_ids
from ember_engine.sample.seeds import child_seed, make_generator
from ember_engine.spec.decoder import SpecDecoder, draft_cache_bytes, draft_model_config


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = gguf_dir.describe(config)  # a .gguf model: the directory describing it
        self.model_config = ModelConfig.from_dir(config.model)
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        self.max_model_len = self.model_config.max_model_len(config.max_model_len)
        draft_config, extra_block_bytes, reserved = None, 0, 0
        if config.speculation == "draft":
            draft_config = draft_model_config(config, self.model_config, self.max_model_len)
            extra_block_bytes, reserved = draft_cache_bytes(config, draft_config)
        # Tensor parallelism: this process is rank 0 (scheduler, sampling, the draft model); the
        # other ranks start here and hold the rest of the target's shards.
        self.workers: WorkerPool | None = None
        tp, device = SINGLE, None
        if config.tensor_parallel_size > 1:
            check_tensor_parallel(self.model_config, config.tensor_parallel_size)
            self.workers = WorkerPool.start(config)
            tp, device = self.workers.tp, self.workers.membership.device
        try:
            self.runner = ModelRunner(
                config,
                self.model_config,
                self.max_model_len,
                extra_block_bytes=extra_block_bytes,
                reserved_bytes=reserved,
                tp=tp,
                device=device,
                peers=self.workers,
            )
            explicit = config.max_model_len is not None
            self.max_model_len = fitted_max_model_len(
                self.max_model_len, self.runner.num_blocks, config.block_size, explicit
            )
        except BaseException as exc:
            if self.workers is None:
                raise
            # The workers may be in a collective that will never complete: they are stopped, not told.
            failure = self.workers.failure(exc) if isinstance(exc, RuntimeError) else None
            self.workers.stop(graceful=False)
            if failure is None:
                raise
            raise failure from exc
        # Per-request sampling parameters and penalty counts, kept on the device across steps.
        vocab, device = self.model_config.vocab_size, self.runner.device
        self.sampling_state = SamplingState(config.max_num_seqs, vocab, device)
        self.sampler = Sampler(self.sampling_state)
        self.masks = MaskPrefetcher(config.max_num_seqs, vocab, device.type)  # grammar masks
        self.spec = SpecDecoder.build(config, draft_config, self.max_model_len, self.runner.num_blocks)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            config.max_loras,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, self.max_model_len)
        self._last_step = (0.0, 0, 0)
        self.num_steps = 0

    @functools.cached_property
    def grammar_compiler(self) -> GrammarCompiler:
        """Structured output's compiler for this checkpoint's tokenizer, built on first use."""
        mc = self.model_config
        return GrammarCompiler(self.config.tokenizer or self.config.model, mc.vocab_size, mc.eos_token_ids)

    @property
    def groups(self) -> dict[str, Group]:
        """Requests not yet finished, by id (each a prompt's n samples)."""
        return self.outputs.groups

    # -- requests -------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora: str | None = None,
    ) -> None:
        """Queue a request (on LoRA adapter `lora` if one is named); raises ValueError (naming the field)
        for one that can never be served."""
        params = params or SamplingParams()
        adapter = slot_of(self.runner.lora, lora)
        params.validate()
        if request_id in self.groups:
            raise ValueError(f"request_id: {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if params.truncate_prompt_tokens is not None:  # its last tokens, whose text is not the prompt's
            prompt = token_ids = params.truncated(token_ids, self.max_model_len)
        text = prompt if isinstance(prompt, str) else None
        max_tokens = self.check_prompt(token_ids, params)
        if params.constraint is not None and params.grammar is None:
            params.grammar = self.grammar_compiler.compile(params.constraint)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        requests = [
            Request(
                request_id=request_id if params.n == 1 else f"{request_id}#{i}",
                prompt_token_ids=token_ids,
                params=params,
                eos_token_ids=self.model_config.eos_token_ids,
                max_tokens=max_tokens,
                priority=priority,
                arrival_time=arrival,
                cache_salt=cache_salt,
                adapter=adapter,
                lora_key=key_of(self.runner.lora, lora),
                generator=None if params.seed is None else make_generator(0, self.runner.device),
                seed=None if params.seed is None else child_seed(params.seed, i),
                index=i,
                grammar=None if params.grammar is None else params.grammar.state(),
                prompt_logprobs=[None] if params.prompt_logprobs is not None and i == 0 else None,
                bad_words=self.tokenizer.word_sequences(params.bad_words) if params.bad_words else [],
            )
            for i in range(params.n)
        ]
        group = self.outputs.add(request_id, text, requests)
        # With a prefix cache, siblings wait for the first sample's prefill and then share its blocks.
        self.scheduler.add(requests[0])
        if self.config.enable_prefix_caching:
            group.pending = requests[1:]
        else:
            for req in requests[1:]:
                self.scheduler.add(req)

    def check_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """The effective max_tokens; ValueError naming the field if never servable (any thread may call)."""
        if not token_ids:
            raise ValueError("prompt: must not be empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside the vocabulary (size {vocab})")
        params.check_vocabulary(vocab)
        n, limit = len(token_ids), self.max_model_len
        if n >= limit:
            raise ValueError(f"prompt: {n} tokens leave no room to generate within max_model_len {limit}")
        if params.max_tokens is None:
            return limit - n
        if n + params.max_tokens > limit:
            why = f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds max_model_len {limit}"
            raise ValueError(f"max_tokens: {why}")
        return params.max_tokens

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now, free its blocks; its final output ("abort" for samples running) or None."""
        group = self.outputs.remove(request_id)
        if group is None:
            return None
        group.pending.clear()
        for s in group.samples:
            self.scheduler.abort(s.request)
            self.sampling_state.release(s.request)
        return self.outputs.make_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and the grammar-mask thread."""
        self.masks.close()
        if self.workers is not None:
            self.workers.stop()

    # -- a step ---------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an update for every request that produced text or finished."""
        start = time.perf_counter()
        speculate = self.spec is not None and self.spec.plan(self.scheduler.running)
        batch = self.scheduler.schedule()
        if not batch:
            return []
        now = time.monotonic()
        all_decoding = True
        for req in batch.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            all_decoding = all_decoding and req.num_tokens - req.num_computed_tokens == 1
        proposed = self.spec.propose(batch) if self.spec is not None and speculate else []
        self.masks.start(*sampling_grammars(batch.requests, batch.num_tokens))  # during the forward pass
        try:
            result = self.runner.execute(batch)
        except RuntimeError as exc:
            if self.workers is None:
                raise
            raise self.workers.failure(exc) from exc
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            self._advance(req, n - len(req.spec_token_ids))  # the known tokens; proposals once verified
        touched: dict[str, Group] = {}
        generated = self.outputs.generation_tokens
        if result.logits is not None:
            self._sample(result.logits, result.sampled, time.monotonic(), touched)
        if self.spec is not None:
            self.spec.trim(proposed, self.block_manager)
        outputs = [self.outputs.make_output(g) for g in touched.values()]
        elapsed = time.perf_counter() - start
        self._last_step = (elapsed, len(batch), batch.total_tokens)
        self.num_steps += 1
        if self.spec is not None and all_decoding:
            # A step in which nobody got proposals ran plainly, whatever the decision was.
            tokens = self.outputs.generation_tokens - generated
            self.spec.record_step(len(batch), bool(proposed), tokens, elapsed)
        for out in outputs:
            if out.finished:
                self.outputs.remove(out.request_id)
        return outputs

    def _advance(self, req: Request, n: int) -> None:
        """The one place `num_computed_tokens` grows: n more tokens have their KV in the cache."""
        req.num_computed_tokens += n
        self.block_manager.cache_full_blocks(req)

    def _sample(
        self, logits: torch.Tensor, sampled: list[Request], now: float, touched: dict[str, Group]
    ) -> None:
        """Plain sampling for requests without proposals (a row each), verification for others (1 + k)."""
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
            rows = logits if not spec else logits.index_select(0, upload_ids(plain_rows, logits.device))
            out = sample_plain(self.sampler, self.sampling_state, rows, plain, self.masks)
            if out.logprobs is not None:
                for k, req in enumerate(plain):
                    if (logprob := row_logprob(out, k)) is not None:
                        self.outputs.record_logprob(req, logprob)
            self.outputs.append_plain(plain, out.token_ids, now, touched, self.sampling_state.release)
        if spec:
            assert self.spec is not None
            rows = logits if not plain else logits.index_select(0, upload_ids(spec_rows, logits.device))
            for req, tokens in zip(spec, self.spec.verify(rows, spec, self.masks), strict=True):
                self._emit(req, tokens, now, touched)

    def _emit(self, req: Request, tokens: list[int], now: float, touched: dict[str, Group]) -> None:
        """Append a request's tokens: its kept proposals (verified, their KV written) and the token sampled
        after them (no KV yet). Each proposal is counted computed once the request goes on past it, as the
        plain path counts a token: so a request that ends here registers the blocks it would without
        speculation, before its blocks are freed."""
        if req.grammar is not None:
            self.outputs.advance_grammar(req, tokens)
        for i, token in enumerate(tokens):
            if i:
                self._advance(req, 1)
            group = self.outputs.append(req, [token], now)
            if req.finished:
                self.sampling_state.release(req)
                break
        else:
            # The draft's KV past the accepted tokens belongs to rejected proposals.
            req.num_draft_computed = min(req.num_draft_computed, req.num_computed_tokens)
        touched[group.request_id] = group
        if group.pending and req.index == 0:
            for sibling in group.pending:
                self.scheduler.add(sibling, front=True)
            group.pending = []

    def reset_counters(self) -> None:
        """Forget warm-up traffic: counters to zero, prefix cache emptied."""
        self.outputs.prompt_tokens = self.outputs.generation_tokens = 0
        self.scheduler.num_preemptions = 0
        self.block_manager.reset_prefix_cache()
        self.block_manager.stats = PrefixCacheStats()
        if self.spec is not None:
            self.spec.reset()

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
            prompt_tokens=self.outputs.prompt_tokens,
            generation_tokens=self.outputs.generation_tokens,
            last_step_seconds=self._last_step[0],
            last_batch_size=self._last_step[1],
            last_batch_tokens=self._last_step[2],
            num_steps=self.num_steps,
            spec=None if self.spec is None else self.spec.stats.copy(),
            spec_enabled=self.spec is not None and self.spec.enabled,
            prefix_cache_preempted_queries=bm.stats.preempted_queries,
            prefix_cache_preempted_hits=bm.stats.preempted_hits,
            running_loras=_loras(self.scheduler.running, self.runner.lora),
            waiting_loras=_loras(self.scheduler.waiting, self.runner.lora),
        )


def _loras(requests: Iterable[Request], adapters: LoraSet | None) -> tuple[str, ...]:
    if adapters is None:
        return ()
    return tuple(dict.fromkeys(adapters.names[r.adapter] for r in requests if r.adapter))
