"""Deployments and ReplicaSets (`apps/v1`) for the local control plane, as pure functions of the objects:
what kube-controller-manager's deployment controller and replicaset controller decide, with upstream's
names and values; `deployment_controller.py` applies it through the API server.

* **The template hash**: a Deployment's ReplicaSet for its current template is `<deployment>-<hash>`, the
  hash (`pod-template-hash`, upstream's `controller.ComputeHash`: FNV-32a over the template and
  `status.collisionCount`, its decimal digits encoded with `rand.SafeEncodeString`) added to the
  template's labels and to the ReplicaSet's selector. The ReplicaSet carries
  `deployment.kubernetes.io/revision`, `desired-replicas` and `max-replicas` annotations and a controller
  ownerReference to its Deployment; its pods (`<replicaset>-` generated names) one to the ReplicaSet, so
  the API server's garbage collector removes the chain from the top.
* **RollingUpdate** (the default, `maxSurge` and `maxUnavailable` 25 %: surge rounded up, unavailability
  down, both never 0 together): the new ReplicaSet grows while all pods stay within replicas + maxSurge;
  old ReplicaSets shrink while the available pods stay at least replicas - maxUnavailable, unhealthy old
  pods first. **Recreate**: old ReplicaSets go to 0, and the new one grows once no old pod is left.
* **ReplicaSet**: creates pods up to `spec.replicas` (at most a slow-start burst at a time is not modelled:
  all at once), and deletes the surplus preferring, as upstream's `ActivePodsWithRanks`, pods not yet
  scheduled, then pending ones, then not-ready, then the most recently created.
* **Status**: a ReplicaSet's `replicas`, `fullyLabeledReplicas`, `readyReplicas`, `availableReplicas`
  (Ready for `minReadySeconds`), `observedGeneration`; a Deployment's `replicas`, `updatedReplicas`,
  `readyReplicas`, `availableReplicas`, `unavailableReplicas`, `observedGeneration` and the `Available`
  and `Progressing` conditions with upstream's reasons and messages.

Not modelled: `progressDeadlineSeconds` (no ProgressDeadlineExceeded), `paused`, rollback, and
`revisionHistoryLimit` (old ReplicaSets at 0 replicas are kept).
"""

from __future__ import annotations

import copy
import json
import math
from datetime import datetime
from typing import Any

HASH_LABEL = "pod-template-hash"
REVISION = "deployment.kubernetes.io/revision"
DESIRED = "deployment.kubernetes.io/desired-replicas"
MAX = "deployment.kubernetes.io/max-replicas"
_SAFE = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand's alphanums
Obj = dict[str, Any]


def template_hash(template: Obj, collision_count: int = 0) -> str:
    """`controller.ComputeHash`: FNV-32a of the template (here its canonical JSON) and the collision
    count, rendered as `rand.SafeEncodeString` renders the decimal sum."""
    data = json.dumps(template, sort_keys=True, separators=(",", ":")).encode()
    if collision_count:
        data += str(collision_count).encode()
    h = 0x811C9DC5
    for byte in data:
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return "".join(_SAFE[ord(c) % len(_SAFE)] for c in str(h))


def owned_by(obj: Obj, owner: Obj) -> bool:
    return any(
        r.get("controller") and r.get("uid") == owner["metadata"].get("uid")
        for r in obj["metadata"].get("ownerReferences") or []
    )


def controller_reference(owner: Obj, kind: str) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _ready_since(pod: Obj) -> datetime | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready" and c.get("status") == "True":
            stamp = c.get("lastTransitionTime")
            return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else datetime.min
    return None


def is_ready(pod: Obj) -> bool:
    return _ready_since(pod) is not None


def is_available(pod: Obj, min_ready_seconds: int, now: datetime) -> bool:
    since = _ready_since(pod)
    if since is None:
        return False
    return (
        min_ready_seconds <= 0 or since == datetime.min or (now - since).total_seconds() >= min_ready_seconds
    )


def is_active(pod: Obj) -> bool:
    """Counted by a ReplicaSet (upstream's `IsPodActive`): not finished and not being deleted."""
    phase = (pod.get("status") or {}).get("phase")
    return phase not in ("Succeeded", "Failed") and not pod["metadata"].get("deletionTimestamp")


# -- ReplicaSet ----------------------------------------------------------------------------------------


def replicaset_pod(rs: Obj) -> Obj:
    """A new pod of `rs`: its template, a name generated from `<replicaset>-`, the ReplicaSet as owner."""
    template = copy.deepcopy(rs["spec"]["template"])
    meta = template.get("metadata") or {}
    metadata = {
        "generateName": f"{rs['metadata']['name']}-",
        "namespace": rs["metadata"].get("namespace") or "default",
        "labels": dict(meta.get("labels") or {}),
        "ownerReferences": [controller_reference(rs, "ReplicaSet")],
    }
    if meta.get("annotations"):
        metadata["annotations"] = dict(meta["annotations"])
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template.get("spec") or {}}


