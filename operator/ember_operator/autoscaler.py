"""The autoscaler's decision: how many active engine pods an InferenceService needs. Pure; no I/O.

It follows the Horizontal Pod Autoscaler's arithmetic on the engines' own signals: each signal's ratio to
its target gives a proposal, `ceil(pods * ratio)`; a ratio within the tolerance band of 1 proposes no
change; the larger proposal wins, so either a long queue or a full KV cache is enough to scale up.

The KV-cache ratio is the plain one, usage / target: usage grows with the requests a pod runs. The waiting
queue is not proportional to load (it stays at zero until a pod is saturated, then grows by the overflow),
and a plain ratio on it limit-cycles: it proposes too few pods while the queue is short, then too many. So
the queue's ratio is (waiting + running) / (running + target): the pod count at which, running as many
requests per pod as now, the queue would sit exactly at its target. An engine that sheds load refuses
what its queue would otherwise show, so requests shed for capacity since the last scrape propose one pod
more than are Ready. Scale-up takes effect at once (or after its stabilisation window, if one is set);
scale-down takes the highest proposal seen during its window, so a short lull never removes a pod. Steps
are limited and the result is clamped to the replica bounds.

Missing metrics never scale down: with no samples the last decision is held; with some pods unscraped the
decision may grow but not shrink.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ember_operator.spec import Autoscaling, Replicas


@dataclass(frozen=True, slots=True)
class PodLoad:
    """One Ready active pod's scraped gauges."""

    waiting: float  # vllm:num_requests_waiting
    running: float  # vllm:num_requests_running
    kv_cache: float  # vllm:kv_cache_usage_perc, 0..1


@dataclass(frozen=True, slots=True)
class Observation:
    loads: list[PodLoad]
    unscraped: list[str] = field(default_factory=list)  # Ready active pods whose /metrics failed, with why
    shed: float = 0.0  # requests the pods refused for want of capacity since the last scrape

    @property
    def queue_per_pod(self) -> float | None:
        return sum(p.waiting for p in self.loads) / len(self.loads) if self.loads else None

    @property
    def kv_cache(self) -> float | None:
        return sum(p.kv_cache for p in self.loads) / len(self.loads) if self.loads else None


@dataclass(frozen=True, slots=True)
class Decision:
    desired: int
    reason: str
    metrics_ok: bool
    metrics_reason: str


@dataclass(slots=True)
class History:
    """Proposals (time, replicas) kept for the stabilisation windows."""

    proposals: list[tuple[float, int]] = field(default_factory=list)

    def add(self, now: float, proposal: int, keep_seconds: float) -> None:
        self.proposals.append((now, proposal))
        self.proposals = [(t, p) for t, p in self.proposals if now - t <= keep_seconds]

    def within(self, now: float, seconds: float) -> list[int]:
        return [p for t, p in self.proposals if now - t <= seconds]


def _proposal(pods: int, current: int, value: float, target: float, tolerance: float) -> int:
    ratio = value / target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return math.ceil(pods * ratio)


def clamp(value: int, replicas: Replicas) -> int:
    return max(replicas.min, min(replicas.max, value))


def decide(
    policy: Autoscaling, replicas: Replicas, current: int, seen: Observation, history: History, now: float
) -> Decision:
    """The desired active replica count, given the current target `current` and what the pods report."""
    if not seen.loads and not seen.unscraped and current == 0:
        # Scaled to zero: there is nothing to read, and nothing is missing (a wake raises the target).
        why = "scaled to zero: no active pod to scrape"
        return Decision(clamp(0, replicas), f"hold 0: {why}", True, why)
    if not seen.loads:
        why = "no Ready active pod to scrape"
        if seen.unscraped:
            why = "scrape failed: " + "; ".join(seen.unscraped)
        held = clamp(current, replicas)
        return Decision(held, f"holding {held}: metrics unavailable ({why})", False, why)

    pods = len(seen.loads)
    queue = seen.queue_per_pod or 0.0
    kv = seen.kv_cache or 0.0
    running = sum(p.running for p in seen.loads) / pods
    by_queue = _proposal(
        pods, current, queue + running, running + policy.queue_depth_per_replica, policy.tolerance
    )
    by_kv = _proposal(pods, current, kv, policy.kv_cache_utilization, policy.tolerance)
    # Shedding (a full queue, or a wait past its limit) keeps the queue short by refusing the demand the
    # queue would show: one pod more than are Ready, which pods already starting count toward.
    by_shed = pods + 1 if seen.shed > 0 else 0
    proposal = max(by_queue, by_kv, by_shed)
    if seen.unscraped:  # the unscraped pods may be the busy ones: never shrink on partial evidence
        proposal = max(proposal, current)
    history.add(
        now, proposal, max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    )

    desired = current
    up_floor = min(history.within(now, policy.scale_up_stabilization_seconds))
    down_ceiling = max(history.within(now, policy.scale_down_stabilization_seconds))
    if up_floor > current:
        desired = min(up_floor, current + policy.scale_up_max_step)
    elif down_ceiling < current:
        desired = max(down_ceiling, current - policy.scale_down_max_step)
    desired = clamp(desired, replicas)

    signals = (
        f"queue {queue:.2f}/pod (target {policy.queue_depth_per_replica:g}) proposes {by_queue}, "
        f"KV cache {kv:.0%} (target {policy.kv_cache_utilization:.0%}) proposes {by_kv}"
    )
    if seen.shed > 0:
        signals += f", {seen.shed:g} shed for capacity since the last scrape proposes {by_shed}"
    if desired > current:
        verdict = f"scale up {current} -> {desired}"
    elif desired < current:
        verdict = f"scale down {current} -> {desired}"
    elif proposal < current:
        verdict = f"hold {current}: scale-down stabilisation window"
    elif proposal > current and current >= replicas.max:
        verdict = f"hold {current}: at replicas.max"
    elif proposal > current:
        verdict = f"hold {current}: scale-up stabilisation window"
    else:
        verdict = f"hold {current}"
    ok = not seen.unscraped
    metrics_reason = "all Ready active pods scraped" if ok else "scrape failed: " + "; ".join(seen.unscraped)
    return Decision(desired, f"{verdict}; {signals}", ok, metrics_reason)
