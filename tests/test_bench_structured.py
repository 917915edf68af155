"""`ember bench serve --structured`'s bookkeeping: measured pairs alternate which kind runs first, and a
process's CPU seconds are read from /proc."""

from __future__ import annotations

import os
import time

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
