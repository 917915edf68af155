"""`ember bench step`: the engine's host time per decode step, with the model's forward stubbed out.

A stub model returns logits of the right shape from a pool of random rows at next to no cost, so what is
timed is everything else a step does: scheduling, laying out the inputs, sampling, appending tokens and
stop checks, detokenizing. Each scenario (greedy, top-p, seeded, penalties, logprobs, n-gram speculation,
and top-p-topk: top-p on the sampler's top-k-candidate path, for comparison)
runs at each batch size with the batch held constant (long outputs, ignore_eos) after a warm-up; the
result is a JSON document and a table with a per-component breakdown. `--baseline FILE` (an earlier run's
JSON, e.g. from before a change) puts that run's figures beside this one's."""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ember_engine.bench.step_timing import COMPONENTS, ComponentTimer, StubModel, instrument
from ember_engine.bench.throughput import cpu_name

SCENARIOS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "top-p": {"temperature": 1.0, "top_p": 0.9},
    # The same rows on the top-k-candidate path that the pivot replaced (`Sampler(pivot=False)`).
    "top-p-topk": {"temperature": 1.0, "top_p": 0.9},
    "seeded": {"temperature": 1.0, "seed": 0},
    "penalties": {
        "temperature": 0.0,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.5,
        "presence_penalty": 0.5,
    },
    "logprobs": {"temperature": 0.0, "logprobs": 5},
    "spec-ngram": {"temperature": 0.0},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: a fresh tiny test model)")
    p.add_argument("--batch-sizes", default="1,64,256", help="comma-separated batch sizes")
    p.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS)
    )
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--warmup-steps", type=int, default=16, help="decode steps before timing starts")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where sampling runs (cpu, cuda, cuda:N)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadier figures on a shared machine)"
    )
    p.add_argument("--json", dest="json_path", default=None, help="write the result here")
    p.add_argument("--baseline", default=None, help="an earlier run's JSON to show beside this one")
    p.add_argument("--label", default=None, help="a name for this run in the JSON (e.g. a commit)")


def _params(scenario: str, index: int, max_tokens: int) -> Any:
    from ember_engine import SamplingParams

    fields = dict(SCENARIOS[scenario])
    if "seed" in fields:
        fields["seed"] = index
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields)


