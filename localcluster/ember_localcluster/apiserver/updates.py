"""Update and workload rules of built-in kinds, as kube-apiserver's validation has them, with its messages.

* Pods (ValidatePodUpdate): a Pod's spec may change only in `containers[*].image`,
  `initContainers[*].image`, `activeDeadlineSeconds` (set, or lowered), added `tolerations`,
  `terminationGracePeriodSeconds` (from a negative value to 1) and removed `schedulingGates`; any other
  change is a 422 `spec: Forbidden: pod updates may not change fields other than ...` followed by a diff
  (upstream prints Go's cmp.Diff; here a list of the changed spec keys stands in for it).
* apps/v1 Deployments and ReplicaSets (ValidateDeploymentSpec, ValidateReplicaSetSpec and their updates):
  a selector is required, not empty, must match the template's labels, and cannot change.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from .errors import Cause

_UPDATABLE = ",".join(
    (
        "`spec.containers[*].image`",
        "`spec.initContainers[*].image`",
        "`spec.activeDeadlineSeconds`",
        "`spec.tolerations` (only additions to existing tolerations)",
        "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
    )
)
WORKLOADS = (("apps", "deployments"), ("apps", "replicasets"))


def pod_update_causes(old: dict[str, Any], new: dict[str, Any]) -> list[Cause]:
    old_spec, new_spec = old.get("spec") or {}, new.get("spec") or {}
    if not isinstance(new_spec, dict) or not isinstance(old_spec, dict):
        return []
    munged = copy.deepcopy(new_spec)
    for key in ("containers", "initContainers"):
        olds = old_spec.get(key) or []
        for i, container in enumerate(munged.get(key) or []):
            if isinstance(container, dict) and i < len(olds) and isinstance(olds[i], dict):
                if "image" in olds[i]:
                    container["image"] = olds[i]["image"]
                else:
                    container.pop("image", None)
    deadline, old_deadline = new_spec.get("activeDeadlineSeconds"), old_spec.get("activeDeadlineSeconds")
    if isinstance(deadline, int) and deadline > 0 and (old_deadline is None or deadline <= old_deadline):
        _restore(munged, old_spec, "activeDeadlineSeconds")
    tolerations, old_tolerations = new_spec.get("tolerations") or [], old_spec.get("tolerations") or []
    if all(t in tolerations for t in old_tolerations):
        _restore(munged, old_spec, "tolerations")
    grace, old_grace = (
        new_spec.get("terminationGracePeriodSeconds"),
        old_spec.get("terminationGracePeriodSeconds"),
    )
    if grace == 1 and isinstance(old_grace, int) and old_grace < 0:
        _restore(munged, old_spec, "terminationGracePeriodSeconds")
    gates, old_gates = new_spec.get("schedulingGates") or [], old_spec.get("schedulingGates") or []
    if all(g in old_gates for g in gates):
        _restore(munged, old_spec, "schedulingGates")
    if munged == old_spec:
        return []
    changed = sorted(k for k in set(munged) | set(old_spec) if munged.get(k) != old_spec.get(k))
    diff = "\n".join(
        f"  spec.{key}: {json.dumps(old_spec.get(key))} -> {json.dumps(munged.get(key))}" for key in changed
    )
    message = f"Forbidden: pod updates may not change fields other than {_UPDATABLE}\n{diff}"
    return [Cause("spec", "FieldValueForbidden", message)]


def _restore(munged: dict[str, Any], old_spec: dict[str, Any], key: str) -> None:
    if key in old_spec:
        munged[key] = copy.deepcopy(old_spec[key])
    else:
        munged.pop(key, None)


def _go_map(labels: dict[str, Any]) -> str:
    return (
        "map[string]string{"
        + ", ".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in sorted(labels.items()))
        + "}"
    )


def _go_selector(selector: dict[str, Any]) -> str:
    """A LabelSelector as Go's %#v prints metav1.LabelSelector."""
    labels = selector.get("matchLabels")
    match_labels = _go_map(labels) if labels else "map[string]string(nil)"
    expressions = selector.get("matchExpressions")
    if expressions:
        parts = ", ".join(
            f"v1.LabelSelectorRequirement{{Key:{json.dumps(e.get('key', ''))}, "
            f"Operator:{json.dumps(e.get('operator', ''))}, Values:[]string{{{', '.join(json.dumps(v) for v in e.get('values') or [])}}}}}"
            for e in expressions
        )
        match_expressions = f"[]v1.LabelSelectorRequirement{{{parts}}}"
    else:
        match_expressions = "[]v1.LabelSelectorRequirement(nil)"
    return f"v1.LabelSelector{{MatchLabels:{match_labels}, MatchExpressions:{match_expressions}}}"


def _matches(selector: dict[str, Any], labels: dict[str, Any]) -> bool:
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e.get("key"), e.get("operator"), e.get("values") or []
        if (
            (op == "In" and labels.get(key) not in values)
            or (op == "NotIn" and key in labels and labels[key] in values)
            or (op == "Exists" and key not in labels)
            or (op == "DoesNotExist" and key in labels)
        ):
            return False
    return True


def workload_causes(obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return []
    selector = spec.get("selector")
    if old is not None:
        old_selector = (old.get("spec") or {}).get("selector")
        if selector != old_selector and isinstance(selector, dict):
            message = f"Invalid value: {_go_selector(selector)}: field is immutable"
            return [Cause("spec.selector", "FieldValueInvalid", message)]
    if selector is None:
        return [Cause("spec.selector", "FieldValueRequired", "Required value")]
    if not isinstance(selector, dict):
        return []
    if not selector.get("matchLabels") and not selector.get("matchExpressions"):
        message = f"Invalid value: {_go_selector(selector)}: empty selector is invalid for deployment"
        return [Cause("spec.selector", "FieldValueInvalid", message)]
    labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    if isinstance(labels, dict) and not _matches(selector, labels):
        message = f"Invalid value: {_go_map(labels)}: `selector` does not match template `labels`"
        return [Cause("spec.template.metadata.labels", "FieldValueInvalid", message)]
    return []
