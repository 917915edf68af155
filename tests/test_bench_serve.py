"""`ember bench serve`: the pure parts on known data, then whole runs against a small streaming server."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

import httpx
import pytest

from ember_engine.bench import serve as bench_serve
from ember_engine.bench.client import Outcome

# --- arrival schedule ---------------------------------------------------------------------------------


def _gaps(rate: float, burstiness: float, seed: int, n: int = 20000) -> list[float]:
    times = bench_serve.arrival_times(n, rate, burstiness, random.Random(seed))
    return [b - a for a, b in itertools.pairwise(times)]


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_arrival_gaps_have_mean_one_over_rate_and_gamma_variation(burstiness: float) -> None:
    gaps = _gaps(rate=4.0, burstiness=burstiness, seed=1)
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(0.25, rel=0.05)
    # gamma with shape B: coefficient of variation 1/sqrt(B)
    assert statistics.pstdev(gaps) / mean == pytest.approx(burstiness**-0.5, rel=0.1)


def test_arrival_schedule_is_seeded_sorted_and_starts_at_zero() -> None:
    a = bench_serve.arrival_times(50, 10.0, 1.0, random.Random(7))
    assert a == bench_serve.arrival_times(50, 10.0, 1.0, random.Random(7))
    assert a != bench_serve.arrival_times(50, 10.0, 1.0, random.Random(8))
    assert a[0] == 0.0
    assert a == sorted(a)


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_evenly() -> None:
    assert bench_serve.arrival_times(5, float("inf"), 1.0, random.Random(0)) == [0.0] * 5
    assert bench_serve.arrival_times(4, 2.0, float("inf"), random.Random(0)) == [0.0, 0.5, 1.0, 1.5]


# --- prompts ------------------------------------------------------------------------------------------


def test_random_prompts_have_the_requested_word_counts() -> None:
    prompts = bench_serve.make_prompts(200, random.Random(0), (5, 9))
    assert all(5 <= len(p.split()) <= 9 for p in prompts)
    assert len(set(prompts)) == 200
    assert prompts == bench_serve.make_prompts(200, random.Random(0), (5, 9))


def test_shared_prefix_and_long_prompts() -> None:
    prompts = bench_serve.make_prompts(40, random.Random(3), (4, 6), 50, long_fraction=0.25, long_factor=10)
    prefix = prompts[0].split()[:50]
    assert all(p.split()[:50] == prefix for p in prompts)
    suffixes = [len(p.split()) - 50 for p in prompts]
    assert sum(s >= 40 for s in suffixes) == 10  # exactly a quarter, each 10x as long
    assert all(4 <= s <= 6 or 40 <= s <= 60 for s in suffixes)


# --- summaries and goodput ----------------------------------------------------------------------------


def test_summary_percentiles_on_known_data() -> None:
    s = bench_serve.summary([i / 1000 for i in range(1, 102)])  # 1..101 ms
    assert s == pytest.approx({"p50": 51.0, "p90": 91.0, "p99": 100.0, "mean": 51.0})
    assert bench_serve.summary([0.004, 0.002]) == pytest.approx(
        {"p50": 3.0, "p90": 3.8, "p99": 3.98, "mean": 3.0}
    )
    assert bench_serve.summary([]) == {"p50": None, "p90": None, "p99": None, "mean": None}


def _ok(ttft: float, latency: float, tokens: int) -> Outcome:
    return Outcome(latency, ttft=ttft, output_tokens=tokens)


def test_goodput_counts_only_requests_meeting_both_slos() -> None:
    outcomes = [
        _ok(0.050, 0.150, 11),  # TTFT 50 ms, TPOT 10 ms: good
        _ok(0.300, 0.400, 11),  # TTFT too slow
        _ok(0.050, 0.550, 11),  # TPOT 50 ms: too slow
        _ok(0.050, 0.050, 1),  # one token: no TPOT to miss
        Outcome(0.001, "503"),  # failed, however fast
    ]
    assert bench_serve.goodput(outcomes, 2.0, 100.0, 20.0) == 1.0
    assert bench_serve.goodput(outcomes, 2.0, 100.0, None) == 1.5
    assert bench_serve.goodput(outcomes, 2.0, None, 20.0) == 1.5
    assert bench_serve.goodput(outcomes, 2.0, None, None) is None


def test_summarize_counts_failures_by_kind_and_fallbacks() -> None:
    outcomes = [
        Outcome(0.5, ttft=0.1, itl=[0.1, 0.3], output_tokens=3, served_by="primary"),
        Outcome(0.3, ttft=0.1, itl=[0.2], output_tokens=2, served_by="fallback-small"),
        Outcome(0.002, "503"),
        Outcome(0.004, "429"),
        Outcome(5.0, "timeout"),
        Outcome(0.2, "stream_error"),
    ]
    r = bench_serve.summarize(outcomes, 2.0)
    assert r["completed"] == 2
    assert r["failed"] == {"503": 1, "429": 1, "timeout": 1, "stream_error": 1}
    assert r["error_latency_ms"]["p50"] == pytest.approx(3.0)  # error responses only, not the timeout
    assert r["itl_ms"]["mean"] == pytest.approx(200.0)
    assert r["tpot_ms"]["p50"] == pytest.approx(200.0)  # (0.5-0.1)/2 and (0.3-0.1)/1
    assert r["request_throughput"] == 1.0
    assert r["output_throughput"] == 2.5
    assert r["served_by_fallback"] == 1
    assert r["served_by"] == {"primary": 1, "fallback-small": 1}


# --- SSE parsing --------------------------------------------------------------------------------------


def test_parse_sse_stream() -> None:
    chunk = {"id": "cmpl-1", "object": "text_completion", "model": "m", "usage": None}
    lines = [
        ": keep-alive",
        'data: {"id": "cmpl-1", "choices": [{"index": 0, "text": "", "finish_reason": null}]}',
        "",
        "data: " + json.dumps({**chunk, "choices": [{"index": 0, "text": " Hello", "finish_reason": None}]}),
        "",
        "data:"
        + json.dumps({**chunk, "choices": [{"index": 0, "text": " world", "finish_reason": "length"}]}),
        "data: "
        + json.dumps({**chunk, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}),
        "data: [DONE]",
    ]
    events = [bench_serve.parse_sse_line(line) for line in lines]
    assert [e is None for e in events] == [True, False, True, False, True, False, False, False]
    assert [e.text for e in events if e] == ["", " Hello", " world", "", ""]
    assert [e.usage_tokens for e in events if e] == [None, None, None, 2, None]
    assert [e.done for e in events if e] == [False] * 4 + [True]
    assert all(e.error is None for e in events if e)

    err = bench_serve.parse_sse_line('data: {"error": {"message": "engine died", "type": "server_error"}}')
    assert err is not None
    assert err.error == "engine died"
    with pytest.raises(ValueError):
        bench_serve.parse_sse_line("data: [1, 2]")
    with pytest.raises(ValueError):
        bench_serve.parse_sse_line("data: {not json")


# --- arguments ----------------------------------------------------------------------------------------


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return p.parse_args(["--model", "m", *argv])


def test_arguments() -> None:
    args = _parse("--rate", "2", "inf", "--header", "x-priority: high", "--input-len", "8:16")
    assert args.rate == [2.0, float("inf")]
    assert args.header == [("x-priority", "high")]
    assert args.input_len == (8, 16)
    assert (args.num_requests, args.burstiness, args.dataset, args.max_concurrency) == (
        100,
        1.0,
        "random",
        None,
    )
    for bad in (["--rate", "0"], ["--rate", "nan"], ["--burstiness", "-1"], ["--header", "novalue"]):
        with pytest.raises(SystemExit):
            _parse(*bad)
    with pytest.raises(SystemExit):
        _parse("--long-fraction", "1.5")


def test_module_does_not_import_torch() -> None:
    code = "import sys, ember_engine.bench.serve; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_plot_without_matplotlib_fails_before_running(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` raise ImportError
    assert bench_serve.main(_parse("--url", "http://127.0.0.1:9", "--plot", "x.png")) == 2
    assert "needs matplotlib" in capsys.readouterr().err


# --- against a real server ----------------------------------------------------------------------------


class StreamingServer:
    """A small OpenAI-style streaming completions server (HTTP/1.1, chunked, keep-alive) on 127.0.0.1, in
    its own thread and event loop. The k-th request it receives (counted from 0, modulo `period`) is shed
    with an immediate 503 if in `shed`, never finishes if in `hang`, gets an error event after one chunk if
    in `stream_error`, and is marked as served by a fallback if in `fallback`."""

    def __init__(
        self,
        *,
        first_delay: float = 0.05,
        gap: float = 0.005,
        period: int = 10**9,
        shed: Collection[int] = (),
        hang: Collection[int] = (),
        stream_error: Collection[int] = (),
        fallback: Collection[int] = (),
    ) -> None:
        self.first_delay, self.gap, self.period = first_delay, gap, period
        self.shed, self.hang, self.stream_error, self.fallback = shed, hang, stream_error, fallback
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.in_flight = self.max_in_flight = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()
        self.port = 0

    def __enter__(self) -> StreamingServer:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self.loop.run_forever()
        server.close()
        self.loop.run_until_complete(self._cancel_handlers())
        self.loop.close()

    async def _cancel_handlers(self) -> None:  # a hanging request's handler sleeps until cancelled
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
                headers = {
                    k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in head[1:] if h)
                }
                body = json.loads(await reader.readexactly(int(headers["content-length"])))
                k = len(self.requests) % self.period
                self.requests.append((headers, body))
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
                try:
                    await self._respond(k, body, reader, writer)
                finally:
                    self.in_flight -= 1
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass  # the client closed the connection, or the server is stopping
        finally:
            writer.close()

    async def _respond(
        self, k: int, body: dict[str, Any], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if k in self.shed:
            payload = json.dumps({"error": {"message": "overloaded", "type": "overloaded", "code": "shed"}})
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload.encode())
            )
            await writer.drain()
            return
        served_by = "fallback" if k in self.fallback else "primary"
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
            b"x-ember-served-by: %s\r\n\r\n" % served_by.encode()
        )

        async def event(data: str) -> None:
            raw = f"data: {data}\n\n".encode()
            writer.write(b"%x\r\n%s\r\n" % (len(raw), raw))
            await writer.drain()

        await asyncio.sleep(self.first_delay)
        if k in self.hang:
            await reader.read()  # until the client gives up and closes the connection
            return
        for i in range(body["max_tokens"]):
            if i:
                await asyncio.sleep(self.gap)
            if k in self.stream_error and i == 1:
                await event(json.dumps({"error": {"message": "engine failed", "type": "server_error"}}))
                break
            await event(
                json.dumps({"id": "c", "choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]})
            )
        else:
            usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": body["max_tokens"]}
            await event(json.dumps({"id": "c", "choices": [], "usage": usage}))
            await event("[DONE]")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _bench(server: StreamingServer, tmp_path: Path, *argv: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    args = _parse("--url", server.url, "--input-len", "4:8", "--output-len", "3:6", "--json", str(out), *argv)
    code = bench_serve.main(args)
    return code, json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"not JSON: {c}"))


def test_one_request_is_timed_from_send() -> None:
    async def one(url: str) -> Outcome:
        async with httpx.AsyncClient() as client:
            body = {"model": "m", "prompt": "a b c", "max_tokens": 5}
            return await bench_serve.send(client, url + "/v1/completions", body, {}, timeout=10.0)

    with StreamingServer(first_delay=0.05, gap=0.01, fallback={0}) as server:
        o = asyncio.run(one(server.url))
    assert o.failure is None
    assert o.ttft >= 0.05
    assert o.output_tokens == 5
    assert len(o.itl) == 4
    assert all(gap >= 0 for gap in o.itl)
    assert o.latency >= 0.05 + 4 * 0.01  # the server cannot finish sooner
    assert o.latency >= o.ttft + sum(o.itl)  # it ends at [DONE], after the last token
    assert o.tpot == pytest.approx((o.latency - o.ttft) / 4)
    assert o.served_by == "fallback"


def test_bench_against_a_server_that_sheds_fails_and_hangs(tmp_path: Path) -> None:
    n, shed, hang, broken, fallback = 20, {3, 7, 11}, {5}, {9}, {2, 4}
    plot = tmp_path / "latency.png"
    with StreamingServer(period=n, shed=shed, hang=hang, stream_error=broken, fallback=fallback) as server:
        start = time.perf_counter()
        code, report = _bench(
            server,
            tmp_path,
            *("--rate", "200", "inf", "--num-requests", str(n), "--timeout", "1", "--slo-ttft", "10000"),
            *("--header", "x-priority: batch", "--plot", str(plot)),
        )
        elapsed = time.perf_counter() - start
    assert code == 0
    assert elapsed < 10  # one request per run would never finish; --timeout 1 s ends it
    assert report["args"]["rate"] == [200.0, "inf"]
    assert [r["rate"] for r in report["results"]] == [200.0, "inf"]
    failing = shed | hang | broken
    for run, r in enumerate(report["results"]):
        assert r["completed"] == n - len(failing)
        assert r["failed"] == {"503": 3, "timeout": 1, "stream_error": 1}
        assert r["served_by_fallback"] == 2
        assert r["goodput"] == pytest.approx(r["request_throughput"])
        assert r["ttft_ms"]["p50"] >= 50.0
        assert r["e2e_ms"]["p50"] > r["ttft_ms"]["p50"]
        assert r["itl_ms"]["p50"] > 0
        # Shed requests are answered at once, before any first token (which the server holds back 50 ms).
        # Not an absolute bound: at an infinite rate one Python client setting up 20 requests at once adds
        # tens of milliseconds to all of them on a busy machine.
        assert r["error_latency_ms"]["p99"] < r["ttft_ms"]["p50"]
        bodies = [body for _, body in server.requests[run * n : (run + 1) * n]]
        tokens = sum(b["max_tokens"] for k, b in enumerate(bodies) if k not in failing)
        assert r["output_throughput"] * r["duration_s"] == pytest.approx(tokens)
    headers, body = server.requests[0]
    assert headers["x-priority"] == "batch"
    assert body["stream"] is True
    assert body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert all(3 <= b["max_tokens"] <= 6 and 4 <= len(b["prompt"].split()) <= 8 for _, b in server.requests)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_open_loop_and_max_concurrency(tmp_path: Path) -> None:
    with StreamingServer(first_delay=0.1) as server:
        code, report = _bench(server, tmp_path, "--rate", "inf", "--num-requests", "8")
        assert code == 0
        assert server.max_in_flight == 8  # all sent at once, none waiting for another's response
        server.max_in_flight = 0
        code, report = _bench(
            server, tmp_path, "--rate", "inf", "--num-requests", "8", "--max-concurrency", "2"
        )
        assert code == 0
        assert server.max_in_flight == 2
    assert report["results"][0]["completed"] == 8
    assert report["results"][0]["goodput"] is None  # no SLO given


def test_unreachable_server_counts_transport_failures(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    out = tmp_path / "down.json"
    args = _parse("--url", f"http://127.0.0.1:{port}", "--num-requests", "3", "--json", str(out))
    assert bench_serve.main(args) == 1
    (result,) = json.loads(out.read_text())["results"]
    assert result["failed"] == {"ConnectError": 3}
    assert result["completed"] == 0
    assert result["ttft_ms"]["p50"] is None
