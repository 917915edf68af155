"""The `pods/eviction` subresource: `POST /api/v1/namespaces/NS/pods/NAME/eviction` with a `policy/v1`
(or `policy/v1beta1`) `Eviction`, how `kubectl drain` removes pods while honouring PodDisruptionBudgets.

As kube-apiserver's `EvictionREST.Create` (pkg/registry/core/pod/storage/eviction.go):

* The body's `metadata.name` must be the pod's (400 "name in URL does not match name in Eviction
  object"); its `deleteOptions` are the pod's delete options, and a dry run asked both in the query and in
  them must agree (500 "Non-matching dry-run options in request and content: ...", a plain error upstream).
* A pod in phase Pending, Succeeded or Failed, or already being deleted, is deleted without looking at any
  budget (`canIgnorePDB`).
* Otherwise the PodDisruptionBudgets of the pod's namespace whose selector matches its labels are found
  (an empty selector matches every pod, as policy/v1 has it; a missing one none). None: the pod is deleted. More than one: a 500 Status
  "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
* A pod that is Running but not Ready goes without spending the budget when the budget's
  `unhealthyPodEvictionPolicy` is `AlwaysAllow`, or (unset or `IfHealthyBudget`, the default) when
  `status.currentHealthy >= status.desiredHealthy > 0`; the delete is then conditional on the pod's
  resourceVersion, and a conflict comes back as the 429 below ("... is still being processed ...").
* Else the budget is checked and spent (`checkAndDecrement`): a status not yet written for the budget's
  generation (`observedGeneration < generation`) is a 429 TooManyRequests "Cannot evict pod as it would
  violate the pod's disruption budget." with retryAfterSeconds 10 and a `DisruptionBudget` cause "The
  disruption budget NAME is still being processed by the server."; a negative `disruptionsAllowed` or
  more than 2000 `disruptedPods` a 403; `disruptionsAllowed: 0` the same 429 (no retry hint) with the
  cause "The disruption budget NAME needs D healthy pods and has C currently". Otherwise
  `disruptionsAllowed` goes down by one (the `DisruptionAllowed` condition turning False,
  InsufficientPods, when it reaches 0) and the pod is recorded in `status.disruptedPods` with the time, so
  the disruption controller does not count it healthy while it goes; a dry run spends nothing.
* Before the delete the pod gets the `DisruptionTarget` condition (reason `EvictionByEvictionAPI`,
  message "Eviction API: evicting"), then it is deleted as a DELETE would delete it (graceful for a
  bound pod). Success answers 201 with a `Success` Status.

The server handles one request at a time, so upstream's retries on conflicts never have anything to do.
"""

from __future__ import annotations

import copy
import dataclasses
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from . import deletion
from .admission import PODS
from .errors import APIError, bad_request
from .resources import ResourceType

if TYPE_CHECKING:
    from .store import Store

EVICTION = ResourceType("policy", "v1", "Eviction", "evictions", namespaced=True)
ACCEPTED_VERSIONS = ("policy/v1", "policy/v1beta1")
MAX_DISRUPTED_POD_SIZE = 2000
VIOLATES = "Cannot evict pod as it would violate the pod's disruption budget."
MORE_THAN_ONE = (
    "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
)


def _too_many_requests(cause: str, retry_after: int) -> APIError:
    details: dict[str, Any] = {"causes": [{"reason": "DisruptionBudget", "message": cause}]}
    if retry_after:
        details["retryAfterSeconds"] = retry_after
    return APIError(429, "TooManyRequests", VIOLATES, details)


def _still_processing(pdb_name: str) -> APIError:
    return _too_many_requests(f"The disruption budget {pdb_name} is still being processed by the server.", 10)


def _forbidden(pdb_name: str, why: str) -> APIError:
    return APIError(
        403,
        "Forbidden",
        f'poddisruptionbudget.policy "{pdb_name}" is forbidden: {why}',
        {"name": pdb_name, "group": "policy", "kind": "poddisruptionbudget"},
    )


def selector_matches(selector: Any, labels: dict[str, str]) -> bool | None:
    """`metav1.LabelSelectorAsSelector(selector).Matches(labels)`; None when the selector selects nothing
    at all (nil) and for an invalid one; an empty selector (`{}`) matches everything."""
    if not isinstance(selector, dict):
        return None
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, op, values = expression.get("key"), expression.get("operator"), expression.get("values") or []
        if op == "In":
            ok = key in labels and labels[key] in values
        elif op == "NotIn":
            ok = key not in labels or labels[key] not in values
        elif op == "Exists":
            ok = key in labels
        elif op == "DoesNotExist":
            ok = key not in labels
        else:
            return None
        if not ok:
            return False
    return True


