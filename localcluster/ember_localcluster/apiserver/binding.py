"""The `pods/binding` subresource: `POST /api/v1/namespaces/NS/pods/NAME/binding`, how a scheduler assigns
a pod to a node.

As kube-apiserver's `BindingREST.Create` (pkg/registry/core/pod/storage): the body is a `v1 Binding`
whose `metadata.name` must be the pod's (400 "name in URL does not match name in Binding object") and
whose `target` names the node (`target.kind` empty or `Node`, `target.name` required: a validation
failure there comes back, as upstream, as a 500 with no reason, since that path returns a plain error).
`metadata.uid` and `metadata.resourceVersion`, when given, are preconditions on the pod (409 on a
mismatch, with the storage layer's message). A pod being deleted, already bound or with scheduling gates
cannot be bound: 409 Conflict on `pods/binding` ("pod NAME is already assigned to node \"NODE\"").
Success sets `spec.nodeName`, merges the binding's annotations into the pod's, replaces the
`PodScheduled` condition with `status: "True"` (lastTransitionTime now) and answers 201 with a `Success`
Status. Like upstream, the node is not looked up: binding to a node that does not exist succeeds. The
write goes around the pod's update rules (no generation bump), as upstream writes storage directly.
`dryRun` checks without writing. Not served: the older `POST .../bindings` collection.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from .admission import PODS
from .errors import APIError, bad_request, conflict
from .resources import ResourceType

if TYPE_CHECKING:
    from .store import Store

BINDING = ResourceType("", "v1", "Binding", "bindings", namespaced=True)


def _binding_conflict(name: str, why: str) -> APIError:
    return APIError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on pods/binding "{name}": {why}',
        {"name": name, "group": "", "kind": "pods/binding"},
    )


def _validation_error(binding: dict[str, Any]) -> APIError | None:
    """`ValidatePodBinding`, aggregated as `ErrorList.ToAggregate()` prints it."""
    target = binding.get("target")
    if not isinstance(target, dict):
        target = {}
    errors = []
    kind = target.get("kind") or ""
    if kind and kind != "Node":
        errors.append(f'target.kind: Unsupported value: "{kind}": supported values: "Node", "<empty>"')
    if not target.get("name"):
        errors.append("target.name: Required value")
    if not errors:
        return None
    message = errors[0] if len(errors) == 1 else "[" + ", ".join(errors) + "]"
    # Not an API status upstream, so the handler answers 500 with no reason.
    return APIError(500, "", message)


def bind(store: Store, namespace: str, name: str, body: Any, *, dry_run: bool = False) -> dict[str, Any]:
    """Bind the pod `namespace/name` as the Binding `body` says; the `Success` Status to answer with."""
    if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
        raise bad_request("the body of the request is not a valid Binding object")
    for key, expected in (("apiVersion", BINDING.api_version), ("kind", BINDING.kind)):
        if body.get(key) not in (None, "", expected):
            raise bad_request(
                f"the {key} in the data ({body[key]}) does not match the expected {key} ({expected})"
            )
    meta = body.get("metadata") or {}
    if meta.get("namespace") not in (None, "", namespace):
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    if meta.get("name") != name:
        raise bad_request("name in URL does not match name in Binding object")
    error = _validation_error(body)
    if error is not None:
        raise error
    pods = store.registry.lookup("", "v1", "pods")
    assert pods is not None
    current = store.get(pods, namespace, name)
    pod_meta = current["metadata"]
    for key, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
        wanted = meta.get(key)
        if wanted and wanted != pod_meta.get(key):
            detail = f"Precondition failed: {label} in precondition: {wanted}, {label} in object meta: {pod_meta.get(key)}"
            raise conflict_on_storage(namespace, name, detail)
    spec = current.get("spec") or {}
    if pod_meta.get("deletionTimestamp"):
        raise _binding_conflict(name, f"pod {name} is being deleted, cannot be assigned to a host")
    if spec.get("nodeName"):
        raise _binding_conflict(name, f'pod {name} is already assigned to node "{spec["nodeName"]}"')
    if spec.get("schedulingGates"):
        raise _binding_conflict(name, f"pod {name} has non-empty .spec.schedulingGates")
    if not dry_run:
        pod = copy.deepcopy(current)
        pod.setdefault("spec", {})["nodeName"] = body["target"]["name"]
        annotations = meta.get("annotations") or {}
        if annotations:
            pod["metadata"]["annotations"] = {**(pod_meta.get("annotations") or {}), **annotations}
        status = pod.setdefault("status", {})
        scheduled = {
            "type": "PodScheduled",
            "status": "True",
            "lastProbeTime": None,
            "lastTransitionTime": store.timestamp(),
        }
        # `UpdatePodCondition`: replace the condition in place, keeping its transition time if unchanged.
        conditions = list(status.get("conditions") or [])
        for i, condition in enumerate(conditions):
            if condition.get("type") == "PodScheduled":
                if condition.get("status") == "True":
                    scheduled["lastTransitionTime"] = condition.get("lastTransitionTime")
                conditions[i] = scheduled
                break
        else:
            conditions.append(scheduled)
        status["conditions"] = conditions
        store.commit(PODS, pod, "MODIFIED", current)
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


def conflict_on_storage(namespace: str, name: str, detail: str) -> APIError:
    """A failed storage precondition, as `storeerr.InterpretUpdateError` reports it on pods."""
    error = conflict("pods", "", name)
    error.message = (
        f'Operation cannot be fulfilled on pods "{name}": StorageError: invalid object, Code: 4, '
        f"Key: /registry/pods/{namespace}/{name}, ResourceVersion: 0, AdditionalErrorMsg: {detail}"
    )
    return error
