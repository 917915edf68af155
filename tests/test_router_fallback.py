"""`ember router` sending what no engine can take to its fallback, when the fallback does not answer well: an
error status, an answer that breaks off, a client that leaves; and what of the client's request reaches it.
The fallback is a stand-in server (`fake_fallback`); the engine behind the router is an address where
nothing listens, so that every request goes to the fallback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from fake_fallback import Answer, FakeFallback, fake_fallback
from prometheus_client.parser import text_string_to_metric_families
from waiting import free_port

from ember_engine.core.tokenizer import Tokenizer
from ember_router.embedded import serving
from ember_router.fallback import FallbackTarget, from_flags
from ember_router.pool import EnginePool
from ember_router.proxy import Router, RouterSettings

BOTH = frozenset({"Overloaded", "Unavailable"})


@pytest.fixture
def fallback() -> Iterator[FakeFallback]:
    with fake_fallback() as fake:
        yield fake


@contextmanager
def router_before(target: FallbackTarget, model: Path, hold_seconds: float = 0.0) -> Iterator[str]:
    """A router whose one engine is nowhere, so that no engine is ever Ready."""
    settings = RouterSettings(fallback=target, hold_seconds=hold_seconds)
    router = Router(
        EnginePool([f"http://127.0.0.1:{free_port()}"], poll_interval=0.1), Tokenizer(str(model)), settings
    )
    with serving(router) as url:
        yield url


def counters(url: str) -> dict[str, float]:
    """The router's fallback and shed counters, as `name{label}` -> value."""
    page = httpx.get(f"{url}/metrics").text
    return {
        f"{s.name}{{{next(iter(s.labels.values()))}}}": s.value
        for f in text_string_to_metric_families(page)
        for s in f.samples
        if s.name in ("ember_router:fallback_requests_total", "ember_router:shed_requests_total")
    }


def body(stream: bool) -> dict[str, object]:
    return {"model": "tiny", "prompt": "hello", "max_tokens": 5, "stream": stream}


@pytest.mark.parametrize("status", [400, 404, 429, 500, 503])
def test_a_fallback_that_answers_an_error_has_failed_and_the_router_sheds(
    tiny_model: Path, fallback: FakeFallback, status: int
) -> None:
    """Only a 503 was taken as the fallback failing: its 400, 404, 429 or 500 went to the client as the
    answer and counted `served`, where the engine's own fallback takes any status >= 400 as failing."""
    fallback.answer = Answer(status=status, retry_after="7")
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/completions", json=body(stream), timeout=30)
            assert r.status_code == 503, (status, r.status_code, r.text)
            assert r.json()["error"]["code"] == "fleet_overloaded" and r.headers["Retry-After"] == "1"
            assert "x-ember-served-by" not in r.headers
        seen = counters(url)
        assert seen["ember_router:fallback_requests_total{failed}"] == 2, seen
        assert seen["ember_router:fallback_requests_total{served}"] == 0, seen
        assert seen["ember_router:shed_requests_total{fleet_overloaded}"] == 2, seen
