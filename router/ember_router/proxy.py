"""The router's HTTP server: OpenAI-compatible endpoints proxied to the engine the policy chooses.

A request is read, its prompt tokenized as the engines will (off the event loop), its block hashes looked
up in the prefix index, and an engine chosen (`policy.choose`). The request goes on unchanged; the response
comes back chunk by chunk (SSE streams included) with `x-ember-routed-to` and `x-ember-route-reason`.
With `hold_seconds`, a request that finds no engine Ready waits (up to that long, counted in
`ember_router:pending_requests`) for one, so that the demand is visible while engines start from zero; so
does, for what is left of that time, a request whose engines all went away before answering (failover).
Before that, the routing rules (`rules.py`) may send the request to another InferenceService instead
(`x-ember-routed-to: <that service>`, `x-ember-route-reason: rule:<name>`). An
engine that answers 503 before the response begins is skipped for its Retry-After and the request
goes to one other engine (a 503 `engine_failed`, an engine that failed for good, counts as one gone); with no engine to take it the request goes to the fallback server if one is set
(the policy file's, read live, or the flags'; `x-ember-served-by: fallback`), else the router sheds at once
(503, Retry-After: the policy file's `loadShedding.retryAfterSeconds`, as the engines answer). A client
that disconnects closes the upstream connection, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.api_keys import ApiKeys
from ember_engine.server.policy import PolicyWatcher
from ember_engine.server.responses_request import RESPONSE_ID_HEADER
from ember_router import models_list
from ember_router.auth import key_check
from ember_router.body import BadBody, read_body
from ember_router.discovery import PodDiscovery
from ember_router.fallback import FallbackTarget, ModelNames, from_policy
from ember_router.headers import answer_headers, encoded, upstream_headers
from ember_router.metrics import RouterMetrics
from ember_router.policy import EngineState, choose, lacking
from ember_router.pool import EnginePool
from ember_router.prompts import request_prompts
from ember_router.relay import EventFramer, StreamIdle, chunks, error_event, error_response, openai_errors
from ember_router.request_id import request_ids, stamp
from ember_router.routes_file import RoutesFile
from ember_router.rules import Request, Rule, decide, requested_max_tokens
from ember_router.stored import ResponseHomes, prompt_body

log = logging.getLogger("ember.router")

ROUTED_TO = "x-ember-routed-to"
ROUTE_REASON = "x-ember-route-reason"
MAX_BODY = 32 * 1024 * 1024
HOLD_POLL = 0.05  # seconds between looks at the pool while a request is held
TRIES = 2  # engines a request is sent to before it is shed (or, their all being gone, held again)
# Times a request whose engines were all gone before answering is held again for another (within its hold).
FAILOVER_HOLDS = 3
# Seconds a prompt just sent to an engine counts as cached there before the engine's events confirm it.
SENT_HOLD = 5.0
# Seconds to connect to an engine or the fallback: a request for one that cannot be reached is shed soon.
CONNECT_TIMEOUT = 2.0
POLICY_POLL = 1.0  # seconds between looks at the policy file, as in the engines
# Bodies up to this many bytes are tokenized on the event loop (tens of microseconds, less than handing the
# work to a thread); larger ones on a worker thread, where a long prompt holds up no request in flight.
INLINE_TOKENIZE = 256
_MODELS_TIMEOUT = aiohttp.ClientTimeout(total=5)  # an engine's /v1/models, to add the routed names to


@dataclass
class Ending:
    """How an answer that began ended, as the fallback's are counted: served (whole), failed (the upstream
    broke off), cancelled (the client left)."""

    outcome: str = "served"


@dataclass
class RouterSettings:
    epsilon: float = 0.25  # bounded load: at most (1 + epsilon) x the mean
    session_header: str = "x-session-id"
    # Seconds in the Retry-After of the router's own refusals, and an engine's 503 that gave none; with a
    # policy file, its loadShedding.retryAfterSeconds instead.
    retry_after: int = 1
    # Seconds to wait for an engine's next bytes (its answer's head, or the next piece of its body) before
    # answering 504; None: as long as the engine takes (its own request deadline applies).
    upstream_timeout: float | None = None
    # Where requests go that no engine can take (any OpenAI-compatible server), when the router has no policy
    # file (whose fallback then applies instead).
    fallback: FallbackTarget | None = None
    # Model routing: (rule, the target's base URL), in order; the first rule a request meets sends it there.
    routes: tuple[tuple[Rule, str], ...] = ()
    # The keys a client must present (none: no check); the engines are sent the first (`EnginePool.headers`).
    api_keys: ApiKeys = field(default_factory=lambda: ApiKeys(()))
    # What requests to the fallback carry for it (EMBER_FALLBACK_API_KEY's key), never the client's.
    fallback_headers: dict[str, str] = field(default_factory=dict)
    # With no engine Ready, hold a request this long for one to become Ready (0: shed at once).
    hold_seconds: float = 0.0
    # Seconds a stream (an event-stream answer) may pass with nothing from its upstream before the router
    # ends it with an error event; None: no limit (a frozen engine holds the client for ever).
    stream_idle_timeout: float | None = 300.0
    # The model name the engines serve: `/v1/models` lists it while no engine is Ready (none: a 503 then).
    served_model_name: str | None = None
    served_aliases: tuple[str, ...] = ()  # the other names the engines serve their model by


@dataclass
class Router:
    pool: EnginePool
    tokenizer: Tokenizer
    settings: RouterSettings = field(default_factory=RouterSettings)
    metrics: RouterMetrics = field(default_factory=RouterMetrics)
    sessions: dict[str, str] = field(default_factory=dict)  # session id -> engine
    discovery: PodDiscovery | None = None  # engines from Kubernetes, instead of a fixed list
    policy: PolicyWatcher | None = None  # the policy file, re-read while serving: its fallback applies
    routes_file: RoutesFile | None = None  # model-routing rules re-read while serving, instead of settings'
    fallback_models: ModelNames = field(default_factory=ModelNames)
    homes: ResponseHomes = field(default_factory=ResponseHomes)  # stored responses' engines
    _turns: itertools.count[int] = field(default_factory=itertools.count)
    session: aiohttp.ClientSession | None = None
    started: int = field(default_factory=lambda: int(time.time()))  # `created` of the models it names

    # -- the app ----------------------------------------------------------------------------------------

    def app(self) -> web.Application:
        checks = [key_check(self.settings.api_keys)] if self.settings.api_keys else []
        app = web.Application(client_max_size=MAX_BODY, middlewares=[request_ids, *checks, openai_errors])
        app.on_response_prepare.append(stamp)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/responses/{id}", self.stored_response)
        app.router.add_delete("/v1/responses/{id}", self.stored_response)
        app.router.add_get("/v1/responses/{id}/input_items", self.stored_response)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/tokenize", self.any_engine)
        app.router.add_post("/detokenize", self.any_engine)
        app.router.add_get("/version", self.any_engine)
        app.router.add_get("/v1/models/{model:.+}", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_page)
        app.cleanup_ctx.append(self._background)
        return app

    async def _background(self, _app: web.Application) -> Any:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(
                total=None, sock_connect=CONNECT_TIMEOUT, sock_read=self.settings.upstream_timeout
            ),
            connector=aiohttp.TCPConnector(limit=0),
            # A proxy: bodies pass as the engine encoded them (with its Content-Encoding), and no cookie
            # one client's answer set is sent on with another client's request.
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        if self.discovery is not None:
            self.discovery.on_change = self._engines_changed
            self.discovery.start(asyncio.get_running_loop())
        poller = asyncio.create_task(self.pool.run(self.session))
        watchers = [asyncio.create_task(self.policy.run(POLICY_POLL))] if self.policy is not None else []
        if self.routes_file is not None:
            watchers.append(asyncio.create_task(self.routes_file.run(POLICY_POLL)))
        yield
        for watcher in watchers:
            watcher.cancel()
        if self.discovery is not None:
            self.discovery.stop()
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        await self.session.close()

    def _engines_changed(self, engines: dict[str, str]) -> None:
        self.pool.sync(engines)
        if self.session is not None:  # poll at once: a promoted engine should take traffic now
            asyncio.get_running_loop().create_task(self.pool.poll_once(self.session))

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        ready = sum(s.ready for s in self.pool.states())
        self.metrics.engines_ready.set(ready)
        if ready or self.settings.hold_seconds > 0:  # holding, it takes requests with no engine Ready
            return web.json_response({"status": "ready", "engines": ready})
        return web.json_response({"status": "no engine ready"}, status=503)

    async def metrics_page(self, _request: web.Request) -> web.Response:
        self.metrics.engines_ready.set(sum(s.ready for s in self.pool.states()))
        return web.Response(
            body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def models(self, request: web.Request) -> web.StreamResponse:
        """`/v1/models` and `/v1/models/{id}` (`models_list`): the engines' answer as they give it while
        no routing rule names other models; else their list with the routed names added."""
        routed = models_list.routed_names(rule for rule, _ in self._routes())
        if not routed:
            for state in self.pool.states():  # the first Ready engine that answers
                if state.ready:
                    response = await self._forward(request, state.name, b"", "GET", "only", 0, retry=True)
                    if response is not None:
                        return response
            own = None
        else:
            own = await self._engine_models()
        if own is None and self.settings.served_model_name is not None:  # none Ready: at zero, say
            names = (self.settings.served_model_name, *self.settings.served_aliases)
            own = [models_list.entry(name, self.started) for name in dict.fromkeys(names)]
        if own is None:
            return _error(503, "no engine is ready", "overloaded", "not_ready", self._retry_after())
        listed = models_list.listing(own, routed, self.started)
        wanted = request.match_info.get("model")
        if wanted is None:
            return web.json_response(listed)
        found = next((m for m in listed["data"] if m.get("id") == wanted), None)
        if found is None:
            error = {"message": f"model: {wanted!r} is not served here", "type": "invalid_request_error"}
            error.update(param="model", code="model_not_found")  # as an engine answers it
            return web.json_response({"error": error}, status=404)
        return web.json_response(found)

    async def any_engine(self, request: web.Request) -> web.StreamResponse:
        """`/tokenize`, `/detokenize` and `/version`: every engine answers them alike (one model, one
        tokenizer and template), so the least busy Ready engine does; the next if it is gone or refuses."""
        raw = await request.read()
        ready = sorted((s for s in self.pool.states() if s.ready), key=lambda s: s.load)
        for state in ready:
            response = await self._forward(request, state.name, raw, request.method, "any", 0, retry=True)
            if response is not None:
                return response
        why = "every engine refused it" if ready else "no engine is ready"
        return _error(503, why, "overloaded", "not_ready", self._retry_after())

    async def _engine_models(self) -> list[dict[str, Any]] | None:
        """The first Ready engine's `/v1/models` entries that it answers with; None when none answers."""
        assert self.session is not None
        for state in self.pool.states():
            if not state.ready:
                continue
            try:
                models = f"{state.name}/v1/models"
                async with self.session.get(models, headers=self.pool.headers, timeout=_MODELS_TIMEOUT) as r:
                    if r.status == 200:
                        data = (await r.json()).get("data")
                        if isinstance(data, list):
                            return [m for m in data if isinstance(m, dict)]
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                log.debug("engine %s: /v1/models: %s", state.name, exc)
        return None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, chat=True)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, chat=True, responses=True)

    async def stored_response(self, request: web.Request) -> web.StreamResponse:
        """`GET`/`DELETE /v1/responses/{id}` and its `input_items`: from the engine that has the response."""
        response_id = request.match_info["id"]
        home = await self._home(response_id)
        if home is None:
            error = {"message": f"response {response_id!r} not found", "type": "invalid_request_error"}
            error.update(param="response_id", code="response_not_found")  # as an engine answers it
            return web.json_response({"error": error}, status=404)
        response = await self._forward(request, home, b"", request.method, "stored", 0)
        assert response is not None  # without retry, every answer is relayed
        if request.method == "DELETE" and response.status == 200:
            self.homes.drop(response_id)
        return response

    async def _home(self, response_id: str) -> str | None:
        """The engine that has a stored response: as noted when it was relayed, else the first Ready
        engine that has it (asked in turn)."""
        home = self.homes.get(response_id)
        if home is not None and home in self.pool.engines:
            return home
        assert self.session is not None
        for state in self.pool.states():
            if not state.ready:
                continue
            try:
                url = f"{state.name}/v1/responses/{quote(response_id, safe='')}"  # an id is any string
                async with self.session.get(url, timeout=_MODELS_TIMEOUT) as r:
                    if r.status == 200:
                        self.homes.put(response_id, state.name)
                        return state.name
            except (aiohttp.ClientError, TimeoutError) as exc:
                log.debug("engine %s: %s: %s", state.name, url, exc)
        return None

    # -- routing -------------------------------------------------------------------------------------

    async def _route(self, request: web.Request, chat: bool, responses: bool = False) -> web.StreamResponse:
        arrived = time.perf_counter()
        try:
            raw = await request.read()
        except web.RequestPayloadError as exc:  # e.g. a body its Content-Encoding does not decode
            why = str(exc).split("message:", 1)[-1].strip()
            return error_response(400, f"body: cannot be read: {why}", "invalid_request_error", None)
        try:
            body = read_body(raw)
        except BadBody as exc:  # no engine, nor any later attempt, could answer it otherwise
            return error_response(400, str(exc), "invalid_request_error", None)
        if responses and isinstance(body, dict) and isinstance(body.get("previous_response_id"), str):
            # It continues a stored response: only the engine that has it can answer.
            home = await self._home(body["previous_response_id"])
            if home is not None:
                response = await self._forward(
                    request, home, raw, "POST", "stored", 0, arrived, stream=_streams(body)
                )
                assert response is not None  # without retry, every answer is relayed
                return response
        asked = prompt_body(body) if responses else body  # a Responses API body: the chat it runs as
        first = self.settings.served_model_name
        served = (first, *self.settings.served_aliases) if first is not None else None
        if len(raw) <= INLINE_TOKENIZE:
            prompts = request_prompts(self.tokenizer, asked, chat, self.pool.block_size, served)
        else:
            prompts = await asyncio.to_thread(
                request_prompts, self.tokenizer, asked, chat, self.pool.block_size, served
            )
        hashes = prompts.first_hashes
        if self._routes():
            routed = await self._by_rule(request, body, raw, prompts.first_tokens, arrived)
            if routed is not None:
                return routed
        hold_until = time.monotonic() + self.settings.hold_seconds  # the request's whole hold budget
        if self.settings.hold_seconds > 0 and not await self._hold(hold_until):
            return await self._no_engine_ready(request, body, arrived)
        session_id = request.headers.get(self.settings.session_header)
        # A request naming a LoRA adapter goes where it is loaded.
        elsewhere = lacking(self.pool.states(), asked.get("model") if isinstance(asked, dict) else None)
        tried: set[str] = set()
        unreachable: set[str] = set()  # of those tried, the ones that could not be reached
        holds = 0
        attempt = tries = 0
        while True:
            now = time.monotonic()
            matched = {
                url: self.pool.index.matched_blocks(url, hashes, e.events_live, now)
                for url, e in self.pool.engines.items()
            }
            decision = (
                choose(
                    self.pool.states(),
                    matched,
                    now,
                    self.settings.epsilon,
                    self.sessions.get(session_id) if session_id else None,
                    frozenset(tried) | elsewhere,
                    next(self._turns),
                )
                if tries < TRIES
                else None
            )
            if decision is None or decision.engine is None:
                # Every engine tried was gone before it answered (it died, or went away with the request)
                # and none is Ready now: hold, with what is left of the hold, for one to be (a warm pod
                # promoted), then try again. Nothing of an answer has reached the client, so the request
                # may run again; an engine that refused it (503) is not gone, and a few holds at most.
                if not (
                    tried
                    and unreachable == tried
                    and self.settings.hold_seconds > 0
                    and holds < FAILOVER_HOLDS
                    and not any(s.ready for s in self.pool.states())
                ):
                    break
                holds += 1
                if not await self._hold(hold_until):
                    return await self._no_engine_ready(request, body, arrived)
                tried.clear()
                unreachable.clear()
                tries = 0
                continue
            if attempt:
                self.metrics.retries.inc()
            engine = self.pool.engines[decision.engine]
            self.metrics.decisions.labels(decision.engine, decision.reason).inc()
            log.debug(
                "route %s -> %s (%s, %d blocks cached)",
                request.path,
                decision.engine,
                decision.reason,
                decision.matched_blocks,
            )
            if attempt == 0:
                self.metrics.overhead.observe(time.perf_counter() - arrived)
            # What the engine will count if it takes the request: every prompt's tokens, and of them those
            # expected in its prefix cache (the first prompt's as the choice found them).
            block = self.pool.block_size or 0
            expected = min(prompts.first_tokens, decision.matched_blocks * block) + sum(
                min(n, self.pool.index.matched_blocks(decision.engine, h, engine.events_live, now) * block)
                for h, n in zip(prompts.hashes[1:], prompts.lengths[1:], strict=True)
            )
            if session_id:
                self.sessions[session_id] = decision.engine
            for sent in prompts.hashes:
                if not engine.events_live and sent:
                    self.pool.index.assume(decision.engine, sent)
                elif sent:  # held from now on, though the engine announces the blocks only once computed
                    self.pool.index.sent(decision.engine, sent, now, SENT_HOLD)
            response = await self._forward(
                request,
                decision.engine,
                raw,
                "POST",
                decision.reason,
                decision.matched_blocks,
                arrived,
                retry=True,
                accepted=self._count_prompts(prompts.tokens, expected),
                unreachable=unreachable,
                stream=_streams(body),
            )
            if response is not None:
                return response
            tried.add(decision.engine)
            attempt += 1
            tries += 1
        # No engine left to take it, or the engines tried refused it or could not be reached.
        ready = any(st.ready for st in self.pool.states())
        why = (
            ("the engines tried were overloaded" if tried else "every engine is overloaded")
            if ready
            else "no engine is ready"
        )
        return await self._shed(request, body, arrived, why, "Overloaded" if ready else "Unavailable")

    def _count_prompts(self, tokens: int, expected_hits: int) -> Callable[[], None]:
        """Count a request's prompt tokens once an engine takes it (a 2xx answer of its own): an engine
        counts no prompt it refuses or hands to its fallback, and the dashboard sets these counters beside
        the engines'."""

        def count() -> None:
            self.metrics.prompt_tokens.inc(tokens)
            self.metrics.predicted_hit_tokens.inc(expected_hits)

        return count

    async def _hold(self, until: float) -> bool:
        """Wait, counted in `ember_router:pending_requests`, until an engine is Ready; False when the
        monotonic time `until` comes first. A client that goes away cancels the wait (and the handler)."""
        if any(s.ready for s in self.pool.states()):
            return True
        self.metrics.pending.inc()
        try:
            while time.monotonic() < until:
                await asyncio.sleep(HOLD_POLL)
                if any(s.ready for s in self.pool.states()):
                    return True
            return False
        finally:
            self.metrics.pending.dec()

    async def _no_engine_ready(self, request: web.Request, body: Any, arrived: float) -> web.StreamResponse:
        """The hold ran out with no engine Ready: the fallback for Unavailable if one is set, else a 503."""
        why = f"no engine became ready within {self.settings.hold_seconds:g} s"
        return await self._shed(request, body, arrived, why, "Unavailable", "no_engine_ready")

    def _retry_after(self) -> int:
        """The seconds the router's own refusals ask clients to wait: the policy file's
        `loadShedding.retryAfterSeconds` (what the engines answer too), else the settings'."""
        if self.policy is not None:
            return self.policy.policy.load_shedding.retry_after_seconds
        return self.settings.retry_after

    def _routes(self) -> tuple[tuple[Rule, str], ...]:
        return self.routes_file.routes if self.routes_file is not None else self.settings.routes

    async def _by_rule(
        self, request: web.Request, body: Any, raw: bytes, num_tokens: int, arrived: float
    ) -> web.StreamResponse | None:
        """Send the request to another InferenceService when a routing rule says so (None: keep it here)."""
        model = body.get("model") if isinstance(body, dict) else None
        ask = Request(
            num_tokens,
            requested_max_tokens(body),
            {k.lower(): v for k, v in request.headers.items()},
            model if isinstance(model, str) else None,
        )
        routes = self._routes()
        rule = decide([rule for rule, _ in routes], ask)
        if rule is None:
            return None
        url = next(url for r, url in routes if r is rule)
        self.metrics.routed.labels(rule.name, rule.target).inc()
        log.debug("route %s -> %s (rule %s)", request.path, rule.target, rule.name)
        return await self._forward(
            request,
            url.rstrip("/"),
            raw,
            "POST",
            f"rule:{rule.name}",
            0,
            arrived,
            routed_to=rule.target,
            stream=_streams(body),
        )

    def _fallback(self) -> FallbackTarget | None:
        return from_policy(self.policy) if self.policy is not None else self.settings.fallback

    async def _shed(
        self,
        request: web.Request,
        body: Any,
        arrived: float,
        why: str,
        condition: str,
        code: str = "fleet_overloaded",
    ) -> web.StreamResponse:
        """No engine takes the request: the fallback serves it if one is set for this `condition` (Overloaded
        or Unavailable) and answers, else a 503 now, with `code` (as `why` says) and counted under it."""
        target = self._fallback()
        if target is not None and condition in target.when and isinstance(body, dict):
            response = await self._to_fallback(request, target, body, arrived)
            if response is not None:
                return response
        self.metrics.shed.labels(code).inc()
        return _error(503, f"{why}; retry later", "overloaded", code, self._retry_after())

    async def _to_fallback(
        self, request: web.Request, target: FallbackTarget, body: dict[str, Any], arrived: float
    ) -> web.StreamResponse | None:
        """Relay the request to the fallback, counted by how that ended (`ember_router:fallback_requests`):
        served whole, failed (None where nothing of it reached the client), or cancelled by the client."""
        assert self.session is not None
        ending = Ending()
        try:
            model = await self.fallback_models.name(self.session, target, self.settings.fallback_headers)
            if model:
                body = {**body, "model": model}
            response = await self._forward(
                request, target.url, json.dumps(body).encode(), "POST", "fallback", 0, arrived, retry=True,
                timeout=target.timeout, fallback=True, stream=_streams(body), ending=ending,
            )  # fmt: skip
        except asyncio.CancelledError:  # the client left (its handler is cancelled)
            self.metrics.fallback.labels("cancelled").inc()
            raise
        self.metrics.fallback.labels("failed" if response is None else ending.outcome).inc()
        return response

    def _timed_out(self, engine_url: str, timeout: float | None) -> web.Response:
        """A 504: the engine has the request but sent nothing for the read deadline. Not retried elsewhere
        (it may be running still) nor taken as the engine being gone."""
        seconds = timeout if timeout is not None else self.settings.upstream_timeout
        return _error(504, f"the engine {engine_url} sent nothing for {seconds:g} s (the router's read deadline)",
                      "upstream_error", "upstream_timeout", self._retry_after())  # fmt: skip

    async def _forward(
        self,
        request: web.Request,
        engine_url: str,
        raw: bytes,
        method: str,
        reason: str,
        matched_blocks: int,
        arrived: float | None = None,
        retry: bool = False,
        routed_to: str | None = None,
        timeout: float | None = None,
        accepted: Callable[[], None] | None = None,
        unreachable: set[str] | None = None,
        fallback: bool = False,
        stream: bool = False,
        ending: Ending | None = None,
    ) -> web.StreamResponse | None:
        """Send the request to one engine and relay its answer; None when, before the response began, it
        answered overloaded or could not be reached (then it is added to `unreachable`) and `retry` allows
        another engine; for the `fallback`, None also when it answered an error status (>= 400: the fallback
        failed, as the engines' own fallback takes it), or when its whole answer broke off; `ending` says how an
        answer that began ended. `accepted` is called when the engine itself takes
        the request (a 2xx answer not from its fallback). Only a stream's answer is a first token: its first
        event comes with it, where a whole answer's first byte comes with its last."""
        assert self.session is not None
        ending = Ending() if ending is None else ending
        arrived = time.perf_counter() if arrived is None else arrived
        engine = self.pool.engines.get(engine_url)
        # The fallback is no engine of the pool: nothing to count or mark there.
        state = engine.state if engine is not None else EngineState(engine_url)
        headers = upstream_headers(request.headers.items(), stream, fallback)
        if fallback:
            headers.update(self.settings.fallback_headers)
        state.in_flight += 1
        try:
            try:
                upstream_cm = self.session.request(
                    method,
                    engine_url + request.path_qs,
                    data=raw or None,
                    headers=headers,
                    # The client's, or none (aiohttp would label a body `application/octet-stream`).
                    skip_auto_headers=("Accept-Encoding", "Content-Type"),
                    # A deadline of its own (the fallback's) bounds each wait for data.
                    timeout=self.session.timeout if timeout is None else _between_reads(timeout),
                )
                upstream = await upstream_cm.__aenter__()
            except aiohttp.SocketTimeoutError:  # it has the request, and said nothing for that long
                self.metrics.upstream_errors.labels(engine_url).inc()
                if fallback:
                    return None  # counted as failed
                return self._timed_out(engine_url, timeout)
            except (aiohttp.ClientError, TimeoutError) as exc:
                self.metrics.upstream_errors.labels(engine_url).inc()
                state.ready = False  # until the next poll says otherwise
                if retry:
                    if unreachable is not None:
                        unreachable.add(engine_url)
                    return None
                return _error(
                    502,
                    f"the engine could not be reached: {exc}",
                    "upstream_error",
                    "engine_unreachable",
                    self._retry_after(),
                )
            finished = False
            try:
                # 503: the engine is overloaded (or not serving): another may take it. A 429 is the client's
                # own limit at that engine: relayed, so the limit holds and no one else is turned away.
                # An engine that failed for good before answering (`engine_failed`: it exits, its pod
                # restarts) is taken as gone, as one that cannot be reached: the request may be held.
                if fallback and upstream.status >= 400:
                    with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                        await upstream.read()
                    finished = True
                    log.warning("fallback %s answered %d: the request is shed", engine_url, upstream.status)
                    return None
                if upstream.status == 503 and retry:
                    refusal = await upstream.read()
                    finished = True
                    if engine is not None and _engine_failed(refusal):
                        self.metrics.upstream_errors.labels(engine_url).inc()
                        state.ready = False  # until the next poll says otherwise
                        if unreachable is not None:
                            unreachable.add(engine_url)
                        return None
                    wait = _retry_after(upstream.headers.get("Retry-After"), self._retry_after())
                    state.overloaded_until = time.monotonic() + wait
                    if engine is not None and _is_shed(refusal):
                        self.metrics.engine_sheds_retried.inc()  # the engine counted it; the client won't see it
                    return None
                ok = 200 <= upstream.status < 300
                if accepted is not None and ok and upstream.headers.get("x-ember-served-by") != "fallback":
                    accepted()
                stored = upstream.headers.get(RESPONSE_ID_HEADER)
                if ok and stored and not fallback:  # a Responses API answer: where it is kept, if it is
                    self.homes.put(stored, engine_url)
                answer = answer_headers(upstream.headers.items())
                answer[ROUTED_TO] = routed_to or engine_url
                answer[ROUTE_REASON] = reason
                if fallback:
                    answer["x-ember-served-by"] = "fallback"
                if upstream.content_length is not None and not _is_sse(upstream.content_type):
                    # A whole answer of known length (not a stream): passed on in one piece, headers and
                    # body in one write, instead of chunk by chunk.
                    try:
                        body = await upstream.read()
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        self.metrics.upstream_errors.labels(engine_url).inc()
                        if fallback:  # nothing has reached the client: the fallback failed
                            log.warning("fallback %s broke off its answer: %r", engine_url, exc)
                            return None
                        if isinstance(exc, aiohttp.SocketTimeoutError):
                            return self._timed_out(engine_url, timeout)
                        log.warning("%s broke off its answer to %s: %r", engine_url, request.path, exc)
                        return _error(502, f"{_upstream(engine_url, fallback)} broke off its answer before its end",
                                      "upstream_error", "upstream_error", self._retry_after())  # fmt: skip
                    finished = True
                    self.metrics.e2e.observe(time.perf_counter() - arrived)
                    return web.Response(
                        body=body, status=upstream.status, reason=upstream.reason, headers=answer
                    )
                out = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=answer)
                await out.prepare(request)
                # A stream is cut into events to end it with a whole error event if it breaks off; one
                # compressed though asked for as it is (`identity`) passes on as it comes.
                framer = (
                    EventFramer()
                    if _is_sse(upstream.content_type) and not encoded(upstream.headers)
                    else None
                )
                # A refusal, or a body other than a stream, has no first token to time.
                first = ok and framer is not None
                idle = self.settings.stream_idle_timeout if _is_sse(upstream.content_type) else None
                try:
                    async for chunk in chunks(upstream.content, idle):
                        if first:
                            self.metrics.ttft.observe(time.perf_counter() - arrived)
                            first = False
                        try:
                            await out.write(framer.feed(chunk) if framer is not None else chunk)
                        except ConnectionResetError:
                            ending.outcome = "cancelled"
                            return out  # the client left; leaving closes the upstream (below)
                except StreamIdle:
                    # The engine sent nothing of the stream for the idle timeout (frozen, or its host
                    # gone without a word): the stream ends as one broken off, and the upstream is closed.
                    self.metrics.upstream_errors.labels(engine_url).inc()
                    ending.outcome = "failed"
                    upstream.close()
                    said = f"{_upstream(engine_url, fallback)} sent nothing for {idle:g} s (the router's stream idle timeout)"
                    log.warning("%s: %s", request.path, said)
                    if framer is None:
                        if request.transport is not None:
                            request.transport.close()
                        finished = True
                        return out
                    with contextlib.suppress(ConnectionResetError):
                        await out.write(error_event(said, "upstream_timeout"))
                except (aiohttp.ClientError, TimeoutError) as exc:
                    # The engine broke off (it died, or said nothing for the read deadline): a stream ends
                    # with an error event after its last whole event; another body cannot be mended, and its
                    # connection is closed unfinished so that the client sees it cut.
                    self.metrics.upstream_errors.labels(engine_url).inc()
                    ending.outcome = "failed"
                    log.warning("%s broke off its answer to %s: %r", engine_url, request.path, exc)
                    if framer is None:
                        if request.transport is not None:
                            request.transport.close()
                        finished = True
                        return out
                    with contextlib.suppress(ConnectionResetError):  # (the client may be gone too)
                        await out.write(
                            error_event(
                                _broke_off(
                                    _upstream(engine_url, fallback),
                                    exc,
                                    timeout or self.settings.upstream_timeout,
                                ),
                                "upstream_error",
                            )
                        )
                else:
                    if framer is not None:
                        with contextlib.suppress(ConnectionResetError):
                            await out.write(framer.rest())
                # A client that closes once it has the last event (as on `data: [DONE]`) is served.
                with contextlib.suppress(ConnectionResetError):
                    await out.write_eof()
                finished = True
                self.metrics.e2e.observe(time.perf_counter() - arrived)
                return out
            finally:
                if not finished:
                    # Leaving early (the client went away, or the handler was cancelled) closes the upstream
                    # connection, and the engine aborts the request within a step.
                    upstream.close()
                await upstream_cm.__aexit__(None, None, None)
        finally:
            state.in_flight -= 1


