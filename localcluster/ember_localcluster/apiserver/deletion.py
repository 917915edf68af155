"""DELETE and what follows it: finalizers, graceful Pod deletion, garbage collection.

* An object with finalizers gets `deletionTimestamp` (now) and `deletionGracePeriodSeconds: 0` and
  stays; the write that later leaves it without finalizers deletes it (see `Store.write`). A second
  DELETE changes nothing.
* A Pod is deleted gracefully, as Kubernetes does it: `deletionTimestamp` is set to now plus the grace
  period (DeleteOptions `gracePeriodSeconds`, else `spec.terminationGracePeriodSeconds`, else 30) and
  the Pod stays until a kubelet deletes it with `gracePeriodSeconds=0` or the period runs out (then the
  server deletes it itself). As in Kubernetes (`podStrategy.CheckGracefulDelete`), a Pod not bound to a
  node (no `spec.nodeName`: no kubelet runs it) and one in phase Succeeded or Failed go at once, and so
  does every Pod when the server runs with `pod_graceful_deletion=False`.
* Garbage collection runs right after each real delete and each create of an object with owners,
  synchronously (Kubernetes runs it in the background): every object whose ownerReferences name no live
  owner (by uid) is deleted through this same path, so its own finalizers hold — one created after its
  owner was deleted too. `propagationPolicy=Orphan` strips the owner's references from its
  dependents instead; `Foreground` keeps the owner (deletionTimestamp, the `foregroundDeletion`
  finalizer) until no dependent with `blockOwnerDeletion` is left. A second DELETE of a Pod in its grace
  period may only shorten it (rest.BeforeDelete).
* Deleting a namespace marks it Terminating and deletes its content (`namespaces.py`); deleting a CRD
  drops its types and all their objects.
* A dry run (DeleteOptions `dryRun: [All]`, one object or a collection) answers what the real delete
  would answer (the object as it was, or marked for deletion where finalizers, Foreground propagation,
  a Pod's grace period or a namespace's termination would keep it) and writes nothing: no garbage
  collection, no orphaning, no namespace termination.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from . import namespaces
from .admission import CRD_STORAGE, NAMESPACES, PODS
from .errors import conflict
from .resources import ResourceType
from .selectors import FieldSelector, LabelSelector

if TYPE_CHECKING:
    from .store import Store

FOREGROUND = "foregroundDeletion"


@dataclass(slots=True)
class DeleteOptions:
    grace_period_seconds: int | None = None
    propagation_policy: str | None = None
    preconditions: dict[str, Any] = field(default_factory=dict)
    dry_run: bool = False


def delete(
    store: Store, rtype: ResourceType, namespace: str | None, name: str, options: DeleteOptions
) -> dict[str, Any]:
    """The object after the DELETE: its last state when gone, else marked for deletion. A dry run answers
    the same and changes nothing: no write, no garbage collection, no namespace termination."""
    current = store.get(rtype, namespace, name)
    meta = current["metadata"]
    for key in ("uid", "resourceVersion"):
        wanted = options.preconditions.get(key)
        if wanted is not None and wanted != meta.get(key):
            raise conflict(rtype.plural, rtype.group, name)
    dry_run = options.dry_run
    if options.propagation_policy == "Orphan" and not dry_run:
        _orphan_dependents(store, meta["uid"])
    if rtype.storage == NAMESPACES:
        return namespaces.delete_namespace(store, rtype, current, dry_run=dry_run)
    grace = _pod_grace(store, current, options) if rtype.storage == PODS else 0
    if grace > 0:
        if meta.get("deletionTimestamp"):
            return _shorten_grace(store, rtype, current, options)
        if not dry_run:
            _expire_grace_later(store, rtype, current, grace)
        return _mark_deleting(store, rtype, current, grace, dry_run=dry_run)
    if options.propagation_policy == "Foreground" and not meta.get("deletionTimestamp"):
        return _delete_in_foreground(store, rtype, current, dry_run=dry_run)
    if meta.get("finalizers"):
        if meta.get("deletionTimestamp"):
            return current
        return _mark_deleting(store, rtype, current, 0, dry_run=dry_run)
    return current if dry_run else remove(store, rtype.storage, current, options)


def deleted_now(store: Store, rtype: ResourceType, obj: dict[str, Any], options: DeleteOptions) -> bool:
    """Whether a DELETE that answered `obj` removed it (or, dry, would have): not held or stopping."""
    meta = obj["metadata"]
    if options.dry_run:
        return not meta.get("deletionTimestamp")
    return store.uid_of(rtype.storage, meta.get("namespace"), meta["name"]) != meta["uid"]


def success_status(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
    """registry.Store's finalizeDelete: a Success Status naming the object (its resource as the kind)."""
    meta = obj["metadata"]
    details = {"name": meta["name"], "group": rtype.group, "kind": rtype.plural, "uid": meta["uid"]}
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "details": details}


