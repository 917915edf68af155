"""`ember bench serve --structured`'s bookkeeping: measured pairs alternate which kind runs first, and a
process's CPU seconds are read from /proc."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest
from test_bench_serve import StreamingServer

from ember_engine.bench import serve as bench_serve
from ember_engine.bench.structured import cpu_seconds, pair_order


def test_pairs_alternate_which_kind_runs_first() -> None:
    orders = [pair_order(k) for k in range(4)]
    assert orders == [("constrained", "free"), ("free", "constrained")] * 2


def test_cpu_seconds_counts_this_process_work() -> None:
    assert cpu_seconds(None) == 0.0
    before, start = cpu_seconds(os.getpid()), time.process_time()
    while time.process_time() - start < 0.3:  # busy for 0.3 s of CPU, however loaded the machine is
        pass
    used = cpu_seconds(os.getpid()) - before
    assert abs(used - (time.process_time() - start)) < 0.05  # clock ticks are 10 ms


def _structured(*argv: str) -> int:
    p = argparse.ArgumentParser()
    bench_serve.add_arguments(p)
    return bench_serve.main(p.parse_args(["--model", "m", "--structured", *argv]))


def test_structured_sends_the_headers_and_counts_failures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "st.json"
    with StreamingServer(period=1, shed={0}) as server:  # every request answered 503
        argv = ("--url", server.url, "--structured-batch", "1", "--structured-rounds", "1", "--timeout", "5")
        code = _structured(*argv, "--header", "Authorization: Bearer x", "--json", str(out))
    assert code == 1
    assert server.requests and all(h["authorization"] == "Bearer x" for h, _ in server.requests)
    assert f"failed 503 x{len(server.requests)}" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["failed"] == {"503": len(server.requests)}
    assert report["args"]["header"] == [["Authorization", "Bearer x"]]


@pytest.mark.parametrize(
    "option", [["--rate", "2"], ["--num-requests", "5"], ["--plot", "x.png"], ["--seed", "3"]]
)
def test_structured_refuses_the_plain_options_by_name(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _structured("--url", "http://127.0.0.1:9", *option) == 2
    assert f"{option[0]} does not apply with --structured" in capsys.readouterr().err
