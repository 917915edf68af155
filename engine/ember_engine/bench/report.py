"""The results of `ember bench serve`: latency percentiles, goodput and throughput of one rate's
outcomes (`summarize`), the table printed at the end, and the TTFT/ITL plot."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from ember_engine.bench.client import Outcome

QUANTILES = (50, 90, 99)


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
