"""`ember bench scale` runs end to end and reports both runs (its figures are for the benchmark, not here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EMBER = str(Path(sys.executable).parent / "ember")


def test_bench_scale_reports_warm_and_cold_runs(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    run = subprocess.run(
        [EMBER, "bench", "scale", "--repeats", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result == json.loads(run.stdout)
    for kind, pool in (("warm", 1), ("cold", 0)):
        (one,) = result["runs"][kind]
        assert one["warm_pool"] == pool
        assert one["spike_to_serving_seconds"] > 0
        # Requests still running when the second engine serves are cancelled; those that ended all succeeded.
        assert set(one["request_statuses"]) <= {"200"}, one["request_statuses"]
    assert result["cold_over_warm"] == round(result["cold_median_seconds"] / result["warm_median_seconds"], 2)


def test_bench_scale_failover_reports_warm_and_cold_runs(tmp_path: Path) -> None:
    out = tmp_path / "failover.json"
    run = subprocess.run(
        [
            EMBER,
            "bench",
            "scale",
            "--scenario",
            "failover",
            "--repeats",
            "1",
            "--tick",
            "2",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    (warm,) = result["runs"]["warm"]
    (cold,) = result["runs"]["cold"]
    assert "FailedOver" in warm["operator_events"] and "FailedOver" not in cold["operator_events"]
    assert 0 < warm["endpoint_ready_seconds"] <= warm["served_seconds"]
    assert 0 < cold["endpoint_ready_seconds"] <= cold["served_seconds"]


def test_bench_fleet_reports_both_policies_for_both_workloads(tmp_path: Path) -> None:
    out, png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    args = [
        "--replicas",
        "2",
        "--requests",
        "16",
        "--rate",
        "4",
        "--system-words",
        "120",
        "--overhead-requests",
        "3",
    ]
    run = subprocess.run(
        [EMBER, "bench", "fleet", *args, "--json", str(out), "--plot", str(png)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    for kind in ("shared", "random"):
        for policy in ("round_robin", "router"):
            r = result["workloads"][kind][policy]
            assert r["failures"] == 0 and len(r["ttfts"]) == 16
            assert sum(r["requests_per_engine"]) == 16 and r["output_tokens_per_s"] > 0
    assert result["workloads"]["random"]["router"]["prefix_hit_rate"] == 0.0
    one = result["workloads"]["shared"]["one_engine"]  # the whole workload, on one engine
    assert (one["requests"], one["failures"], one["rate"]) == (16, 0, 2.0)
    assert 0 < one["prefix_hit_rate"] <= 1
    assert result["router_overhead_p50_s"] is not None
    assert png.stat().st_size > 0


def test_a_roll_completes_on_a_full_gpu_pool_within_max_unavailable(tmp_path: Path) -> None:
    out = tmp_path / "roll.json"
    run = subprocess.run(
        [EMBER, "bench", "scale", "--scenario", "roll", "--tick", "1", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    bare, pooled = json.loads(out.read_text())["runs"]
    assert (bare["gpus"], bare["warm_pool"]) == (2, 0) and (pooled["gpus"], pooled["warm_pool"]) == (3, 1)
    for r in (bare, pooled):
        assert r["roll_seconds"] > 0 and r["a_surge_pod_waited_unschedulable"]  # the pool really was full
    assert bare["fewest_ready_active"] == 1  # 2 - maxUnavailable
    assert pooled["fewest_ready_active"] == 2  # the warm pool is the surge


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signalled_bench_scale_stops_its_processes_and_removes_its_directory(
    tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen(
        [EMBER, "bench", "scale", "--repeats", "1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # A shell's background job ignores SIGINT; the bench must see it as from a terminal.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 120
        # Once the cluster has started an engine: processes to stop, files in the directory.
        while not any(tmp_path.glob("ember-bench-scale-*/**/*.log")) or not _descendants(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr and proc.stderr.read()
            time.sleep(0.2)
        started = _descendants(proc.pid)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == code, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert f"stopped by {sig.name}" in err
    assert not list(tmp_path.glob("ember-bench-scale-*"))
    assert not {p for p in started if Path(f"/proc/{p}").exists()}