def pod_budgets(store: Store, pod: dict[str, Any]) -> list[dict[str, Any]]:
    """`getPodDisruptionBudgets`: the namespace's budgets whose selector matches the pod (policy/v1: an
    empty selector matches every pod, a missing one none)."""
    from .selectors import FieldSelector, LabelSelector

    pdbs = store.registry.lookup("policy", "v1", "poddisruptionbudgets")
    assert pdbs is not None
    labels = pod["metadata"].get("labels") or {}
    return [
        pdb
        for pdb in store.list(pdbs, pod["metadata"].get("namespace"), LabelSelector(), FieldSelector())
        if selector_matches((pdb.get("spec") or {}).get("selector"), labels)
    ]


def is_ready(pod: dict[str, Any]) -> bool:
    """`podutil.IsPodReady`: the Ready condition is True."""
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def set_disruption_allowed_condition(status: dict[str, Any], now: str) -> None:
    """`pdbhelper.UpdateDisruptionAllowedCondition`, with `meta.SetStatusCondition`'s transition times."""
    allowed = int(status.get("disruptionsAllowed") or 0) > 0
    condition = {
        "type": "DisruptionAllowed",
        "status": "True" if allowed else "False",
        "reason": "SufficientPods" if allowed else "InsufficientPods",
        "message": "",
        "observedGeneration": status.get("observedGeneration") or 0,
    }
    set_status_condition(status, condition, now)


def set_status_condition(status: dict[str, Any], condition: dict[str, Any], now: str) -> None:
    """`meta.SetStatusCondition`: replace by type, keeping lastTransitionTime unless the status changes."""
    conditions = list(status.get("conditions") or [])
    for i, existing in enumerate(conditions):
        if existing.get("type") == condition["type"]:
            same = existing.get("status") == condition["status"]
            stamp = existing.get("lastTransitionTime") if same else now
            conditions[i] = {**condition, "lastTransitionTime": stamp}
            break
    else:
        conditions.append({**condition, "lastTransitionTime": now})
    status["conditions"] = conditions


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _check_and_decrement(store: Store, pod_name: str, pdb: dict[str, Any], dry_run: bool) -> None:
    name = pdb["metadata"]["name"]
    status = copy.deepcopy(pdb.get("status") or {})
    if int(status.get("observedGeneration") or 0) < int(pdb["metadata"].get("generation") or 0):
        raise _still_processing(name)
    allowed = int(status.get("disruptionsAllowed") or 0)
    if allowed < 0:
        raise _forbidden(name, "pdb disruptions allowed is negative")
    if len(status.get("disruptedPods") or {}) > MAX_DISRUPTED_POD_SIZE:
        raise _forbidden(
            name, "DisruptedPods map too big - too many evictions not confirmed by PDB controller"
        )
    if allowed == 0:
        desired, current = int(status.get("desiredHealthy") or 0), int(status.get("currentHealthy") or 0)
        raise _too_many_requests(
            f"The disruption budget {name} needs {desired} healthy pods and has {current} currently", 0
        )
    status["disruptionsAllowed"] = allowed - 1
    if status["disruptionsAllowed"] == 0:
        set_disruption_allowed_condition(status, _now())
    if dry_run:
        return
    status["disruptedPods"] = {**(status.get("disruptedPods") or {}), pod_name: _now()}
    rtype = store.registry.lookup("policy", "v1", "poddisruptionbudgets")
    assert rtype is not None
    store.update(rtype, pdb["metadata"]["namespace"], name, {**pdb, "status": status}, subresource="status")


def _dry_run(query_dry_run: bool, options: dict[str, Any]) -> bool:
    """`propagateDryRun`: the Eviction's deleteOptions.dryRun and the request's must agree."""
    listed = options.get("dryRun")
    if listed and query_dry_run and listed != ["All"]:
        shown = " ".join(listed)
        raise APIError(500, "", f"Non-matching dry-run options in request and content: [All] and [{shown}]")
    if listed and any(value != "All" for value in listed):
        raise bad_request(f'dryRun: Unsupported value: "{listed[0]}": supported values: "All"')
    return query_dry_run or bool(listed)


