"""`ember bench serve`: latency and throughput of a running OpenAI-compatible server, measured from the
client, one open-loop run per offered request rate.

Every request streams `POST {url}/v1/completions` with `ignore_eos`, so output lengths are the ones asked
for. Failures are counted by kind (listed in `client`). This module holds the command (`add_arguments`,
`main`) and one rate's run; the workload is in `workload`, one request in `client`, the statistics, table
and plot in `report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from typing import Any

# `x as x`: re-exported, so `bench_serve.summary` and the like keep working where they were.
from ember_engine.bench.arg_types import fraction, positive, positive_int
from ember_engine.bench.client import Outcome, send
from ember_engine.bench.client import parse_sse_line as parse_sse_line
from ember_engine.bench.report import _json_rate, _label, _pyplot, format_table, plot, summarize
from ember_engine.bench.report import goodput as goodput
from ember_engine.bench.report import summary as summary
from ember_engine.bench.throughput import parse_range
from ember_engine.bench.workload import arrival_times, make_prompts


async def run_rate(args: argparse.Namespace, rate: float, index: int) -> tuple[list[Outcome], float]:
    n = args.num_requests
    # One arrival seed for every rate makes the schedules scaled copies of one another; prompts differ
    # per rate so that one run does not warm the server's prefix cache for the next.
    arrivals = arrival_times(n, rate, args.burstiness, random.Random(f"arrivals/{args.seed}"))
    rng = random.Random(f"prompts/{args.seed}/{index}")
    prefix_len = args.prefix_len if args.dataset == "shared-prefix" else 0
    prompts = make_prompts(n, rng, args.input_len, prefix_len, args.long_fraction, args.long_factor)
    bodies = [
        {
            "model": args.model,
            "prompt": prompt,
            "max_tokens": rng.randint(*args.output_len),
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        for prompt in prompts
    ]
    url = args.url.rstrip("/").removesuffix("/v1") + "/v1/completions"
    headers = dict(args.header)
    slots = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    import httpx

    # No pool cap: httpx's default of 100 connections would quietly queue requests and close the loop.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def one(body: dict[str, Any], at: float) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if slots is None:
                return await send(client, url, body, headers, args.timeout)
            async with slots:
                return await send(client, url, body, headers, args.timeout)

        outcomes = await asyncio.gather(*(one(b, t) for b, t in zip(bodies, arrivals, strict=True)))
        return list(outcomes), time.perf_counter() - start


# Options of the plain run that `--structured` does not use, and their defaults (set by add_arguments).
PLAIN_ONLY = ("rate", "num_requests", "burstiness", "dataset", "input_len", "output_len", "prefix_len",
              "long_fraction", "long_factor", "slo_ttft", "slo_tpot", "max_concurrency", "seed", "plot")  # fmt: skip
_PLAIN_DEFAULTS: dict[str, Any] = {}


def main(args: argparse.Namespace) -> int:
    if args.structured:
        from ember_engine.bench import structured

        given = [d for d in PLAIN_ONLY if getattr(args, d) != _PLAIN_DEFAULTS[d]]
        for dest in given:
            print(
                f"ember bench serve: --{dest.replace('_', '-')} does not apply with --structured",
                file=sys.stderr,
            )
        if given:
            return 2

        return structured.main(args)
    if args.plot:
        try:  # fail before the run rather than after it
            _pyplot()
        except ImportError:
            print("ember bench serve: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
            return 2
    results = []
    for i, rate in enumerate(args.rate):
        print(f"rate {_label(rate)} requests/s: sending {args.num_requests} requests", file=sys.stderr)
        outcomes, duration = asyncio.run(run_rate(args, rate, i))
        results.append(
            {"rate": _json_rate(rate), **summarize(outcomes, duration, args.slo_ttft, args.slo_tpot)}
        )
    print(format_table(results))
    if args.json:
        settings = {k: v for k, v in vars(args).items() if not callable(v)}
        settings["rate"] = [_json_rate(r) for r in args.rate]
        with open(args.json, "w") as f:
            json.dump({"args": settings, "results": results}, f, indent=2, allow_nan=False)
    if args.plot:
        plot(results, args.plot)
    return 0 if any(r["completed"] for r in results) else 1


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition(":")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected K:V, got {text!r}")
    return key.strip(), value.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server base URL")
    add("--model", required=True, help="model name sent in each request")
    add("--rate", type=positive, nargs="+", default=[math.inf], metavar="R", help="requests/s (or inf)")
    add("--num-requests", type=positive_int, default=100, metavar="N", help="per rate")
    add("--burstiness", type=positive, default=1.0, metavar="B", help="arrival gaps' gamma shape")
    add("--dataset", choices=["random", "shared-prefix"], default="random")
    add("--input-len", type=parse_range, default=(128, 512), metavar="A:B", help="prompt words")
    add("--output-len", type=parse_range, default=(64, 256), metavar="A:B", help="max_tokens")
    add("--prefix-len", type=positive_int, default=1024, metavar="N", help="shared-prefix words")
    add("--long-fraction", type=fraction, default=0.0, metavar="F", help="share of long prompts")
    add("--long-factor", type=positive_int, default=8, metavar="K", help="how many times longer")
    add("--slo-ttft", type=positive, metavar="MS", help="goodput: TTFT bound")
    add("--slo-tpot", type=positive, metavar="MS", help="goodput: TPOT bound")
    add("--max-concurrency", type=positive_int, metavar="C", help="cap on in-flight requests")
    add("--seed", type=int, default=0, help="seeds arrivals and prompts")
    add("--timeout", type=positive, default=300.0, metavar="S", help="per request, then it failed")
    add("--header", type=_header, action="append", default=[], metavar="K:V", help="repeatable")
    add("--json", metavar="FILE", help="write the arguments and results here")
    add("--plot", metavar="FILE.png", help="plot TTFT and ITL against offered rate")
    from ember_engine.bench.structured import add_arguments as add_structured

    add_structured(add, positive_int)
    _PLAIN_DEFAULTS.update({dest: p.get_default(dest) for dest in PLAIN_ONLY})
