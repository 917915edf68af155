"""How the router polls engines: an ember engine in one request (`/v1/load`), any other OpenAI-compatible
engine the way vLLM's are polled (`/ready`, `/metrics`, `/v1/kv_events`), and an unreadable answer taken as
an engine not Ready rather than the end of polling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import plainhttp
import pytest
from aiohttp import web
from server_util import running_server

from ember_engine.core.kv_events import STORED, prefix_hashes
from ember_router.pool import REPROBE_POLLS, EnginePool


def _counting_session(paths: list[str]) -> aiohttp.ClientSession:
    """A real client that notes the path of every request it sends."""
    trace = aiohttp.TraceConfig()

    async def on_start(_s: Any, _c: Any, params: aiohttp.TraceRequestStartParams) -> None:
        paths.append(params.url.path)

    trace.on_request_start.append(on_start)
    return aiohttp.ClientSession(trace_configs=[trace])


def test_the_engines_load_endpoint_answers_readiness_gauges_and_events_at_once(tiny_model: Path) -> None:
    with running_server(tiny_model, "--block-size", "16") as s:
        first = plainhttp.get(f"{s.url}/v1/load", params={"since": 0}).json()
        assert first["status"] == "ready"
        assert first["num_requests_running"] == 0 and first["num_requests_waiting"] == 0
        assert 0.0 <= first["kv_cache_usage_perc"] <= 1.0
        events = first["kv_events"]
        assert events["block_size"] == 16 and events["enabled"] is True and "snapshot" in events
        prompt = [7 + i % 40 for i in range(48)]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        assert plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
        delta = plainhttp.get(f"{s.url}/v1/load", params={"since": events["seq"]}).json()["kv_events"]
        assert "snapshot" not in delta
        assert [h for kind, h in delta["events"] if kind == STORED][:2] == prefix_hashes(prompt, 16)[:2]

        # The router polls it with that one request, and learns what the three would have told it.
        async def poll() -> list[str]:
            paths: list[str] = []
            pool = EnginePool([s.url])
            async with _counting_session(paths) as session:
                await pool.poll_once(session)
                await pool.poll_once(session)
            engine = pool.engines[s.url]
            assert engine.state.ready and engine.events_live and engine.block_size == 16
            assert pool.index.matched_blocks(s.url, prefix_hashes(prompt, 16), events_live=True) == 3
            return paths

        assert asyncio.run(poll()) == ["/v1/load", "/v1/load"]

        s.state.draining = True  # `/v1/load` answers 503, as `/ready` does
        try:
            assert plainhttp.get(f"{s.url}/v1/load").status_code == 503

            async def poll_draining() -> bool:
                pool = EnginePool([s.url])
                async with aiohttp.ClientSession() as session:
                    await pool.poll_once(session)
                return pool.engines[s.url].state.ready

            assert asyncio.run(poll_draining()) is False
        finally:
            s.state.draining = False


_PAGE = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m"} 0.5
"""


@contextlib.asynccontextmanager
async def _vllm_shaped(answers: dict[str, tuple[int, str]]) -> AsyncIterator[str]:
    """An HTTP server with only the endpoints in `answers` (vLLM has no `/v1/load`); 404 for the rest."""
    app = web.Application()
    for path, (status, text) in answers.items():

        async def handler(_r: web.Request, status: int = status, text: str = text) -> web.Response:
            return web.Response(status=status, text=text)

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_an_engine_without_the_load_endpoint_is_polled_as_vllms_are_and_asked_again_later() -> None:
    async def run() -> None:
        async with _vllm_shaped({"/ready": (200, "ok"), "/metrics": (200, _PAGE)}) as url:
            paths: list[str] = []
            pool = EnginePool([url])
            async with _counting_session(paths) as session:
                await pool.poll_once(session)
                state = pool.engines[url].state
                assert (state.ready, state.running, state.waiting, state.kv_usage) == (True, 3.0, 2.0, 0.5)
                assert not pool.engines[url].events_live  # no /v1/kv_events: the router's own record
                assert paths == ["/v1/load", "/ready", "/metrics", "/v1/kv_events"]
                for _ in range(REPROBE_POLLS):
                    await pool.poll_once(session)
            assert paths.count("/v1/load") == 2  # once at first, once again after REPROBE_POLLS polls

    asyncio.run(run())


def test_an_unreadable_answer_leaves_nothing_trusted_from_it_and_polling_goes_on() -> None:
    async def run() -> None:
        garbled_load = {"/v1/load": (200, "not json")}
        garbled_events = {"/ready": (200, "ok"), "/metrics": (200, _PAGE), "/v1/kv_events": (200, "{")}
        async with _vllm_shaped(garbled_load) as bad, _vllm_shaped(garbled_events) as half:
            pool = EnginePool([bad, half])
            pool.engines[bad].state.ready = True
            async with aiohttp.ClientSession() as session:
                await pool.poll_once(session)  # raises nothing
                await pool.poll_once(session)
            assert pool.engines[bad].state.ready is False  # its readiness came in the unreadable answer
            assert pool.engines[half].state.ready is True  # `/ready` said so; only its events are unread
            assert pool.engines[half].state.running == 3.0 and not pool.engines[half].events_live

    asyncio.run(run())


@pytest.mark.parametrize(
    "events",
    [
        "[]",  # JSON, but not an object
        "null",
        '{"block_size": Infinity, "seq": 1, "events": []}',
        '{"block_size": 16, "seq": "1", "events": []}',
        '{"block_size": 16, "seq": 1, "events": [["stored"]]}',
        '{"block_size": 16, "seq": 1, "events": 3}',
    ],
)
def test_events_of_the_wrong_shape_leave_the_events_unread_and_polling_goes_on(events: str) -> None:
    """Such an answer raised out of the poll (AttributeError, OverflowError) and ended the poller: no engine
    was polled again, whatever became of it."""

    async def run() -> None:
        answers = {"/ready": (200, "ok"), "/metrics": (200, _PAGE), "/v1/kv_events": (200, events)}
        async with _vllm_shaped(answers) as half, _vllm_shaped({"/ready": (200, "ok")}) as other:
            pool = EnginePool([half, other], poll_interval=0.01)
            async with aiohttp.ClientSession() as session:
                poller = asyncio.create_task(pool.run(session))
                await asyncio.sleep(0.3)
                alive = not poller.done()
                poller.cancel()
            assert alive, poller.exception()
            assert pool.engines[half].state.ready is True and not pool.engines[half].events_live
            assert pool.engines[other].state.ready is True

    asyncio.run(run())


@pytest.mark.parametrize(
    "load",
    [
        "[]",
        '{"num_requests_waiting": 0, "num_requests_running": 0, "kv_cache_usage_perc": 0, "kv_events": null}',
    ],
)
def test_a_load_answer_of_the_wrong_shape_leaves_the_engine_not_ready(load: str) -> None:
    async def run() -> None:
        async with _vllm_shaped({"/v1/load": (200, load)}) as bad:
            pool = EnginePool([bad])
            pool.engines[bad].state.ready = True
            async with aiohttp.ClientSession() as session:
                await pool.poll_once(session)
            assert pool.engines[bad].state.ready is False

    asyncio.run(run())
