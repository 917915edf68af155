"""`ember bench throughput`: offline output tokens/s of ember against transformers, same checkpoint, same
process, same workload (random token prompts, random output lengths, ignore_eos; nano-vllm's shape).

With `--tensor-parallel-size N` (N > 1) ember runs split over N ranks, the unsplit engine runs beside it as
a baseline (`ember-tp1`), and the result says how much of each step rank 0 spent communicating: the step's
broadcast and the layers' collectives (waiting for the slowest rank included), per step and as a
fraction of step time."""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import time
from dataclasses import dataclass
from typing import Any

from ember_engine.bench.arg_types import existing_path, names_from, positive_int


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    low, high = int(lo), int(hi or lo)
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B, got {text!r}")
    return low, high


def make_workload(
    n: int, input_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(*input_len))] for _ in range(n)]
    return Workload(prompts, [rng.randint(*output_len) for _ in range(n)])


def run_ember(args: argparse.Namespace, work: Workload, tensor_parallel_size: int = 1) -> dict[str, Any]:
    from ember_engine import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        tensor_parallel_size=tensor_parallel_size,
    )
    try:
        llm.generate([work.prompts[0][:16]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        params = [
            SamplingParams(temperature=args.temperature, max_tokens=n, ignore_eos=True)
            for n in work.output_lens
        ]
        workers, steps_before = llm.engine.workers, llm.engine.num_steps
        if workers is not None:
            workers.tp.timed = True
            workers.channel.seconds = 0.0
        start = time.perf_counter()
        outs = llm.generate(work.prompts, params, use_tqdm=not args.quiet)
        elapsed = time.perf_counter() - start
        steps = llm.engine.num_steps - steps_before
        stats = llm.engine.stats()
    finally:
        llm.engine.shutdown()
    produced = sum(len(o.token_ids) for o in outs)
    assert produced == work.output_tokens, (produced, work.output_tokens)
    result: dict[str, Any] = {
        "output_tokens": produced,
        "seconds": elapsed,
        "output_tokens_per_s": produced / elapsed,
        "num_preemptions": stats.num_preemptions,
        "num_kv_blocks": stats.num_kv_blocks,
        "tensor_parallel_size": tensor_parallel_size,
        "num_steps": steps,
    }
    if workers is not None:
        collectives, broadcast = workers.tp.seconds, workers.channel.seconds
        result["communication"] = {
            "collective_seconds": collectives,
            "broadcast_seconds": broadcast,
            "per_step_ms": 1000 * (collectives + broadcast) / max(steps, 1),
            "step_ms": 1000 * elapsed / max(steps, 1),
            "fraction_of_step_time": (collectives + broadcast) / elapsed,
        }
    return result


def _hf_model(args: argparse.Namespace) -> Any:  # a transformers PreTrainedModel
    import torch
    from transformers import AutoModelForCausalLM

    dtype = "auto" if args.dtype == "auto" else getattr(torch, args.dtype)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model: Any = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    return model.to(device).eval()


def run_hf_padded(args: argparse.Namespace, work: Workload) -> dict[str, Any]:
    """Static batches, left-padded; each batch runs to its longest requested output (the waste that
    continuous batching removes). Only requested tokens are counted."""
    import torch

    model = _hf_model(args)
    device = next(model.parameters()).device
    batch = args.hf_batch_size or len(work.prompts)
    with torch.inference_mode():  # warm-up, untimed, as for the other two sides
        ids = torch.tensor([work.prompts[0][:16]], device=device)
        model.generate(input_ids=ids, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work.prompts), batch):
            prompts = work.prompts[i : i + batch]
            width = max(map(len, prompts))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max(work.output_lens[i : i + batch]),
                min_new_tokens=max(work.output_lens[i : i + batch]),
                do_sample=False,
                pad_token_id=0,
            )
    elapsed = time.perf_counter() - start
    return {
        "output_tokens": work.output_tokens,
        "seconds": elapsed,
        "output_tokens_per_s": work.output_tokens / elapsed,
        "batch_size": batch,
    }


