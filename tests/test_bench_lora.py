"""`ember bench lora` runs and reports every way at every batch size (its figures are for the benchmark, not
here); the adapters it writes are PEFT's format: PEFT loads them and computes what ember does with them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from peft import PeftModel
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.bench.lora import write_adapter
from ember_engine.model.model_config import ModelConfig

EMBER = str(Path(sys.executable).parent / "ember")


def test_bench_lora_reports_each_way_at_each_batch_size(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    args = ["--model", str(tiny_model), "--batch-sizes", "1,3", "--max-tokens", "4", "--repeats", "1"]
    run = subprocess.run(
        [EMBER, "bench", "lora", *args, "--json", str(out)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert (report["adapters"], report["rank"], report["device"]) == (4, 16, "cpu")
    rows = [(r["batch"], r["way"]) for r in report["results"]]
    assert rows == [(b, w) for b in (1, 3) for w in ("base", "one adapter", "all adapters")]
    for r in report["results"]:
        base = next(x["tokens_per_s"] for x in report["results"] if x["batch"] == r["batch"])
        # The ratio is of the unrounded medians: within the rounding of the two figures shown.
        assert r["tokens_per_s"] > 0 and abs(r["over_base"] - r["tokens_per_s"] / base) < 0.01, r
    assert len(run.stdout.strip().splitlines()) == 6


def test_the_adapters_it_writes_are_peft_adapters(tiny_model: Path, tmp_path: Path) -> None:
    write_adapter(tmp_path / "a", ModelConfig.from_dir(str(tiny_model)), rank=4, seed=0)
    prompts = [[5, 6, 7, 8, 9, 10], list(range(100, 140))]
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    want = hf_greedy(PeftModel.from_pretrained(base, tmp_path / "a").eval(), prompts, 8)
    llm = LLM(str(tiny_model), dtype="float32", lora_modules={"a": str(tmp_path / "a")})
    got = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False, lora="a"
    )
    assert [o.token_ids for o in got] == want
    plain = llm.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False
    )
    assert [o.token_ids for o in plain] != want  # the adapter changes what is generated
