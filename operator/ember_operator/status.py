"""The InferenceService's status: counts, the endpoint, and conditions with kstatus semantics. Pure.

`Ready` says whether the service can serve at its floor (and, with the router on, whether a router pod is
Ready: the Service selects the routers); `Reconciling` (abnormal-true) says work is under
way; `Stalled` (abnormal-true) says it will not converge without a change to the spec. While stalled,
`Reconciling` is False, so that kstatus and Argo CD report a failure rather than endless progress.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ember_operator.pods import Trouble
from ember_operator.rollout import PodPlan, PodView


@dataclass(frozen=True, slots=True)
class Condition:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""


def render_conditions(
    conditions: list[Condition], previous: list[dict[str, Any]], generation: int, now: datetime
) -> list[dict[str, Any]]:
    """metav1.Condition dicts; lastTransitionTime moves only when a condition's status flips."""
    before = {c.get("type"): c for c in previous}
    out = []
    for c in conditions:
        status = "Unknown" if c.status is None else str(c.status)
        old = before.get(c.type) or {}
        since = old.get("lastTransitionTime") if old.get("status") == status else None
        out.append(
            {
                "type": c.type,
                "status": status,
                "reason": c.reason,
                "message": c.message,
                "observedGeneration": generation,
                "lastTransitionTime": since or now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            }
        )
    return out


@dataclass(slots=True)
class Assessment:
    """Everything one reconcile pass learned, reduced to what status reports."""

    template_hash: str
    desired_active: int
    warm_size: int
    min_replicas: int
    pods: list[PodView]
    plan: PodPlan
    troubles: list[Trouble] = field(default_factory=list)  # spec problems only the operator can see
    metrics: Condition | None = None
    fallback: Condition | None = None
    waiting_for_capacity: list[str] = field(default_factory=list)  # scheduler messages, within the wait
    preempting: list[str] = field(default_factory=list)  # pods nominated to a node where victims are ending
    # (Ready, wanted) router pods; None with the router off. The Service selects the routers when it is on.
    routers: tuple[int, int] | None = None

    def _current(self, role: str) -> list[PodView]:
        return [p for p in self.pods if not p.deleting and p.role == role]

    def counts(self) -> dict[str, int]:
        active = self._current("active")
        return {
            "replicas": len(active),
            "warmReplicas": len(self._current("warm")),
            "readyReplicas": sum(p.ready for p in active),
            "desiredReplicas": self.desired_active,
        }

    def conditions(self) -> list[Condition]:
        counts = self.counts()
        ready_active = counts["readyReplicas"]
        floor = max(self.min_replicas, 1 if self.desired_active else 0)
        # Warm units count once Ready (a group that never comes up is no stand-by).
        ready_warm = sum(p.ready for p in self._current("warm"))
        summary = f"{ready_active}/{self.desired_active} active Ready, {ready_warm} warm Ready"
        ready = Condition(
            "Ready",
            ready_active >= floor,
            "MinimumReplicasReady" if ready_active >= floor else "MinimumReplicasUnavailable",
            summary,
        )
        if self.routers is not None and self.routers[0] == 0:
            # The Service's only endpoints are the routers: with none Ready nothing is served.
            message = f"{summary}; 0/{self.routers[1]} router pods Ready"
            ready = Condition("Ready", False, "RouterUnavailable", message)
        current_ready_warm = sum(
            p.ready for p in self._current("warm") if p.template_hash == self.template_hash
        )
        if self.warm_size == 0:
            warm = Condition("WarmPoolReady", True, "NoWarmPool", "warmPool.size is 0")
        else:
            warm = Condition(
                "WarmPoolReady",
                current_ready_warm >= self.warm_size,
                "PoolFull" if current_ready_warm >= self.warm_size else "PoolFilling",
                f"{current_ready_warm}/{self.warm_size} warm pods Ready",
            )
        if self.troubles:
            message = "; ".join(t.message for t in self.troubles)
            stalled = Condition("Stalled", True, self.troubles[0].reason, message)
            reconciling = Condition("Reconciling", False, "Stalled", "waiting for a change to the spec")
        else:
            stalled = Condition("Stalled", False, "NoProblems")
            progress = self._progress(ready_active)
            if progress is not None and self.preempting:
                # The scheduler evicts pods of lower priority for them: room is being freed.
                message = f"{summary}; waiting for preemption: " + "; ".join(self.preempting)
                reconciling = Condition("Reconciling", True, "WaitingForPreemption", message)
            elif progress is not None and self.waiting_for_capacity:
                # Pods wait for a node (e.g. one a cluster autoscaler is adding): progress, not failure.
                message = f"{summary}; waiting for capacity: " + "; ".join(self.waiting_for_capacity)
                reconciling = Condition("Reconciling", True, "WaitingForCapacity", message)
            else:
                if progress == "ReplacingLostPods":
                    summary += "; replacing active pods on nodes that stopped reporting: " + ", ".join(
                        self.plan.replacing
                    )
                reconciling = Condition("Reconciling", progress is not None, progress or "Converged", summary)
        out = [ready, reconciling, stalled, warm]
        out += [c for c in (self.metrics, self.fallback) if c is not None]
        return out

    def _progress(self, ready_active: int) -> str | None:
        live = [p for p in self.pods if not p.deleting]
        if any(p.template_hash != self.template_hash for p in live):
            return "RollingUpdate"
        if self.plan.replacing:
            return "ReplacingLostPods"
        if ready_active < self.desired_active or self.plan.create_warm or self.plan.promote:
            return "ScalingUp"
        if len(self._current("active")) > self.desired_active or self.plan.demote or self.plan.delete:
            return "ScalingDown"
        if any(not p.ready for p in live):
            return "PodsStarting"
        if self.routers is not None and self.routers[0] < self.routers[1]:
            return "RoutersStarting"
        if any(p.releasing for p in self.pods):  # not one stranded on a lost node: that may never end
            return "PodsTerminating"
        return None
