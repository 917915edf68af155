"""Namespace deletion, as the namespace registry, the NamespaceLifecycle admission plugin and
kube-controller-manager's namespace controller do it.

* A new Namespace gets `spec.finalizers: [kubernetes]` (namespaceStrategy.PrepareForCreate).
* DELETE marks it (deletionTimestamp, `status.phase: Terminating`) and answers it; a DELETE of a namespace
  already terminating is a 409 (`The system is ensuring all content is removed from this namespace. ...`).
* Creating anything in a terminating namespace is a 403 with the NamespaceTerminating cause.
* The controller's part runs at once, synchronously: every object in the namespace is deleted (Pods
  gracefully, with their own grace periods); while some remain (finalizers, grace periods) the namespace's
  conditions say what, in the controller's words; when the last one goes, the `kubernetes` finalizer is
  removed and the namespace with it (unless metadata.finalizers hold it).
"""

from __future__ import annotations

import copy
from collections import Counter
from typing import TYPE_CHECKING, Any

from . import deletion
from .admission import NAMESPACES
from .errors import APIError, not_found, precondition_failed
from .resources import ResourceType

if TYPE_CHECKING:
    from .store import Store

FINALIZER = "kubernetes"
_PURGING = (
    "The system is ensuring all content is removed from this namespace.  Upon completion, this namespace will "
    "automatically be purged by the system."
)


def admit_create(store: Store, rtype: ResourceType, namespace: str, name: str) -> None:
    """NamespaceLifecycle: a 404 for a namespace that does not exist, a 403 for one being terminated."""
    ns = store.objects[NAMESPACES].get(("", namespace))
    if ns is None:
        raise not_found("namespaces", "", namespace)
    if (ns.get("status") or {}).get("phase") == "Terminating":
        resource = f"{rtype.plural}.{rtype.group}" if rtype.group else rtype.plural
        who = f'{resource} "{name}"' if name else resource
        cause = {
            "reason": "NamespaceTerminating",
            "message": f"namespace {namespace} is being terminated",
            "field": "metadata.namespace",
        }
        raise APIError(
            403,
            "Forbidden",
            f"{who} is forbidden: unable to create new content in namespace {namespace} because it is being "
            "terminated",
            {"name": name, "group": rtype.group, "kind": rtype.plural, "causes": [cause]},
        )


def delete_namespace(
    store: Store, rtype: ResourceType, current: dict[str, Any], *, dry_run: bool = False
) -> dict[str, Any]:
    name = current["metadata"]["name"]
    if current["metadata"].get("deletionTimestamp"):
        if FINALIZER in ((current.get("spec") or {}).get("finalizers") or []):
            raise precondition_failed("namespaces", "", name, _PURGING)
        return current
    marked = copy.deepcopy(current)
    marked["metadata"].update(deletionTimestamp=store.timestamp(), deletionGracePeriodSeconds=0)
    marked["status"] = {**(marked.get("status") or {}), "phase": "Terminating"}
    if dry_run:
        return marked
    store.commit(NAMESPACES, marked, "MODIFIED", current)
    _delete_content(store, name)
    finish(store, name)
    return marked


def _content(store: Store, namespace: str) -> list[tuple[ResourceType, dict[str, Any]]]:
    found = []
    for storage, objects in list(store.objects.items()):
        rtype = store.registry.by_storage(storage)
        if rtype is not None and rtype.namespaced:
            found += [(rtype, obj) for (ns, _), obj in sorted(objects.items()) if ns == namespace]
    return found


def _delete_content(store: Store, namespace: str) -> None:
    for rtype, obj in _content(store, namespace):
        meta = obj["metadata"]
        if store.uid_of(rtype.storage, namespace, meta["name"]) == meta["uid"] and not meta.get(
            "deletionTimestamp"
        ):
            deletion.delete(store, rtype, namespace, meta["name"], deletion.DeleteOptions())


def finish(store: Store, namespace: str) -> None:
    """The controller's next look at a terminating namespace: its conditions, or its removal."""
    current = store.objects[NAMESPACES].get(("", namespace))
    if current is None or not current["metadata"].get("deletionTimestamp"):
        return
    remaining = _content(store, namespace)
    if not remaining:
        done = copy.deepcopy(current)
        spec = done.setdefault("spec", {})
        spec["finalizers"] = [f for f in spec.get("finalizers") or [] if f != FINALIZER]
        if done["metadata"].get("finalizers"):
            done["status"]["conditions"] = _conditions(store, current, [])
            store.commit(NAMESPACES, done, "MODIFIED", current)
        else:
            deletion.remove(store, NAMESPACES, done, deletion.DeleteOptions())
        return
    conditions = _conditions(store, current, remaining)
    if conditions != (current.get("status") or {}).get("conditions"):
        updated = copy.deepcopy(current)
        updated["status"]["conditions"] = conditions
        store.commit(NAMESPACES, updated, "MODIFIED", current)


def _conditions(
    store: Store, namespace: dict[str, Any], remaining: list[tuple[ResourceType, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """The namespace controller's five deletion conditions."""
    counts = Counter(f"{rtype.plural}.{rtype.group}" for rtype, _ in remaining)
    finalizers = Counter(f for _, obj in remaining for f in obj["metadata"].get("finalizers") or [])
    content = ", ".join(f"{r} has {n} resource instances" for r, n in sorted(counts.items()))
    held = ", ".join(f"{f} in {n} resource instances" for f, n in sorted(finalizers.items()))
    wanted = [
        (
            "NamespaceDeletionDiscoveryFailure",
            "False",
            "ResourcesDiscovered",
            "All resources successfully discovered",
        ),
        (
            "NamespaceDeletionGroupVersionParsingFailure",
            "False",
            "ParsedGroupVersions",
            "All legacy kube types successfully parsed",
        ),
        (
            "NamespaceDeletionContentFailure",
            "False",
            "ContentDeleted",
            "All content successfully deleted, may be waiting on finalization",
        ),
        (
            (
                "NamespaceContentRemaining",
                "True",
                "SomeResourcesRemain",
                f"Some resources are remaining: {content}",
            )
            if counts
            else ("NamespaceContentRemaining", "False", "ContentRemoved", "All content successfully removed")
        ),
        (
            (
                "NamespaceFinalizersRemaining",
                "True",
                "SomeFinalizersRemain",
                f"Some content in the namespace has finalizers remaining: {held}",
            )
            if finalizers
            else (
                "NamespaceFinalizersRemaining",
                "False",
                "ContentHasNoFinalizers",
                "All content-preserving finalizers finished",
            )
        ),
    ]
    previous = {c["type"]: c for c in (namespace.get("status") or {}).get("conditions") or []}
    conditions = []
    for kind, status, reason, message in wanted:
        old = previous.get(kind)
        same = old is not None and old["status"] == status
        when = old["lastTransitionTime"] if same and old is not None else store.timestamp()
        conditions.append(
            {"type": kind, "status": status, "lastTransitionTime": when, "reason": reason, "message": message}
        )
    return conditions
