"""The autoscaling side of a reconcile pass: scrape the engines, decide, and keep what was decided.

`autoscaler.decide` is the pure decision; this module feeds it from the pods' /metrics, keeps its history
and the recent decisions in the per-InferenceService memory, and reports them (status, Events, metrics).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

import kopf

from ember_operator import metrics
from ember_operator.autoscaler import Decision, History, Observation, clamp, decide
from ember_operator.desired import ACTIVE, Owner, template_hash
from ember_operator.known import Known
from ember_operator.podcache import Pending
from ember_operator.pods import is_ready, metrics_url
from ember_operator.rollout import PodView, Releases, plan_pods
from ember_operator.router import wakes
from ember_operator.scrape import PodSample, Scraper
from ember_operator.spec import InferenceServiceSpec
from ember_operator.status import Condition

MAX_DECISIONS = 10


@dataclass(slots=True)
class Memory:
    """What the operator keeps per InferenceService between passes (kopf's per-object memo)."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    desired: int | None = None
    history: History = field(default_factory=History)
    next_scrape: float = 0.0  # time.monotonic() of the next autoscaler evaluation
    inputs: dict[str, Any] | None = None
    decisions: list[dict[str, Any]] = field(default_factory=list)
    metrics_ok: bool | None = None
    metrics: Condition | None = None
    fallback: Condition | None = None
    fallback_counters: dict[str, float] = field(default_factory=dict)
    shed_counters: dict[str, float] = field(default_factory=dict)
    cold_start: float | None = None
    stalled: str | None = None  # the Stalled message last announced with an Event
    # Crash troubles by pod name, held until that pod has been Ready for a while (a crash-looping engine
    # runs between its crashes: without this, Stalled would flap with every restart).
    held: dict[str, Any] = field(default_factory=dict)
    router_held: dict[str, Any] = field(default_factory=dict)  # the same, of the router pods
    create_refused: Any = None  # the Trouble of the latest refused pod creation, while backing off
    create_backoff: float = 0.0  # seconds until the next try; doubles up to a minute
    create_retry_at: float = 0.0  # time.monotonic() of the next try
    pending: Pending = field(default_factory=Pending)  # pod writes the pod index may not show yet
    has_groups: bool | None = None  # whether the last LeaderWorkerSet LIST found any (None: not listed)
    known: Known = field(default_factory=Known)  # children made sure of, until the next resync
    releases: Releases = field(default_factory=Releases)  # when a pod of its last went away
    # The last spec the model took: a later one it refuses (under an older CRD) leaves the service on it.
    last_spec: InferenceServiceSpec | None = None
    # The watch listed the pods again (after a pause, or a watch that had to start over): pods deleted while
    # it was down may still be in the index, so the next pass lists them itself.
    relist: bool = False
    # The watch listed the service again: what a peer did while this operator was paused is unknown, so
    # the next pass starts from status (`reset`), as an operator starting then would.
    stale: bool = False
    # The conditions the last pass rendered: a pass may be handed a status older than that pass's write
    # (kopf's body for the timer, read before the lock), and a condition that did not flip keeps its time.
    conditions: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def restored(cls, status: dict[str, Any]) -> Memory:
        autoscaler = status.get("autoscaler") or {}
        desired = status.get("desiredReplicas")
        # After a restart the restored target counts as a fresh proposal, so that the scale-down window
        # starts over instead of being skipped.
        history = History([(time.monotonic(), desired)] if desired is not None else [])
        stalled = next(
            (
                c.get("message")
                for c in status.get("conditions") or []
                if c.get("type") == "Stalled" and c.get("status") == "True"
            ),
            None,
        )
        return cls(
            history=history,
            desired=desired,
            inputs=autoscaler.get("inputs"),
            decisions=list(autoscaler.get("decisions") or []),
            cold_start=status.get("coldStartSeconds"),
            stalled=stalled,  # announced with an Event already: not announced again
            conditions=list(status.get("conditions") or []),
        )

    def reset(self, status: dict[str, Any]) -> None:
        """Forget everything but the lock and the writes the index may not show yet, and take up what
        `status` holds, as an operator starting now would."""
        fresh = Memory.restored(status)
        for f in fields(self):
            if f.name not in ("lock", "pending"):
                setattr(self, f.name, getattr(fresh, f.name))


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


async def autoscale(
    body: kopf.Body,
    spec: InferenceServiceSpec,
    owner: Owner,
    pods: list[dict[str, Any]],
    views: list[PodView],
    memory: Memory,
    now: datetime,
    scraper: Scraper,
    routers: dict[str, str] | None = None,
    live: Callable[[], list[dict[str, Any]]] | None = None,
) -> None:
    """Update memory.desired: the External target, or (when due) the Builtin autoscaler's decision.
    `routers`: the Ready router pods' /metrics by pod name, read on the same ticks for FallbackActive.
    `live`: the engine pods as the operator's cache holds them now (it moves while the pods are read)."""
    replicas = spec.replicas
    if memory.desired is None:  # first pass, or a restart without status: keep what is there
        memory.desired = clamp(sum(v.role == ACTIVE and not v.deleting for v in views), replicas)
    if spec.autoscaling.mode == "External":
        record(body, owner, memory, external_decision(spec, memory), now)
    elif clamp(memory.desired, replicas) != memory.desired:
        clamped = clamp(memory.desired, replicas)
        record(
            body,
            owner,
            memory,
            Decision(
                clamped,
                f"clamped to replicas [{replicas.min}, {replicas.max}]",
                memory.metrics_ok is not False,
                "",
            ),
            now,
        )

    tick = time.monotonic()
    if tick < memory.next_scrape:
        return
    memory.next_scrape = tick + spec.autoscaling.interval_seconds
    # The active pods as this pass leaves them: a Ready warm pod it promotes (in place of an active pod
    # deleted or down) serves from now on, and is read instead of finding no pod to read.
    promoted = plan_pods(
        views, template_hash(spec), memory.desired, 0, now, spec.warm_pool.failover_after_seconds
    ).promote
    targets = {
        v.name: url
        for p, v in zip(pods, views, strict=True)
        if (v.role == ACTIVE or v.name in promoted) and v.ready and not v.deleting and (url := metrics_url(p))
    }
    results = await scraper.scrape(targets) if targets else {}
    if live is not None and (gone := went_away(results, live())):
        # A pod deleted or gone unready while it was read has not failed to report: this reading is
        # dropped, and the pass that sees the pods as they are now reads them again.
        memory.next_scrape = tick
        metrics.SCRAPES_DROPPED.labels(owner.namespace, owner.name).inc(len(gone))
        return
    routed = await scraper.router_fallback(routers) if routers and spec.fallback is not None else {}
    samples = {n: r for n, r in results.items() if isinstance(r, PodSample)}
    failed = [f"{n}: {r}" for n, r in results.items() if isinstance(r, str)]
    if failed:
        metrics.SCRAPE_FAILURES.labels(owner.namespace, owner.name).inc(len(failed))
    unread = (set(targets) - set(samples)) | (set(routers or {}) - set(routed))
    shed, memory.shed_counters = since_last(
        {p: s.shed for p, s in samples.items()}, memory.shed_counters, unread
    )
    seen = Observation([s.load for s in samples.values()], failed, sum(shed.values()))
    memory.fallback = fallback_condition(
        spec, memory, samples, spec.autoscaling.interval_seconds, routed, unread
    )
    # A reading no pod gave is an explicit null: status goes out as a merge patch, which keeps a key left
    # out, so the last queue depth and KV use would stay in status (and on `kubectl get`) with no pod read.
    memory.inputs = {
        "queueDepth": seen.queue_per_pod,
        "kvCacheUtilization": seen.kv_cache,
        "readyPods": len(samples),
    }
    if spec.autoscaling.mode == "External":
        ok = not failed and bool(samples)
        why = (
            "all Ready active pods scraped" if ok else ("; ".join(failed) or "no Ready active pod to scrape")
        )
        reason = "Scraped" if ok else ("ScrapeFailed" if failed else "NoReadyPods")  # as Builtin says
        memory.metrics = Condition("MetricsAvailable", ok, reason, why)
        return
    decision = decide(spec.autoscaling, replicas, memory.desired, seen, memory.history, tick)
    if decision.metrics_ok:
        reason = "ScaledToZero" if not targets and decision.desired == 0 else "Scraped"
    else:
        reason = "ScrapeFailed" if failed else "NoReadyPods"
    memory.metrics = Condition("MetricsAvailable", decision.metrics_ok, reason, decision.metrics_reason)
    record(body, owner, memory, decision, now)


def went_away(results: dict[str, PodSample | str], now: list[dict[str, Any]]) -> list[str]:
    """The pods whose read failed and that are, by now, deleted, being deleted or not Ready."""
    live = {p["metadata"]["name"]: p for p in now}
    return [
        name
        for name, result in results.items()
        if isinstance(result, str)
        and ((p := live.get(name)) is None or p["metadata"].get("deletionTimestamp") or not is_ready(p))
    ]


def external_decision(spec: InferenceServiceSpec, memory: Memory) -> Decision:
    """External mode's target: spec.replicas.desired, clamped to replicas.min..max. A target from outside
    says nothing about metrics: their state is kept as it is."""
    target = clamp(spec.replicas.desired, spec.replicas)
    current = memory.desired
    verdict = "hold" if current in (None, target) else "scale up" if target > (current or 0) else "scale down"
    change = f"{verdict} {target}" if current in (None, target) else f"{verdict} {current} -> {target}"
    return Decision(target, f"{change}: spec.replicas.desired (External)", memory.metrics_ok is not False, "")


def woken(spec: InferenceServiceSpec, memory: Memory, pending: float, tick: float) -> Decision | None:
    """Scale from zero: the decision to raise the target to 1 while the routers hold `pending` requests
    and the target is 0 (None otherwise). The 1 goes into the autoscaler's history as a proposal made at
    `tick` (time.monotonic()), so that the scale-down window holds the woken pod as it holds any other:
    at zero there is nothing to scrape, and the first idle scrape alone would otherwise take it back."""
    if not wakes(spec, memory.desired or 0, pending):
        return None
    policy = spec.autoscaling
    keep = max(policy.scale_up_stabilization_seconds, policy.scale_down_stabilization_seconds)
    memory.history.add(tick, 1, keep)
    why = f"{pending:g} requests held by the routers with no engine (scale from zero)"
    return Decision(1, why, memory.metrics_ok is not False, "")


def record(body: kopf.Body, owner: Owner, memory: Memory, decision: Decision, now: datetime) -> None:
    """Keep a decision in status and as an Event when it changes the target or the metrics state."""
    changed = decision.desired != memory.desired
    flipped = memory.metrics_ok is not None and decision.metrics_ok != memory.metrics_ok
    previous = memory.desired
    memory.metrics_ok = decision.metrics_ok
    memory.desired = decision.desired
    if not (changed or flipped):
        return
    entry = {
        "time": _stamp(now),
        "desired": decision.desired,
        "reason": decision.reason,
        # Nulls left out: the API server drops them inside lists, and kopf would see its patch half-applied.
        "inputs": {k: v for k, v in (memory.inputs or {}).items() if v is not None},
    }
    memory.decisions = [*memory.decisions, entry][-MAX_DECISIONS:]
    if changed:
        direction = "up" if previous is None or decision.desired > previous else "down"
        metrics.SCALING_DECISIONS.labels(owner.namespace, owner.name, direction).inc()
        kopf.info(body, reason="Scaled", message=decision.reason)
    elif decision.metrics_ok:
        kopf.info(body, reason="MetricsAvailable", message=f"{decision.metrics_reason}; {decision.reason}")
    else:
        kopf.warn(body, reason="MetricsUnavailable", message=f"{decision.metrics_reason}; {decision.reason}")


def fallback_condition(
    spec: InferenceServiceSpec,
    memory: Memory,
    samples: dict[str, PodSample],
    interval: float,
    routers: dict[str, float] | None = None,
    unread: Collection[str] = (),
) -> Condition:
    """FallbackActive from the served-by-fallback counters since the last scrape: the engines' (requests
    an engine handed on) and the routers' (requests a router sent there itself, `routers` by pod name). A
    request is in one of them only: a router does not count an engine's fallback answer that it relays.
    A pod in `unread` (its scrape failed this pass) keeps its last reading as its base."""
    counters = {pod: s.fallback_served for pod, s in samples.items()}
    counters.update(routers or {})
    sent, memory.fallback_counters = since_last(counters, memory.fallback_counters, unread)
    if spec.fallback is None:
        return Condition("FallbackActive", False, "NoFallback", "no fallback configured")
    by_engines = sum(n for pod, n in sent.items() if pod in samples)
    total = sum(sent.values())
    if total > 0:
        return Condition(
            "FallbackActive",
            True,
            "Overflowing",
            f"{total:g} requests served by the fallback in the last {interval:g} s ({by_engines:g} handed on "
            f"by the engines, {total - by_engines:g} sent by the routers)",
        )
    return Condition("FallbackActive", False, "Idle", "no requests sent to the fallback recently")


def since_last(
    counters: dict[str, float], before: dict[str, float], unread: Collection[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Each pod's counter increase since its last reading (0 at its first; a counter that went back is a
    restarted process, counting from 0), and the readings to keep: these, and a pod in `unread` (its
    scrape failed this pass) keeping its last reading as its base."""
    grown = {pod: 0.0 for pod in counters}
    for pod, now in counters.items():
        last = before.get(pod)
        if last is not None:
            grown[pod] = now - last if now >= last else now
    kept = {pod: before[pod] for pod in unread if pod in before}
    return grown, {**kept, **counters}
