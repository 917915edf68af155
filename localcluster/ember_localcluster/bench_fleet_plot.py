"""`ember bench fleet --plot`: the TTFT distributions of both policies, per workload, as a PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("shared", "random"), strict=True):
        for policy in ("round_robin", "router"):
            ttfts = sorted(result["workloads"][kind][policy]["ttfts"])
            if ttfts:
                ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{kind} prompts")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
