"""`ember bench quant`: each weight scheme and the FP8 KV cache side by side with full precision, in one
run on one model.

Per configuration: weight bytes (the whole model, and the decoder projections alone against the same
projections in bf16), KV blocks at a fixed cache memory, decode tokens/s at batch 1 and 32, perplexity on
held-out text, greedy agreement with full precision over 64 tokens (the fraction of generated positions
holding the same token), the fraction of prompts whose 64 tokens either match full precision's or first
differ where each side's token is among the other's 5 most likely (the check vLLM's tests apply to
quantized models: a divergence between near-tied tokens passes), and teacher-forced next-token agreement
(the fraction of held-out positions where the argmax is full precision's, each position given the true
text before it). The FP8 KV cache's row
(`kv-fp8`) keeps full-precision weights and stores K and V as E4M3 (`kv-fp8-e5m2`, with `--kv-e5m2`: as
E5M2). Default model: the packaged trained target, whose held-out split (files its
training never saw) is the perplexity text. `--checkpoint LABEL=PATH` adds a row for a checkpoint quantized
elsewhere (llm-compressor's, `ember quantize`'s: a directory; a GGUF file) of the same model, loaded in
its own scheme.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ember_engine.bench.arg_types import non_negative_int, positive_int
from ember_engine.bench.quant_inputs import checked_checkpoints, checked_inputs, checked_schemes

GEN_TOKENS = 64
PROMPT_TOKENS = 64
RATE_BATCH = 32  # sequences decoded together for the "b32" rate
CLOSE_TOP = 5  # how many of a side's most likely tokens a first divergence may fall among
_KV_LABELS = {"fp8": "kv-fp8", "fp8_e5m2": "kv-fp8-e5m2"}  # rows of a KV cache dtype, full-precision weights


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint (default: the packaged trained pair's target)")
    p.add_argument(
        "--schemes", default="fp8,w8a16,w4a16,w8a8", help="comma-separated, run after full precision"
    )
    p.add_argument(
        "--kv-cache-memory", type=positive_int, default=64 << 20, help="bytes for the KV-block count"
    )
    p.add_argument(
        "--kv-fp8",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the FP8 KV cache's row (full-precision weights)",
    )
    p.add_argument(
        "--kv-e5m2",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="add the E5M2 KV cache's row (kv_cache_dtype fp8_e5m2, full-precision weights)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the model dtype of every row (default: the checkpoint's)",
    )
    p.add_argument(
        "--repeats",
        type=non_negative_int,
        default=3,
        help="decode rates are measured this many times, round-robin over the configurations; best kept"
        " (0: quality and sizes only, no rates)",
    )
    p.add_argument(
        "--ppl-windows", type=positive_int, default=16, help="held-out windows of 512 tokens scored"
    )
    p.add_argument("--prompts", type=positive_int, default=32, help="greedy-agreement prompts")
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="a row for a quantized checkpoint (directory or GGUF file) of the same model (repeatable)",
    )
    p.add_argument("--json", help="write the results here")


@functools.lru_cache(maxsize=2)
def held_out(model_dir: Path) -> torch.Tensor:
    """The pair's held-out token ids (tokenizing the corpus takes seconds; kept per model directory)."""
    from ember_engine.tools import testmodel
    from ember_engine.tools.training import corpus_tokens

    ids = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    eos = next((t["id"] for t in ids if t["content"] == testmodel.EOS), None)
    if eos is None:  # the held-out split is the packaged pair's corpus, in its tokenizer
        raise SystemExit(
            f"--model: {model_dir}'s tokenizer has no {testmodel.EOS} token: not a model of the packaged pair's"
        )
    return corpus_tokens(model_dir / "tokenizer.json", eos)[1]


