"""A tensor-parallel rank that dies takes the engine down with an error naming it, never a hang: the
offline API raises, `ember serve` exits 1 with a fatal line (the pod restarts), and workers do not
outlive the engine's process."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from server_util import server_process

from ember_engine import LLM, SamplingParams
from ember_engine.distributed.group import TensorParallelFailure

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
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 200
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
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
            assert s.status_code == 200
            lines = s.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert json.loads(first.removeprefix("data: "))["choices"]
            os.kill(worker, signal.SIGKILL)
            events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        proc.wait(timeout=30)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "internal_server_error"
    assert f"rank 1 (pid {worker}) was killed by SIGKILL" in error["message"]
