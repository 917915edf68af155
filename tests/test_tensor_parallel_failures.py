"""A tensor-parallel rank that dies takes the engine down with an error naming it, never a hang: the
offline API raises, `ember serve` exits 1 with a fatal line (the pod restarts), and workers do not
outlive the engine's process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import plainhttp
import pytest
from server_util import running_server, server_process, wait_ready
from test_router import running_router
from test_tensor_parallel_nodes import two_nodes
from waiting import wait_for

from ember_engine import LLM, SamplingParams
from ember_engine.distributed.group import TensorParallelFailure
from ember_router.proxy import ROUTED_TO, RouterSettings

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def workers_of(pid: int) -> list[int]:
    """The spawned worker processes of `pid` (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing parenthesis.
        if (
            int(stat.rsplit(")", 1)[1].split()[1]) == pid
            and b"spawn_main" in (entry / "cmdline").read_bytes()
        ):
            found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_killed_worker_fails_the_next_step_naming_it(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", tensor_parallel_size=2)
    workers = llm.engine.workers
    assert workers is not None
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 4
        lost: list[BaseException] = []
        workers.on_lost = lost.append
        pid = workers.processes[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:  # the watchdog sees it while the engine idles
            time.sleep(0.05)
        assert [str(e) for e in lost] == [f"tensor-parallel worker rank 1 (pid {pid}) was killed by SIGKILL"]
        with pytest.raises(TensorParallelFailure, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    finally:
        llm.engine.shutdown()


def test_ember_serve_exits_with_the_cause_when_a_worker_dies(tiny_model: Path) -> None:
    with server_process(tiny_model, "--tensor-parallel-size", "2", "--dtype", "float32") as (url, proc):
        body = {"model": tiny_model.name, "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
        assert plainhttp.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
        (worker,) = workers_of(proc.pid)
        os.kill(worker, signal.SIGKILL)
        code = proc.wait(timeout=30)
        output = proc.stdout.read() if proc.stdout else ""
    assert code == 1
    last = output.strip().splitlines()[-1]
    assert last == (
        "ember serve: fatal: the engine stopped: TensorParallelFailure: "
        f"tensor-parallel worker rank 1 (pid {worker}) was killed by SIGKILL"
    )


def test_workers_do_not_outlive_a_killed_engine(tiny_model: Path) -> None:
    with server_process(tiny_model, "--tensor-parallel-size", "2", "--dtype", "float32") as (_, proc):
        (worker,) = workers_of(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 15
        while alive(worker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(worker)


def test_a_stream_the_engine_cannot_finish_ends_with_an_error_event_and_done(tiny_model: Path) -> None:
    """A rank dies while a response streams: the client gets an OpenAI error event and [DONE], not a
    connection cut mid-stream."""
    body = {"model": tiny_model.name, "prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True}
    with server_process(tiny_model, "--tensor-parallel-size", "2", "--dtype", "float32") as (url, proc):
        (worker,) = workers_of(proc.pid)
        with plainhttp.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"]
            os.kill(worker, signal.SIGKILL)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        proc.wait(timeout=30)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["type"], error["code"]) == ("unavailable", "engine_failed")
    assert f"rank 1 (pid {worker}) was killed by SIGKILL" in error["message"]


def _running(url: str) -> int:
    return int(plainhttp.get(f"{url}/v1/load", timeout=5).json()["num_requests_running"])


def test_requests_in_flight_when_a_node_dies_get_a_503_saying_the_engine_failed(tiny_model: Path) -> None:
    """Every request in flight on a group whose node 1 was killed was answered 500 (`internal error:
    RuntimeError: the engine has stopped: ...`, gloo's source paths included), though none had begun its
    answer: a 503 with Retry-After and `code: "engine_failed"` says to send it again; node 0 still exits."""
    body = {"model": tiny_model.name, "prompt": "def f(x):", "max_tokens": 1500, "ignore_eos": True}
    with two_nodes(tiny_model, tiny_model, [], []) as (url, procs), ThreadPoolExecutor(4) as pool:
        wait_ready(url, timeout=120)
        futures = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120) for _ in range(4)]
        wait_for(lambda: _running(url) == 4, what="4 requests running")
        procs[1].send_signal(signal.SIGKILL)
        answers = [f.result() for f in futures]
        code = procs[0].wait(timeout=30)
        output = procs[0].stdout.read() if procs[0].stdout else ""
    for r in answers:
        assert r.status_code == 503, r.text
        assert r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert (error["type"], error["code"]) == ("unavailable", "engine_failed"), error
        assert error["message"].startswith("the engine failed and is restarting ("), error
        assert ".cc:" not in error["message"] and "/" not in error["message"], error
    # It exits as it did: the fatal line, then (a step's collective having failed) gloo may abort it.
    assert code in (1, -signal.SIGABRT), output[-3000:]
    assert "ember serve: fatal: the engine stopped: TensorParallelFailure: " in output, output[-3000:]


def test_a_router_sends_the_requests_of_a_failed_group_to_the_next_ready_engine(tiny_model: Path) -> None:
    """The router relayed the group's 500s to the clients; an engine's `engine_failed` 503 is an engine
    gone before answering: the requests go to the other engine, which was Ready."""
    body = {"model": tiny_model.name, "prompt": "def f(x):", "max_tokens": 500, "ignore_eos": True}
    with (
        running_server(tiny_model, "--dtype", "float32") as other,
        two_nodes(tiny_model, tiny_model, [], []) as (group, procs),
    ):
        wait_ready(group, timeout=120)
        settings = RouterSettings(hold_seconds=30.0)
        with (
            running_router(tiny_model, [group, other.url], settings=settings) as (url, router),
            ThreadPoolExecutor(4) as pool,
        ):
            other.state.draining = True  # not Ready while the requests are sent: they all go to the group
            wait_for(
                lambda: not router.pool.engines[other.url].state.ready, what="the other engine not Ready"
            )
            futures = [
                pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120) for _ in range(4)
            ]
            wait_for(lambda: _running(group) == 4, what="4 requests running on the group")
            other.state.draining = False
            wait_for(lambda: router.pool.engines[other.url].state.ready, what="the other engine Ready")
            procs[1].send_signal(signal.SIGKILL)
            answers = [f.result() for f in futures]
    for r in answers:
        assert r.status_code == 200, r.text
        assert r.headers[ROUTED_TO] == other.url
        assert r.json()["usage"]["completion_tokens"] == 500


def test_an_idle_group_that_loses_a_node_stops_within_seconds(tiny_model: Path) -> None:
    """Node 0 of an idle group whose node 1 was killed answered /ready 200 until a request came (its first
    step failed: a 500): it looked at the other nodes only when it stepped. Now it notices within a few
    seconds, idle, and exits 1 (the pod restarts) naming the failure."""
    with two_nodes(tiny_model, tiny_model, [], []) as (url, procs):
        wait_ready(url, timeout=120)
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait(timeout=30)
        killed = time.monotonic()
        try:
            code = procs[0].wait(timeout=30)
        except subprocess.TimeoutExpired:
            ready = plainhttp.get(f"{url}/ready", timeout=5).status_code
            pytest.fail(f"node 0 still running 30 s after node 1 was killed (/ready: {ready})")
        output = procs[0].stdout.read() if procs[0].stdout else ""
    assert code == 1
    assert time.monotonic() - killed < 30
    last = output.strip().splitlines()[-1]
    assert last.startswith("ember serve: fatal: the engine stopped: TensorParallelFailure: "), last
