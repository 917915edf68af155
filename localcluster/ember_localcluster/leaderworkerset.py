"""LeaderWorkerSets (`leaderworkerset.x-k8s.io/v1`) for the local control plane: the groups of pods (a
leader and its workers) that the kubernetes-sigs/lws controller and its pod webhook make, as pure
functions; `leaderworkerset_controller.py` applies them through the API server.

`crd_manifest()` is the CustomResourceDefinition to install (`leaderworkersets`,
short name `lws`, with upstream's defaults: `replicas` 1, `size` 1, `restartPolicy`
RecreateGroupOnPodRestart, `startupPolicy` LeaderCreated; status and scale subresources). What it does, with
upstream's names and values:

* **The headless Service** `<lws>` (`clusterIP: None`, `publishNotReadyAddresses: true`, selecting the
  set's pods), under which the pods have DNS names.
* **Group i**: the leader pod `<lws>-<i>` from `leaderTemplate` (else `workerTemplate`), then the workers
  `<lws>-<i>-<j>`, j = 1..size-1, from `workerTemplate`. Labels `leaderworkerset.sigs.k8s.io/name`,
  `group-index`, `worker-index` (0 for the leader), `group-key` (sha1 of `<namespace>/<leader>`),
  `template-revision-hash`; annotations `leaderworkerset.sigs.k8s.io/size` and, on workers, `leader-name`;
  `spec.hostname` is the pod's name and `spec.subdomain` the set's; every container gets
  `LWS_LEADER_ADDRESS` (`<leader>.<lws>.<namespace>`), `LWS_GROUP_SIZE` and `LWS_WORKER_INDEX` first in its
  env. `startupPolicy: LeaderReady` waits for the leader to be Ready before creating workers.
* **RecreateGroupOnPodRestart**: when a container of a group's pod has restarted, or a pod of it is being
  deleted, the leader is deleted; the workers go with it and the group is created anew (`None` leaves
  pods to their own restarts).
* **Status**: `replicas` (leader pods), `readyReplicas` (groups whose leader and every worker are Ready),
  `updatedReplicas` (groups of the current template revision), `hpaPodSelector` (the leaders), and one
  condition True: `Available` (`AllGroupsReady`, "All replicas are ready") when every group is ready and
  updated, else `Progressing` (`GroupsAreProgressing`, "Replicas are progressing").
* **Scaling down** deletes the groups of index `replicas` and up.

Different on purpose: no StatefulSets in between (the leader is owned by the LeaderWorkerSet, the workers by
their leader, which gives the same garbage collection); with LeaderCreated the workers are created once the
leader pod has its address, because the process kubelet's stand-in for cluster DNS resolves the leader's
name only then; a changed template is not rolled out (groups take it when next created); no subgroups,
exclusive placement, volume claim templates, partitions or surge.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

GROUP, VERSION, PLURAL, KIND = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"
_P = "leaderworkerset.sigs.k8s.io/"
NAME, GROUP_INDEX, WORKER_INDEX = _P + "name", _P + "group-index", _P + "worker-index"
GROUP_KEY, REVISION, SIZE, LEADER_NAME = (
    _P + "group-key",
    _P + "template-revision-hash",
    _P + "size",
    _P + "leader-name",
)
_OBJECT = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def crd_manifest() -> dict[str, Any]:
    template = {
        "type": "object",
        "required": ["workerTemplate"],
        "properties": {
            "leaderTemplate": _OBJECT,
            "workerTemplate": _OBJECT,
            "size": {"type": "integer", "format": "int32", "default": 1, "minimum": 1},
            "restartPolicy": {
                "type": "string",
                "default": "RecreateGroupOnPodRestart",
                "enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"],
            },
        },
        "x-kubernetes-preserve-unknown-fields": True,
    }
    spec = {
        "type": "object",
        "required": ["leaderWorkerTemplate"],
        "properties": {
            "replicas": {"type": "integer", "format": "int32", "default": 1},
            "leaderWorkerTemplate": template,
            "startupPolicy": {
                "type": "string",
                "default": "LeaderCreated",
                "enum": ["LeaderCreated", "LeaderReady"],
            },
            "rolloutStrategy": _OBJECT,
            "networkConfig": _OBJECT,
        },
    }
    status = {
        "type": "object",
        "properties": {
            "conditions": {"type": "array", "items": _OBJECT},
            "readyReplicas": {"type": "integer", "format": "int32"},
            "updatedReplicas": {"type": "integer", "format": "int32"},
            "replicas": {"type": "integer", "format": "int32"},
            "hpaPodSelector": {"type": "string"},
            "observedGeneration": {"type": "integer", "format": "int64"},
        },
    }
    schema = {
        "type": "object",
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": spec,
            "status": status,
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": "leaderworkerset",
                "shortNames": ["lws"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": schema},
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.hpaPodSelector",
                        },
                    },
                }
            ],
        },
    }


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["metadata"].get("namespace") or "default", obj["metadata"]["name"]


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _restarted_or_deleted(pod: dict[str, Any]) -> bool:
    status = pod.get("status") or {}
    statuses = (status.get("containerStatuses") or []) + (status.get("initContainerStatuses") or [])
    return pod["metadata"].get("deletionTimestamp") is not None or any(
        s.get("restartCount", 0) > 0 for s in statuses
    )


def revision(lws: dict[str, Any]) -> str:
    template = lws["spec"]["leaderWorkerTemplate"]
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def controller_reference(owner: dict[str, Any], api_version: str, kind: str) -> dict[str, Any]:
    # Given, not read from the object: items of a list of pods carry no apiVersion or kind.
    return {
        "apiVersion": api_version,
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def group_pod(
    lws: dict[str, Any], group: int, worker: int, leader: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Pod `worker` of group `group` (0: the leader; a worker needs its `leader` pod, its owner)."""
    namespace, name = _key(lws)
    spec = lws["spec"]["leaderWorkerTemplate"]
    template = (
        spec.get("leaderTemplate") if worker == 0 and spec.get("leaderTemplate") else spec["workerTemplate"]
    )
    leader_name = f"{name}-{group}"
    pod_name = leader_name if worker == 0 else f"{leader_name}-{worker}"
    meta = copy.deepcopy(template.get("metadata") or {})
    labels = {
        **(meta.get("labels") or {}),
        NAME: name,
        GROUP_INDEX: str(group),
        WORKER_INDEX: str(worker),
        GROUP_KEY: hashlib.sha1(f"{namespace}/{leader_name}".encode()).hexdigest(),
        REVISION: revision(lws),
    }
    annotations = {**(meta.get("annotations") or {}), SIZE: str(spec.get("size", 1))}
    if worker:
        annotations[LEADER_NAME] = leader_name
    pod_spec = copy.deepcopy(template.get("spec") or {})
    pod_spec["hostname"], pod_spec["subdomain"] = pod_name, name
    env = [
        {"name": "LWS_LEADER_ADDRESS", "value": f"{leader_name}.{name}.{namespace}"},
        {"name": "LWS_GROUP_SIZE", "value": str(spec.get("size", 1))},
        {"name": "LWS_WORKER_INDEX", "value": str(worker)},
    ]
    for container in (pod_spec.get("containers") or []) + (pod_spec.get("initContainers") or []):
        own = container.get("env") or []
        taken = {e.get("name") for e in own}
        container["env"] = [e for e in env if e["name"] not in taken] + own
    if worker == 0:
        reference = controller_reference(lws, f"{GROUP}/{VERSION}", KIND)
    else:
        assert leader is not None
        reference = controller_reference(leader, "v1", "Pod")
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [reference],
        },
        "spec": pod_spec,
    }


