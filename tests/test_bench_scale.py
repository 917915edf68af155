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
