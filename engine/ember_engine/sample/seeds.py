"""Seeds of seeded sampling: each sample's generator, its seed, and the seed of each output position's noise."""

from __future__ import annotations

import numpy as np
import torch

from ember_engine.sample import cpu_kernels

U64 = (1 << 64) - 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator must live on the logits' device: exponential_ refuses a generator from another one."""
    return torch.Generator(device=device).manual_seed(seed)


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def child_seed(seed: int, index: int) -> int:
    """Distinct, reproducible streams for the n samples of one seeded request (sample 0 keeps the seed's
    64 bits; a negative seed is its two's complement)."""
    return seed & U64 if index == 0 else _mix64((seed & U64) ^ _mix64(index))


def position_seed(seed: int, position: int) -> int:
    """The seed of the noise a seeded sample's output token at `position` is drawn with. Keyed by position,
    not drawn from a running stream, so the token does not depend on how many draws came before it: a
    speculative step (proposals, verification) and a plain step pick the same token."""
    return _mix64(seed ^ _mix64(position + (1 << 40)))


def keyed_race(probs: torch.Tensor, rows: list[int], seeds: list[int]) -> torch.Tensor:
    """The exponential race of `rows` of `probs` (on a CPU), each with the noise of its seed."""
    picked = probs if rows == list(range(probs.shape[0])) else probs.index_select(0, torch.tensor(rows))
    values = picked.to(torch.float32).contiguous().numpy()
    keys = np.array([seed & U64 for seed in seeds], dtype=np.uint64)
    out = np.empty(len(rows), dtype=np.int64)
    cpu_kernels.keyed_race(values, keys, out)
    return torch.from_numpy(out)


def warm_up() -> None:
    """Compile seeded rows' race (or load it from numba's cache) before any request waits on it."""
    keyed_race(torch.ones(1, 8), [0], [1])