def _workers(leader: dict[str, Any], pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The leader's workers: pods of its group owned by this leader (a recreated group's old workers,
    still being removed, belong to the leader before it)."""
    uid = leader["metadata"].get("uid")
    return [
        p
        for p in pods
        if p["metadata"]["labels"].get(WORKER_INDEX) != "0"
        and p["metadata"]["labels"].get(GROUP_INDEX) == leader["metadata"]["labels"].get(GROUP_INDEX)
        and any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or [])
    ]


def _leaders(pods: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {
        int(p["metadata"]["labels"][GROUP_INDEX]): p
        for p in pods
        if p["metadata"]["labels"].get(WORKER_INDEX) == "0"
    }


def desired_status(lws: dict[str, Any], pods: list[dict[str, Any]], now: str) -> dict[str, Any]:
    """The set's status from its pods (`pods`: those labelled with its name)."""
    spec = lws["spec"]
    replicas, size, current = (
        int(spec.get("replicas", 1)),
        int(spec["leaderWorkerTemplate"].get("size", 1)),
        revision(lws),
    )
    leaders = _leaders(pods)
    ready = updated = updated_ready = 0
    for index, leader in leaders.items():
        workers = _workers(leader, pods)
        is_ready = _ready(leader) and sum(_ready(w) for w in workers) == size - 1
        is_updated = all(p["metadata"]["labels"].get(REVISION) == current for p in [leader, *workers])
        ready += is_ready
        updated += is_updated
        updated_ready += is_ready and is_updated and index < replicas
    available = updated_ready == replicas
    true_type, reason, message = (
        ("Available", "AllGroupsReady", "All replicas are ready")
        if available
        else ("Progressing", "GroupsAreProgressing", "Replicas are progressing")
    )
    previous = {c.get("type"): c for c in (lws.get("status") or {}).get("conditions") or []}
    conditions = []
    for kind in ("Available", "Progressing"):
        old = previous.get(kind)
        status = "True" if kind == true_type else "False"
        if old is None and status == "False":
            continue  # upstream adds a condition only when it first turns True
        since = old["lastTransitionTime"] if old is not None and old.get("status") == status else now
        if kind == true_type:
            conditions.append(
                {
                    "type": kind,
                    "status": status,
                    "reason": reason,
                    "message": message,
                    "lastTransitionTime": since,
                }
            )
        else:
            conditions.append({**(old or {}), "status": status, "lastTransitionTime": since})
    return {
        "replicas": len(leaders),
        "readyReplicas": ready,
        "updatedReplicas": updated,
        "hpaPodSelector": f"{NAME}={lws['metadata']['name']},{WORKER_INDEX}=0",
        "conditions": conditions,
    }


