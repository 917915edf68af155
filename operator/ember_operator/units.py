"""What a pass plans over: units, each one engine pod or one multi-node group (a LeaderWorkerSet), read as
`PodView`s so that the warm pool, rolls and failover treat both alike. Pure.

A group whose pods crash is recreated whole by its LeaderWorkerSet (new pods, restart counts at 0), so the
crash loop never shows on a pod as CrashLoopBackOff: `CrashLog` remembers the crashes of each group's pods
as they are seen, and a group with CRASH_RESTARTS of them that has not become Ready is trouble, with the
leader's error line (the leader is the rank that checks the model and says why it cannot run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ember_operator.groups import WORKER_INDEX_LABEL, crash, group_key, group_view, instance_of, members
from ember_operator.pods import CRASH_RESTARTS, Trouble, error_line, view
from ember_operator.rollout import PodView


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


def collect_units(owner_uid: str, pods: list[dict[str, Any]], groups: list[dict[str, Any]]) -> Units:
    """The owner's single pods and groups. A group's serving pod is its leader (a stub named after the
    group while the leader is missing, which serves nothing)."""
    units = Units()
    for p in pods:
        if owned_by(p, owner_uid) and group_key(p) is None:
            units.views.append(view(p))
            units.serving.append(p)
            units.pods_of[p["metadata"]["name"]] = [p]
    for g in groups:
        if not owned_by(g, owner_uid):
            continue
        name = g["metadata"]["name"]
        leader, workers = members(g, pods)
        units.views.append(group_view(g, pods))
        units.serving.append(leader or {"metadata": {"name": name}, "status": {}})
        units.pods_of[name] = ([leader] if leader else []) + workers
        units.leaders[name] = leader
    return units


@dataclass(slots=True)
class _Crashes:
    instance: str
    pods: set[str] = field(default_factory=set)  # uids of the group's pods seen crashed
    message: str = ""  # the latest error, the leader's when it has one
    from_leader: bool = False


class CrashLog:
    """Crashes of group pods by (namespace, group), for as long as the group has not become Ready."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], _Crashes] = {}

    def record(self, pod: dict[str, Any]) -> None:
        group, instance = group_key(pod), instance_of(pod)
        message = crash(pod)
        if group is None or instance is None or message is None:
            return
        meta = pod["metadata"]
        entry = self._groups.setdefault((meta.get("namespace", ""), group), _Crashes(instance))
        entry.pods.add(meta.get("uid", meta["name"]))
        leader = (meta.get("labels") or {}).get(WORKER_INDEX_LABEL) == "0"
        if leader or not entry.from_leader:
            entry.message, entry.from_leader = message, leader

    def troubles(self, namespace: str, instance: str, units: Units) -> list[Trouble]:
        """Groups of `instance` crash-looping; forgets groups that became Ready or are gone."""
        found = []
        views = {v.name: v for v in units.views if units.is_group(v.name)}
        for (ns, group), entry in list(self._groups.items()):
            if ns != namespace or entry.instance != instance:
                continue
            v = views.get(group)
            if v is None or v.ready:
                del self._groups[(ns, group)]
            elif len(entry.pods) >= CRASH_RESTARTS and not v.deleting:
                detail = error_line(entry.message)
                found.append(
                    Trouble(
                        "PodsCrashLooping",
                        f"group {group}: recreated after its pods crashed {len(entry.pods)} times: {detail}",
                    )
                )
        return found