def _deletion_rank(pod: Obj) -> tuple[int, int, int, str]:
    """Lower goes first: unscheduled, pending, not ready, then the newest (`ActivePodsWithRanks`)."""
    phase = (pod.get("status") or {}).get("phase")
    created = pod["metadata"].get("creationTimestamp") or ""
    newest_first = "".join(chr(0x10FFFF - ord(c)) for c in created)
    return (
        1 if pod["spec"].get("nodeName") else 0,
        {"Pending": 0, "Unknown": 1, "Running": 2}.get(phase or "Pending", 0),
        1 if is_ready(pod) else 0,
        newest_first,
    )


def replicaset_actions(rs: Obj, pods: list[Obj]) -> tuple[int, list[str]]:
    """How many pods to create and which to delete, for `rs`'s active pods `pods`."""
    want = int(rs["spec"].get("replicas", 1))
    active = [p for p in pods if is_active(p)]
    if len(active) < want:
        return want - len(active), []
    surplus = sorted(active, key=_deletion_rank)[: len(active) - want]
    return 0, [p["metadata"]["name"] for p in surplus]


def replicaset_status(rs: Obj, pods: list[Obj], now: datetime) -> Obj:
    active = [p for p in pods if is_active(p)]
    labels = (rs["spec"]["template"].get("metadata") or {}).get("labels") or {}
    min_ready = int(rs["spec"].get("minReadySeconds", 0))
    return {
        "replicas": len(active),
        "fullyLabeledReplicas": sum(
            all((p["metadata"].get("labels") or {}).get(k) == v for k, v in labels.items()) for p in active
        ),
        "readyReplicas": sum(is_ready(p) for p in active),
        "availableReplicas": sum(is_available(p, min_ready, now) for p in active),
        "observedGeneration": rs["metadata"].get("generation", 1),
    }


# -- Deployment ----------------------------------------------------------------------------------------


def _scaled(value: Any, total: int, round_up: bool) -> int:
    """`intstr.GetScaledValueFromIntOrPercent`."""
    if isinstance(value, str) and value.endswith("%"):
        exact = int(value[:-1]) * total / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


def surge_and_unavailable(deploy: Obj) -> tuple[int, int]:
    """`deploymentutil.ResolveFenceposts`: maxSurge rounded up, maxUnavailable down, not both 0."""
    replicas = int(deploy["spec"].get("replicas", 1))
    rolling = (deploy["spec"].get("strategy") or {}).get("rollingUpdate") or {}
    surge = _scaled(rolling.get("maxSurge", "25%"), replicas, True)
    unavailable = _scaled(rolling.get("maxUnavailable", "25%"), replicas, False)
    if surge == 0 and unavailable == 0:
        unavailable = 1
    return surge, unavailable


def new_replicaset(deploy: Obj, revision: int) -> Obj:
    """The ReplicaSet for the Deployment's current template, at 0 replicas (the rollout scales it)."""
    template = copy.deepcopy(deploy["spec"]["template"])
    pod_hash = template_hash(template, int((deploy.get("status") or {}).get("collisionCount", 0)))
    meta = template.setdefault("metadata", {})
    meta["labels"] = {**(meta.get("labels") or {}), HASH_LABEL: pod_hash}
    selector = copy.deepcopy(deploy["spec"]["selector"])
    selector["matchLabels"] = {**(selector.get("matchLabels") or {}), HASH_LABEL: pod_hash}
    surge, _ = surge_and_unavailable(deploy)
    replicas = int(deploy["spec"].get("replicas", 1))
    spec: Obj = {"replicas": 0, "selector": selector, "template": template}
    if deploy["spec"].get("minReadySeconds"):
        spec["minReadySeconds"] = deploy["spec"]["minReadySeconds"]
    return {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": f"{deploy['metadata']['name']}-{pod_hash}",
            "namespace": deploy["metadata"].get("namespace") or "default",
            "labels": dict(meta["labels"]),
            "annotations": {REVISION: str(revision), DESIRED: str(replicas), MAX: str(replicas + surge)},
            "ownerReferences": [controller_reference(deploy, "Deployment")],
        },
        "spec": spec,
    }


def matches_template(rs: Obj, deploy: Obj) -> bool:
    """Upstream's `EqualIgnoreHash`: the templates are the same but for the pod-template-hash label."""
    a = copy.deepcopy(rs["spec"]["template"])
    (a.get("metadata") or {}).get("labels", {}).pop(HASH_LABEL, None)
    b = copy.deepcopy(deploy["spec"]["template"])
    (b.get("metadata") or {}).get("labels", {}).pop(HASH_LABEL, None)
    return bool(a == b)


def _replicas(rs: Obj) -> int:
    return int(rs["spec"].get("replicas", 0))