def prompts_from(text: torch.Tensor, count: int) -> list[list[int]]:
    """`count` prompts of PROMPT_TOKENS tokens, evenly spaced through `text`."""
    stride = len(text) // (count + 1)
    return [text[i * stride : i * stride + PROMPT_TOKENS].tolist() for i in range(count)]


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ, or None where they agree throughout."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def score(llm: Any, tokens: torch.Tensor, windows: int, length: int = 512) -> tuple[float, torch.Tensor]:
    """Perplexity over `windows` held-out windows, and the argmax next token at each of their positions."""
    from ember_engine.model.model_runner import Chunk

    runner = llm.engine.runner
    blocks = list(range(-(-length // runner.block_size)))
    nll, count, argmax = 0.0, 0, []
    for w in range(min(windows, (len(tokens) - 1) // length)):
        seq = tokens[w * length : (w + 1) * length + 1]
        logits = runner.forward([Chunk(blocks, 0, seq[:-1].tolist(), num_logits=length)])
        target = seq[1:].to(logits.device)
        nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
        count += length
        argmax.append(logits.argmax(-1).cpu())
    return math.exp(nll / count), torch.cat(argmax)


def _decode_rate(llm: Any, prompts: list[list[int]]) -> tuple[float, int]:
    """Tokens/s decoding `prompts` together, and how many sequences that was."""
    from ember_engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start), len(outs)


def measure(
    model: Path,
    scheme: str | None,
    args: argparse.Namespace,
    text: torch.Tensor,
    kv_cache_dtype: str = "auto",
    label: str = "",
) -> tuple[dict[str, Any], Any, list[list[int]]]:
    """One configuration's row (all but its decode rates), its engine, and the `RATE_BATCH` prompts its
    rates decode (the greedy-agreement prompts are `--prompts` of their own)."""
    from ember_engine import LLM, SamplingParams
    from ember_engine.model.quant.apply import PROJECTIONS, weight_bytes

    llm = LLM(
        str(model),
        quantization=scheme,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=64,
        dtype=args.dtype,
        kv_cache_dtype=kv_cache_dtype,
    )
    runner = llm.engine.runner
    proj_bytes = proj_numel = 0
    seen: set[int] = set()  # a tensor several projections share (a rotation's matrix) counted once
    for name, module in runner.model.named_modules():
        if name.rsplit(".", 1)[-1] in PROJECTIONS:
            for t in [*module.buffers(), *module.parameters()]:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    proj_bytes += t.numel() * t.element_size()
            proj_numel += getattr(module, "in_features", 0) * getattr(module, "out_features", 0)
    prompts = prompts_from(text, args.prompts)
    greedy = llm.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True, logprobs=CLOSE_TOP),
        use_tqdm=False,
    )
    ppl, next_tokens = score(llm, text, args.ppl_windows)
    llm.engine.block_manager.reset_prefix_cache()  # the windows overwrote the blocks the prompts cached
    row = {
        "scheme": label or _KV_LABELS.get(kv_cache_dtype) or scheme or "full",
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "weight_bytes": weight_bytes(runner.model),
        "projection_bytes_vs_bf16": proj_bytes / (2 * proj_numel),
        "kv_blocks": runner.num_blocks,
        "perplexity": ppl,
        "outputs": [list(o.token_ids) for o in greedy],
        "tops": [[{t for t, _ in lp.top} for lp in o.logprobs or []] for o in greedy],
        "next_tokens": next_tokens,
        "decode_tok_s_b1": 0.0,
        "decode_tok_s_b32": 0.0,
    }
    return row, llm, prompts_from(text, RATE_BATCH)


def logprobs_close(row: dict[str, Any], base: dict[str, Any]) -> float:
    """The fraction of prompts whose greedy tokens equal `base`'s, or first differ at a position where each
    side's token is among the other side's CLOSE_TOP most likely (both saw the same text up to there)."""
    close = 0
    for i, (ours, theirs) in enumerate(zip(row["outputs"], base["outputs"], strict=True)):
        first = first_difference(ours, theirs)
        close += first is None or (
            ours[first] in base["tops"][i][first] and theirs[first] in row["tops"][i][first]
        )
    return close / len(row["outputs"])


def measure_rates(configs: list[tuple[dict[str, Any], Any, list[list[int]]]], repeats: int) -> None:
    """Decode tokens/s at batch 1 and 32 for every configuration, taken round-robin `repeats` times and
    the best kept: a change in the machine's load then touches every configuration alike."""
    for _ in range(repeats):
        for row, llm, prompts in configs:
            for key, batch in (("b1", 1), ("b32", RATE_BATCH)):
                rate, row[f"decode_sequences_{key}"] = _decode_rate(llm, prompts[:batch])
                row[f"decode_tok_s_{key}"] = max(row[f"decode_tok_s_{key}"], rate)


def main(args: argparse.Namespace) -> int:
    from ember_engine.tools.spec_pair import packaged_pair

    model = Path(args.model) if args.model else packaged_pair()[0]
    schemes = checked_schemes(args.schemes)
    checkpoints = checked_checkpoints(args.checkpoint, model)
    text = checked_inputs(args, model, checkpoints, held_out)
    torch.set_num_threads(torch.get_num_threads())
    start = time.perf_counter()

    def timed(
        row: tuple[dict[str, Any], Any, list[list[int]]],
    ) -> tuple[dict[str, Any], Any, list[list[int]]]:
        print(
            f"measured {row[0]['scheme']} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True
        )
        return row

    configs = [timed(measure(model, None, args, text))]
    configs += [timed(measure(model, s, args, text)) for s in schemes]
    if args.kv_fp8:
        configs.append(timed(measure(model, None, args, text, kv_cache_dtype="fp8")))
    if args.kv_e5m2:
        configs.append(timed(measure(model, None, args, text, kv_cache_dtype="fp8_e5m2")))
    for label, path in checkpoints:
        configs.append(timed(measure(path, None, args, text, label=label)))
    measure_rates(configs, args.repeats)
    rows = [row for row, _, _ in configs]
    base = rows[0]
    for row in rows:
        pairs = [
            (a, b)
            for x, y in zip(row["outputs"], base["outputs"], strict=True)
            for a, b in zip(x, y, strict=True)
        ]
        row["greedy_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        row["logprobs_close"] = logprobs_close(row, base)
        row["next_token_agreement"] = (row["next_tokens"] == base["next_tokens"]).float().mean().item()
        row["perplexity_ratio"] = row["perplexity"] / base["perplexity"]
        for key, rate in (("b1_speedup", "decode_tok_s_b1"), ("b32_speedup", "decode_tok_s_b32")):
            row[key] = row[rate] / base[rate] if base[rate] else 0.0
        row["weight_ratio"] = row["weight_bytes"] / base["weight_bytes"]
        row["kv_blocks_ratio"] = row["kv_blocks"] / base["kv_blocks"]
    width = max(11, *(len(r["scheme"]) + 1 for r in rows))  # a --checkpoint label may be longer
    head = (
        f"{'scheme':<{width}} weight MB (x full) proj/bf16 KV blocks (x)    b1 tok/s (x)   b32 tok/s (x)   "
        "ppl (x full)    agree64 close5 next-token"
    )
    print(f"model: {model} ({base['dtype']}; KV cache memory {args.kv_cache_memory} bytes)\n{head}")

    def rate_cell(r: dict[str, Any], key: str, digits: int) -> str:  # "-" where --repeats 0 took none
        if not args.repeats:
            return f"{'-':>{digits}}       "
        return f"{r[f'decode_tok_s_{key}']:{digits}.1f} ({r[f'{key}_speedup']:.2f})"

    for r in rows:
        print(
            f"{r['scheme']:<{width}} {r['weight_bytes'] / 1e6:7.2f} ({r['weight_ratio']:.2f})  {r['projection_bytes_vs_bf16']:8.3f}"
            f" {r['kv_blocks']:9d} ({r['kv_blocks_ratio']:.2f}) {rate_cell(r, 'b1', 7)}"
            f" {rate_cell(r, 'b32', 8)} {r['perplexity']:7.3f} ({r['perplexity_ratio']:.3f})"
            f" {r['greedy_agreement']:8.3f} {r['logprobs_close']:6.3f} {r['next_token_agreement']:10.4f}"
        )
    if args.json:
        clean = [{k: v for k, v in r.items() if k not in ("outputs", "tops", "next_tokens")} for r in rows]
        if not args.repeats:  # no rates taken: null, as the table's "-"
            rates = ("decode_tok_s_b1", "decode_tok_s_b32", "b1_speedup", "b32_speedup")
            clean = [r | dict.fromkeys(rates) for r in clean]
        Path(args.json).write_text(json.dumps({"model": str(model), "rows": clean}, indent=2) + "\n")
    return 0
