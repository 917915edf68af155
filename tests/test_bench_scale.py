"""`ember bench scale` runs end to end and reports both runs (its figures are for the benchmark, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
    assert 0 < result["workloads"]["shared"]["single_replica_prefix_hit_rate"] <= 1
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