def delete_collection(
    store: Store,
    rtype: ResourceType,
    namespace: str | None,
    labels: LabelSelector,
    fields: FieldSelector,
    options: DeleteOptions,
) -> list[dict[str, Any]]:
    deleted = []
    for obj in store.list(rtype, namespace, labels, fields):
        meta = obj["metadata"]
        # An earlier delete's garbage collection may have taken this one already.
        if store.contains(rtype.storage, meta.get("namespace"), meta["name"]):
            deleted.append(delete(store, rtype, meta.get("namespace"), meta["name"], options))
    return deleted


def remove(
    store: Store, storage: tuple[str, str], obj: dict[str, Any], options: DeleteOptions
) -> dict[str, Any]:
    """Really delete: a DELETED event with a new resourceVersion, then garbage collection."""
    obj = copy.deepcopy(obj)
    store.commit(storage, obj, "DELETED", None)
    if storage == CRD_STORAGE:
        _drop_type(store, (obj["spec"]["group"], obj["spec"]["names"]["plural"]))
    if options.propagation_policy != "Orphan":
        collect_garbage(store)
    _finish_foreground(store)
    if obj["metadata"].get("namespace"):
        namespaces.finish(store, obj["metadata"]["namespace"])
    return obj


def _pod_grace(store: Store, pod: dict[str, Any], options: DeleteOptions) -> int:
    if not store.pod_graceful_deletion or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return 0
    if not (pod.get("spec") or {}).get("nodeName"):
        return 0  # not scheduled: no kubelet will confirm the kill
    if options.grace_period_seconds is not None:
        return max(0, options.grace_period_seconds)
    grace = (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30)
    return grace if isinstance(grace, int) else 30


def _expire_grace_later(store: Store, rtype: ResourceType, pod: dict[str, Any], grace: int) -> None:
    namespace, name, uid = pod["metadata"].get("namespace"), pod["metadata"]["name"], pod["metadata"]["uid"]

    def expire() -> None:
        # The server stands in for a kubelet that never confirmed the kill. Only after a margin past the
        # deadline: a kubelet SIGKILLs at the deadline and still has its final status to write.
        if store.uid_of(rtype.storage, namespace, name) == uid:
            delete(store, rtype, namespace, name, DeleteOptions(grace_period_seconds=0))

    if store.pod_kill_margin is not None:
        asyncio.get_running_loop().call_later(grace + store.pod_kill_margin, expire)


