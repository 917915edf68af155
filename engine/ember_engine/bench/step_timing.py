"""`ember bench step`'s instruments: a stub model and a per-component timer wrapped around a live engine.

The timer charges each wrapped call its own time, less the time of wrapped calls inside it, to one
component; whatever a step spends outside every wrapped call is "other"."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

COMPONENTS = ("schedule", "inputs", "sampling", "output", "detok", "other")


class StubModel:
    """Stands in for the model: hidden states of one column, logits taken in turn from a pool of random
    rows (so sampled tokens vary from step to step)."""

    def __init__(self, vocab: int, rows: int, device: torch.device, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.pool = (torch.randn(rows + 7, vocab, generator=gen) * 4.0).to(device)
        self.device = device
        self.rows = rows
        self.offset = 0

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(input_ids.shape[0], 1, device=self.device)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        self.offset = (self.offset + 1) % 7
        return self.pool[self.offset : self.offset + n]


class ComponentTimer:
    def __init__(self) -> None:
        self.totals = dict.fromkeys(COMPONENTS, 0.0)
        self.steps = 0
        self._stack: list[float] = []  # time spent in wrapped children, per open call

    def begin_step(self) -> None:
        self._stack.clear()

    def end_step(self) -> None:
        self.steps += 1

    def wrap(self, fn: Callable[..., Any], component: str) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._stack.append(0.0)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                children = self._stack.pop()
                self.totals[component] += elapsed - children
                if self._stack:
                    self._stack[-1] += elapsed

        return timed

    def means(self, step_seconds: float) -> dict[str, float]:
        """Per-step seconds by component; "other" is the step's mean less the wrapped components."""
        n = max(self.steps, 1)
        out = {c: self.totals[c] / n for c in COMPONENTS if c != "other"}
        out["other"] = max(0.0, step_seconds - sum(out.values()))
        return out


# (attribute path from the engine, method name, component)
_TARGETS = (
    ("scheduler", "schedule", "schedule"),
    ("spec", "plan", "schedule"),
    ("spec", "propose", "schedule"),
    ("runner", "execute", "inputs"),
    ("", "_sample", "sampling"),
    ("outputs", "append", "output"),
    ("outputs", "make_output", "output"),
)
_DETOK_METHODS = ("append", "flush", "take_delta")


def instrument(engine: Any, timer: ComponentTimer) -> Callable[[], None]:
    """Wrap the engine's parts in the timer; returns the function that unwraps them. The stub model's
    forward is charged to "other" (it costs next to nothing)."""
    from ember_engine.core.detokenizer import Detokenizer

    undo: list[Callable[[], None]] = []
    for path, name, component in _TARGETS:
        owner = getattr(engine, path) if path else engine
        if owner is None or not hasattr(owner, name):
            continue
        setattr(owner, name, timer.wrap(getattr(owner, name), component))
        undo.append(functools.partial(delattr, owner, name))
    for name in _DETOK_METHODS:
        original = Detokenizer.__dict__[name]
        setattr(Detokenizer, name, timer.wrap(original, "detok"))
        undo.append(functools.partial(setattr, Detokenizer, name, original))

    def restore() -> None:
        for fn in reversed(undo):
            fn()

    return restore