def group_actions(lws: dict[str, Any], pods: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """One step toward the set's groups: (pods to create, names of leader pods to delete)."""
    spec = lws["spec"]
    replicas, size = int(spec.get("replicas", 1)), int(spec["leaderWorkerTemplate"].get("size", 1))
    recreate = (
        spec["leaderWorkerTemplate"].get("restartPolicy", "RecreateGroupOnPodRestart")
        == "RecreateGroupOnPodRestart"
    )
    names = {p["metadata"]["name"] for p in pods}
    leaders = _leaders(pods)
    create: list[dict[str, Any]] = []
    delete = [
        p["metadata"]["name"]
        for i, p in leaders.items()
        if i >= replicas and not p["metadata"].get("deletionTimestamp")
    ]
    for index in range(replicas):
        leader = leaders.get(index)
        if leader is None:
            if f"{lws['metadata']['name']}-{index}" not in names:
                create.append(group_pod(lws, index, 0))
            continue
        if leader["metadata"].get("deletionTimestamp"):
            continue  # the group goes; it is created again once its leader is gone
        workers = _workers(leader, pods)
        if recreate and any(_restarted_or_deleted(p) for p in [leader, *workers]):
            delete.append(leader["metadata"]["name"])
            continue
        started = (
            _ready(leader)
            if spec.get("startupPolicy") == "LeaderReady"
            else bool((leader.get("status") or {}).get("podIP"))
        )
        if not started:
            continue
        have = {int(w["metadata"]["labels"][WORKER_INDEX]) for w in workers}
        for worker in range(1, size):
            pod = group_pod(lws, index, worker, leader)
            if worker not in have and pod["metadata"]["name"] not in names:
                create.append(pod)
    return create, delete


def headless_service(lws: dict[str, Any]) -> dict[str, Any]:
    namespace, name = _key(lws)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {NAME: name},
            "ownerReferences": [controller_reference(lws, f"{GROUP}/{VERSION}", KIND)],
        },
        "spec": {"clusterIP": "None", "selector": {NAME: name}, "publishNotReadyAddresses": True},
    }
