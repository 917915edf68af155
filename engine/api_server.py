"""The OpenAI-compatible HTTP API of one engine: admission and shedding, fallback, deadlines,
cancellation on disconnect, graceful drain, and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ember_engine.admission import (
    Admit,
    QueueState,
    Shed,
    WaitCalibration,
    decide,
    wait_limit_s,
)
from ember_engine.async_engine import AsyncEngine
from ember_engine.chat import ChatTemplateError, render_chat
from ember_engine.fallback import Fallback, FallbackFailed
from ember_engine.llm_engine import LLMEngine
from ember_engine.metrics import EngineMetrics
from ember_engine.openai_format import Formatter, Usage, sse
from ember_engine.outputs import RequestOutput
from ember_engine.policy import PolicyError, PolicyWatcher
from ember_engine.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ember_engine.queue_forecast import ForecastObserver

log = logging.getLogger("ember.server")


@dataclass
class ServerState:
    model_name: str
    policy: PolicyWatcher
    metrics: EngineMetrics
    fallback: Fallback
    engine: AsyncEngine | None = None  # set once the model is loaded and warmed up
    draining: bool = False
    in_flight: int = 0  # HTTP requests being served (drain waits for these)
    queued: Counter[int] = field(default_factory=Counter)  # admitted, not yet started, by priority
    # Samples admitted but not yet handed to the engine (AsyncEngine.generate runs when first iterated).
    unsubmitted: Counter[int] = field(default_factory=Counter)
    client_in_flight: Counter[str] = field(default_factory=Counter)
    forecast: ForecastObserver = field(default_factory=ForecastObserver)
    calibration: WaitCalibration = field(default_factory=WaitCalibration)

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """The step hook (engine thread): metrics, and the forecast admission reads."""
        stats = engine.stats()
        self.metrics.record_step(stats, outputs)
        taken_in = self.engine.taken_in if self.engine is not None else {}
        self.forecast.observe(engine, stats, outputs, taken_in, time.monotonic())

    def queue_state(self, priority: int, samples: int = 1) -> QueueState:
        """The queue as a newcomer of `priority` with this many samples (prompts times n) would find it."""
        waiting = sum(self.queued.values())
        return QueueState(
            num_waiting=waiting,
            num_waiting_by_priority=dict(self.queued),
            estimated_wait_s=self.forecast_wait(priority, samples),
            draining=self.draining,
            ready=self.ready,
            wait_factor=self.calibration.factor(time.monotonic()),
        )

    def forecast_wait(self, priority: int, samples: int = 1) -> float:
        """The queue wait forecast (uncalibrated) of a newcomer of `priority` until its last sample starts;
        0 with nothing to go on."""
        forecast, engine = self.forecast.forecast, self.engine
        if forecast is None or engine is None:
            return 0.0
        ahead = forecast.ahead(priority, engine.submitted + self.unsubmitted)
        return forecast.wait(ahead + max(1, samples) - 1, time.monotonic())


class _Ticket:
    """One admitted HTTP request's share of the server's counters, released exactly once."""

    def __init__(
        self,
        state: ServerState,
        priority: int,
        class_name: str,
        client: str | None,
        num_requests: int,  # engine requests (prompts)
        n: int,  # samples each
        forecast_s: float,  # the uncalibrated queue wait forecast that admitted it
    ) -> None:
        self.state, self.priority, self.class_name, self.client, self.n = (
            state,
            priority,
            class_name,
            client,
            n,
        )
        self.admitted_at = time.monotonic()
        self.wait_limit_s = wait_limit_s(state.policy.policy, priority)
        state.calibration.admitted(self, forecast_s, self.wait_limit_s, self.admitted_at)
        self.num_requests = self.unstarted = self.unsubmitted = num_requests
        state.in_flight += 1
        state.queued[priority] += num_requests
        state.unsubmitted[priority] += num_requests * n
        if client:
            state.client_in_flight[client] += 1
        self.released = False

    def submitting(self) -> None:
        """One of its engine requests is about to be handed to the engine."""
        self.unsubmitted -= 1
        self.state.unsubmitted[self.priority] -= self.n

    def started(self, out: RequestOutput) -> None:
        s = self.state
        self.unstarted -= 1
        s.queued[self.priority] -= 1
        m = out.metrics
        if self.wait_limit_s and m is not None and m.first_scheduled_time is not None:
            waited = m.first_scheduled_time - self.admitted_at
            s.calibration.started(self, waited)
            if waited > self.wait_limit_s:  # admission misjudged it
                s.metrics.record_wait_over_limit(self.class_name)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        s = self.state
        now = time.monotonic()
        s.queued[self.priority] -= self.unstarted
        s.unsubmitted[self.priority] -= self.unsubmitted * self.n
        s.in_flight -= 1
        s.calibration.forget(self, now)
        if (
            self.unstarted == self.num_requests
            and self.wait_limit_s
            and now - self.admitted_at > self.wait_limit_s
        ):
            s.metrics.record_wait_over_limit(self.class_name)  # it gave up (or timed out) queued, too late
        if self.client:
            s.client_in_flight[self.client] -= 1
            if s.client_in_flight[self.client] <= 0:  # one key per client ever seen would only grow
                del s.client_in_flight[self.client]


class _TicketedStream(StreamingResponse):
    """A streamed response that releases its ticket however it ends: if the client is gone before the
    response starts, Starlette never runs the body, so the body's own cleanup would never run."""

    def __init__(self, body: AsyncIterator[str], ticket: _Ticket) -> None:
        super().__init__(body, media_type="text/event-stream")
        self._body, self._ticket = body, ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._body.aclose()  # type: ignore[attr-defined]
            self._ticket.release()


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ember", version="0.1.0")

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _error_response(APIError(400, f"body: malformed JSON ({first.get('msg')})"))
        param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
        return _error_response(
            APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid')}", param=param)
        )

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        if state.ready:
            return JSONResponse({"status": "ready"})
        return JSONResponse({"status": "draining" if state.draining else "loading"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None:  # gauges as of now, also when no step has run since an abort
            state.metrics.record_stats(state.engine.stats())
            # A newcomer behind everyone: less important than any priority.
            wait = state.forecast_wait(sys.maxsize) * state.calibration.factor(time.monotonic())
            state.metrics.set_estimated_wait(wait)
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        max_len = state.engine.engine.max_model_len if state.engine else None
        card = {
            "id": state.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "ember",
            "max_model_len": max_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await _serve(state, request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await _serve(state, request, body, chat=True)

    return app


async def _serve(
    state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    if body.model != state.model_name:
        raise APIError(
            400,
            f"model: {body.model!r} is not served here; this server serves {state.model_name!r}",
            param="model",
            code="model_not_found",
        )
    params = body.to_sampling_params()
    policy = state.policy.policy
    class_name, priority = _priority(state, request, body.priority)
    client = request.headers.get("x-ember-client") or request.headers.get("authorization")
    num_prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
    queue = state.queue_state(priority, num_prompts * params.n)
    verdict = decide(policy, queue, priority, state.client_in_flight[client] if client else 0)
    if isinstance(verdict, Shed):
        return await _shed(state, request, verdict, class_name)
    assert isinstance(verdict, Admit)
    engine = state.engine
    assert engine is not None  # decide() sheds while not ready
    prompts = _prompt_token_ids(engine, body)
    for ids in prompts:  # a bad prompt is a 400 before anything is queued
        try:
            engine.engine.check_prompt(ids, params)
        except ValueError as exc:
            raise APIError(400, str(exc), param=str(exc).split(":", 1)[0]) from exc
    deadline = _deadline(request, body, policy.request_timeout_seconds)
    fmt = Formatter(state.model_name, engine.tokenizer, chat)
    ticket = _Ticket(state, priority, class_name, client, len(prompts), params.n, queue.estimated_wait_s)

    def generators() -> list[AsyncIterator[RequestOutput]]:
        return [
            _tracked(engine.generate(ids, params, f"{fmt.id}-{i}", priority, body.cache_salt), ticket)
            for i, ids in enumerate(prompts)
        ]

    if body.stream:
        stream = _stream(state, fmt, _merge(generators()), params.n, body.include_usage, deadline, ticket)
        return _TicketedStream(stream, ticket)
    try:
        return await _complete(state, request, fmt, _merge(generators()), params.n, deadline)
    finally:
        ticket.release()


def _priority(state: ServerState, request: Request, value: str | int | None) -> tuple[str, int]:
    header = request.headers.get("x-ember-priority")
    chosen: str | int | None = header if header is not None else value
    if isinstance(chosen, int) or (isinstance(chosen, str) and chosen.lstrip("-").isdigit()):
        classes = state.policy.policy.load_shedding.priority_classes
        match = next((c for c in classes if c.priority == int(chosen)), None)
        if match is None:
            raise APIError(400, f"priority: no priority class has number {chosen}", param="priority")
        chosen = match.name
    try:
        return state.policy.priority_of(chosen)
    except PolicyError as exc:
        raise APIError(400, f"priority: {exc}", param="priority") from exc


def _prompt_token_ids(
    engine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest
) -> list[list[int]]:
    tok = engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        try:
            text = render_chat(tok, body.template_messages(), body.add_generation_prompt)
        except ChatTemplateError as exc:
            raise APIError(400, f"messages: {exc}", param="messages") from exc
        # The template writes the special tokens itself.
        return [tok.encode(text, add_special_tokens=False)]
    return [tok.encode(p) if isinstance(p, str) else p for p in body.prompts()]


def _deadline(
    request: Request, body: CompletionRequest | ChatCompletionRequest, default: float
) -> float | None:
    header = request.headers.get("x-ember-timeout")
    if header is not None:
        try:
            value = float(header)
        except ValueError:
            raise APIError(
                400, f"x-ember-timeout: not a number of seconds: {header!r}", param="x-ember-timeout"
            ) from None
        if value <= 0:
            raise APIError(400, "x-ember-timeout: must be > 0", param="x-ember-timeout")
        return value
    return body.timeout or default or None


async def _shed(state: ServerState, request: Request, verdict: Shed, class_name: str) -> Response:
    fb = state.policy.policy.fallback
    if verdict.fallback_eligible and fb.url:
        try:
            body = json.loads(await request.body())
            resp = await state.fallback.forward(fb.url, fb.model, request.url.path, body, fb.timeout_seconds)
            state.metrics.record_fallback("served")
            return resp
        except FallbackFailed as exc:
            log.warning("%s; answering with the shed error", exc)
            state.metrics.record_fallback("failed")
    state.metrics.record_shed(verdict.reason, class_name)
    headers = {"Retry-After": str(verdict.retry_after_s)}
    err = APIError(verdict.status, verdict.message, type="overloaded", code=verdict.reason, headers=headers)
    return _error_response(err)


async def _tracked(gen: AsyncIterator[RequestOutput], ticket: _Ticket) -> AsyncIterator[RequestOutput]:
    first = True
    # `gen` hands its request to the engine as soon as it is first iterated, below, with no await between.
    ticket.submitting()
    async with contextlib.aclosing(gen):  # type: ignore[type-var]
        async for out in gen:
            if first:
                first = False
                ticket.started(out)
            yield out


async def _merge(gens: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' updates as they come; closing this closes (aborts) them all."""
    if len(gens) == 1:
        async with contextlib.aclosing(gens[0]):  # type: ignore[type-var]
            async for out in gens[0]:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(gen):  # type: ignore[type-var]
                async for out in gen:
                    await queue.put((i, out))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _timeout_error(deadline: float) -> APIError:
    return APIError(
        504,
        f"the request did not finish within its deadline of {deadline:g} s and was aborted",
        type="timeout",
        code="deadline_exceeded",
    )


async def _complete(
    state: ServerState,
    request: Request,
    fmt: Formatter,
    merged: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    deadline: float | None,
) -> Response:
    finals: dict[int, RequestOutput] = {}

    async def collect() -> None:
        async with contextlib.aclosing(merged):  # type: ignore[type-var]
            async for i, out in merged:
                if out.finished:
                    finals[i] = out

    work = asyncio.create_task(collect())
    gone = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, gone}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()  # the client left or the deadline passed: abort its requests
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work not in done:
        if gone in done:
            return Response(status_code=499)  # nobody is listening
        state.metrics.record_deadline_abort()
        raise _timeout_error(deadline or 0)
    try:
        work.result()
    except ValueError as exc:
        raise APIError(400, str(exc), param=str(exc).split(":", 1)[0]) from exc
    usage = Usage()
    outputs = []
    for i, out in finals.items():
        usage.prompt_tokens += len(out.prompt_token_ids)
        usage.cached_tokens += out.num_cached_tokens
        for o in out.outputs:
            usage.completion_tokens += len(o.token_ids)
            outputs.append((i * n + o.index, o))
    return JSONResponse(fmt.response(outputs, usage))


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _stream(
    state: ServerState,
    fmt: Formatter,
    merged: AsyncIterator[tuple[int, RequestOutput]],
    n: int,
    include_usage: bool,
    deadline: float | None,
    ticket: _Ticket,
) -> AsyncIterator[str]:
    loop = asyncio.get_running_loop()
    ends_at = None if deadline is None else loop.time() + deadline
    sent_logprobs: Counter[int] = Counter()
    started: set[int] = set()
    usage = Usage()
    try:
        while True:
            timeout = None if ends_at is None else max(0.0, ends_at - loop.time())
            try:
                # The deadline covers waiting for the engine, never a yield to the client.
                async with asyncio.timeout(timeout):
                    i, out = await anext(merged)
            except StopAsyncIteration:
                break
            except TimeoutError:
                state.metrics.record_deadline_abort()
                yield sse(_timeout_error(deadline or 0).body())
                yield sse("[DONE]")
                return
            except ValueError as exc:
                yield sse(APIError(400, str(exc)).body())
                yield sse("[DONE]")
                return
            for o in out.outputs:
                index = i * n + o.index
                if not (o.delta_text or o.finish_reason or index not in started):
                    continue
                new_lps = None
                if o.logprobs is not None:
                    new_lps = o.logprobs[sent_logprobs[index] :]
                    sent_logprobs[index] = len(o.logprobs)
                yield sse(fmt.chunk(index, o, new_lps, first=index not in started))
                started.add(index)
            if out.finished:
                usage.prompt_tokens += len(out.prompt_token_ids)
                usage.cached_tokens += out.num_cached_tokens
                usage.completion_tokens += sum(len(o.token_ids) for o in out.outputs)
        if include_usage:
            yield sse(fmt.usage_chunk(usage))
        yield sse("[DONE]")
    finally:
        with contextlib.suppress(RuntimeError):  # already closed by a cancellation
            await merged.aclose()  # type: ignore[attr-defined]
        ticket.release()