def _available(rs: Obj) -> int:
    return int((rs.get("status") or {}).get("availableReplicas", 0))


def rollout(deploy: Obj, new: Obj, old: list[Obj]) -> dict[str, int]:
    """The replica counts to set, by ReplicaSet name, for one step of the rollout (only those that change)."""
    replicas = int(deploy["spec"].get("replicas", 1))
    kind = (deploy["spec"].get("strategy") or {}).get("type", "RollingUpdate")
    changes: dict[str, int] = {}
    name = new["metadata"]["name"]
    if kind == "Recreate":
        for rs in old:
            if _replicas(rs):
                changes[rs["metadata"]["name"]] = 0
        still_running = any(int((rs.get("status") or {}).get("replicas", 0)) for rs in old)
        if not changes and not still_running and _replicas(new) != replicas:
            changes[name] = replicas
        return changes
    surge, max_unavailable = surge_and_unavailable(deploy)
    total = _replicas(new) + sum(_replicas(rs) for rs in old)
    if _replicas(new) > replicas:
        changes[name] = replicas
    elif _replicas(new) < replicas:
        grow = min(replicas + surge - total, replicas - _replicas(new))
        if grow > 0:
            changes[name] = _replicas(new) + grow
    if not old or changes:  # upstream returns after scaling the new ReplicaSet; the next sync goes on
        return changes
    # Scale the old ReplicaSets down while keeping replicas - maxUnavailable pods available.
    all_pods = _replicas(new) + sum(_replicas(rs) for rs in old)
    min_available = replicas - max_unavailable
    new_unavailable = _replicas(new) - _available(new)
    budget = all_pods - min_available - max(0, new_unavailable)
    # Unhealthy old pods first: they cost no availability.
    for rs in sorted(old, key=lambda r: r["metadata"].get("creationTimestamp") or ""):
        unhealthy = _replicas(rs) - _available(rs)
        if unhealthy > 0 and budget > 0:
            cut = min(unhealthy, budget)
            changes[rs["metadata"]["name"]] = _replicas(rs) - cut
            budget -= cut
    for rs in sorted(old, key=lambda r: r["metadata"].get("creationTimestamp") or ""):
        current = changes.get(rs["metadata"]["name"], _replicas(rs))
        cut = min(current, max(0, budget))
        if cut > 0:
            changes[rs["metadata"]["name"]] = current - cut
            budget -= cut
    return changes


def _condition(kind: str, status: bool, reason: str, message: str, now: str, old: list[Obj]) -> Obj:
    previous = next((c for c in old if c.get("type") == kind), None)
    value = "True" if status else "False"
    since = previous["lastTransitionTime"] if previous and previous.get("status") == value else now
    return {
        "type": kind,
        "status": value,
        "reason": reason,
        "message": message,
        "lastUpdateTime": now
        if not previous or previous.get("reason") != reason
        else previous["lastUpdateTime"],
        "lastTransitionTime": since,
    }


def deployment_status(deploy: Obj, new: Obj | None, old: list[Obj], now: str) -> Obj:
    sets = ([new] if new is not None else []) + old
    replicas = int(deploy["spec"].get("replicas", 1))

    def total(field: str) -> int:
        return sum(int((rs.get("status") or {}).get(field, 0)) for rs in sets)

    available = total("availableReplicas")
    updated = int((new.get("status") or {}).get("replicas", 0)) if new is not None else 0
    _, max_unavailable = surge_and_unavailable(deploy)
    previous = (deploy.get("status") or {}).get("conditions") or []
    has_minimum = available >= replicas - max_unavailable
    conditions = [
        _condition(
            "Available",
            has_minimum,
            "MinimumReplicasAvailable" if has_minimum else "MinimumReplicasUnavailable",
            "Deployment has minimum availability."
            if has_minimum
            else "Deployment does not have minimum availability.",
            now,
            previous,
        )
    ]
    if new is not None:
        rs_name = new["metadata"]["name"]
        done = updated == replicas and available >= replicas and total("replicas") == replicas
        conditions.append(
            _condition(
                "Progressing",
                True,
                "NewReplicaSetAvailable" if done else "ReplicaSetUpdated",
                f'ReplicaSet "{rs_name}" has successfully progressed.'
                if done
                else f'ReplicaSet "{rs_name}" is progressing.',
                now,
                previous,
            )
        )
    status: Obj = {
        "observedGeneration": deploy["metadata"].get("generation", 1),
        "replicas": total("replicas"),
        "updatedReplicas": updated,
        "readyReplicas": total("readyReplicas"),
        "availableReplicas": available,
        "unavailableReplicas": max(0, replicas - available),
        "conditions": conditions,
    }
    if (deploy.get("status") or {}).get("collisionCount"):
        status["collisionCount"] = deploy["status"]["collisionCount"]
    return status
