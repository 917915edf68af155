"""`ember router` when an engine's answer does not come whole: a read deadline (`--upstream-timeout`) that
bounds the wait for the engine's next bytes, not the whole answer; an engine that dies mid-stream; and the
router's own errors (unknown routes, wrong methods, bodies over its limit) in OpenAI's shape."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import plainhttp
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_util import InProcessServer, running_server, server_process
from test_router import running_router
from waiting import wait_for

from ember_engine.core.tokenizer import Tokenizer
from ember_router.embedded import serving
from ember_router.pool import EnginePool
from ember_router.proxy import ROUTED_TO, Router, RouterSettings


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--block-size", "16") as server:
        yield server


def _model(url: str) -> str:
    return str(plainhttp.get(f"{url}/v1/models").json()["data"][0]["id"])


def _counter(url: str, name: str) -> float:
    page = plainhttp.get(f"{url}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(page) for s in f.samples if s.name == name)


def test_the_read_deadline_bounds_each_wait_not_the_whole_answer(
    tiny_model: Path, engine: InProcessServer
) -> None:
    """The router's deadline covered the whole answer (600 s, no flag): a longer stream was cut and a longer
    request run again on another engine, then answered 502 with an empty message and the engines marked
    not Ready."""
    settings = RouterSettings(upstream_timeout=1.0)
    with running_router(tiny_model, [engine.url], settings=settings) as (url, router):
        model = _model(engine.url)
        body = {"model": model, "prompt": "go", "max_tokens": 1500, "ignore_eos": True}
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(
            model=model,
            prompt="go",
            max_tokens=1500,
            extra_body={"ignore_eos": True},
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 1500
        routed = _counter(url, "ember_router:decisions_total")
        r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=120)  # nothing comes until it is done
        assert r.status_code == 504, r.text
        assert r.json()["error"]["code"] == "upstream_timeout" and "1 s" in r.json()["error"]["message"]
        assert _counter(url, "ember_router:decisions_total") == routed + 1  # sent once, not run again
        assert router.pool.engines[engine.url].state.ready  # slow is not gone


def test_an_engine_that_dies_mid_stream_ends_the_stream_with_an_error_event(tiny_model: Path) -> None:
    """The client's stream was cut as an incomplete chunked body, with no error event and no [DONE], and
    the router logged a traceback without counting an upstream error."""
    with (
        server_process(tiny_model, "--block-size", "16") as (engine_url, proc),
        running_router(tiny_model, [engine_url]) as (url, _router),
    ):
        body = {"model": _model(engine_url), "prompt": "go", "max_tokens": 1900, "ignore_eos": True}
        events: list[str] = []
        with plainhttp.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 3:
                        proc.send_signal(signal.SIGKILL)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "upstream_error" and engine_url in error["message"]
        assert all("choices" in json.loads(e) for e in events[:-2])  # every event before it whole
        assert _counter(url, "ember_router:upstream_errors_total") == 1


def test_requests_on_an_engine_that_dies_before_answering_are_held_for_the_next_ready_one(
    tiny_model: Path, engine: InProcessServer
) -> None:
    """Failover: the requests in flight on an engine killed before it answered were shed at once (503
    `fleet_overloaded`), though the router holds requests (`hold_seconds`) and a warm engine was Ready a
    moment later; with no engine Ready within the hold the answer is `no_engine_ready`, as for a request
    that arrives to no engine."""
    engine.state.draining = True  # the warm engine: not Ready yet
    try:
        with server_process(tiny_model, "--block-size", "16") as (dying, proc), ExitStack() as stack:
            routers = []
            for urls, hold in (([dying, engine.url], 30.0), ([dying], 1.0)):
                router = Router(
                    EnginePool(urls, poll_interval=0.1),
                    Tokenizer(str(tiny_model)),
                    RouterSettings(hold_seconds=hold),
                )
                url = stack.enter_context(serving(router))
                wait_for(lambda r=router: r.pool.engines[dying].state.ready, what="the engine polled Ready")
                routers.append(url)
            held_url, short_url = routers
            body = {"model": _model(dying), "prompt": "go", "max_tokens": 500, "ignore_eos": True}
            with ThreadPoolExecutor(4) as pool:
                held = [
                    pool.submit(httpx.post, f"{held_url}/v1/completions", json=body, timeout=120)
                    for _ in range(3)
                ]
                short = pool.submit(httpx.post, f"{short_url}/v1/completions", json=body, timeout=120)
                wait_for(lambda: _counter(dying, "vllm:num_requests_running") == 4, what="4 requests running")
                proc.send_signal(signal.SIGKILL)  # before any byte of a whole answer
                wait_for(
                    lambda: (
                        _counter(held_url, "ember_router:pending_requests") == 3
                        or all(f.done() for f in held)
                    ),
                    what="the 3 requests held",
                )
                answered = [f.result().text for f in held if f.done()]
                assert not answered, answered
                r = short.result(timeout=30)  # its hold (1 s from its arrival) runs out
                assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_ready", r.text
                engine.state.draining = False  # the warm engine becomes Ready
                for f in held:
                    r = f.result(timeout=120)
                    assert r.status_code == 200, r.text
                    assert r.headers[ROUTED_TO] == engine.url
                    assert r.json()["usage"]["completion_tokens"] == 500
    finally:
        engine.state.draining = False


def test_an_engine_that_refuses_is_not_held_for(tiny_model: Path, engine: InProcessServer) -> None:
    """Holding is for engines that are not there: one that answers 503 (overloaded, draining) sheds the
    request at once, as without a hold."""
    settings = RouterSettings(hold_seconds=30)
    with running_router(tiny_model, [engine.url], poll_interval=3600, settings=settings) as (url, _router):
        body = {"model": _model(engine.url), "prompt": "x", "max_tokens": 1}
        engine.state.draining = True  # answers 503; the router has not polled since
        try:
            start = time.perf_counter()
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
            elapsed = time.perf_counter() - start
        finally:
            engine.state.draining = False
        assert r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded", r.text
        assert elapsed < 1.0, f"a refusal must be answered at once, took {elapsed:.3f} s"


def test_the_routers_own_errors_are_openai_shaped(tiny_model: Path, engine: InProcessServer) -> None:
    """They were aiohttp's plain text (404, 405, 413), and `GET /v1/models/{id}` was a 404 the engine
    answers."""
    with running_router(tiny_model, [engine.url]) as (url, _router):
        for r, status in (
            (plainhttp.get(f"{url}/v1/nowhere"), 404),
            (plainhttp.get(f"{url}/v1/completions"), 405),
            (plainhttp.post(f"{url}/v1/completions", content=b"x" * (32 * 1024 * 1024 + 1)), 413),
        ):
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], error
        model = _model(engine.url)
        one = plainhttp.get(f"{url}/v1/models/{model}")
        assert one.status_code == 200 and one.json()["id"] == model, one.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert client.models.retrieve(model).id == model


def test_a_stream_from_a_frozen_engine_ends_after_the_stream_idle_timeout(tiny_model: Path) -> None:
    """With no `--upstream-timeout` (as the operator runs the router), a stream whose engine froze mid-way
    (SIGSTOP) never ended: no error event, no `[DONE]`, the client waiting for ever. An idle stream now ends
    after the router's stream idle timeout (300 s unless set, as Envoy's `stream_idle_timeout`)."""
    assert RouterSettings().stream_idle_timeout == 300.0
    with (
        server_process(tiny_model, "--block-size", "16") as (engine_url, proc),
        running_router(tiny_model, [engine_url], settings=RouterSettings(stream_idle_timeout=1.0)) as (
            url,
            _,
        ),
    ):
        body = {
            "model": _model(engine_url),
            "prompt": "go",
            "max_tokens": 1900,
            "ignore_eos": True,
            "stream": True,
        }
        events: list[str] = []
        try:
            with plainhttp.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        if len(events) == 3:
                            proc.send_signal(signal.SIGSTOP)
        finally:
            proc.send_signal(signal.SIGCONT)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "upstream_timeout" and "1 s" in error["message"], error
        assert all("choices" in json.loads(e) for e in events[:-2])
        assert _counter(url, "ember_router:upstream_errors_total") == 1
