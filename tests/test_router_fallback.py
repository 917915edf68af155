"""`ember router` sending what no engine can take to its fallback, when the fallback does not answer well: an
error status, an answer that breaks off, a client that leaves; and what of the client's request reaches it.
The fallback is a stand-in server (`fake_fallback`); the engine behind the router is an address where
nothing listens, so that every request goes to the fallback."""

from __future__ import annotations

import argparse
import http.client
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import plainhttp
import pytest
from fake_fallback import MODEL, Answer, FakeFallback, fake_fallback
from prometheus_client.parser import text_string_to_metric_families
from waiting import free_port, wait_for

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.policy import Fallback
from ember_router import main as router_main
from ember_router.embedded import serving
from ember_router.fallback import FallbackTarget, from_flags
from ember_router.pool import EnginePool
from ember_router.proxy import Router, RouterSettings
from ember_router.rules import Rule

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
    page = plainhttp.get(f"{url}/metrics").text
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
            r = plainhttp.post(f"{url}/v1/completions", json=body(stream), timeout=30)
            assert r.status_code == 503, (status, r.status_code, r.text)
            assert r.json()["error"]["code"] == "fleet_overloaded" and r.headers["Retry-After"] == "1"
            assert "x-ember-served-by" not in r.headers
        seen = counters(url)
        assert seen["ember_router:fallback_requests_total{failed}"] == 2, seen
        assert seen["ember_router:fallback_requests_total{served}"] == 0, seen
        assert seen["ember_router:shed_requests_total{fleet_overloaded}"] == 2, seen


def post_raw(url: str, payload: dict[str, object]) -> tuple[int, dict[str, str], bytes]:
    """POST with no header but the body's (http.client, unlike httpx, can leave out Accept-Encoding)."""
    parsed = httpx.URL(url)
    connection = http.client.HTTPConnection(parsed.host, parsed.port, timeout=30)
    try:
        data = json.dumps(payload).encode()
        connection.putrequest("POST", "/v1/completions", skip_accept_encoding=True)
        connection.putheader("Content-Type", "application/json")
        connection.putheader("Content-Length", str(len(data)))
        connection.endheaders(data)
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        connection.close()


def test_a_client_that_asks_for_no_encoding_gets_none(tiny_model: Path, fallback: FakeFallback) -> None:
    """aiohttp added `Accept-Encoding: gzip, deflate` to every request the router sent on, and the router
    passes bodies on as they come: a client that asked for no encoding got a compressed body."""
    fallback.answer = Answer(compress=True)
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        status, headers, data = post_raw(url, body(False))
        assert status == 200 and headers["x-ember-served-by"] == "fallback", (status, data[:80])
        assert "content-encoding" not in headers, headers
        assert json.loads(data)["model"] == MODEL
        assert "Accept-Encoding" not in fallback.seen[-1], fallback.seen[-1]
        # One that asks for gzip gets it, as the server sends it.
        r = plainhttp.post(
            f"{url}/v1/completions", json=body(False), headers={"Accept-Encoding": "gzip"}, timeout=30
        )
        assert fallback.seen[-1]["Accept-Encoding"] == "gzip"
        assert r.headers["content-encoding"] == "gzip" and r.json()["model"] == MODEL


def stream_events(url: str, accept_encoding: str = "gzip") -> list[str]:
    """The `data:` payloads of a stream through the router, decoded as the client's HTTP library does."""
    with plainhttp.stream(
        "POST",
        f"{url}/v1/completions",
        json=body(True),
        headers={"Accept-Encoding": accept_encoding},
        timeout=30,
    ) as r:
        assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
        return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def test_a_stream_that_breaks_off_ends_with_an_error_event_whatever_the_client_accepts(
    tiny_model: Path, fallback: FakeFallback
) -> None:
    """A client's `Accept-Encoding: gzip` went on, the server compressed the stream, and the router looked
    for the ends of events in compressed bytes: when the stream broke off, its error event was plain text
    after gzip data, and the client could not decode the stream."""
    fallback.answer = Answer(compress=True, events=6, break_after=3)
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        events = stream_events(url)
        assert len(events) == 5 and events[-1] == "[DONE]", events
        assert all("choices" in json.loads(e) for e in events[:3])
        error = json.loads(events[3])["error"]
        assert error["code"] == "upstream_error"
        # Said plainly, naming the fallback (it said "the engine" and passed on an aiohttp exception's repr).
        assert error["message"] == f"the fallback {fallback.url} broke off its answer before its end", error
        # A server that compresses a stream though asked not to: passed on as it is, still whole.
        fallback.answer = Answer(force_gzip=True, events=6)
        events = stream_events(url)
        assert len(events) == 7 and events[-1] == "[DONE]", events


