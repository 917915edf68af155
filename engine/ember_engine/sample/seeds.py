"""Seeds of seeded sampling: each sample's generator, its seed, and the seed of each output position's noise."""

from __future__ import annotations

import torch

_U64 = (1 << 64) - 1


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """The generator must live on the logits' device: exponential_ refuses a generator from another one."""
    return torch.Generator(device=device).manual_seed(seed)


def _mix64(x: int) -> int:
    """SplitMix64's finalizer: a bijection of 64-bit integers that spreads every input bit."""
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def child_seed(seed: int, index: int) -> int:
    """Distinct, reproducible streams for the n samples of one seeded request (sample 0 keeps the seed's
    64 bits; a negative seed is its two's complement)."""
    return seed & _U64 if index == 0 else _mix64((seed & _U64) ^ _mix64(index))


def position_seed(seed: int, position: int) -> int:
    """The seed of the noise a seeded sample's output token at `position` is drawn with. Keyed by position,
    not drawn from a running stream, so the token does not depend on how many draws came before it: a
    speculative step (proposals, verification) and a plain step pick the same token."""
    return _mix64(seed ^ _mix64(position + (1 << 40)))
