"""`ember bench serve`: latency and throughput of a running OpenAI-compatible server, measured from the
client, one open-loop run per offered request rate.

Every request streams `POST {url}/v1/completions` with `ignore_eos`, so output lengths are the ones asked
for. A failure is counted under its kind: the HTTP status of a response other than 2xx ("503"), "timeout" (still
running at --timeout), "stream_error" (an error event inside a 200 stream), "incomplete_stream" (the
stream ended without `data: [DONE]` or without any text), "malformed_stream" (a data line that is not a
JSON object), or the name of the transport error ("ConnectError").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ember_engine.bench_throughput import parse_range

if TYPE_CHECKING:  # imported where used: `ember --help` must not need httpx
    import httpx

SERVED_BY = "x-ember-served-by"
QUANTILES = (50, 90, 99)
# Short, common English words: about one token each in the usual BPE vocabularies, so a prompt of N words
# is roughly N tokens on any server without the client needing the model's tokenizer.
_VOCABULARY = (
    "the of and to in is was for on that with as by at from his it an were are which this be or has had "
    "not but first one their its new after who they two her she been other when there all during into "
    "school time may years more most only over city some world would where later up such used many can "
    "state about national out known university united then made"
)
WORDS = _VOCABULARY.split()


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. Times are seconds from sending; ttft, itl and output_tokens
    mean something only for a success (failure is None)."""

    latency: float  # to the end of the stream, or to the error
    failure: str | None = None  # None, or the kind of failure (see the module's docstring)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    served_by: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None  # a single token has no decode time to share out
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Event:
    """What the benchmark needs from one SSE data line."""

    text: str = ""
    usage_tokens: int | None = None
    error: str | None = None
    done: bool = False


def arrival_times(n: int, rate: float, burstiness: float, rng: random.Random) -> list[float]:
    """Send times in seconds from the start: gamma-distributed gaps with shape `burstiness` and mean
    1/rate (coefficient of variation 1/sqrt(burstiness): 1 is a Poisson process, infinity a steady beat).
    An infinite rate sends everything at once."""
    if math.isinf(rate):
        return [0.0] * n
    times, t = [], 0.0
    for _ in range(n):
        times.append(t)
        t += 1.0 / rate if math.isinf(burstiness) else rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return times


def make_prompts(
    n: int,
    rng: random.Random,
    input_len: tuple[int, int],
    prefix_len: int = 0,
    long_fraction: float = 0.0,
    long_factor: int = 1,
) -> list[str]:
    """Random-word prompts of `input_len` words after a common prefix of `prefix_len` words; a random
    `long_fraction` of them (exactly that share, rounded) is `long_factor` times longer past the prefix."""
    prefix = " ".join(rng.choices(WORDS, k=prefix_len))
    long = set(rng.sample(range(n), round(long_fraction * n)))
    prompts = []
    for i in range(n):
        words = rng.randint(*input_len) * (long_factor if i in long else 1)
        prompts.append(" ".join(filter(None, [prefix, *rng.choices(WORDS, k=words)])))
    return prompts


def parse_sse_line(line: str) -> Event | None:
    """None for lines that carry nothing here (blank separators, `: keep-alive` comments, `event:`
    fields). Raises ValueError for a data line that is not a JSON object."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return Event(done=True)
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
    if obj.get("error") is not None:
        err = obj["error"]
        return Event(error=str(err.get("message", err) if isinstance(err, dict) else err))
    text = "".join(c.get("text") or "" for c in obj.get("choices") or [])
    usage = obj.get("usage") or {}
    return Event(text=text, usage_tokens=usage.get("completion_tokens"))


def summary(seconds: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (linear interpolation between closest ranks) and mean, in milliseconds."""
    xs = sorted(s * 1000.0 for s in seconds)
    out: dict[str, float | None] = {}
    for q in QUANTILES:
        if not xs:
            out[f"p{q}"] = None
            continue
        pos = q / 100 * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    out["mean"] = sum(xs) / len(xs) if xs else None
    return out


def goodput(
    outcomes: list[Outcome], duration: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> float | None:
    """Completed requests per second that met every SLO given; None when no SLO was given."""
    if slo_ttft_ms is None and slo_tpot_ms is None:
        return None
    good = sum(
        1
        for o in outcomes
        if o.failure is None
        and (slo_ttft_ms is None or o.ttft * 1000 <= slo_ttft_ms)
        # A one-token output has no TPOT to miss.
        and (slo_tpot_ms is None or (o.tpot or 0.0) * 1000 <= slo_tpot_ms)
    )
    return good / duration


def summarize(
    outcomes: list[Outcome],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict[str, Any]:
    ok = [o for o in outcomes if o.failure is None]
    served = Counter(o.served_by for o in ok if o.served_by)
    return {
        "ttft_ms": summary([o.ttft for o in ok]),
        "itl_ms": summary([gap for o in ok for gap in o.itl]),
        "tpot_ms": summary([t for o in ok if (t := o.tpot) is not None]),
        "e2e_ms": summary([o.latency for o in ok]),
        # Error responses only: a timeout measures --timeout, not how fast the server refuses work.
        "error_latency_ms": summary([o.latency for o in outcomes if o.failure and o.failure.isdigit()]),
        "request_throughput": len(ok) / duration,
        "output_throughput": sum(o.output_tokens for o in ok) / duration,
        "goodput": goodput(outcomes, duration, slo_ttft_ms, slo_tpot_ms),
        "completed": len(ok),
        "failed": dict(Counter(o.failure for o in outcomes if o.failure is not None)),
        "served_by_fallback": sum(n for name, n in served.items() if "fallback" in name.lower()),
        "served_by": dict(served),
        "duration_s": duration,
    }


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], start: float
) -> Outcome:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if not resp.is_success:
            latency = time.perf_counter() - start
            await resp.aread()  # so the connection can be reused
            return Outcome(latency, str(resp.status_code))
        stamps: list[float] = []
        usage: int | None = None
        end: float | None = None
        async for line in resp.aiter_lines():
            event = parse_sse_line(line)
            now = time.perf_counter()
            if event is None or end is not None:
                continue  # read on to the end of the body rather than drop a keep-alive connection
            if event.error is not None:
                return Outcome(now - start, "stream_error")
            if event.done:
                end = now
            if event.text:
                stamps.append(now)
            if event.usage_tokens is not None:
                usage = event.usage_tokens
    if end is None or not stamps:
        return Outcome(time.perf_counter() - start, "incomplete_stream")
    return Outcome(
        end - start,
        ttft=stamps[0] - start,
        itl=[b - a for a, b in pairwise(stamps)],
        output_tokens=usage if usage is not None else len(stamps),
        served_by=resp.headers.get(SERVED_BY),
    )