def run_hf_continuous(args: argparse.Namespace, work: Workload) -> dict[str, Any] | None:
    model = _hf_model(args)
    if not hasattr(model, "generate_batch"):
        return None
    from transformers import GenerationConfig

    # generate_batch takes one generation config: give every request the longest output and count only
    # what each asked for, as for the padded baseline. Its own warm-up runs outside the timed region.
    config = GenerationConfig(
        max_new_tokens=max(work.output_lens), do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generate_batch([work.prompts[0][:16]], generation_config=config, progress_bar=False)
    start = time.perf_counter()
    model.generate_batch(work.prompts, generation_config=config, progress_bar=False)
    elapsed = time.perf_counter() - start
    return {
        "output_tokens": work.output_tokens,
        "seconds": elapsed,
        "output_tokens_per_s": work.output_tokens / elapsed,
    }


BASELINES = {"transformers-padded": run_hf_padded, "transformers-continuous": run_hf_continuous}


def cpu_name() -> str:
    """The CPU's model name (platform.processor() is empty on Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main(args: argparse.Namespace) -> int:
    import torch

    from ember_engine.model.model_config import ModelConfig

    config = ModelConfig.from_dir(args.model)
    work = make_workload(args.num_requests, args.input_len, args.output_len, config.vocab_size, args.seed)
    result: dict[str, Any] = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({cpu_name()})",
        "threads": torch.get_num_threads(),
        "workload": {
            "num_requests": args.num_requests,
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "output_tokens": work.output_tokens,
            "seed": args.seed,
        },
    }
    tp = args.tensor_parallel_size
    result["engine"] = engine = run_ember(args, work, tp)
    label = "ember" if tp == 1 else f"ember (tensor-parallel {tp})"
    print(f"{label}: {engine['output_tokens_per_s']:.1f} output tok/s ({engine['seconds']:.1f} s)")
    if "communication" in engine:
        c = engine["communication"]
        print(
            f"communication: {c['per_step_ms']:.2f} ms of each {c['step_ms']:.2f} ms step "
            f"({100 * c['fraction_of_step_time']:.1f}% of step time in the broadcast and collectives)"
        )
    gc.collect()
    result["baselines"] = {}
    if tp > 1:
        result["baselines"]["ember-tp1"] = unsplit = run_ember(args, work)
        print(f"ember-tp1: {unsplit['output_tokens_per_s']:.1f} output tok/s ({unsplit['seconds']:.1f} s)")
    for name in args.baselines:
        measured = BASELINES[name](args, work)
        gc.collect()
        if measured is None:
            print(f"{name}: not available in the installed transformers")
            continue
        result["baselines"][name] = measured
        print(f"{name}: {measured['output_tokens_per_s']:.1f} output tok/s ({measured['seconds']:.1f} s)")
    if result["baselines"]:
        best = max(b["output_tokens_per_s"] for b in result["baselines"].values())
        result["speedup_vs_best_baseline"] = result["engine"]["output_tokens_per_s"] / best
        for name, b in result["baselines"].items():
            print(
                f"speedup vs {name}: {result['engine']['output_tokens_per_s'] / b['output_tokens_per_s']:.2f}x"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=existing_path, required=True, help="checkpoint directory")
    p.add_argument("--num-requests", type=positive_int, default=64)
    p.add_argument("--input-len", type=parse_range, default=(32, 256), help="prompt length range A:B")
    p.add_argument("--output-len", type=parse_range, default=(32, 128), help="output length range A:B")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-seqs", type=positive_int, default=256)
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    p.add_argument("--hf-batch-size", type=int, default=0, help="padded baseline batch (0: all at once)")
    p.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="split ember's model over N ranks; adds the unsplit engine as baseline ember-tp1",
    )
    p.add_argument(
        "--baselines",
        type=lambda s: names_from(tuple(BASELINES))(s) if s else [],
        default=list(BASELINES),
        help=f"comma-separated subset of {','.join(BASELINES)}",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