def _broke_off(upstream: str, exc: BaseException, read_deadline: float | None) -> str:
    """What a client is told of an upstream that broke off its answer, in words (the exception is logged)."""
    if isinstance(exc, TimeoutError) and read_deadline is not None:
        return f"{upstream} sent nothing for {read_deadline:g} s (the router's read deadline)"
    return f"{upstream} broke off its answer before its end"


def _upstream(url: str, fallback: bool) -> str:
    """The upstream as the router's messages name it."""
    return f"the fallback {url}" if fallback else f"the engine {url}"


def _streams(body: Any) -> bool:
    """Whether the request asks for its answer as a stream of events."""
    return isinstance(body, dict) and body.get("stream") is True


def _is_sse(content_type: str) -> bool:
    return content_type == "text/event-stream"


def _between_reads(seconds: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=None, sock_connect=min(seconds, CONNECT_TIMEOUT), sock_read=seconds)


def _is_shed(body: bytes) -> bool:
    """Whether an engine's 503 body is a load-shedding refusal (`type: "overloaded"`), which the engine counts
    in `ember:requests_shed_total`; a 503 of another kind (a model still loading) is not."""
    error = _error_of(body)
    return error is not None and error.get("type") == "overloaded"


def _engine_failed(body: bytes) -> bool:
    """Whether an engine's 503 body says the engine failed for good before answering (`engine_failed`)."""
    error = _error_of(body)
    return error is not None and error.get("code") == "engine_failed"


def _error_of(body: bytes) -> dict[str, Any] | None:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, dict) else None


def _retry_after(value: str | None, default: int) -> float:
    try:
        return max(0.0, float(value)) if value is not None else float(default)
    except ValueError:
        return float(default)


def _error(status: int, message: str, type_: str, code: str, retry_after: int) -> web.Response:
    return error_response(status, message, type_, code, retry_after)
