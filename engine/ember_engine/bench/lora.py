"""`ember bench lora`: LoRA adapters against the base model, side by side in one engine.

One engine holds `--adapters` adapters of rank `--rank` on all seven projections of every layer (random
factors, written in PEFT's format by the bench itself). For each batch size the same prompts run three
ways: on the base model, every request on one adapter, and the requests spread over all the adapters (each
batch mixing them); each is run `--repeats` times, interleaved, and the median output tokens/s is reported
with its ratio to the base model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from ember_engine.bench.arg_types import positive_int, positive_int_list
from ember_engine.bench.throughput import cpu_name
from ember_engine.model.lora_files import PROJECTIONS, projection_shape

WAYS = ("base", "one adapter", "all adapters")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint (default: the packaged trained pair's target)")
    p.add_argument("--adapters", type=positive_int, default=4, help="adapters loaded (default 4)")
    p.add_argument("--rank", type=positive_int, default=16, help="each adapter's rank (default 16)")
    p.add_argument(
        "--batch-sizes", type=positive_int_list, default="1,16", help="comma-separated (default 1,16)"
    )
    p.add_argument("--prompt-len", type=positive_int, default=32)
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per request")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs of each way; the median is kept")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", help="write the results here")


def write_adapter(path: Path, config: Any, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of the model `config` describes: every projection of every layer, random factors
    (alpha = 2 * rank)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for proj in PROJECTIONS:
            out, inp = projection_shape(config, proj)
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    cfg = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(PROJECTIONS),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def main(args: argparse.Namespace) -> int:
    import torch

    from ember_engine import LLM, SamplingParams
    from ember_engine.model.model_config import ModelConfig

    model = args.model
    if model is None:
        from ember_engine.tools.spec_pair import packaged_pair

        model = str(packaged_pair()[0])
    config = ModelConfig.from_dir(model)
    names = [f"adapter-{i}" for i in range(args.adapters)]
    with tempfile.TemporaryDirectory(prefix="ember-bench-lora-") as root:
        for i, name in enumerate(names):
            write_adapter(Path(root) / name, config, args.rank, i)
        llm = LLM(
            model,
            dtype=args.dtype,
            max_num_seqs=max(args.batch_sizes),
            lora_modules={name: str(Path(root) / name) for name in names},
        )
    g = torch.Generator().manual_seed(0)
    vocab = config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([[5] * args.prompt_len] * 2, params, use_tqdm=False, lora=[None, names[0]])  # first calls
    results = []
    for batch in args.batch_sizes:
        ways: dict[str, list[str | None]] = {
            "base": [None] * batch,
            "one adapter": [names[0]] * batch,
            "all adapters": [names[i % len(names)] for i in range(batch)],
        }
        rates: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way, loras in ways.items():  # fresh prompts each run: no prefix-cache hits
                prompts = [torch.randint(10, vocab, (args.prompt_len,), generator=g).tolist() for _ in loras]
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora=loras)
                elapsed = time.perf_counter() - start
                rates[way].append(sum(len(o.token_ids) for o in outs) / elapsed)
        base = statistics.median(rates["base"])
        for way in WAYS:
            median = statistics.median(rates[way])
            row = {
                "batch": batch,
                "way": way,
                "tokens_per_s": round(median, 2),
                "over_base": round(median / base, 3),
            }
            results.append(row)
            print(f"batch {batch:3d} {way:12s} {median:9.1f} tok/s  {median / base:.2f}x base", flush=True)
    report = {
        "model": str(model),
        "adapters": args.adapters,
        "rank": args.rank,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "repeats": args.repeats,
        "device": str(llm.engine.runner.device),
        "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