def _shorten_grace(
    store: Store, rtype: ResourceType, current: dict[str, Any], options: DeleteOptions
) -> dict[str, Any]:
    """rest.BeforeDelete on an object already being deleted: only a shorter grace period changes it,
    moving deletionTimestamp back by the difference."""
    meta = current["metadata"]
    old = meta.get("deletionGracePeriodSeconds") or 0
    wanted = options.grace_period_seconds
    if wanted is None or wanted >= old:
        return current
    obj = copy.deepcopy(current)
    stamp = datetime.strptime(meta["deletionTimestamp"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    stamp += timedelta(seconds=wanted - old)
    obj["metadata"].update(
        deletionTimestamp=stamp.strftime("%Y-%m-%dT%H:%M:%SZ"), deletionGracePeriodSeconds=wanted
    )
    if not options.dry_run:
        store.commit(rtype.storage, obj, "MODIFIED", current)
        _expire_grace_later(store, rtype, obj, wanted)
    return obj


def _delete_in_foreground(
    store: Store, rtype: ResourceType, current: dict[str, Any], *, dry_run: bool
) -> dict[str, Any]:
    """Foreground propagation: the owner is kept, marked and with the `foregroundDeletion` finalizer,
    while the garbage collector deletes its dependents (in the foreground too); it goes when no dependent
    with `blockOwnerDeletion` is left."""
    marked = copy.deepcopy(current)
    meta = marked["metadata"]
    meta["finalizers"] = [*(meta.get("finalizers") or []), FOREGROUND]
    meta["deletionTimestamp"], meta["deletionGracePeriodSeconds"] = store.timestamp(), 0
    if meta.get("generation"):
        meta["generation"] += 1
    if dry_run:
        return marked
    store.commit(rtype.storage, marked, "MODIFIED", current)
    for storage, objects in list(store.objects.items()):
        dependent_type = store.registry.by_storage(storage)
        for obj in list(objects.values()):
            refs = obj["metadata"].get("ownerReferences") or []
            dep = obj["metadata"]
            if (
                dependent_type is not None
                and any(ref.get("uid") == meta["uid"] for ref in refs)
                and not dep.get("deletionTimestamp")
                and store.uid_of(storage, dep.get("namespace"), dep["name"]) == dep["uid"]
            ):
                delete(
                    store,
                    dependent_type,
                    dep.get("namespace"),
                    dep["name"],
                    DeleteOptions(propagation_policy="Foreground"),
                )
    _finish_foreground(store)
    latest = store.objects[rtype.storage].get((meta.get("namespace") or "", meta["name"]))
    return latest if latest is not None and latest["metadata"]["uid"] == meta["uid"] else marked


def _finish_foreground(store: Store) -> None:
    """The garbage collector's look at owners deleted in the foreground: one that no blocking dependent
    holds any more loses the `foregroundDeletion` finalizer (and goes, if it was the last)."""
    waiting = [
        (storage, obj)
        for storage, objects in store.objects.items()
        for obj in objects.values()
        if FOREGROUND in (obj["metadata"].get("finalizers") or [])
    ]
    for storage, owner in waiting:
        uid = owner["metadata"]["uid"]
        blocked = any(
            ref.get("uid") == uid and ref.get("blockOwnerDeletion")
            for objects in store.objects.values()
            for obj in objects.values()
            for ref in obj["metadata"].get("ownerReferences") or []
        )
        rtype = store.registry.by_storage(storage)
        if blocked or rtype is None:
            continue
        meta = owner["metadata"]
        if store.uid_of(storage, meta.get("namespace"), meta["name"]) != uid:
            continue
        released = copy.deepcopy(owner)
        released["metadata"]["finalizers"] = [f for f in meta["finalizers"] if f != FOREGROUND]
        store.write(rtype, owner, released)


def _mark_deleting(
    store: Store, rtype: ResourceType, current: dict[str, Any], grace: int, *, dry_run: bool = False
) -> dict[str, Any]:
    obj = copy.deepcopy(current)
    meta = obj["metadata"]
    meta["deletionTimestamp"] = store.timestamp(grace)
    meta["deletionGracePeriodSeconds"] = grace
    if meta.get("generation"):  # rest.BeforeDelete
        meta["generation"] += 1
    if not dry_run:
        store.commit(rtype.storage, obj, "MODIFIED", current)
    return obj


def _drop_type(store: Store, storage: tuple[str, str]) -> None:
    for obj in list(store.objects[storage].values()):
        store.commit(storage, copy.deepcopy(obj), "DELETED", None)
    store.objects.pop(storage, None)
    store.registry.unregister(storage)


def collect_garbage(store: Store) -> None:
    """Delete every dependent none of whose owners is alive any more, until nothing changes."""
    while True:
        live = {obj["metadata"]["uid"] for objects in store.objects.values() for obj in objects.values()}
        orphans = [
            (storage, obj["metadata"].get("namespace"), obj["metadata"]["name"])
            for storage, objects in store.objects.items()
            for obj in objects.values()
            if (refs := obj["metadata"].get("ownerReferences"))
            and not obj["metadata"].get("deletionTimestamp")
            and not any(ref.get("uid") in live for ref in refs)
        ]
        progressed = False
        for storage, namespace, name in orphans:
            rtype = store.registry.by_storage(storage)
            if rtype is not None and store.contains(storage, namespace, name):
                delete(store, rtype, namespace, name, DeleteOptions())
                progressed = True
        if not progressed:
            return


def _orphan_dependents(store: Store, owner_uid: str) -> None:
    for storage, objects in list(store.objects.items()):
        rtype = store.registry.by_storage(storage)
        for obj in list(objects.values()):
            refs = obj["metadata"].get("ownerReferences") or []
            if rtype is not None and any(ref.get("uid") == owner_uid for ref in refs):
                new = copy.deepcopy(obj)
                # The garbage collector's merge patch sets what is left, `null` (the key gone) when nothing is.
                kept = [ref for ref in refs if ref.get("uid") != owner_uid]
                if kept:
                    new["metadata"]["ownerReferences"] = kept
                else:
                    del new["metadata"]["ownerReferences"]
                store.write(rtype, obj, new)
