"""The OpenAI-compatible HTTP API of one engine: admission and shedding, fallback, deadlines,
cancellation on disconnect, graceful drain, and metrics.

This module holds the app and the request path up to the engine (`build_app`, `_serve`); the server's
counters are in `state`, turning engine outputs into responses in `responses`, error bodies in `errors`."""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ember_engine.async_engine import AsyncEngine
from ember_engine.core.outputs import RequestOutput
from ember_engine.server.admission import Admit, Shed, decide
from ember_engine.server.chat import ChatTemplateError, render_chat
from ember_engine.server.errors import _error_response, add_error_handlers
from ember_engine.server.fallback import FallbackFailed
from ember_engine.server.openai_format import Formatter
from ember_engine.server.policy import PolicyError
from ember_engine.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ember_engine.server.responses import _complete, _merge, _stream, _TicketedStream, _tracked
from ember_engine.server.state import ServerState, _Ticket
from ember_engine.server.structured import CompileCache, request_constraint
from ember_engine.server.tools import ToolPlan, plan_tools

log = logging.getLogger("ember.server")


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ember", version="0.1.0")

    add_error_handlers(app)

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

    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0) -> JSONResponse:
        """The prefix cache's changes after event `since` (0: a snapshot of every cached block hash), for
        routers that send a request where its prefix is cached."""
        if state.engine is None:
            raise APIError(503, "the model is still loading", type="unavailable", code="not_ready")
        engine = state.engine.engine
        bm = engine.block_manager
        batch = bm.events.since(since, lambda: tuple(bm.cached))
        body: dict[str, Any] = {
            "block_size": bm.block_size,
            "enabled": bm.enable_prefix_caching,
            "seq": batch.seq,
            "events": [[kind, h] for kind, h in batch.events],
        }
        if batch.snapshot is not None:
            body["snapshot"] = batch.snapshot
        return JSONResponse(body)

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
    prompts = _prompt_token_ids(engine, body, tools)
    if constraint is not None:  # compiled in a worker thread: other requests go on meanwhile
        if state.grammars is None:
            llm_engine = engine.engine
            state.grammars = CompileCache(lambda: llm_engine.grammar_compiler)
        params.constraint = constraint[1]
        params.grammar = await state.grammars.compile(constraint[1], constraint[0])
    deadline = _deadline(request, body, policy.request_timeout_seconds)
    fmt = Formatter(state.model_name, engine.tokenizer, chat)
    fmt.tool_calls = tools.parallel if tools is not None and tools.parse else None
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
    engine: AsyncEngine, body: CompletionRequest | ChatCompletionRequest, tools: ToolPlan | None = None
) -> list[list[int]]:
    tok = engine.tokenizer
    if isinstance(body, ChatCompletionRequest):
        try:
            rendered = None if tools is None else tools.tools
            text = render_chat(tok, body.template_messages(), body.add_generation_prompt, rendered)
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
