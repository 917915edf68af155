"""The fallback relay: a client that leaves, and a fallback that breaks or stalls after taking the request."""

from __future__ import annotations

import gzip
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import plainhttp
import pytest
from server_util import InProcessServer, running_server
from test_server_robustness import LONG, MODEL, _one_running_one_waiting, metrics, wait_for, write_policy


def fallback_outcome(url: str, outcome: str) -> float:
    return metrics(url)[("ember:fallback_requests_total", (("outcome", outcome),))]


def finished(url: str, reason: str) -> float:
    return metrics(url)[("vllm:request_success_total", (("finished_reason", reason),))]


def post_then_hang_up(url: str, body: dict[str, Any], when: Callable[[], bool]) -> None:
    """POST `body` to /v1/completions on a raw connection, and close it once `when()` holds."""
    parts = urlsplit(url)
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {parts.hostname}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n\r\n"
    ).encode()
    with socket.create_connection((parts.hostname, parts.port)) as sock:
        sock.sendall(head + data)
        wait_for(when)


def test_a_client_leaving_a_non_streaming_fallback_request_aborts_it_there(
    tiny_model: Path, tmp_path: Path
) -> None:
    with running_server(tiny_model, "--served-model-name", "small-fallback") as fb:
        policy = write_policy(
            tmp_path / "policy.yaml", {"loadShedding": {"maxQueueDepth": 1}, "fallback": {"url": fb.url}}
        )
        with running_server(
            tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)
        ) as s:
            threads = _one_running_one_waiting(s)
            assert fb.state.engine is not None
            before = finished(fb.url, "abort"), finished(fb.url, "length")
            post_then_hang_up(s.url, {**LONG, "n": 4}, lambda: fb.state.engine.stats().num_running > 0)
            # The fallback's request is aborted there, not run on to its 1500 tokens.
            wait_for(lambda: fb.state.engine.stats().num_running == 0, timeout=10)
            assert (finished(fb.url, "abort"), finished(fb.url, "length")) == (before[0] + 1, before[1])
            # Sent there, but not served to anyone: counted apart from what the fallback did serve.
            wait_for(lambda: fallback_outcome(s.url, "cancelled") == 1, timeout=10)
            assert fallback_outcome(s.url, "served") == 0
            for t in threads:
                t.join(60)


class _BrokenFallback(BaseHTTPRequestHandler):
    """Takes the request, then: "truncate" sends its headers and part of the body and hangs up (a stream:
    one event first); "stall" says nothing until the relay gives up; "gzip" answers whole, compressed as
    its request accepts."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if body["prompt"] == "stall":
            self.server.release.wait(10)  # type: ignore[attr-defined]
            return
        if body["prompt"] == "gzip" and "gzip" in self.headers.get("accept-encoding", ""):
            events = b'data: {"id": "x"}\n\n' if body.get("stream") else b'{"id": "x"}'
            packed = gzip.compress(events + (b"data: [DONE]\n\n" if body.get("stream") else b""))
            self.send_response(200)
            self.send_header(
                "content-type", "text/event-stream" if body.get("stream") else "application/json"
            )
            self.send_header("content-encoding", "gzip")
            self.send_header("content-length", str(len(packed)))
            self.end_headers()
            self.wfile.write(packed)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream" if body.get("stream") else "application/json")
        self.send_header("content-length", "1000")
        self.end_headers()
        self.wfile.write(b'data: {"id": "x"}\n\n' if body.get("stream") else b'{"id": "x"')
        self.wfile.flush()
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def broken_fallback() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _BrokenFallback)
    httpd.release = threading.Event()  # type: ignore[attr-defined]
    t = threading.Thread(target=httpd.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.release.set()  # type: ignore[attr-defined]
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def shedding_to(tiny_model: Path, tmp_path: Path, broken_fallback: str) -> Iterator[InProcessServer]:
    fallback = {"url": broken_fallback, "model": "m", "timeoutSeconds": 0.3}
    policy = write_policy(
        tmp_path / "policy.yaml", {"loadShedding": {"maxQueueDepth": 1}, "fallback": fallback}
    )
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)
    ) as s:
        threads = _one_running_one_waiting(s)
        yield s
        for t in threads:
            t.join(60)


def test_a_fallback_that_breaks_off_its_answer_gives_the_shed_error(shedding_to: InProcessServer) -> None:
    s = shedding_to
    r = plainhttp.post(
        f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "truncate", "max_tokens": 2}
    )
    assert r.status_code == 503 and r.headers["retry-after"]
    assert r.json()["error"]["type"] == "overloaded" and r.json()["error"]["code"] == "queue_full"
    assert (fallback_outcome(s.url, "failed"), fallback_outcome(s.url, "served")) == (1, 0)


def test_a_fallback_stream_that_breaks_ends_with_a_whole_error_event(shedding_to: InProcessServer) -> None:
    body = {"model": MODEL, "prompt": "truncate", "max_tokens": 2, "stream": True}
    with plainhttp.stream("POST", f"{shedding_to.url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
        lines = [line for line in r.iter_lines() if line]
    assert lines[0] == 'data: {"id": "x"}' and lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error == {
        "message": "fallback stream interrupted",
        "type": "overloaded",
        "param": None,
        "code": "fallback_interrupted",
    }


@pytest.mark.parametrize("stream", [False, True])
def test_a_fallback_that_compresses_its_answer_is_relayed_readable(
    shedding_to: InProcessServer, stream: bool
) -> None:
    """The relay asks the fallback for a compressed answer (httpx's default Accept-Encoding) and sends it on
    without its Content-Encoding: a stream went on still compressed, bytes no client could read."""
    body = {"model": MODEL, "prompt": "gzip", "max_tokens": 2, "stream": stream}
    with plainhttp.stream("POST", f"{shedding_to.url}/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
        assert "content-encoding" not in r.headers
        text = r.read().decode()
    assert text == ('data: {"id": "x"}\n\ndata: [DONE]\n\n' if stream else '{"id": "x"}')
    assert fallback_outcome(shedding_to.url, "served") == 1


def test_a_fallback_timing_out_is_logged_by_the_error_type(
    shedding_to: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        r = plainhttp.post(f"{shedding_to.url}/v1/completions", json={"model": MODEL, "prompt": "stall"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
    assert "unreachable: ReadTimeout; answering with the shed error" in caplog.text
