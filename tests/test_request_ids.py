"""`X-Request-Id` on every answer, of the engine and of the router: the client's own id when it sent a usable
one, else one made for the request; through a router the upstream gets the same id the client is told."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import plainhttp
import pytest
from fake_fallback import FakeFallback, fake_fallback
from server_util import InProcessServer, running_server
from test_router_fallback import BOTH, body, router_before

from ember_router.fallback import from_flags

MADE = re.compile(r"[0-9a-f]{32}")


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", "tiny") as server:
        yield server


@pytest.fixture
def fallback() -> Iterator[FakeFallback]:
    with fake_fallback() as fake:
        yield fake


def test_the_engine_answers_with_the_clients_id_or_one_of_its_own(engine: InProcessServer) -> None:
    made = plainhttp.get(f"{engine.url}/v1/models").headers["x-request-id"]
    assert MADE.fullmatch(made)
    assert plainhttp.get(f"{engine.url}/v1/models").headers["x-request-id"] != made
    mine = {"X-Request-Id": "report-42"}
    assert plainhttp.get(f"{engine.url}/v1/models", headers=mine).headers["x-request-id"] == "report-42"
    # Errors, and the body limit's refusals before any route, carry it too.
    bad = plainhttp.post(f"{engine.url}/v1/completions", json={"model": "tiny"}, headers=mine)
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "report-42"
    # An id that cannot go back as it came (a space in it, or too long) is replaced by one made here.
    for unusable in ("two words", "x" * 300):
        r = plainhttp.get(f"{engine.url}/v1/models", headers={"X-Request-Id": unusable})
        assert MADE.fullmatch(r.headers["x-request-id"]), r.headers


def test_an_engine_stream_carries_the_id(engine: InProcessServer) -> None:
    with plainhttp.stream(
        "POST", f"{engine.url}/v1/completions", json=body(True), headers={"X-Request-Id": "s-1"}, timeout=60
    ) as r:
        assert r.status_code == 200 and r.headers["x-request-id"] == "s-1"
        assert r.read().endswith(b"data: [DONE]\n\n")


def test_the_router_gives_a_request_an_id_and_sends_the_same_one_on(
    tiny_model: Path, fallback: FakeFallback
) -> None:
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        for stream in (False, True):
            r = plainhttp.post(f"{url}/v1/completions", json=body(stream), timeout=30)
            assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
            assert MADE.fullmatch(r.headers["x-request-id"]), r.headers
            assert fallback.seen[-1]["X-Request-Id"] == r.headers["x-request-id"]
        r = plainhttp.post(
            f"{url}/v1/completions", json=body(True), headers={"X-Request-Id": "mine"}, timeout=30
        )
        assert r.headers["x-request-id"] == "mine" and fallback.seen[-1]["X-Request-Id"] == "mine"
        # The router's own answers: an unknown route, a body that is no JSON object.
        missing = plainhttp.get(f"{url}/v1/nothing-here")
        assert missing.status_code == 404 and MADE.fullmatch(missing.headers["x-request-id"])
        refused = plainhttp.post(f"{url}/v1/completions", content=b"[1]", headers={"X-Request-Id": "r-9"})
        assert refused.status_code == 400 and refused.headers["x-request-id"] == "r-9"
