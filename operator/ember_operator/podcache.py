"""Engine pods from the operator's pod watch instead of a LIST on every pass.

kopf keeps an index of the pods labelled as ember's (`index_pod`), filled from the one pod watch it runs
anyway, and holds every other handler until the first listing is in it. A pass reads an InferenceService's
pods from that index, and its router pods (whose /metrics it reads on the autoscaler's ticks).

The index lags the operator's own writes by one watch event: a pass that ran before the event of a pod it
created, relabelled or deleted would plan from the state before, and create the pod twice. `Pending` keeps
what the operator wrote, as the API server answered, until the watch has caught up (what kube-controller-
manager's ReplicaSet controller calls expectations): the written copy stands in for the indexed one until
the indexed one's resourceVersion moves past the one it had at the write; a deleted pod is left out until the
index drops it or shows it terminating. An expectation the watch never meets lapses after `LAPSE` seconds.

kopf fills its index from its watch and never empties it on a new listing: a pod deleted while the watch was
down (the operator paused by a peer of higher priority, or a watch that had to list again) stays in it for
good. After such a listing a pass lists the pods itself (`SELECTOR`), works from that listing, and leaves
out from then on every pod the index still holds that the listing did not (`ghosts`), as a Kubernetes
informer replaces its store with each new listing.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ember_operator.desired import INSTANCE_LABEL, NAME_LABEL
from ember_operator.router import ROUTER, ROUTER_LABEL

INDEX = "ember_pods"  # the index's handler id: handlers receive it as a keyword argument of that name
LAPSE = 30.0

Obj = dict[str, Any]


def indexed_names(value: str | None, **_: Any) -> bool:
    """kopf's label filter for the index: engine pods (`ember`) and router pods (`ember-router`)."""
    return value in ("ember", "ember-router")


def index_pod(namespace: str | None, labels: Mapping[str, str], body: Mapping[str, Any], **_: Any) -> Any:
    """kopf's indexing function: each engine pod under (namespace, its instance label), each router pod
    under (namespace, the InferenceService it routes for, "router")."""
    if labels.get(NAME_LABEL) == "ember-router" and labels.get(ROUTER_LABEL):
        return {(namespace, labels[ROUTER_LABEL], ROUTER): dict(body)}
    instance = labels.get(INSTANCE_LABEL)
    if labels.get(NAME_LABEL) != "ember" or instance is None:
        return None
    return {(namespace, instance): dict(body)}


SELECTOR = f"{NAME_LABEL} in (ember,ember-router)"  # the pods the index holds, as one LIST's selector


def _rv(pod: Mapping[str, Any] | None) -> str | None:
    return None if pod is None else (pod.get("metadata") or {}).get("resourceVersion")


@dataclass(slots=True)
class _Write:
    pod: Obj | None  # as the API server answered; None: deleted
    seen_rv: str | None  # the indexed copy's resourceVersion at the write (None: not indexed)
    at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class Pending:
    """The operator's writes to its pods that the index may not show yet, by pod name."""

    writes: dict[str, _Write] = field(default_factory=dict)
    indexed_rvs: dict[str, str | None] = field(default_factory=dict)  # as `pods` last saw the index

    def wrote(self, pod: Obj) -> None:
        name = pod["metadata"]["name"]
        self.writes[name] = _Write(pod, self.indexed_rvs.get(name))

    def deleted(self, name: str) -> None:
        self.writes[name] = _Write(None, self.indexed_rvs.get(name))

    def pods(self, indexed_pods: Iterable[Obj]) -> list[Obj]:
        """The pods as they are after the operator's writes: the index, overridden where it lags."""
        indexed = {p["metadata"]["name"]: p for p in indexed_pods}
        self.indexed_rvs = {name: _rv(p) for name, p in indexed.items()}
        now = time.monotonic()
        for name, w in list(self.writes.items()):
            current = indexed.get(name)
            caught_up = _rv(current) != w.seen_rv or (
                w.pod is None and (current is None or current["metadata"].get("deletionTimestamp"))
            )
            if caught_up or now - w.at > LAPSE:
                del self.writes[name]
                continue
            if w.pod is None:
                indexed.pop(name, None)
            else:
                indexed[name] = w.pod
        return sorted(indexed.values(), key=lambda p: p["metadata"]["name"])


def _key(namespace: str, instance: str, role: str | None) -> tuple[str, ...]:
    return (namespace, instance) if role is None else (namespace, instance, role)


def _uid(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("uid", ""))


def indexed(
    index: Any, namespace: str, instance: str, role: str | None = None, ghosts: Collection[str] = ()
) -> list[Obj]:
    """The engine pods (or with `role` "router", the router pods) kopf's index holds for one
    InferenceService (its store: a list of bodies per key), less the `ghosts` (uids)."""
    if index is None:
        raise RuntimeError(f"the {INDEX!r} index was not passed to the handler")
    return [dict(p) for p in index.get(_key(namespace, instance, role), []) if _uid(p) not in ghosts]


def as_indexed(listed: Iterable[Obj], namespace: str, instance: str, role: str | None = None) -> list[Obj]:
    """The pods of a LIST (by `SELECTOR`) that the index would hold for one InferenceService and role."""
    key = _key(namespace, instance, role)
    return [p for p in listed if key in (index_pod(namespace, _labels(p), p) or {})]


def held(index: Any, namespace: str, instance: str) -> list[Obj]:
    """Every pod, engine or router, the index holds for one InferenceService."""
    return indexed(index, namespace, instance) + indexed(index, namespace, instance, ROUTER)


def held_uids(index: Any) -> set[str]:
    """The uids of every pod kopf's index holds."""
    return {_uid(p) for store in index.values() for p in store}


def ghosts(held: Iterable[Obj], listed: Iterable[Obj]) -> set[str]:
    """The uids of the pods the index `held` that a LIST made after reading them does not have: deleted,
    with the index never told (a pod the index gains after the LIST is not in `held`)."""
    return {_uid(p) for p in held} - {_uid(p) for p in listed}


def _labels(pod: Obj) -> dict[str, str]:
    return dict((pod.get("metadata") or {}).get("labels") or {})
