"""`OutputProcessor`: from sampled tokens to what callers see.

It owns the request groups (a prompt's n samples), appends each new token with its stop checks (stop
token ids, EOS, stop strings found by the incremental detokenizer, max_tokens, the model length), counts
prompt and generation tokens, and builds each `RequestOutput` with the text and token deltas since the
previous one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ember_engine.core.detokenizer import Detokenizer
from ember_engine.core.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ember_engine.core.request import Request, RequestStatus
from ember_engine.core.scheduler import Scheduler
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.sample.constraint import DEAD_END

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Sample:
    """One of a request's n samples, with its text state."""

    request: Request
    detok: Detokenizer
    logprobs: list[Logprob] | None
    emitted_tokens: int = 0


@dataclass(slots=True)
class Group:
    """A prompt's samples, reported together as one `RequestOutput`."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    pending: list[Request] = field(default_factory=list)  # siblings admitted after the first's prefill

    @property
    def finished(self) -> bool:
        return not self.pending and all(s.request.finished for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, scheduler: Scheduler, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.groups: dict[str, Group] = {}
        self._group_of: dict[Request, Group] = {}
        self.prompt_tokens = 0  # tokens of the prompts whose first token came out (once per prompt)
        self.generation_tokens = 0

    def add(self, request_id: str, prompt: str | None, requests: list[Request]) -> Group:
        """Track a prompt's samples (their requests already built, sharing the prompt's token ids)."""
        token_ids = requests[0].prompt_token_ids
        samples = [
            _Sample(
                req,
                Detokenizer(self.tokenizer, token_ids, req.params),
                [] if req.params.logprobs is not None else None,
            )
            for req in requests
        ]
        group = Group(request_id, prompt, token_ids, samples)
        self.groups[request_id] = group
        for req in requests:
            self._group_of[req] = group
        return group

    def remove(self, request_id: str) -> Group | None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            for s in group.samples:
                self._group_of.pop(s.request, None)
        return group

    def record_logprob(self, req: Request, logprob: Logprob) -> None:
        logprobs = self._group_of[req].samples[req.index].logprobs
        if logprobs is not None:
            logprobs.append(logprob)

    def append(self, req: Request, tokens: list[int], now: float) -> Group:
        """Append a request's new tokens, stopping early at one that ends it; returns its group."""
        group = self._group_of[req]
        sample = group.samples[req.index]
        for token in tokens:
            self._append_token(req, sample, token, now)
            if req.finished:
                break
        return group

    def append_plain(
        self,
        requests: Sequence[Request],
        tokens: Sequence[int],
        now: float,
        touched: dict[str, Group],
        release: Callable[[Request], None],
    ) -> None:
        """Each request's one new token (sampled without proposals; this runs for every request every
        step): its grammar advanced, its group marked `touched`, `release` called for one that finished,
        and a first sample's siblings queued (at the front, to share its blocks) once it has prefilled."""
        group_of = self._group_of
        for req, token in zip(requests, tokens, strict=True):
            if req.grammar is not None:
                self.advance_grammar(req, [token])
            group = group_of[req]
            self._append_token(req, group.samples[req.index], token, now)
            if req.status is RequestStatus.FINISHED:
                release(req)
            elif req.num_draft_computed > req.num_computed_tokens:
                req.num_draft_computed = req.num_computed_tokens
            touched[group.request_id] = group
            if group.pending and req.index == 0:
                for sibling in group.pending:
                    self.scheduler.add(sibling, front=True)
                group.pending = []

    @staticmethod
    def advance_grammar(req: Request, tokens: list[int]) -> None:
        """Advance the request's grammar by the tokens it keeps. Where the grammar engine cannot (it met an
        internal limit, or refused a token its own mask allowed), the request ends with `error` set: its
        text no longer follows the constraint, and must not end as if it did."""
        assert req.grammar is not None
        if not req.grammar.accept(tokens):
            why = req.grammar.error or "it refused a token its own mask allowed"
            req.error = (
                DEAD_END
                if req.grammar.dead_end
                else f"structured output: the grammar engine could not go on: {why}"
            )
            log.warning("request %s: %s", req.request_id, req.error)

    def _append_token(self, req: Request, sample: _Sample, token: int, now: float) -> None:
        req.all_token_ids.append(token)  # `Request.append_token`, inline
        output = req.output_token_ids
        output.append(token)
        self.generation_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
            if self._group_of[req].samples[0].request is req:  # a prompt counts once, not once per sample
                self.prompt_tokens += req.num_prompt_tokens
        req.last_token_time = now
        p = req.params
        num_output = len(output)
        # Below min_tokens nothing may end the request (the sampler already kept EOS and stop ids out),
        # unless its grammar is complete: the grammar then allowed only EOS, and wins.
        grammar_done = req.grammar is not None and req.grammar.finished
        may_stop = num_output >= p.min_tokens or grammar_done
        reason: str | None = None
        stop_token = (
            False  # ended by a stop id or EOS, whose text is kept only if the stop's text is asked for
        )
        if req.error is not None:
            reason = "abort"
        elif may_stop and p.stop_token_ids and token in p.stop_token_ids:
            reason, req.stop_reason, stop_token = "stop", token, True
        elif may_stop and not p.ignore_eos and token in req.eos_token_ids:
            reason, stop_token = "stop", True
        else:
            # As vLLM: stop strings count only in the text after the first min_tokens tokens'.
            stop = sample.detok.append(token, detect_stop=num_output > p.min_tokens or grammar_done)
            if stop is not None:
                reason, req.stop_reason = "stop", stop
            elif num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
                reason = "length"
        if reason is not None:
            if stop_token and p.include_stop_str_in_output:
                sample.detok.append(token, detect_stop=False)
            sample.detok.flush()
            self.scheduler.finish(req, reason)

    def make_output(self, group: Group) -> RequestOutput:
        """The group's update: O(new tokens) per sample (the token list itself is shared while running)."""
        outs = []
        samples = group.samples
        for s in samples:
            req = s.request
            done = req.status is RequestStatus.FINISHED
            output = req.output_token_ids
            new_ids = output[s.emitted_tokens :]
            s.emitted_tokens = len(output)
            # Positional, in field order: index, text, token_ids (while running the request's own list,
            # which grows; a copy once final), delta_text, delta_token_ids, finish_reason, stop_reason,
            # logprobs.
            outs.append(
                CompletionOutput(
                    req.index,
                    s.detok.text,
                    list(output) if done else output,
                    s.detok.take_delta(done),
                    new_ids,
                    req.finish_reason,
                    req.stop_reason,
                    s.logprobs,
                )
            )
        first = samples[0].request
        times = None
        if len(samples) == 1:
            generated, preemptions = len(first.output_token_ids), first.num_preemptions
            finished = done and not group.pending
        else:
            generated = sum(len(s.request.output_token_ids) for s in samples)
            preemptions = sum(s.request.num_preemptions for s in samples)
            finished = group.finished
            times = [(s.request.first_token_time, s.request.last_token_time) for s in samples]
        cached = first.num_prompt_cached_tokens
        # Field order: arrival, first scheduled, first token, last token, prompt tokens, generated
        # tokens, cached tokens, preemptions, each sample's token times, max_tokens.
        metrics = RequestMetrics(
            first.arrival_time,
            first.first_scheduled_time,
            first.first_token_time,
            first.last_token_time,
            len(first.prompt_token_ids),
            generated,
            cached,
            preemptions,
            times,
            first.max_tokens,
        )
        error = next((s.request.error for s in samples if s.request.error is not None), None)
        return RequestOutput(
            group.request_id,
            group.prompt,
            group.prompt_token_ids,
            outs,
            finished,
            cached,
            error,
            metrics,
            first.prompt_logprobs,  # complete by the first token (a prompt's first sample collects them)
        )
