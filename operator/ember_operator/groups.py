"""Replicas that span nodes: each one a LeaderWorkerSet group (leaderworkerset.x-k8s.io/v1). Pure.

With `resources.nodes` N > 1 the operator creates, for every replica it would have made a pod for, one
LeaderWorkerSet of `replicas: 1` and `size: N`: the leader pod runs `ember serve --node-rank=0`, serves
HTTP and is what the Service selects; the N - 1 worker pods run `ember serve --node-rank=K` and join the
leader's tensor-parallel group at `$(LWS_LEADER_ADDRESS)`. The group is the unit of everything the
operator does to pods: it starts warm and is promoted (the group's `ember.dev/role` label, mirrored onto
its leader pod), a roll replaces groups, a failed active group is replaced by a Ready warm one. The
LeaderWorkerSet's `RecreateGroupOnPodRestart` restarts all of a group together: a tensor-parallel group
cannot lose a rank and go on.

A group is read as one `PodView` (`group_view`): Ready when its leader and every worker are, down when any
of its pods' engines is down or a pod is missing.
"""

from __future__ import annotations

import copy
from datetime import UTC, datetime
from typing import Any

from ember_operator.desired import (
    HASH_LABEL,
    INSTANCE_LABEL,
    MANAGED_BY_LABEL,
    ROLE_LABEL,
    WARM,
    Owner,
    desired_pod,
    instance_labels,
)
from ember_operator.pods import parse_time, view
from ember_operator.rollout import PodView
from ember_operator.spec import InferenceServiceSpec

LWS_GROUP, LWS_VERSION, LWS_PLURAL, LWS_KIND = (
    "leaderworkerset.x-k8s.io",
    "v1",
    "leaderworkersets",
    "LeaderWorkerSet",
)
SET_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
# The leader listens for its group's ranks here, on its pod address.
RENDEZVOUS_PORT = 29500


def desired_group(owner: Owner, spec: InferenceServiceSpec, role: str, pod_hash: str) -> dict[str, Any]:
    """One replica as a LeaderWorkerSet. Its name is generated from `<name>-`, so its pods' names
    (`<lws>-0`, `<lws>-0-K`) stay DNS labels for the longest InferenceService name."""
    nodes = spec.resources.nodes
    parallel = [f"--nnodes={nodes}", f"--master-port={RENDEZVOUS_PORT}"]
    leader = desired_pod(owner, spec, role, pod_hash)
    worker = copy.deepcopy(leader)
    (serving,) = leader["spec"]["containers"]
    serving["args"] += [*parallel, "--node-rank=0", "--master-addr=0.0.0.0"]
    (engine,) = worker["spec"]["containers"]
    # A worker serves no HTTP: no port, no probe of any kind (Ready once running), no pause before stopping.
    for key in ("ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"):
        engine.pop(key, None)
    engine["args"] += [*parallel, "--node-rank=$(LWS_WORKER_INDEX)", "--master-addr=$(LWS_LEADER_ADDRESS)"]
    group_labels = {**leader["metadata"]["labels"]}
    worker_labels = {k: v for k, v in group_labels.items() if k != ROLE_LABEL}
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": LWS_KIND,
        "metadata": {
            "generateName": f"{owner.name}-",
            "namespace": owner.namespace,
            "labels": group_labels,
            "ownerReferences": [owner.reference()],
        },
        "spec": {
            "replicas": 1,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": {"metadata": {"labels": group_labels}, "spec": leader["spec"]},
                "workerTemplate": {"metadata": {"labels": worker_labels}, "spec": worker["spec"]},
            },
        },
    }


def group_selector(name: str) -> str:
    """The instance's groups (and their pods carry the same labels)."""
    labels = {**instance_labels(name), MANAGED_BY_LABEL: "ember-operator"}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def members(
    group: dict[str, Any], pods: list[dict[str, Any]]
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """The group's leader pod (None while missing) and its worker pods: the pods of the set's group 0, the
    one group the operator asks for (a set someone scaled up has more, which are not this unit's)."""
    name = group["metadata"]["name"]
    mine = [
        p
        for p in pods
        if (labels := p["metadata"].get("labels") or {}).get(SET_NAME_LABEL) == name
        and labels.get(GROUP_INDEX_LABEL, "0") == "0"
    ]
    leader = next((p for p in mine if p["metadata"]["labels"].get(WORKER_INDEX_LABEL) == "0"), None)
    return leader, [p for p in mine if p is not leader]


def group_view(
    group: dict[str, Any],
    pods: list[dict[str, Any]],
    now: datetime | None = None,
    capacity_wait: float = 0.0,
) -> PodView:
    """The group as the plan sees a pod: Ready when every pod is, down when any engine is or a pod is
    missing (a group being recreated serves nothing until all of it is back)."""
    meta = group["metadata"]
    labels = meta.get("labels") or {}
    size = int(((group.get("spec") or {}).get("leaderWorkerTemplate") or {}).get("size") or 1)
    leader, workers = members(group, pods)
    views = [view(p, now, capacity_wait) for p in ([leader] if leader else []) + workers]
    complete = leader is not None and len(workers) == size - 1
    lead = views[0] if leader is not None else None
    return PodView(
        name=meta["name"],
        role=labels.get(ROLE_LABEL, WARM),
        template_hash=labels.get(HASH_LABEL, ""),
        ready=complete and all(v.ready for v in views),
        created=parse_time(meta.get("creationTimestamp")) or datetime.now(UTC),
        phase=lead.phase if lead is not None else "Pending",
        deleting=meta.get("deletionTimestamp") is not None,
        unready_since=lead.unready_since if lead is not None else None,
        container_down=not complete or any(v.container_down for v in views),
        unschedulable=any(v.unschedulable for v in views),
        stranded=bool(views) and all(v.stranded for v in views),
    )


def crash(pod: dict[str, Any]) -> str | None:
    """The log tail of a container of this group pod that ended in error (what a crash leaves in the pod's
    status before `RecreateGroupOnPodRestart` replaces it), or None."""
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        for state in (s.get("state") or {}, s.get("lastState") or {}):
            ended = state.get("terminated") or {}
            if ended and ended.get("exitCode", 0) != 0:
                return str(ended.get("message") or f"exit code {ended.get('exitCode')}")
    return None


def group_key(pod: dict[str, Any]) -> str | None:
    """The LeaderWorkerSet a pod belongs to (None for a pod of no group)."""
    return (pod["metadata"].get("labels") or {}).get(SET_NAME_LABEL)


def instance_of(pod: dict[str, Any]) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(INSTANCE_LABEL)