async def send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> Outcome:
    import httpx

    start = time.perf_counter()
    try:
        # httpx's own timeouts bound each read, not the whole request; a slow trickle must still end here.
        async with asyncio.timeout(timeout):
            return await _stream(client, url, body, headers, start)
    except TimeoutError:
        failure = "timeout"
    except httpx.HTTPError as exc:
        failure = type(exc).__name__
    except ValueError:
        failure = "malformed_stream"
    return Outcome(time.perf_counter() - start, failure=failure)


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


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(results: list[dict[str, Any]]) -> str:
    cols = ["rate", "ok", "failed", "req/s", "tok/s", "goodput"]
    cols += [f"{m} {q}" for m in ("TTFT", "ITL") for q in ("p50", "p99")]
    cols += ["TPOT p50", "E2E p50", "err p50", "err p99"]
    rows = []
    for r in results:
        rows.append(
            [_label(r["rate"]), str(r["completed"]), str(sum(r["failed"].values()))]
            + [_fmt(r[k]) for k in ("request_throughput", "output_throughput", "goodput")]
            + [_fmt(r[k][q]) for k in ("ttft_ms", "itl_ms") for q in ("p50", "p99")]
            + [_fmt(r["tpot_ms"]["p50"]), _fmt(r["e2e_ms"]["p50"])]
            + [_fmt(r["error_latency_ms"][q]) for q in ("p50", "p99")]
        )
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in [cols, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("latencies in ms; goodput: completed requests/s within --slo-ttft and --slo-tpot")
    for r in results:
        if r["failed"] or r["served_by_fallback"]:
            failed = ", ".join(f"{kind} x{n}" for kind, n in sorted(r["failed"].items()))
            lines.append(
                f"rate {_label(r['rate'])}: failed {failed or 'none'}; by fallback {r['served_by_fallback']}"
            )
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # the output is a file; a server has no display
    import matplotlib.pyplot as plt

    return plt


def plot(results: list[dict[str, Any]], path: str) -> None:
    plt = _pyplot()
    finite = [r["rate"] for r in results if r["rate"] != "inf"]
    # An infinite rate has no place on a numeric axis: it is drawn a step right of the highest finite one.
    xs = [r["rate"] if r["rate"] != "inf" else max(finite, default=1.0) * 1.25 for r in results]
    order = sorted(range(len(results)), key=xs.__getitem__)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, name in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "ITL"), strict=True):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [results[i][key][q] for i in order]
            ax.plot([xs[i] for i in order], [math.nan if y is None else y for y in ys], style, label=q)
        ax.set_xticks([xs[i] for i in order], [_label(results[i]["rate"]) for i in order])
        ax.set(title=f"{name} vs offered rate", xlabel="offered rate (requests/s)", ylabel=f"{name} (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _json_rate(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate  # JSON has no infinity


def _label(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def main(args: argparse.Namespace) -> int:
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


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a positive number or inf, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}")
    return value


def _header(text: str) -> tuple[str, str]:
    key, sep, value = text.partition(":")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected K:V, got {text!r}")
    return key.strip(), value.strip()


def add_arguments(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--url", default="http://127.0.0.1:8000", help="server base URL")
    add("--model", required=True, help="model name sent in each request")
    add("--rate", type=_positive, nargs="+", default=[math.inf], metavar="R", help="requests/s (or inf)")
    add("--num-requests", type=_positive_int, default=100, metavar="N", help="per rate")
    add("--burstiness", type=_positive, default=1.0, metavar="B", help="arrival gaps' gamma shape")
    add("--dataset", choices=["random", "shared-prefix"], default="random")
    add("--input-len", type=parse_range, default=(128, 512), metavar="A:B", help="prompt words")
    add("--output-len", type=parse_range, default=(64, 256), metavar="A:B", help="max_tokens")
    add("--prefix-len", type=_positive_int, default=1024, metavar="N", help="shared-prefix words")
    add("--long-fraction", type=_fraction, default=0.0, metavar="F", help="share of long prompts")
    add("--long-factor", type=_positive_int, default=8, metavar="K", help="how many times longer")
    add("--slo-ttft", type=_positive, metavar="MS", help="goodput: TTFT bound")
    add("--slo-tpot", type=_positive, metavar="MS", help="goodput: TPOT bound")
    add("--max-concurrency", type=_positive_int, metavar="C", help="cap on in-flight requests")
    add("--seed", type=int, default=0, help="seeds arrivals and prompts")
    add("--timeout", type=_positive, default=300.0, metavar="S", help="per request, then it failed")
    add("--header", type=_header, action="append", default=[], metavar="K:V", help="repeatable")
    add("--json", metavar="FILE", help="write the arguments and results here")
    add("--plot", metavar="FILE.png", help="plot TTFT and ITL against offered rate")
