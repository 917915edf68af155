"""Which engine pods to create, promote, demote and delete: one pure step toward the desired set.

The operator calls `plan_pods` on every pass with the pods as they are and applies the result; the next pass
sees the outcome. Three rules make it safe to repeat:

- New pods always start in the warm pool and are promoted (relabelled) once Ready, so a cold pod never sits
  behind the Service and scale-up from a ready pool is a label change.
- Pods of an older template (`ember.dev/template-hash`) are retired only while the Ready active pods that
  remain still number at least the active target: a roll surges, it never dips.
- Pods that are not Ready serve nothing, so retiring them never costs capacity.
- A roll (pods of an older template remain) keeps to `max_surge` extra pods and, when no new pod can make
  progress (none starting that a node can take), retires up to `max_unavailable` Ready active old pods to
  free room: on a cluster with no spare GPU it still completes, one pod (or the warm pool) at a time. A
  waiting pod is judged stuck only once the scheduler has had time to retry it since a pod last went away
  (`RESCHEDULE_SECONDS`): before that, its Unschedulable condition may predate the room just freed.
- An active pod that fails (its engine container is down, or it has not been Ready for `failover_after`
  seconds) is replaced by a Ready warm pod in the same pass: the failed pod is deleted, the warm pod
  promoted, and the pool refilled. Without a Ready warm pod the failed one stays: its own restart is then
  as quick as anything else.
- A warm pod on a node that stopped reporting (the node lifecycle controller marks its pods not Ready and
  leaves their containers ready) is deleted after `failover_after` and the pool refilled elsewhere; left, it
  would count in the pool until the taint eviction (300 s by default) while it can take over nothing.
- An active pod on such a node, with no Ready warm pod to take its place, gets a pod made in its place
  after `failover_after` (`replacing`); once that one is Ready it takes over as above and the lost one is
  retired. Before, it waited for the taint eviction, reported as ScalingUp, though other nodes had room.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from ember_operator.desired import ACTIVE, WARM

# How long after one of its pods is gone the plan still expects a waiting (Unschedulable) pod to be placed
# in the room it left: kube-scheduler retries an unschedulable pod when a pod is deleted, but only once its
# back-off has passed, and that back-off grows to podMaxBackoffDuration, 10 s by default.
RESCHEDULE_SECONDS = 10.0


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
    unschedulable: bool = False  # Pending with PodScheduled=False: no node can take it now
    stranded: bool = False  # deleting, and long past its grace period: no kubelet confirms it (node lost)
    node_lost: bool = False  # marked not Ready by the node lifecycle controller, its containers still ready

    @property
    def releasing(self) -> bool:
        """On its way out and about to free its room: being deleted by a kubelet that is there to do it."""
        return self.deleting and not self.stranded

    def lost(self, now: datetime, failover_after: float) -> bool:
        """On a node that stopped reporting for longer than `failover_after`: it serves nothing until the
        node comes back, if it ever does."""
        return (
            self.node_lost
            and self.unready_since is not None
            and (now - self.unready_since).total_seconds() >= failover_after
        )

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
    replacing: list[str] = field(default_factory=list)  # active pods on lost nodes, a pod made in their place

    def empty(self) -> bool:
        return not (self.create_warm or self.promote or self.demote or self.delete)


def applied(pods: list[PodView], plan: PodPlan) -> list[PodView]:
    """The pods as a pass that carried out `plan` leaves them: promoted pods active, demoted ones warm,
    deleted ones on their way out. Status reports these, not the pods the pass started from."""
    promoted, demoted, deleted = set(plan.promote), set(plan.demote), set(plan.delete)
    out = []
    for p in pods:
        if p.name in deleted:
            p = replace(p, deleting=True)
        elif p.name in promoted:
            p = replace(p, role=ACTIVE)
        elif p.name in demoted:
            p = replace(p, role=WARM)
        out.append(p)
    return out


@dataclass(slots=True)
class Releases:
    """When a pod (or group) of one InferenceService last went away, from the names each pass sees."""

    grace: float = RESCHEDULE_SECONDS
    seen: set[str] = field(default_factory=set)
    last: float | None = None

    def observe(self, names: Iterable[str], now: float) -> bool:
        """Record this pass's names (`now` in seconds, monotonic); True while room a pod left may still be
        taken by a pod the scheduler has yet to retry."""
        current = set(names)
        if self.seen - current:
            self.last = now
        self.seen = current
        return self.last is not None and now - self.last < self.grace

    def at(self, now: datetime) -> datetime | None:
        """The last release as a wall-clock time (`now` is the wall clock's now); None before any."""
        if self.last is None:
            return None
        return now - timedelta(seconds=time.monotonic() - self.last)


def roll_frees_room(views: Iterable[PodView], template_hash: str) -> bool:
    """Whether a roll under way will free room with no change to anything: pods of an older template are
    left to retire, and a pod is on its way out or one of the current template is starting on a node (once
    it is Ready, the roll retires an old one, whose room a waiting pod then takes). Meanwhile a pod that no
    node can take waits on the roll, not on the cluster's capacity."""
    live = [v for v in views if not v.deleting]
    if not any(v.template_hash != template_hash for v in live) and not any(v.releasing for v in views):
        return False
    starting = any(
        v.template_hash == template_hash and not v.ready and not v.unschedulable and not v.container_down
        for v in live
    )
    return starting or any(v.releasing for v in views)


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
    max_surge: int | None = None,
    max_unavailable: int = 0,
    rescheduling: bool = False,
) -> PodPlan:
    """One step toward `active` Ready active pods and `warm` warm pods, all of `template_hash`.

    `now` (with `failover_after`) lets failed active pods be replaced by Ready warm ones. While pods of
    another template remain, at most `active + warm + max_surge` pods live (None: no limit), and when no new
    pod can make progress (none starting that a node can take), up to `max_unavailable` Ready active pods
    of the old template are retired to make room. `rescheduling` (from `Releases`) says room was freed too
    lately to know yet whether the scheduler will place a waiting pod in it: no old pod is retired then.
    """
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

    # A warm pod on a lost node stands by for nothing: replaced now, not when the taint eviction takes it.
    if now is not None:
        for p in [p for p in cur_warm if p.lost(now, failover_after)]:
            cur_warm.remove(p)
            plan.delete.append(p.name)

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

    # Active pods on lost nodes that no Ready warm pod could replace, and that are kept (a scale-down
    # deletes not-Ready ones first): a pod each is made in their place.
    if now is not None:
        plan.replacing = [p.name for p in cur_active if p.lost(now, failover_after)]

    # Warm pods still starting may be the active pods of tomorrow: the pool's budget includes the shortfall.
    budget = warm + max(0, active - len(cur_active)) + len(plan.replacing)
    if len(cur_warm) > budget:
        for p in sorted(cur_warm, key=_retire_order)[: len(cur_warm) - budget]:
            cur_warm.remove(p)
            plan.delete.append(p.name)
    wanted = max(0, budget - len(cur_warm))

    # Retire outdated pods: warm and not-Ready ones at once (they serve nothing), Ready active ones while
    # enough Ready active pods remain.
    serving = sum(p.ready for p in cur_active) + sum(p.ready for p in outdated if p.role == ACTIVE)
    old_serving = []
    for p in sorted(outdated, key=_retire_order):
        if p.role == WARM or not p.ready:
            plan.delete.append(p.name)
        elif serving - 1 >= active:
            plan.delete.append(p.name)
            serving -= 1
        else:
            old_serving.append(p)

    if max_surge is None or not old_serving:
        plan.create_warm = wanted
        return plan
    # A roll with old pods still serving: new pods only within the surge, and when nothing new can make
    # progress, retire old Ready active pods (within maxUnavailable) to make room.
    gone = set(plan.delete)
    alive = sum(p.name not in gone for p in live)
    room = max(0, active + warm + max_surge - alive)
    in_flight = [p for p in current if not p.ready and not p.unschedulable and p.name not in gone]
    # Pods of ours terminating (or retired in this pass) are about to free their resources, and room freed
    # lately may yet go to a waiting pod (`rescheduling`): wait for them before retiring more.
    releasing = bool(gone) or any(p.releasing for p in pods) or rescheduling
    if min(wanted, room) == 0 and not in_flight and not releasing:
        # New pods that no node can take, and new pods the surge leaves no room for: each retired old pod
        # frees room for one (its place in the count, and its resources once it is gone).
        waiting = sum(p.unschedulable for p in current)
        shortage = waiting + wanted
        floor = max(0, active - max_unavailable)
        # Oldest first: the youngest old pods were the last to warm their caches.
        for p in sorted(old_serving, key=lambda p: p.created)[: max(0, min(shortage, serving - floor))]:
            plan.delete.append(p.name)
            room += 1
    plan.create_warm = min(wanted, room)
    return plan
