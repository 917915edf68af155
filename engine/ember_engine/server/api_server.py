"""The OpenAI-compatible HTTP API of one engine: admission and shedding, fallback, deadlines,
cancellation on disconnect, graceful drain, and metrics.

This module holds the app and the request path up to the engine (`build_app`, `_serve`); the server's
counters are in `state`, turning engine outputs into HTTP answers in `answers`, error bodies in `errors`;
the Responses API (`/v1/responses`) in `responses_api`."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember_engine.async_engine import AsyncEngine, EngineFailed
from ember_engine.core.outputs import RequestOutput
from ember_engine.server import generation_defaults
from ember_engine.server.admission import Admit, Shed, decide
from ember_engine.server.answers import _complete, _merge, _stream, _TicketedStream, _tracked
from ember_engine.server.api_keys import ApiKeyCheck, ApiKeys
from ember_engine.server.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit, arrival_of
from ember_engine.server.chat import ChatTemplateError
from ember_engine.server.chat_prompt import chat_prompt_ids
from ember_engine.server.errors import _error_response, add_error_handlers, engine_failed
from ember_engine.server.fallback import FallbackFailed, RelayedStream
from ember_engine.server.load_api import add_load_routes
from ember_engine.server.lora_api import add_lora_routes
from ember_engine.server.openai_format import Formatter
from ember_engine.server.policy import PolicyError
from ember_engine.server.protocol import (
    INTEGER,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from ember_engine.server.request_id import RequestId
from ember_engine.server.responses_api import add_responses_routes
from ember_engine.server.state import ServerState, _Ticket
from ember_engine.server.structured import CompileCache, request_constraint
from ember_engine.server.tokenize_api import add_tokenize_routes, model_card
from ember_engine.server.tools import ToolPlan, plan_tools
from ember_engine.server.unknown_fields import check_unknown

log = logging.getLogger("ember.server")
# allowed_token_ids beside a structured-output constraint: the two may leave no token at all, where the
# grammar could not go on (it was the server's 500, "grammar_failed")
_ALLOWED_WITH = "allowed_token_ids: not with {} (a structured-output constraint: use one or the other)"


def build_app(
    state: ServerState, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, keys: ApiKeys | None = None
) -> FastAPI:
    app = FastAPI(title="ember", version="0.1.0")

    add_error_handlers(app)
    app.add_middleware(BodyLimit, max_body_bytes=max_body_bytes)
    if keys:  # outside the body limit: a refused request's body is never read
        app.add_middleware(ApiKeyCheck, keys=keys)
    app.add_middleware(RequestId)  # outermost: the body limit's refusals carry an id too

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"status": state.status}, status_code=200 if state.ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine is not None:  # gauges as of now, also when no step has run since an abort
            state.metrics.record_stats(state.engine.stats())
            # A newcomer behind everyone: less important than any priority.
            wait = state.forecast_wait(sys.maxsize) * state.calibration.factor(time.monotonic())
            state.metrics.set_estimated_wait(wait)
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    add_load_routes(app, state)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        names = [*state.model_names, *state.loras]
        return {"object": "list", "data": [model_card(state, n) for n in names]}

    add_tokenize_routes(app, state)
    add_lora_routes(app, state)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await _serve(state, request, body, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await _serve(state, request, body, chat=True)

    add_responses_routes(app, state, _serve)
    return app


async def _serve(
    state: ServerState, request: Request, body: CompletionRequest | ChatCompletionRequest, chat: bool
) -> Response:
    lora = state.lora_of(body.model)
    if state.engine is not None and state.engine.fatal is not None:  # the server is about to exit
        raise engine_failed(EngineFailed(state.engine.fatal))
    warning = check_unknown(body.model_extra)
    body = generation_defaults.apply(body, state.sampling_defaults)
    params = body.to_sampling_params()
    tools = None
    if isinstance(body, ChatCompletionRequest):
        tools = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)
    constraint = request_constraint(body)
    if tools is not None and tools.constraint is not None:
        if constraint is not None:
            raise APIError(
                400, f"tool_choice: a forced tool call excludes {constraint[0]}", param="tool_choice"
            )
        constraint = ("tool_choice", tools.constraint)
    if constraint is not None and params.allowed_token_ids is not None:
        raise APIError(400, _ALLOWED_WITH.format(constraint[0]), param="allowed_token_ids")
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
    # Admitted: its share of the counters is taken now, before the first await, so requests arriving
    # while this one is templated and tokenized are admitted against it (or shed).
    ticket = _Ticket(state, priority, class_name, client, num_prompts, params.n, queue.estimated_wait_s)
    try:
        # Templating and tokenizing a long prompt take a while: the event loop serves others meanwhile.
        prompts = await asyncio.to_thread(_prompt_token_ids, engine, body, tools)
        if params.truncate_prompt_tokens is not None:  # each prompt's last tokens
            try:
                prompts = [params.truncated(ids, engine.engine.max_model_len) for ids in prompts]
            except ValueError as exc:
                raise APIError(400, str(exc), param="truncate_prompt_tokens") from exc
        arrival = arrival_of(request.scope)
        for ids in prompts:  # a bad prompt is a 400 before anything is queued
            try:
                engine.engine.check_prompt(ids, params)
            except ValueError as exc:
                raise APIError(400, str(exc), param=str(exc).split(":", 1)[0]) from exc
        if constraint is not None:  # compiled in a worker thread: other requests go on meanwhile
            if state.grammars is None:
                llm_engine = engine.engine
                state.grammars = CompileCache(lambda: llm_engine.grammar_compiler)
            params.constraint = constraint[1]
            params.grammar = await state.grammars.compile(constraint[1], constraint[0])
        deadline = _deadline(request, body, policy.request_timeout_seconds)
        fmt = Formatter(body.model, engine.tokenizer, chat, n=params.n)
        fmt.token_ids_as_text = body.return_tokens_as_token_ids
        if isinstance(body, CompletionRequest) and body.echo:
            given = body.prompts() if params.truncate_prompt_tokens is None else prompts  # as served
            fmt.echo = [p if isinstance(p, str) else engine.tokenizer.decode(p) for p in given]
            fmt.echo_logprobs = body.echo_logprobs
        fmt.prompt_logprobs = body.prompt_logprobs
        fmt.tool_calls = tools.parallel if tools is not None and tools.parse else None
        fmt.constraint = constraint[0] if constraint is not None else None
    except BaseException:
        ticket.release()
        raise

    def generators() -> list[AsyncIterator[RequestOutput]]:
        return [
            _tracked(
                engine.generate(ids, params, f"{fmt.id}-{i}", priority, body.cache_salt, arrival, lora),
                ticket,
            )
            for i, ids in enumerate(prompts)
        ]

    if body.stream:
        stream = _stream(
            state,
            fmt,
            _merge(generators()),
            params.n,
            body.include_usage,
            deadline,
            ticket,
            body.continuous_usage,
        )
        response: Response = _TicketedStream(stream, ticket)
    else:
        try:
            response = await _complete(state, request, fmt, _merge(generators()), params.n, deadline)
        finally:
            ticket.release()
    response.headers.update(warning)
    return response


def _priority(state: ServerState, request: Request, value: str | int | None) -> tuple[str, int]:
    header = request.headers.get("x-ember-priority")
    chosen: str | int | None = header if header is not None else value
    if isinstance(chosen, int) or (isinstance(chosen, str) and INTEGER.fullmatch(chosen)):
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
    engine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None = None
) -> list[list[int]]:
    tok = engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        try:
            return [chat_prompt_ids(tok, body, tools)]
        except ChatTemplateError as exc:
            raise APIError(400, f"{exc.param}: {exc}", param=exc.param) from exc
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
        if not math.isfinite(value) or value <= 0:
            raise APIError(
                400, f"x-ember-timeout: must be a finite number > 0, got {header!r}", param="x-ember-timeout"
            )
        return value
    return body.timeout or default or None


async def _shed(state: ServerState, request: Request, verdict: Shed, class_name: str) -> Response:
    fb = state.policy.policy.fallback
    if verdict.fallback_eligible and fb.url:
        state.in_flight += 1  # a relayed request is in flight too: a drain waits until it is relayed whole

        def release() -> None:
            state.in_flight -= 1

        try:
            body = json.loads(await request.body())
            resp = await state.fallback.forward(
                fb.url, fb.model, request.url.path, body, fb.timeout_seconds, request
            )
        except BaseException as exc:
            release()
            if not isinstance(exc, FallbackFailed):
                raise
            log.warning("%s; answering with the shed error", exc)
            state.metrics.record_fallback("failed")
        else:
            # 499: the client left before the fallback answered (the request there was aborted).
            state.metrics.record_fallback("cancelled" if resp.status_code == 499 else "served")
            if isinstance(resp, RelayedStream):
                resp.on_close = release
            else:
                release()
            return resp
    state.metrics.record_shed(verdict.reason, class_name)
    headers = {"Retry-After": str(verdict.retry_after_s)}
    err = APIError(verdict.status, verdict.message, type="overloaded", code=verdict.reason, headers=headers)
    return _error_response(err)
