"""`ember router` as an HTTP proxy (RFC 9110): the headers of one hop stay on it, a compressed request body
reaches the engine as a body it can read, and `Expect: 100-continue` is answered by the router. The engine
behind it is a stand-in server that keeps what each request brought and answers as an engine would."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import plainhttp
import pytest
from aiohttp import web
from multidict import CIMultiDict
from test_router import running_router

from ember_router.embedded import serving_app

BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 3}


@dataclass
class RecordingEngine:
    url: str
    seen: list[tuple[CIMultiDict[str], bytes]] = field(default_factory=list)  # each request's headers, body

    async def _ready(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    async def _complete(self, request: web.Request) -> web.Response:
        body = await request.read()  # decoded as its Content-Encoding says, as any aiohttp server does
        self.seen.append((CIMultiDict(request.headers), body))
        answer = {"object": "text_completion", "model": json.loads(body)["model"], "choices": []}
        # A header its Connection names belongs to this hop only.
        return web.json_response(answer, headers={"Connection": "keep-alive, X-Hop", "X-Hop": "engine"})


async def _no_continue(_request: web.Request) -> None:
    """A server need not send `100 Continue` (RFC 9110 §10.1.1): it waits for the body."""


@contextmanager
def recording_engine() -> Iterator[RecordingEngine]:
    engine = RecordingEngine("")
    app = web.Application()
    app.router.add_get("/ready", engine._ready)
    app.router.add_post("/v1/completions", engine._complete, expect_handler=_no_continue)
    with serving_app(app, name="recording-engine") as url:
        engine.url = url
        yield engine


@pytest.fixture
def router(tiny_model: Path) -> Iterator[tuple[str, RecordingEngine]]:
    with recording_engine() as engine, running_router(tiny_model, [engine.url]) as (url, _router):
        yield url, engine


def test_the_headers_of_one_hop_stay_on_it(router: tuple[str, RecordingEngine]) -> None:
    """The router dropped only the hop-by-hop headers it knew by name: a header the client's `Connection`
    named (RFC 9110 §7.6.1), and `Proxy-Connection`, went on to the engine, and the engine's own
    connection options came back to the client. A request with no `Content-Type` reached the engine as
    `application/octet-stream` (what aiohttp labels bytes), which FastAPI servers do not read as JSON."""
    url, engine = router
    r = plainhttp.post(
        f"{url}/v1/completions",
        content=json.dumps(BODY).encode(),
        headers={
            "Connection": "keep-alive, X-Hop",
            "X-Hop": "client",
            "Proxy-Connection": "keep-alive",
            "Authorization": "Bearer k",
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    headers, _ = engine.seen[-1]
    assert headers["Authorization"] == "Bearer k"  # an end-to-end header goes on
    assert "X-Hop" not in headers and "Proxy-Connection" not in headers, headers
    assert "Content-Type" not in headers, headers
    assert "x-hop" not in r.headers, r.headers


def test_a_compressed_request_body_reaches_the_engine_as_one_it_can_read(
    router: tuple[str, RecordingEngine],
) -> None:
    """The router's server decodes a `Content-Encoding: gzip` body, and the router sent the decoded body on
    still labelled gzip: an engine that decodes it as labelled failed (500), and a body that was not gzip
    at all was the router's own 500 with a traceback in its log."""
    url, engine = router
    r = plainhttp.post(
        f"{url}/v1/completions",
        content=gzip.compress(json.dumps(BODY).encode()),
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    headers, body = engine.seen[-1]
    assert json.loads(body) == BODY and "Content-Encoding" not in headers, headers
    bad = plainhttp.post(
        f"{url}/v1/completions",
        content=b"not gzip",
        headers={"Content-Encoding": "gzip", "Content-Type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400, bad.text
    error = bad.json()["error"]
    assert error["type"] == "invalid_request_error" and "gzip" in error["message"], error
    assert len(engine.seen) == 1


def test_expect_100_continue_is_answered_by_the_router(router: tuple[str, RecordingEngine]) -> None:
    """The router answers a client's `Expect: 100-continue` itself and then has the whole body, but sent the
    header on: aiohttp then waited for the engine's `100 Continue` before sending the body, and an engine
    that sends none (it need not) waited for the body: the request hung (curl sends the header with any
    body over 1 MiB)."""
    url, engine = router
    r = plainhttp.post(f"{url}/v1/completions", json=BODY, headers={"Expect": "100-continue"}, timeout=30)
    assert r.status_code == 200, r.text
    headers, body = engine.seen[-1]
    assert json.loads(body) == BODY and "Expect" not in headers, headers