@pytest.mark.parametrize("line_end", ["\r\n", "\r"])
def test_a_stream_whose_lines_end_in_cr_is_relayed_event_by_event(
    tiny_model: Path, fallback: FakeFallback, line_end: str
) -> None:
    """The router found the ends of events only at `\\n\\n`: a server ending its lines with CRLF (as
    sse-starlette does) or CR, as SSE allows, had its whole stream held back until its end, and one that
    broke off lost every event it had sent, the client getting only the error event."""
    fallback.answer = Answer(events=6, break_after=3, line_end=line_end)
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        with plainhttp.stream("POST", f"{url}/v1/completions", json=body(True), timeout=30) as r:
            assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
            events = [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]
        assert len(events) == 5 and events[-1] == "[DONE]", events
        assert all("choices" in json.loads(e) for e in events[:3]), events
        assert json.loads(events[3])["error"]["code"] == "upstream_error", events


def test_the_fallback_flags_bound_the_wait_as_the_policy_file_does(
    tiny_model: Path, fallback: FakeFallback
) -> None:
    """`--fallback-url` had no deadline (a fallback that said nothing held the request for ever), where the
    policy file's `fallback.timeoutSeconds` is 30 s unless set, and no flag could set one."""
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    argv = [
        "--model",
        str(tiny_model),
        "--endpoint",
        f"http://127.0.0.1:{free_port()}",
        "--poll-interval",
        "0.1",
    ]
    built = router_main.build(parser.parse_args([*argv, "--fallback-url", fallback.url]))
    assert built.settings.fallback is not None
    assert built.settings.fallback.timeout == Fallback().timeout_seconds == 30.0
    fallback.answer = Answer(head_delay=60)
    router = router_main.build(
        parser.parse_args([*argv, "--fallback-url", fallback.url, "--fallback-timeout", "0.5"])
    )
    with serving(router) as url:
        r = plainhttp.post(f"{url}/v1/completions", json=body(False), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded", r.text
        assert counters(url)["ember_router:fallback_requests_total{failed}"] == 1


@pytest.mark.parametrize("hold_seconds", [0.0, 1.0])
def test_a_body_that_is_not_a_json_object_is_a_400_at_once(
    tiny_model: Path, fallback: FakeFallback, hold_seconds: float
) -> None:
    """With no engine Ready such a body was shed (503 `fleet_overloaded`, as if a retry could help), or held
    for `hold_seconds` first, where OpenAI and vLLM answer 400."""
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model, hold_seconds) as url:
        for raw, says in ((b"{bad", "body: malformed JSON"), (b"[1, 2]", "body: must be a JSON object")):
            r = plainhttp.post(
                f"{url}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}
            )
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["message"].startswith(says), error
        assert not fallback.seen


CREDENTIALS = {
    "Authorization": "Bearer sk-client",
    "Cookie": "session=abc",
    "Proxy-Authorization": "Basic cHJveHk=",
}


