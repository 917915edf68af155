"""The benchmarks' command lines: bad arguments are refused by argparse (exit 2, the option named) before
anything is measured; the JSON names the CPU; the step table and JSON report one statistic."""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import pytest

from ember_engine import cli
from ember_engine.bench import throughput


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.build_parser(list(argv)).parse_args(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["bench", "throughput", "--model", "{m}", "--baselines", "foo"], "--baselines"),
        (["bench", "throughput", "--model", "{m}", "--num-requests", "0"], "--num-requests"),
        (["bench", "throughput", "--model", "{m}", "--num-requests", "-2"], "--num-requests"),
        (["bench", "throughput", "--model", "{m}", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["bench", "throughput", "--model", "{m}", "--tensor-parallel-size", "0"], "--tensor-parallel-size"),
        (["bench", "throughput", "--model", "/nonexistent/checkpoint"], "--model"),
        (["bench", "scale", "--repeats", "0"], "--repeats"),
        (["bench", "scale", "--rate", "0"], "--rate"),
        (["bench", "scale", "--rate", "-3"], "--rate"),
        (["bench", "operator", "--services", "0"], "--services"),
        (["bench", "spec", "--batch-sizes", "0"], "--batch-sizes"),
        (["bench", "spec", "--batch-sizes", "1,x"], "--batch-sizes"),
        (["bench", "spec", "--methods", "ngram,eagle"], "--methods"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    argv: list[str], option: str, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(capsys, *(a.replace("{m}", str(tiny_model)) for a in argv))
    assert f"argument {option}" in err, err
    assert "Traceback" not in err


def test_spec_methods_parse_to_names() -> None:
    args = cli.build_parser(["bench", "spec"]).parse_args(["bench", "spec", "--batch-sizes", "1,4"])
    assert args.methods == ["draft", "ngram"] and args.batch_sizes == [1, 4]


def _model_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def test_throughput_json_names_the_cpu(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    argv = ["bench", "throughput", "--model", str(tiny_model), "--num-requests", "2", "--input-len", "4"]
    argv += ["--output-len", "2", "--baselines", "", "--max-num-seqs", "2", "--json", str(out), "--quiet"]
    assert cli.main(argv) == 0
    assert json.loads(out.read_text())["device"] == f"cpu ({_model_name()})"


def test_step_table_and_json_report_the_same_per_request_statistic(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "step.json"
    argv = ["bench", "step", "--scenarios", "greedy", "--batch-sizes", "2", "--steps", "5"]
    assert cli.main([*argv, "--warmup-steps", "1", "--prompt-len", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["processor"] == _model_name()
    (row,) = doc["results"]
    assert row["per_request_us"] == pytest.approx(row["step_p50_ms"] / 2 * 1e3)
    head, _, line = capsys.readouterr().out.splitlines()[:3]
    assert "p50 µs/req" in head
    assert float(line.split()[3]) == pytest.approx(row["per_request_us"], abs=0.06)


def test_padded_baseline_is_warmed_up_outside_the_timed_region(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = throughput._hf_model

    def counting(args: Any) -> Any:
        model = real(args)
        generate = model.generate

        def counted(*a: Any, **k: Any) -> Any:
            calls.append(k["input_ids"].shape[0])
            return generate(*a, **k)

        model.generate = counted
        return model

    monkeypatch.setattr(throughput, "_hf_model", counting)
    args = cli.build_parser(["bench", "throughput"]).parse_args(
        ["bench", "throughput", "--model", str(tiny_model), "--dtype", "float32"]
    )
    work = throughput.make_workload(3, (4, 6), (2, 3), 100, 0)
    throughput.run_hf_padded(args, work)
    assert calls == [1, 3]  # a one-prompt warm-up, then the timed batch of all three
