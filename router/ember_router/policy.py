"""The routing decision, as a pure function: prefix affinity within a bounded load.

Each engine's load is the requests outstanding there: what the router has in flight, or what the engine
itself last reported running and waiting when that is more (other routers' requests). An engine is
eligible when taking one more request keeps its load within (1 + epsilon) times the fleet's mean load
after the request (consistent hashing with bounded loads, applied to prefix scores), or within twice that
while it reports no queue, so one hot tenant cannot pile onto one engine however well its prefix is cached
there. Among eligible engines the longest cached prefix wins, then the lightest load, then whose turn it
is (round robin). A session id keeps a client on its engine while that engine is eligible. Engines that
answered "overloaded" recently, or are not Ready, are not candidates; none left is a fleet-level shed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# How far past the bound an engine with no queue may go (a multiple of the bound).
QUEUELESS_FACTOR = 2


@dataclass(slots=True)
class EngineState:
    name: str
    in_flight: int = 0  # requests the router has sent there and not yet finished
    waiting: float = 0.0  # the engine's own vllm:num_requests_waiting, last scraped
    running: float = 0.0  # the engine's own vllm:num_requests_running, last scraped
    kv_usage: float = 0.0
    ready: bool = True
    overloaded_until: float = 0.0  # monotonic time before which it is skipped (after a 503/429)
    adapters: frozenset[str] | None = None  # the LoRA adapters it has loaded; None: not known

    @property
    def load(self) -> float:
        """Requests outstanding at the engine: the router's own count, or what the engine last reported
        holding (running and waiting) when that is more, as with other routers in front of it. Not their
        sum: the engine's count includes this router's requests."""
        return max(float(self.in_flight), self.running + self.waiting)


@dataclass(frozen=True, slots=True)
class Decision:
    engine: str | None  # None: shed
    reason: str  # prefix | load | spill (the prefix's engine was over the bound) | session | only | shed
    matched_blocks: int = 0


def bounded_capacity(loads: Sequence[float], epsilon: float) -> float:
    """The most load any engine may carry after one more request is placed."""
    mean = (sum(loads) + 1) / len(loads)
    return math.ceil(mean * (1 + epsilon))


def within_bound(engine: EngineState, cap: float) -> bool:
    """Whether `engine` may take one more request under the bound `cap`. An engine that reported no queue
    at its last poll starts the request at once, in its running batch: it may go to twice the bound (at
    the few requests per engine of a light load the bound is a request or two, and skipping an engine
    that holds the prompt costs the whole prefill elsewhere); one with a queue keeps to the bound."""
    if engine.load + 1 <= cap:
        return True
    return engine.waiting == 0 and engine.load + 1 <= QUEUELESS_FACTOR * cap


def lacking(engines: Sequence[EngineState], model: object) -> frozenset[str]:
    """The engines known not to hold LoRA adapter `model`, when some engine is known to: a request naming
    it goes only where it is loaded (adapters loaded into some engines at run time). Empty when no engine
    holds it (the base model's name, or a name no engine serves: any engine answers that)."""
    if not isinstance(model, str) or not any(e.adapters and model in e.adapters for e in engines):
        return frozenset()
    return frozenset(e.name for e in engines if e.adapters is not None and model not in e.adapters)


def choose(
    engines: Sequence[EngineState],
    matched: dict[str, int],
    now: float,
    epsilon: float = 0.25,
    session_engine: str | None = None,
    exclude: frozenset[str] = frozenset(),
    turn: int = 0,
) -> Decision:
    """Pick an engine for one request; `matched` holds each engine's cached prefix length in blocks."""
    candidates = [e for e in engines if e.ready and e.overloaded_until <= now and e.name not in exclude]
    if not candidates:
        return Decision(None, "shed")
    if len(candidates) == 1:
        only = candidates[0]
        return Decision(only.name, "only", matched.get(only.name, 0))
    cap = bounded_capacity([e.load for e in candidates], epsilon)
    eligible = [e for e in candidates if within_bound(e, cap)] or candidates
    if session_engine is not None:
        for e in eligible:
            if e.name == session_engine:
                return Decision(e.name, "session", matched.get(e.name, 0))
    # Equal prefix and load: take turns (round robin over a stable order), not always the first name.
    order = {
        e.name: (i - turn) % len(candidates) for i, e in enumerate(sorted(candidates, key=lambda e: e.name))
    }
    best = min(eligible, key=lambda e: (-matched.get(e.name, 0), e.load, order[e.name]))
    blocks = matched.get(best.name, 0)
    if max(matched.get(e.name, 0) for e in candidates) > blocks:
        # An engine over the bound holds more of the prompt: the request spills, its prefix computed again.
        return Decision(best.name, "spill", blocks)
    return Decision(best.name, "prefix" if blocks > 0 else "load", blocks)