def test_the_clients_credentials_stay_with_the_fleet(tiny_model: Path, fallback: FakeFallback) -> None:
    """The client's Authorization, Cookie and Proxy-Authorization went on to the fallback, where the engines'
    own fallback sends a request of its own with none of the client's headers; and Proxy-Authorization, a
    credential for the proxy alone, went on to every upstream."""
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        headers = {**CREDENTIALS, "Accept": "application/json", "OpenAI-Organization": "org-1"}
        r = plainhttp.post(f"{url}/v1/completions", json=body(False), headers=headers)
        assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback", r.text
        got = fallback.seen[-1]
        assert not {"Authorization", "Cookie", "Proxy-Authorization", "OpenAI-Organization"} & set(got), got
        assert got["Content-Type"] == "application/json" and got["Accept"] == "application/json"
    # Another InferenceService of the fleet (a routing rule's target) is no fallback: per-client limits
    # there need the client's Authorization.
    settings = RouterSettings(routes=((Rule("all", "other"), fallback.url),))
    router = Router(EnginePool([f"http://127.0.0.1:{free_port()}"]), Tokenizer(str(tiny_model)), settings)
    with serving(router) as url:
        r = plainhttp.post(f"{url}/v1/completions", json=body(False), headers=CREDENTIALS)
        assert r.status_code == 200 and r.headers["x-ember-routed-to"] == "other", r.text
        got = fallback.seen[-1]
        assert got["Authorization"] == "Bearer sk-client" and got["Cookie"] == "session=abc"
        assert "Proxy-Authorization" not in got, got


def test_each_fallback_outcome_is_counted_as_what_it_was(tiny_model: Path, fallback: FakeFallback) -> None:
    """A fallback that broke off mid-stream counted `served`, one that broke off a whole answer too (and the
    client got a 502); a client that left while the fallback answered was counted nowhere (the engines
    count it `cancelled`)."""
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model) as url:
        fallback.answer = Answer(events=6, break_after=3)
        events = stream_events(url)
        assert json.loads(events[-2])["error"]["code"] == "upstream_error" and events[-1] == "[DONE]"
        fallback.answer = Answer(break_after=10)  # a whole answer cut: nothing has reached the client
        r = plainhttp.post(f"{url}/v1/completions", json=body(False), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded", r.text
        seen = counters(url)
        assert seen["ember_router:fallback_requests_total{failed}"] == 2, seen
        assert seen["ember_router:fallback_requests_total{served}"] == 0, seen
        # The client leaves mid-stream, then before a whole answer's head.
        fallback.answer = Answer(events=400, event_gap=0.05)
        with plainhttp.stream("POST", f"{url}/v1/completions", json=body(True), timeout=30) as r:
            next(r.iter_lines())
        wait_for(lambda: fallback.left == 1, what="the fallback's stream closed")
        fallback.answer = Answer(head_delay=60)
        with pytest.raises(httpx.ReadTimeout):
            plainhttp.post(f"{url}/v1/completions", json=body(False), timeout=httpx.Timeout(30, read=0.5))
        wait_for(
            lambda: counters(url)["ember_router:fallback_requests_total{cancelled}"] == 2,
            what=lambda: f"both counted cancelled: {counters(url)}",
        )
        seen = counters(url)
        assert seen["ember_router:fallback_requests_total{served}"] == 0, seen
        assert seen["ember_router:fallback_requests_total{failed}"] == 2, seen


def test_a_hold_that_runs_out_on_a_failing_fallback_says_so_once(
    tiny_model: Path, fallback: FakeFallback
) -> None:
    """The answer said "no engine became ready within 1 s" with code `fleet_overloaded`, counted
    `shed{fleet_overloaded}`: the message, the code and the counter now agree."""
    fallback.answer = Answer(status=500)
    with router_before(from_flags(fallback.url, None, BOTH), tiny_model, hold_seconds=0.5) as url:
        r = plainhttp.post(f"{url}/v1/completions", json=body(False), timeout=30)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert (
            error["code"] == "no_engine_ready" and "no engine became ready within 0.5 s" in error["message"]
        )
        seen = counters(url)
        assert seen["ember_router:shed_requests_total{no_engine_ready}"] == 1, seen
        assert seen["ember_router:shed_requests_total{fleet_overloaded}"] == 0, seen
        assert seen["ember_router:fallback_requests_total{failed}"] == 1, seen
