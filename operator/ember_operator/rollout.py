"""Which engine pods to create, promote, demote and delete: one pure step toward the desired set.

The operator calls `plan_pods` on every pass with the pods as they are and applies the result; the next pass
sees the outcome. Three rules make it safe to repeat:

- New pods always start in the warm pool and are promoted (relabelled) once Ready, so a cold pod never sits
  behind the Service and scale-up from a ready pool is a label change.
- Pods of an older template (`ember.dev/template-hash`) are retired only while the Ready active pods that
  remain still number at least the active target: a roll surges, it never dips.
- Pods that are not Ready serve nothing, so retiring them never costs capacity.
- An active pod that fails (its engine container is down, or it has not been Ready for `failover_after`
  seconds) is replaced by a Ready warm pod in the same pass: the failed pod is deleted, the warm pod
  promoted, and the pool refilled. Without a Ready warm pod the failed one stays: its own restart is then
  as quick as anything else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from ember_operator.desired import ACTIVE, WARM


@dataclass(frozen=True, slots=True)
class PodView:
    """What the plan needs to know about one existing pod."""

    name: str
    role: str  # ACTIVE or WARM
    template_hash: str
    ready: bool
    created: datetime
    phase: str = "Running"
    deleting: bool = False  # deletionTimestamp set: on its way out, counts for nothing
    unready_since: datetime | None = None  # when its Ready condition last turned False
    container_down: bool = False  # its engine container is not running (exited, restarting, crash loop)

    def failed(self, now: datetime, failover_after: float) -> bool:
        """An active pod that stopped serving: down, or not Ready for longer than `failover_after`."""
        if self.ready or self.role != ACTIVE:
            return False
        if self.container_down:
            return True
        return self.unready_since is not None and (now - self.unready_since).total_seconds() >= failover_after


@dataclass(slots=True)
class PodPlan:
    create_warm: int = 0
    promote: list[str] = field(default_factory=list)
    demote: list[str] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    failovers: list[tuple[str, str]] = field(default_factory=list)  # (failed active pod, warm pod promoted)

    def empty(self) -> bool:
        return not (self.create_warm or self.promote or self.demote or self.delete)


def _retire_order(pod: PodView) -> tuple[bool, float]:
    # Not-ready pods first (they serve nothing), then the youngest (the least likely to have warm caches).
    return (pod.ready, -pod.created.timestamp())


def plan_pods(
    pods: list[PodView],
    template_hash: str,
    active: int,
    warm: int,
    now: datetime | None = None,
    failover_after: float = 5.0,
) -> PodPlan:
    """One step toward `active` Ready active pods and `warm` warm pods, all of `template_hash`; `now` (with
    `failover_after`) lets failed active pods be replaced by Ready warm ones."""
    plan = PodPlan()
    live = []
    for p in pods:
        if p.deleting:
            continue
        if p.phase in ("Failed", "Succeeded"):  # will never run again: replace it
            plan.delete.append(p.name)
        else:
            live.append(p)
    current = [p for p in live if p.template_hash == template_hash]
    outdated = [p for p in live if p.template_hash != template_hash]
    cur_active = [p for p in current if p.role == ACTIVE]
    cur_warm = [p for p in current if p.role == WARM]

    # Replace failed active pods by Ready warm pods, oldest warm pod first.
    ready_warm = sorted((p for p in cur_warm if p.ready), key=lambda p: p.created)
    if now is not None:
        for p in sorted(cur_active, key=lambda p: p.created):
            if not ready_warm:
                break
            if p.failed(now, failover_after):
                w = ready_warm.pop(0)
                cur_active.remove(p)
                plan.delete.append(p.name)
                cur_warm.remove(w)
                cur_active.append(w)
                plan.promote.append(w.name)
                plan.failovers.append((p.name, w.name))

    # Promote the oldest Ready warm pods while active pods are missing.
    while len(cur_active) < active and ready_warm:
        p = ready_warm.pop(0)
        plan.promote.append(p.name)
        cur_warm.remove(p)
        cur_active.append(p)

    # Too many active: demote Ready ones while the pool is short (they stay loaded), delete the rest.
    if len(cur_active) > active:
        for p in sorted(cur_active, key=_retire_order)[: len(cur_active) - active]:
            cur_active.remove(p)
            if p.ready and len(cur_warm) < warm:
                plan.demote.append(p.name)
                cur_warm.append(p)
            else:
                plan.delete.append(p.name)

    # Warm pods still starting may be the active pods of tomorrow: the pool's budget includes the shortfall.
    budget = warm + max(0, active - len(cur_active))
    if len(cur_warm) > budget:
        for p in sorted(cur_warm, key=_retire_order)[: len(cur_warm) - budget]:
            cur_warm.remove(p)
            plan.delete.append(p.name)
    plan.create_warm = max(0, budget - len(cur_warm))

    # Retire outdated pods: warm ones at once, active ones only while enough Ready active pods remain.
    serving = sum(p.ready for p in cur_active) + sum(p.ready for p in outdated if p.role == ACTIVE)
    for p in sorted(outdated, key=_retire_order):
        if p.role == WARM or not p.ready:
            plan.delete.append(p.name)
        elif serving - 1 >= active:
            plan.delete.append(p.name)
            serving -= 1
    return plan
