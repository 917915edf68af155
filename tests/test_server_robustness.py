"""What the server does under pressure: disconnects, deadlines, shedding, fallback, policy changes, drain."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import plainhttp
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from server_util import InProcessServer, running_server, server_process
from waiting import free_port

MODEL = "tiny"
LONG = {"model": MODEL, "prompt": "def main():", "max_tokens": 1500, "ignore_eos": True, "temperature": 0}


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = plainhttp.get(f"{url}/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return out


def wait_for(check: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def engine_idle(server: InProcessServer) -> bool:
    assert server.state.engine is not None
    s = server.state.engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0


def write_policy(path: Path, policy: dict) -> Path:
    path.write_text(json.dumps(policy))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1") as s:
        yield s


def aborted(url: str) -> float:
    return metrics(url)[("vllm:request_success_total", (("finished_reason", "abort"),))]


def test_streaming_disconnect_aborts_and_frees_blocks(server: InProcessServer) -> None:
    before = aborted(server.url)
    with plainhttp.stream("POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
    wait_for(lambda: engine_idle(server))
    m = metrics(server.url)
    assert m[("vllm:num_requests_running", ())] == 0 and m[("vllm:kv_cache_usage_perc", ())] == 0.0
    assert aborted(server.url) == before + 1


def test_non_streaming_disconnect_aborts(server: InProcessServer) -> None:
    before = aborted(server.url)
    with pytest.raises(httpx.ReadTimeout):
        plainhttp.post(f"{server.url}/v1/completions", json=LONG, timeout=0.5)
    wait_for(lambda: engine_idle(server))
    assert aborted(server.url) == before + 1


def test_deadline_non_streaming_and_streaming(server: InProcessServer) -> None:
    before = metrics(server.url)[("ember:deadline_aborts_total", ())]
    r = plainhttp.post(f"{server.url}/v1/completions", json={**LONG, "timeout": 0.3}, timeout=30)
    assert r.status_code == 504
    assert r.json()["error"]["type"] == "timeout" and "deadline" in r.json()["error"]["message"]
    with plainhttp.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={**LONG, "stream": True},
        headers={"x-ember-timeout": "0.3"},
        timeout=30,
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][len("data: ") :])["error"]["type"] == "timeout"
    assert any('"text"' in line for line in lines[:-2])  # it had been streaming before the deadline
    wait_for(lambda: engine_idle(server))
    assert metrics(server.url)[("ember:deadline_aborts_total", ())] == before + 2


def _hold(
    url: str, body: dict, started: threading.Event | None = None, headers: dict | None = None
) -> threading.Thread:
    """Stream a request in the background until it ends."""

    def run() -> None:
        with plainhttp.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers or {}, timeout=60
        ) as r:
            for _ in r.iter_lines():
                if started is not None:
                    started.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _one_running_one_waiting(s: InProcessServer) -> list[threading.Thread]:
    """With --max-num-seqs 1: one request decoding and one queued behind it."""
    started = threading.Event()
    threads = [_hold(s.url, {**LONG, "max_tokens": 300}, started)]
    started.wait(30)
    threads.append(_hold(s.url, {**LONG, "max_tokens": 300}))
    wait_for(lambda: sum(s.state.queued.values()) == 1)
    return threads


def test_shedding_by_queue_depth_and_priority(tiny_model: Path, tmp_path: Path) -> None:
    policy = write_policy(
        tmp_path / "policy.yaml",
        {
            "loadShedding": {
                "maxQueueDepth": 3,
                "retryAfterSeconds": 7,
                "priorityClasses": [
                    {"name": "critical", "priority": 0},
                    {"name": "standard", "priority": 1},
                    {"name": "batch", "priority": 2},
                ],
                "defaultPriorityClass": "standard",
            }
        },
    )
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)
    ) as s:
        threads = _one_running_one_waiting(s)  # the waiting one is of the default class, standard
        body = {**LONG, "max_tokens": 300}
        small = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        shed = plainhttp.post(f"{s.url}/v1/completions", json={**small, "priority": "batch"})
        assert shed.status_code == 503 and shed.headers["retry-after"] == "7"
        err = shed.json()["error"]
        assert err["type"] == "overloaded" and err["code"] in ("queue_full", "queue_wait")
        # (A critical request may preempt the running one, which then waits again: count the engine's.)
        threads.append(_hold(s.url, body, headers={"x-ember-priority": "critical"}))
        wait_for(lambda: sum(engine_stats(s)) == 3)
        threads.append(_hold(s.url, body, headers={"x-ember-priority": "critical"}))
        wait_for(lambda: engine_stats(s) == (1, 3))
        standard = plainhttp.post(f"{s.url}/v1/completions", json=small)
        assert standard.status_code == 503  # standard's share is full, critical still had room
        m = metrics(s.url)
        assert m[("ember:requests_shed_total", (("priority", "batch"), ("reason", err["code"])))] == 1
        for t in threads:
            t.join(60)


def test_shedding_on_the_forecast_queue_wait(tiny_model: Path, tmp_path: Path) -> None:
    # One seat, held by a request with 1,500 tokens to go: a newcomer's forecast wait is the rest of that
    # request, far over a 0.2 s limit, although nothing is queued yet.
    one_class = {"priorityClasses": [{"name": "only", "priority": 0}], "defaultPriorityClass": "only"}
    policy = write_policy(
        tmp_path / "policy.yaml", {"loadShedding": {"maxQueueWaitSeconds": 0.2, **one_class}}
    )
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)
    ) as s:
        with plainhttp.stream(
            "POST", f"{s.url}/v1/completions", json={**LONG, "stream": True}, timeout=60
        ) as held:
            lines = held.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            wait_for(lambda: s.state.forecast.forecast is not None)
            r = plainhttp.post(
                f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
            )
            assert r.status_code == 503 and "retry-after" in r.headers
            err = r.json()["error"]
            assert err["type"] == "overloaded" and err["code"] == "queue_wait"
            assert "estimated queue wait" in err["message"] and "maxQueueWaitSeconds 0.2" in err["message"]
            m = metrics(s.url)
            assert m[("ember:estimated_queue_wait_seconds", ())] > 0.2
            assert m[("ember:requests_shed_total", (("priority", "only"), ("reason", "queue_wait")))] == 1
        wait_for(lambda: engine_idle(s))  # hanging up aborted the held request
        assert metrics(s.url)[("ember:estimated_queue_wait_seconds", ())] == 0.0
        # With the seat free again, a newcomer is admitted.
        r = plainhttp.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 200
        wait_for(lambda: s.state.in_flight == 0)
        assert sum(s.state.queued.values()) == 0 and sum(s.state.unsubmitted.values()) == 0
        assert s.state.engine is not None and s.state.engine.submitted == s.state.engine.taken_in


def test_per_client_limit_is_429(tiny_model: Path, tmp_path: Path) -> None:
    policy = write_policy(tmp_path / "policy.yaml", {"loadShedding": {"maxConcurrentPerClient": 1}})
    with running_server(tiny_model, "--served-model-name", MODEL, "--policy", str(policy)) as s:
        started = threading.Event()
        t = _hold(s.url, {**LONG, "max_tokens": 200}, started, headers={"x-ember-client": "alice"})
        started.wait(30)
        r = plainhttp.post(
            f"{s.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            headers={"x-ember-client": "alice"},
        )
        assert (
            r.status_code == 429
            and "retry-after" in r.headers
            and r.json()["error"]["code"] == "client_limit"
        )
        other = plainhttp.post(
            f"{s.url}/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 2},
            headers={"x-ember-client": "bob"},
        )
        assert other.status_code == 200
        t.join(60)


def test_overflow_goes_to_the_fallback(tiny_model: Path, tmp_path: Path) -> None:
    with running_server(tiny_model, "--served-model-name", "small-fallback") as fb:
        policy = write_policy(
            tmp_path / "policy.yaml",
            {
                "loadShedding": {"maxQueueDepth": 1},
                "fallback": {"url": fb.url, "when": ["Overloaded", "Unavailable"]},
            },
        )
        with running_server(
            tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)
        ) as s:
            threads = _one_running_one_waiting(s)
            small = {"model": MODEL, "prompt": "def", "max_tokens": 5, "temperature": 0}
            r = plainhttp.post(f"{s.url}/v1/completions", json=small)
            assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
            assert r.json()["model"] == "small-fallback"
            with plainhttp.stream("POST", f"{s.url}/v1/completions", json={**small, "stream": True}) as st:
                assert st.headers["x-ember-served-by"] == "fallback"
                lines = [line for line in st.iter_lines() if line]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 3
            assert metrics(s.url)[("ember:fallback_requests_total", (("outcome", "served"),))] == 2
            for t in threads:
                t.join(60)
            wait_for(lambda: s.state.in_flight == 0)  # relayed requests count while they are relayed


def test_failed_fallback_gives_the_shed_error(tiny_model: Path, tmp_path: Path) -> None:
    from waiting import free_port

    policy = write_policy(
        tmp_path / "policy.yaml",
        {"loadShedding": {"maxQueueDepth": 1}, "fallback": {"url": f"http://127.0.0.1:{free_port()}"}},
    )
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)
    ) as s:
        threads = _one_running_one_waiting(s)
        r = plainhttp.post(f"{s.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded"
        assert metrics(s.url)[("ember:fallback_requests_total", (("outcome", "failed"),))] == 1
        for t in threads:
            t.join(60)


def test_policy_reloads_without_restart(tiny_model: Path, tmp_path: Path) -> None:
    path = write_policy(tmp_path / "policy.yaml", {"requestTimeoutSeconds": 0})
    with running_server(tiny_model, "--served-model-name", MODEL, "--policy", str(path)) as s:
        body = {**LONG, "max_tokens": 60}
        assert plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60).status_code == 200
        write_policy(path, {"requestTimeoutSeconds": 0.05})
        wait_for(lambda: s.state.policy.policy.request_timeout_seconds == 0.05, timeout=10)
        assert plainhttp.post(f"{s.url}/v1/completions", json=LONG, timeout=60).status_code == 504
        path.write_text("requestTimeoutSeconds: [not a number")  # invalid: the last good policy stays
        time.sleep(1.5)
        assert s.state.policy.policy.request_timeout_seconds == 0.05
        assert plainhttp.post(f"{s.url}/v1/completions", json=LONG, timeout=60).status_code == 504


def test_sigterm_drains_then_exits_zero(tiny_model: Path) -> None:
    with server_process(tiny_model, "--served-model-name", MODEL, "--drain-timeout", "60") as (url, proc):
        lines: list[str] = []
        started = threading.Event()

        def stream() -> None:
            with plainhttp.stream(
                "POST", f"{url}/v1/completions", json={**LONG, "max_tokens": 400, "stream": True}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()

        t = threading.Thread(target=stream)
        t.start()
        started.wait(30)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 503, timeout=10)
        refused = plainhttp.post(
            f"{url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}
        )
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        t.join(60)
        assert proc.wait(timeout=60) == 0
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" if lines[-1] else [x for x in lines if x][-1] == "data: [DONE]"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the in-flight request finished whole


def _stream_lines(url: str, body: dict, lines: list[str], started: threading.Event) -> threading.Thread:
    """Stream a request in the background, keeping its lines (and, last, how the connection broke)."""

    def run() -> None:
        try:
            with plainhttp.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
            ) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    started.set()
        except httpx.HTTPError as exc:
            lines.append(f"broken: {exc!r}")

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    ("signals", "drain_timeout"),
    [(["SIGTERM"], "0.3"), (["SIGTERM", "SIGTERM"], "60"), (["SIGINT"], "60")],
    ids=["drain-timeout", "second-sigterm", "sigint"],
)
def test_requests_cut_by_the_stop_get_a_503_draining(
    tiny_model: Path, signals: list[str], drain_timeout: str
) -> None:
    """Requests still running when the drain timeout ends (or a second signal, or SIGINT, stops the
    server at once) end readably: a JSON 503 `code: "draining"` with Retry-After, a stream's final error
    event and [DONE]. They used to be cancelled: a plain-text 500 and a stream cut mid-body."""
    body = {**LONG, "max_tokens": 1500}
    with server_process(tiny_model, "--served-model-name", MODEL, "--drain-timeout", drain_timeout) as (
        url,
        proc,
    ):
        lines: list[str] = []
        started = threading.Event()
        answers: list[httpx.Response] = []
        threads = [
            _stream_lines(url, body, lines, started),
            threading.Thread(
                target=lambda: answers.append(plainhttp.post(f"{url}/v1/completions", json=body, timeout=60))
            ),
        ]
        threads[1].start()
        started.wait(30)
        wait_for(lambda: metrics(url)[("vllm:num_requests_running", ())] == 2)
        for name in signals:
            proc.send_signal(getattr(signal, name))
            time.sleep(0.1)
        for t in threads:
            t.join(60)
        code = proc.wait(timeout=30)
        assert proc.stdout is not None
        log = proc.stdout.read()
    assert answers[0].status_code == 503, (answers[0].headers, answers[0].text)
    assert answers[0].json()["error"]["code"] == "draining" and answers[0].headers["retry-after"]
    events = [line.removeprefix("data: ") for line in lines if line.startswith(("data: ", "broken: "))]
    assert events[-1] == "[DONE]", events[-2:]
    assert json.loads(events[-2])["error"]["code"] == "draining"
    assert "Exception in ASGI application" not in log, log
    if signals == ["SIGTERM"]:
        assert code == 0 and "Traceback" not in log, log


def test_a_drain_waits_for_requests_relayed_to_the_fallback(tiny_model: Path, tmp_path: Path) -> None:
    """A request relayed to the fallback during a drain is in flight too: the drain waits until its
    stream is relayed whole. It used to count for nothing: the drain ended with the local requests and
    the relayed stream was cut mid-body."""
    with running_server(tiny_model, "--served-model-name", "small-fallback") as fb:
        policy = write_policy(
            tmp_path / "policy.yaml", {"fallback": {"url": fb.url, "when": ["Unavailable"]}}
        )
        with server_process(
            tiny_model, "--served-model-name", MODEL, "--policy", str(policy), "--drain-timeout", "30"
        ) as (url, proc):
            local: list[str] = []
            started = threading.Event()
            threads = [_stream_lines(url, {**LONG, "max_tokens": 400}, local, started)]
            started.wait(30)
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 503, timeout=10)
            relayed: list[str] = []
            with plainhttp.stream(
                "POST", f"{url}/v1/completions", json={**LONG, "stream": True}, timeout=60
            ) as r:
                assert r.headers["x-ember-served-by"] == "fallback"
                try:
                    relayed.extend(line for line in r.iter_lines() if line)
                except httpx.HTTPError as exc:
                    relayed.append(f"broken: {exc!r}")
            threads[0].join(60)
            assert proc.wait(timeout=60) == 0
    assert relayed[-1] == "data: [DONE]", relayed[-2:]
    assert json.loads(relayed[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_sigterm_while_the_model_loads_exits_zero(tiny_model: Path) -> None:
    """A pod deleted while its model loads: the process exits 0 with a plain last line, not a "fatal"
    one the operator would report as the failure (nor a "ready" line after the stop), wherever in the load
    the signal lands. Four servers, stopped at staggered moments of their loads, at once."""
    cmd = [os.path.join(os.path.dirname(sys.executable), "ember"), "serve", "--model", str(tiny_model)]
    outcomes: list[tuple[int, str]] = []

    def stop_while_loading(delay: float) -> None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [*cmd, "--port", str(port), "--host", "127.0.0.1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            wait_for(lambda: _answers(f"{url}/health"), timeout=60)
            time.sleep(delay)
            if plainhttp.get(f"{url}/ready").json()["status"] != "loading":
                return  # loaded before its moment came: not a stop during the load
            proc.send_signal(signal.SIGTERM)
            out, _ = proc.communicate(timeout=60)
            outcomes.append((proc.returncode, out))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    threads = [threading.Thread(target=stop_while_loading, args=(d,)) for d in (0.4, 1.2, 2.0, 2.8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Here (2 cores, four loads at once) each load takes seconds and three or four are stopped while loading;
    # a faster machine may finish more before their moment, but the first is stopped within half a second.
    assert outcomes, "no server was still loading when stopped"
    for code, out in outcomes:
        lines = out.strip().splitlines()
        assert code == 0, out
        assert "stopped before the model was ready" in lines[-1], out
        assert "fatal" not in out and "Traceback" not in out and "; ready" not in out, out


def _answers(url: str) -> bool:
    try:
        return plainhttp.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_log_interval_zero_turns_the_load_log_off_and_a_negative_one_is_refused(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import resource

    from server_util import serve_args

    with pytest.raises(SystemExit):
        serve_args(tiny_model, "--log-interval", "-1")
    assert "--log-interval: must be 0 (off) or more seconds, not -1" in capsys.readouterr().err
    with running_server(tiny_model, "--log-interval", "0"):
        # Idle, the server sleeps: no loop that wakes with nothing to wait for.
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(1.0)
        after = resource.getrusage(resource.RUSAGE_SELF)
        busy = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        assert busy < 0.2, f"an idle server used {busy:.2f} s of CPU in 1 s"


def test_a_model_that_computes_nan_gets_well_formed_errors(tiny_model: Path, tmp_path: Path) -> None:
    """A checkpoint whose final norm is NaN (a diverged fine-tune): its logprobs are not numbers. The
    answer is an OpenAI-shaped 500, and a stream ends with an error event and [DONE], every event JSON;
    never a plain-text 500 nor a NaN in an event."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "nan"
    broken.mkdir()
    for f in tiny_model.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    for f in tiny_model.glob("*.safetensors"):
        tensors = load_file(f)
        if "model.norm.weight" in tensors:
            tensors["model.norm.weight"] = torch.full_like(tensors["model.norm.weight"], float("nan"))
        save_file(tensors, broken / f.name, metadata={"format": "pt"})
    body = {"model": MODEL, "prompt": "x", "max_tokens": 3, "temperature": 0, "logprobs": 2}
    with running_server(broken, "--served-model-name", MODEL) as s:
        r = plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["type"] == "internal_server_error" and "NaN" in error["message"]
        with plainhttp.stream(
            "POST", f"{s.url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as st:
            assert st.status_code == 200
            events = [line.removeprefix("data: ") for line in st.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"

        def not_a_number(constant: str) -> None:
            pytest.fail(f"{constant} in a stream event: {events}")

        parsed = [json.loads(e, parse_constant=not_a_number) for e in events[:-1]]
        assert parsed[-1]["error"]["type"] == "internal_server_error"
        assert plainhttp.get(f"{s.url}/health", timeout=10).status_code == 200  # the server still serves


@pytest.mark.parametrize(
    ("flags", "error"),
    [
        # started, then answered every request 413 "limit of -1 bytes"
        (["--max-request-body-bytes", "-1"], "--max-request-body-bytes: must be 1 or more bytes, not -1"),
        (["--drain-timeout", "-5"], "--drain-timeout: must be 0 or more seconds, not -5"),
        (["--drain-timeout", "nan"], "--drain-timeout: must be 0 or more seconds, not nan"),
    ],
)
def test_server_numbers_it_cannot_run_with_are_refused_by_name(
    tiny_model: Path, capsys: pytest.CaptureFixture[str], flags: list[str], error: str
) -> None:
    from server_util import serve_args

    with pytest.raises(SystemExit):
        serve_args(tiny_model, *flags)
    assert error in capsys.readouterr().err


@pytest.mark.parametrize(
    ("config", "error"),
    [
        # taken as unset: the model's whole length
        ({"max_model_len": 0}, "max_model_len: must be >= 1, got 0"),
        # both given: the blocks won and the memory was ignored
        (
            {"num_kv_blocks": 10, "kv_cache_memory": 100000},
            "num_kv_blocks and kv_cache_memory: give one or the other, not both",
        ),
    ],
)
def test_engine_sizes_that_contradict_are_refused_by_name(tiny_model: Path, config: dict, error: str) -> None:  # type: ignore[type-arg]
    from ember_engine import LLM

    with pytest.raises(ValueError, match=re.escape(error)):
        LLM(str(tiny_model), **config)


def test_a_burst_that_free_seats_take_is_not_shed(tiny_model: Path, tmp_path: Path) -> None:
    """Requests taking free seats never wait, so they are not the queue `maxQueueDepth` limits: a burst of
    four on an idle server with two seats and a depth of two runs two and queues two; a fifth is shed. Every
    request admitted used to count as waiting until its first token, so two of the burst were shed."""
    policy = write_policy(tmp_path / "policy.yaml", {"loadShedding": {"maxQueueDepth": 2}})
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--max-num-seqs", "2", "--policy", str(policy)
    ) as s:
        body = {**LONG, "max_tokens": 400, "stream": True}

        async def burst() -> tuple[list[int], tuple[int, str] | None]:
            statuses: list[int] = []
            release = asyncio.Event()
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:

                async def one(i: int) -> None:
                    prompt = {**body, "prompt": f"def f{i}():"}
                    async with client.stream("POST", "/v1/completions", json=prompt) as r:
                        statuses.append(r.status_code)
                        if r.status_code == 200:
                            await release.wait()

                tasks = [asyncio.create_task(one(i)) for i in range(4)]
                while len(statuses) < 4:
                    await asyncio.sleep(0.02)
                extra = None
                if statuses == [200] * 4:
                    while engine_stats(s) != (2, 2):  # two running, two waiting: the queue at its limit
                        await asyncio.sleep(0.02)
                    r = await client.post("/v1/completions", json={**body, "stream": False})
                    extra = (r.status_code, r.json()["error"]["code"])
                release.set()
                await asyncio.gather(*tasks)
                return statuses, extra

        statuses, extra = asyncio.run(burst())
        assert sorted(statuses) == [200, 200, 200, 200]
        assert extra == (503, "queue_full")


def engine_stats(s: InProcessServer) -> tuple[int, int]:
    assert s.state.engine is not None
    stats = s.state.engine.stats()
    return stats.num_running, stats.num_waiting
