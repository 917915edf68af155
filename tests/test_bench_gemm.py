"""`ember bench gemm` on small shapes: a row for every layout, shape and row count, each layer's product
checked against its reference, its weight bytes against the full weight's, and bad options refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from ember_engine.bench.gemm import LAYOUTS
from ember_engine.cli import main as ember

# Bytes per weight against float32's four: the values, plus a float32 scale per channel or per group
# (fp8's 128-column tiles: one per 128 x 128 tile, held per row), nf4's absmax per block of 64; w4a8fp8's
# 16 E4M3 values per row and group of 128 and a float32 scale per row.
K, N = 256, 96
EXPECTED_RATIO = {
    "fp8": 1 / 4 + 1 / K,
    "fp8-block128": 1 / 4 + 1 / 128,
    "w8a16": 1 / 4 + 1 / K,
    "w8a16-g128": 1 / 4 + 1 / 128,
    "w8a8": 1 / 4 + 1 / K,
    "w4a16-g128": 1 / 8 + 1 / 128,
    "w4afp8-g128": 1 / 8 + 1 / 128,
    "nf4-b64": 1 / 8 + 1 / 64,
    "w4a8fp8-g128": 1 / 8 + 1 / 32 + 1 / K,
}


def test_every_layout_is_timed_and_computes_its_reference(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "gemm.json"
    args = ["bench", "gemm", "--shapes", f"{K}x{N}", "--rows", "1,5,33", "--repeats", "2", "--json", str(out)]
    assert ember(args) == 0
    result = json.loads(out.read_text())
    assert result["device"].startswith("cpu") and result["dtype"] == "float32"
    rows = result["rows"]
    assert [(r["layout"], r["rows"]) for r in rows] == [(name, m) for name in LAYOUTS for m in (1, 5, 33)]
    for r in rows:
        assert (r["k"], r["n"]) == (K, N)
        # float32 activations: each path's sums rounded in float32 and no more.
        assert r["rel_error"] <= 1e-5, r
        assert r["full_us"] > 0 and r["quant_us"] > 0
        assert r["speedup"] == pytest.approx(r["full_us"] / r["quant_us"])
        assert r["weight_ratio"] == pytest.approx(EXPECTED_RATIO[r["layout"]], rel=0.02), r["layout"]
    table = capsys.readouterr().out
    assert f"{'w4afp8-g128':<13} {f'{K}x{N}':>11}     1" in table


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--layouts", "fp8,int3", "--layouts: unknown int3; known: fp8, fp8-block128"),
        ("--shapes", "256by96", "--shapes takes KxN"),
        ("--rows", "0", "--shapes and --rows need positive sizes"),
        ("--dtype", "int8", "--dtype: not a floating-point torch dtype: 'int8'"),
        ("--device", "tpu", "--device: 'tpu' is not available here"),
        # fp8's 128-column tiles need whole tiles of input columns.
        ("--layouts", "fp8-block128", "fp8-block128 at 64x32: fp8: input size 64 is not a multiple of the"),
    ],
)
def test_bad_options_are_refused_by_name(option: str, value: str, message: str) -> None:
    base = ["bench", "gemm", "--shapes", "64x32", "--rows", "1", "--layouts", "w8a16"]
    with pytest.raises(SystemExit, match=message):
        ember([*base, option, value])  # the option given last is the one taken


def test_the_path_is_chosen_for_the_run_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--gemm torch` sets the layers' path (EMBER_QUANT_GEMM) for the run, records it, and puts the
    variable back; `--gemm triton` needs CUDA and is refused on the CPU by name."""
    monkeypatch.delenv("EMBER_QUANT_GEMM", raising=False)
    out = tmp_path / "gemm.json"
    base = ["bench", "gemm", "--shapes", "64x32", "--rows", "1", "--layouts", "fp8", "--device", "cpu"]
    assert ember([*base, "--repeats", "1", "--gemm", "torch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gemm"] == "torch" and result["rows"][0]["rel_error"] <= 1e-5
    assert "EMBER_QUANT_GEMM" not in os.environ
    with pytest.raises(SystemExit, match="--gemm triton: the Triton kernels run compiled on CUDA only"):
        ember([*base, "--gemm", "triton"])
