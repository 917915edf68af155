"""What a pass plans over: units, each one engine pod or one multi-node group (a LeaderWorkerSet), read as
`PodView`s so that the warm pool, rolls and failover treat both alike. Pure.

A group whose pods crash is recreated whole by its LeaderWorkerSet (new pods, restart counts at 0), so the
crash loop never shows on a pod as CrashLoopBackOff and no kubelet back-off slows it: `CrashLog` remembers
the crashes of each group's pods as they are seen, and a group with CRASH_RESTARTS of them that has not
become Ready is trouble, with the leader's error line (the leader is the rank that checks the model and says
why it cannot run). Such a group is held back as the kubelet holds back a crash-looping container: its
LeaderWorkerSet at 0 replicas for HOLD_FIRST seconds, then started again; each crash after that holds it
twice as long, up to HOLD_MAX, until it becomes Ready.

The hold is kept on the LeaderWorkerSet itself (CRASH_HOLD_ANNOTATION: the crashes counted, the hold's
length and its end in wall-clock time), and an operator that starts again takes it up from there
(`restore`): before, a restart forgot it, started the set again at once and the back-off over at 10 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ember_operator.desired import INSTANCE_LABEL
from ember_operator.groups import (
    GROUP_INDEX_LABEL,
    WORKER_INDEX_LABEL,
    crash,
    group_key,
    group_view,
    instance_of,
    members,
)
from ember_operator.pods import CRASH_RESTARTS, Trouble, error_line, view
from ember_operator.rollout import PodView

# The kubelet's CrashLoopBackOff: 10 s, doubling, at most 5 minutes.
HOLD_FIRST, HOLD_MAX = 10.0, 300.0
CRASH_HOLD_ANNOTATION = "ember.dev/crash-hold"
CRASH_PODS_KEPT = 32  # uids of crashed pods kept in the annotation, the latest ones


def owned_by(obj: dict[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or [])


@dataclass(slots=True)
class Units:
    views: list[PodView] = field(default_factory=list)
    serving: list[dict[str, Any]] = field(default_factory=list)  # per view: the pod serving it
    pods_of: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # per unit: all its pods
    leaders: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # per group: its leader

    def is_group(self, name: str) -> bool:
        return name in self.leaders

    def all_pods(self) -> list[dict[str, Any]]:
        return [p for pods in self.pods_of.values() for p in pods]


def collect_units(
    owner_uid: str,
    pods: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    now: datetime | None = None,
    capacity_wait: float = 0.0,
) -> Units:
    """The owner's single pods and groups. A group's serving pod is its leader (a stub named after the
    group while the leader is missing, which serves nothing). `now` and `capacity_wait` end the wait of a
    pod for its preemption (see `pods.preempting`)."""
    units = Units()
    for p in pods:
        if owned_by(p, owner_uid) and group_key(p) is None:
            units.views.append(view(p, now, capacity_wait))
            units.serving.append(p)
            units.pods_of[p["metadata"]["name"]] = [p]
    for g in groups:
        if not owned_by(g, owner_uid):
            continue
        name = g["metadata"]["name"]
        leader, workers = members(g, pods)
        units.views.append(group_view(g, pods, now, capacity_wait))
        units.serving.append(leader or {"metadata": {"name": name}, "status": {}})
        units.pods_of[name] = ([leader] if leader else []) + workers
        units.leaders[name] = leader
    return units


@dataclass(slots=True)
class _Crashes:
    instance: str
    pods: dict[str, None] = field(default_factory=dict)  # uids of the group's pods seen crashed, in order
    message: str = ""  # the latest error, the leader's when it has one
    from_leader: bool = False
    hold: float = 0.0  # seconds of the latest hold (0: never held)
    held_until: float | None = None  # monotonic time the hold ends; None while not held
    crashes_at_release: int = 0  # crashes seen when the latest hold ended
    earlier: int = 0  # crashes counted by an operator before this one started, of pods it no longer names
    restored: bool = False  # whether the hold kept on the LeaderWorkerSet was taken up (`restore`)

    @property
    def crashes(self) -> int:
        return self.earlier + len(self.pods)


def same_hold(a: str | None, b: str | None) -> bool:
    """Whether two CRASH_HOLD_ANNOTATION values keep the same hold, as far as writing it again matters: all
    but the exact end (which each pass recomputes from the monotonic clock, a few milliseconds off each time)
    unless it is set or not."""
    return _hold_fields(a) == _hold_fields(b)


def _hold_fields(kept: str | None) -> tuple[Any, ...] | None:
    if kept is None:
        return None
    try:
        data = json.loads(kept)
        return (data.get("crashes"), data.get("hold"), data.get("until") is None, data.get("released"))
    except (ValueError, AttributeError):
        return ("unreadable",)


class CrashLog:
    """Crashes of group pods by (namespace, group), for as long as the group has not become Ready, and the
    groups held back for them."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], _Crashes] = {}

    def record(self, pod: dict[str, Any]) -> None:
        group, instance = group_key(pod), instance_of(pod)
        message = crash(pod)
        labels = pod["metadata"].get("labels") or {}
        if group is None or instance is None or message is None or labels.get(GROUP_INDEX_LABEL, "0") != "0":
            return
        meta = pod["metadata"]
        entry = self._groups.setdefault((meta.get("namespace", ""), group), _Crashes(instance))
        entry.pods[meta.get("uid", meta["name"])] = None
        leader = labels.get(WORKER_INDEX_LABEL) == "0"
        if leader or not entry.from_leader:
            entry.message, entry.from_leader = message, leader

    def restore(self, group: dict[str, Any], now: float, wall: float) -> None:
        """Take up the hold kept on a LeaderWorkerSet (`now`: monotonic, `wall`: time.time() seconds), once
        per entry of the log (an operator that started again): merged into what the log already recorded of
        the group (its pod watch may list crashed pods before the first pass), each crashed pod counted once."""
        meta = group["metadata"]
        key = (meta.get("namespace", ""), meta["name"])
        kept = (meta.get("annotations") or {}).get(CRASH_HOLD_ANNOTATION)
        instance = (meta.get("labels") or {}).get(INSTANCE_LABEL)
        entry = self._groups.get(key)
        if entry is not None and entry.restored:
            return
        if entry is not None:
            entry.restored = True
        if kept is None or instance is None:
            return
        try:
            data = json.loads(kept)
            until = data.get("until")
            uids = [str(u) for u in data.get("pods") or []][-CRASH_PODS_KEPT:]
            message = str(data.get("message", ""))
            hold = float(data.get("hold", 0.0))
            held_until = None if until is None else now + float(until) - wall
            released = int(data.get("released", 0))
            earlier = max(0, int(data.get("crashes", 0)) - len(uids))
        except (ValueError, TypeError, AttributeError):  # not what an operator wrote: start afresh
            return
        if entry is None:
            entry = self._groups[key] = _Crashes(instance, restored=True)
        recorded = entry.pods
        entry.pods = dict.fromkeys(uids)
        entry.pods.update(recorded)
        entry.message = entry.message or message
        entry.hold, entry.held_until, entry.crashes_at_release, entry.earlier = (
            hold,
            held_until,
            released,
            earlier,
        )

    def annotation(self, namespace: str, group: str, now: float, wall: float) -> str | None:
        """The hold of a group as CRASH_HOLD_ANNOTATION keeps it; None for a group with no crash kept."""
        entry = self._groups.get((namespace, group))
        if entry is None:
            return None
        until = None if entry.held_until is None else round(wall + entry.held_until - now, 3)
        kept = {
            "crashes": entry.crashes,
            "hold": entry.hold,
            "until": until,
            "released": entry.crashes_at_release,
            "pods": list(entry.pods)[-CRASH_PODS_KEPT:],
            "message": entry.message,
        }
        return json.dumps(kept, sort_keys=True, separators=(",", ":"))

    def held(self, namespace: str, group: str) -> bool:
        """Whether the group is held back (its LeaderWorkerSet wanted at 0 replicas); as of `troubles`."""
        entry = self._groups.get((namespace, group))
        return entry is not None and entry.held_until is not None

    def troubles(self, namespace: str, instance: str, units: Units, now: float) -> list[Trouble]:
        """Groups of `instance` crash-looping (`now`: monotonic seconds); holds back a group once it is, and
        again at each crash after a hold ended; forgets groups that became Ready or are gone."""
        found = []
        views = {v.name: v for v in units.views if units.is_group(v.name)}
        for (ns, group), entry in list(self._groups.items()):
            if ns != namespace or entry.instance != instance:
                continue
            v = views.get(group)
            if v is None or v.ready:
                del self._groups[(ns, group)]
                continue
            crashes = entry.crashes
            if crashes < CRASH_RESTARTS or v.deleting:
                continue
            if entry.held_until is not None and now >= entry.held_until:
                entry.held_until, entry.crashes_at_release = None, crashes
            elif entry.held_until is None and (entry.hold == 0 or crashes > entry.crashes_at_release):
                entry.hold = min(HOLD_MAX, entry.hold * 2 or HOLD_FIRST)
                entry.held_until = now + entry.hold
            found.append(
                Trouble(
                    "PodsCrashLooping",
                    f"group {group}: its pods crashed {crashes} times without it becoming Ready; "
                    f"held back {entry.hold:g} s between tries: {error_line(entry.message)}",
                )
            )
        return found