def _mark_disruption_target(store: Store, pod: dict[str, Any]) -> dict[str, Any]:
    """`addConditionAndDeletePod`'s first step: the DisruptionTarget condition, written through the
    status strategy and conditional on the resourceVersion the eviction read."""
    new = copy.deepcopy(pod)
    status = new.setdefault("status", {})
    condition = {
        "type": "DisruptionTarget",
        "status": "True",
        "lastProbeTime": None,
        "lastTransitionTime": _now(),
        "reason": "EvictionByEvictionAPI",
        "message": "Eviction API: evicting",
    }
    conditions = list(status.get("conditions") or [])
    for i, existing in enumerate(conditions):
        if existing.get("type") == "DisruptionTarget":
            if existing.get("status") == "True":
                condition["lastTransitionTime"] = existing.get("lastTransitionTime")
            conditions[i] = condition
            break
    else:
        conditions.append(condition)
    status["conditions"] = conditions
    rtype = store.registry.lookup("", "v1", "pods")
    assert rtype is not None
    return store.update(
        rtype, pod["metadata"]["namespace"], pod["metadata"]["name"], new, subresource="status"
    )


def _delete(
    store: Store, pod: dict[str, Any], options: deletion.DeleteOptions, dry_run: bool
) -> dict[str, Any]:
    rtype = store.registry.lookup("", "v1", "pods")
    assert rtype is not None
    meta = pod["metadata"]
    if not dry_run:
        wanted = options.preconditions.get("resourceVersion")
        if wanted is None or wanted == meta.get("resourceVersion"):
            marked = _mark_disruption_target(store, pod)
            if wanted is not None:  # the condition's write moved the version the caller named
                options = deletion.DeleteOptions(
                    options.grace_period_seconds,
                    options.propagation_policy,
                    {**options.preconditions, "resourceVersion": marked["metadata"]["resourceVersion"]},
                )
    options = dataclasses.replace(options, dry_run=dry_run)
    deletion.delete(store, rtype, meta.get("namespace"), meta["name"], options)
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}


def evict(
    store: Store,
    namespace: str,
    name: str,
    body: Any,
    options: deletion.DeleteOptions,
    *,
    dry_run: bool = False,
) -> tuple[dict[str, Any], int]:
    """Evict the pod `namespace/name` as the Eviction `body` asks; (the Status to answer with, its code).
    `options` are the body's `deleteOptions`, already read."""
    if not isinstance(body, dict) or not isinstance(body.get("metadata") or {}, dict):
        raise bad_request("the body of the request is not a valid Eviction object")
    if body.get("apiVersion") not in (None, "", *ACCEPTED_VERSIONS):
        raise bad_request(
            f"the apiVersion in the data ({body['apiVersion']}) does not match the expected apiVersion "
            f"({EVICTION.api_version})"
        )
    if body.get("kind") not in (None, "", EVICTION.kind):
        raise bad_request(
            f"the kind in the data ({body['kind']}) does not match the expected kind (Eviction)"
        )
    meta = body.get("metadata") or {}
    if meta.get("namespace") not in (None, "", namespace):
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    if meta.get("name") != name:
        raise bad_request("name in URL does not match name in Eviction object")
    delete_options = body.get("deleteOptions") or {}
    dry_run = _dry_run(dry_run, delete_options if isinstance(delete_options, dict) else {})
    rv_unset = options.preconditions.get("resourceVersion") is None
    pods = store.registry.lookup("", "v1", "pods")
    assert pods is not None and pods.storage == PODS
    pod = store.get(pods, namespace, name)
    phase = (pod.get("status") or {}).get("phase")
    deleting = bool(pod["metadata"].get("deletionTimestamp"))
    if phase in ("Succeeded", "Failed", "Pending") or deleting:  # canIgnorePDB
        if rv_unset and phase not in ("Succeeded", "Failed") and not deleting:  # shouldEnforceResourceVersion
            options = _with_resource_version(options, pod["metadata"]["resourceVersion"])
        return _delete(store, pod, options, dry_run), 201
    budgets = pod_budgets(store, pod)
    if len(budgets) > 1:
        return {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": MORE_THAN_ONE,
            "code": 500,
        }, 500
    if budgets:
        pdb = budgets[0]
        spec, status = pdb.get("spec") or {}, pdb.get("status") or {}
        if not is_ready(pod):
            desired, current = int(status.get("desiredHealthy") or 0), int(status.get("currentHealthy") or 0)
            if spec.get("unhealthyPodEvictionPolicy") == "AlwaysAllow" or (current >= desired > 0):
                conditional = _with_resource_version(options, pod["metadata"]["resourceVersion"])
                try:
                    return _delete(store, pod, conditional, dry_run), 201
                except APIError as error:
                    if error.code == 409 and rv_unset:
                        raise _still_processing(pdb["metadata"]["name"]) from None
                    raise
        _check_and_decrement(store, name, pdb, dry_run)
    return _delete(store, pod, options, dry_run), 201


def _with_resource_version(options: deletion.DeleteOptions, resource_version: str) -> deletion.DeleteOptions:
    return deletion.DeleteOptions(
        options.grace_period_seconds,
        options.propagation_policy,
        {**options.preconditions, "resourceVersion": resource_version},
    )
