"""`ember bench spec`: speculative decoding against plain decoding, side by side in one process.

For each batch size the same code prompts run through three engines on the same target — no speculation,
the draft model, n-gram lookup — and the run reports output tokens/s, the mean inter-token latency, the
speedup over the plain engine, the acceptance rate and the mean accepted length. With greedy sampling it
also checks that every speculative output equals the plain one.
"""

from __future__ import annotations

import argparse
import json
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember_engine.bench.arg_types import names_from, positive_int_list
from ember_engine.bench.throughput import cpu_name

METHODS = ("draft", "ngram")

if TYPE_CHECKING:
    from ember_engine.llm import LLM


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="target checkpoint (default: the packaged trained pair's target)")
    p.add_argument("--draft-model", help="draft checkpoint (default: the packaged pair's draft)")
    p.add_argument(
        "--batch-sizes",
        type=positive_int_list,
        default="1,4,16,64",
        help="comma-separated (default 1,4,16,64)",
    )
    p.add_argument("--max-tokens", type=int, default=96, help="tokens generated per request")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument(
        "--methods", type=names_from(METHODS), default="draft,ngram", help="comma-separated: draft, ngram"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    p.add_argument("--no-adaptive", action="store_true", help="speculate at every step (no controller)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="write the results here")


def code_prompts(count: int, lines: int = 8) -> list[str]:
    """Openings of functions in the standard library's sources that the packaged pair did not train on
    (the modules after the training corpus), in a fixed order."""
    from ember_engine.tools.testmodel import corpus_files

    trained = set(corpus_files())
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        if path in trained:
            continue
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for i, line in enumerate(text):
            if line.startswith("def ") and i + lines < len(text):
                prompts.append("\n".join(text[i : i + lines]) + "\n")
                break
        if len(prompts) == count:
            return prompts
    if not prompts:
        raise RuntimeError("no standard-library sources found for prompts")
    return [prompts[i % len(prompts)] for i in range(count)]


def _measure(llm: LLM, prompts: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from ember_engine import SamplingParams

    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    before = llm.engine.stats().spec
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    after = llm.engine.stats().spec
    produced = sum(len(o.token_ids) for o in outs)
    itls = []
    for o in outs:
        m = o.metrics
        if m is not None and m.first_token_time is not None and m.last_token_time is not None:
            itls.append((m.last_token_time - m.first_token_time) / max(len(o.token_ids) - 1, 1))
    result: dict[str, Any] = {
        "tokens_per_s": produced / elapsed,
        "itl_ms": 1000 * sum(itls) / len(itls),
        "outputs": [list(o.token_ids) for o in outs],
        "acceptance_rate": None,
        "mean_accepted_length": None,
    }
    if before is not None and after is not None:
        drafts = after.num_drafts - before.num_drafts
        drafted = after.num_draft_tokens - before.num_draft_tokens
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        result["acceptance_rate"] = accepted / drafted if drafted else None
        result["mean_accepted_length"] = 1 + accepted / drafts if drafts else None
        result["verified_steps"] = drafts
    return result


def main(args: argparse.Namespace) -> int:
    import torch

    from ember_engine import LLM

    target, draft = args.model, args.draft_model
    if target is None or (draft is None and "draft" in args.methods):
        from ember_engine.tools.spec_pair import packaged_pair

        default_target, default_draft = packaged_pair()
        target = target or str(default_target)
        draft = draft or str(default_draft)
    batch_sizes, methods = args.batch_sizes, args.methods
    common: dict[str, Any] = {"dtype": args.dtype, "max_num_seqs": max(batch_sizes)}
    engines: dict[str, LLM] = {"none": LLM(target, **common)}
    spec_options: dict[str, Any] = {
        "num_speculative_tokens": args.num_speculative_tokens,
        "speculative_adaptive": not args.no_adaptive,
    }
    for method in methods:
        extra = {"draft_model": draft} if method == "draft" else {"speculative_method": "ngram"}
        engines[method] = LLM(target, **common, **spec_options, **extra)
    prompts_all = code_prompts(max(batch_sizes))
    for llm in engines.values():  # first-call costs out of the way
        llm.generate(prompts_all[:2], None, use_tqdm=False)

    results = []
    for batch in batch_sizes:
        prompts = prompts_all[:batch]
        base = _measure(engines["none"], prompts, args)
        for method in methods:
            run = _measure(engines[method], prompts, args)
            row = {
                "method": method,
                "batch": batch,
                "tokens_per_s": round(run["tokens_per_s"], 2),
                "baseline_tokens_per_s": round(base["tokens_per_s"], 2),
                "speedup": round(run["tokens_per_s"] / base["tokens_per_s"], 3),
                "itl_ms": round(run["itl_ms"], 3),
                "baseline_itl_ms": round(base["itl_ms"], 3),
                "acceptance_rate": run["acceptance_rate"],
                "mean_accepted_length": run["mean_accepted_length"],
                "verified_steps": run.get("verified_steps"),
            }
            if args.temperature == 0:
                same = sum(a == b for a, b in zip(run["outputs"], base["outputs"], strict=True))
                row["identical_outputs"] = f"{same}/{len(prompts)}"
            results.append(row)
            rate = row["acceptance_rate"]
            print(
                f"batch {batch:3d} {method:6s} {row['tokens_per_s']:8.1f} tok/s vs {row['baseline_tokens_per_s']:8.1f}"
                f"  speedup {row['speedup']:.2f}x  ITL {row['itl_ms']:.1f} ms vs {row['baseline_itl_ms']:.1f}"
                f"  acceptance {'-' if rate is None else f'{rate:.2f}'}"
                f"  mean accepted length {row['mean_accepted_length'] or 0:.2f}"
                + (f"  identical {row['identical_outputs']}" if "identical_outputs" in row else ""),
                flush=True,
            )
    report = {
        "target": str(target),
        "draft": str(draft),
        "max_tokens": args.max_tokens,
        "num_speculative_tokens": args.num_speculative_tokens,
        "temperature": args.temperature,
        "adaptive": not args.no_adaptive,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