def _prompt(rng: random.Random, length: int, vocab: int, repeating: bool) -> list[int]:
    if not repeating:
        return [rng.randrange(10, vocab) for _ in range(length)]
    # A repeated phrase gives the n-gram proposer something to find.
    phrase = [rng.randrange(10, vocab) for _ in range(8)]
    return (phrase * (length // 8 + 1))[:length]


def run_case(model: str, scenario: str, batch: int, args: argparse.Namespace) -> dict[str, Any]:
    from ember_engine.core.config import EngineConfig
    from ember_engine.core.llm_engine import LLMEngine

    spec = scenario == "spec-ngram"
    k = 4
    max_tokens = (args.warmup_steps + 2 * args.steps + 8) * (k + 1 if spec else 1)
    per_seq = -(-(args.prompt_len + max_tokens + k + 1) // 16)
    config = EngineConfig(
        model=model,
        device=args.device,
        max_num_seqs=max(batch, 1),
        max_num_batched_tokens=max(2048, batch * (args.prompt_len + k + 1)),
        num_kv_blocks=batch * per_seq + 16,
        enable_prefix_caching=False,
        speculative_method="ngram" if spec else None,
        num_speculative_tokens=k if spec else None,
        speculative_adaptive=False if spec else None,
    )
    engine = LLMEngine(config)
    vocab = engine.model_config.vocab_size
    engine.sampler.pivot = scenario != "top-p-topk"
    engine.runner.model = StubModel(vocab, batch * (k + 1) + 1, engine.runner.device, seed=args.seed)  # type: ignore[assignment]
    rng = random.Random(args.seed)
    for i in range(batch):
        prompt = _prompt(rng, args.prompt_len, vocab, repeating=spec)
        engine.add_request(f"r{i}", prompt, _params(scenario, i, max_tokens))
    # Prefill everyone, then settle into decoding.
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(args.warmup_steps):
        engine.step()
    # Timed twice: plainly for the step time, then wrapped in the timer for the breakdown (whose own
    # cost, about a microsecond a wrapped call, lands in the components it wraps).
    totals = []
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - start)
    timer = ComponentTimer()
    restore = instrument(engine, timer)
    try:
        wrapped = []
        for _ in range(args.steps):
            timer.begin_step()
            start = time.perf_counter()
            engine.step()
            wrapped.append(time.perf_counter() - start)
            timer.end_step()
    finally:
        restore()
    assert len(engine.scheduler.running) == batch, "the batch shrank while timing"
    mean = statistics.fmean(totals)
    return {
        "scenario": scenario,
        "batch": batch,
        "step_ms": mean * 1e3,
        "step_p50_ms": statistics.median(totals) * 1e3,
        "per_request_us": statistics.median(totals) / batch * 1e6,  # as the table: the p50 step
        "instrumented_step_ms": statistics.fmean(wrapped) * 1e3,
        "components_ms": {c: v * 1e3 for c, v in timer.means(statistics.fmean(wrapped)).items()},
    }


def _table(results: list[dict[str, Any]], baseline: dict[tuple[str, int], dict[str, Any]]) -> str:
    """Medians (steadier than means on a shared machine); the components are the instrumented pass's means."""
    head = f"{'scenario':<11} {'batch':>5} {'p50 ms':>8} {'p50 µs/req':>10} {'x greedy':>8}"
    head += "".join(f" {c:>9}" for c in COMPONENTS)
    if baseline:
        head += f" {'before':>9} {'speed-up':>8}"
    lines = [head, "-" * len(head)]
    greedy = {r["batch"]: r["step_p50_ms"] for r in results if r["scenario"] == "greedy"}
    for r in results:
        step = r["step_p50_ms"]
        ratio = step / greedy[r["batch"]] if r["batch"] in greedy else float("nan")
        line = f"{r['scenario']:<11} {r['batch']:>5} {step:>8.3f} {r['per_request_us']:>10.1f} {ratio:>8.2f}"
        line += "".join(f" {r['components_ms'].get(c, 0.0):>9.3f}" for c in COMPONENTS)
        old = baseline.get((r["scenario"], r["batch"]))
        if baseline:
            line += (
                f" {old['step_p50_ms']:>9.3f} {old['step_p50_ms'] / step:>7.2f}x"
                if old
                else f" {'-':>9} {'-':>8}"
            )
        lines.append(line)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    import torch

    from ember_engine.tools.testmodel import make_test_model

    torch.set_num_threads(max(1, args.threads))
    batches = [int(b) for b in args.batch_sizes.split(",")]
    scenarios = args.scenarios.split(",")
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        raise SystemExit(f"--scenarios: unknown {', '.join(unknown)}; choose from {', '.join(SCENARIOS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(make_test_model(Path(tmp) / "tiny", size="tiny"))
        results = [run_case(model, s, b, args) for s in scenarios for b in batches]
    doc = {
        "benchmark": "step",
        "label": args.label,
        "machine": {
            "platform": platform.platform(),
            "processor": cpu_name(),
            "threads": torch.get_num_threads(),
        },
        "settings": {k: getattr(args, k) for k in ("prompt_len", "warmup_steps", "steps", "seed", "threads")},
        "results": results,
    }
    baseline: dict[tuple[str, int], dict[str, Any]] = {}
    if args.baseline:
        before = json.loads(Path(args.baseline).read_text())
        baseline = {(r["scenario"], r["batch"]): r for r in before["results"]}
        doc["baseline"] = {"label": before.get("label"), "results": before["results"]}
    print(_table(results, baseline))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=2) + "\n")
    return 0
