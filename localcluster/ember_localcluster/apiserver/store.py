"""Objects and the rules for writing them: the part of the API server that kopf depends on most.

* One global integer resourceVersion. Every committed write bumps it, returns it and is published as a
  watch event carrying exactly that value. A write that changes nothing (after defaulting and the
  status/metadata rules below) is a no-op: same resourceVersion, no event.
* Create sets uid, creationTimestamp (RFC 3339, `Z`), generation 1 (for the kinds that keep one:
  custom resources, CRDs, Deployments, ReplicaSets, PodDisruptionBudgets) and honours `generateName`; it
  needs an existing namespace (404 otherwise). Where a kind has a status subresource, the client's `status`
  is dropped on create, except for Nodes, which a kubelet registers with their status (as the node
  registry keeps it).
* Create refuses a body with `metadata.resourceVersion` (etcd3 storage's 500), after validation and
  admission and before AlreadyExists, in the generic registry's order.
* Update: a stale `metadata.resourceVersion` (in a PUT body, or left in a patched document) is a 409;
  none means "unconditionally", except for custom resources and CRDs (a 422: their strategies do not
  allow unconditional updates). A PUT body's namespace and name must match the URL (400s), its uid is a
  precondition (409); a patch that changes the name is a 400, one that changes the uid a 422.
  Namespace, creationTimestamp, the deletion fields and generation are the server's. Where a kind has a status subresource (Pods, Services, Deployments,
  Namespaces, CRDs, custom resources that declare one) the main endpoint keeps the stored status and
  `/status` changes only the status. generation grows by one as each registry strategy decides: a custom
  resource on any change outside metadata (status included where it has no status subresource), a
  Deployment on a spec or annotation change, the other kinds that keep one on a spec change.
* A write that leaves an object being deleted without finalizers deletes it, unless it is in a grace
  period (a Pod being stopped: `deletionGracePeriodSeconds` above 0), as the generic registry's
  `ShouldDeleteDuringUpdate` decides; adding a finalizer to such an object is a 422. DELETE itself is
  in `deletion.py`, `/scale` in `scale.py`.

Everything runs on the server's event loop, one call at a time, so no locking is needed. Stored
objects are never mutated in place: every write stores a fresh dict, so events and responses can
share them safely.
"""

from __future__ import annotations

import copy
import uuid
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

from . import deletion, namespaces, patching, podsecurity, quota, scale
from .admission import CRD_STORAGE, NAMESPACES, PODS, admit, check_name, checked_body, generated_name
from .builtin import INITIAL_NAMESPACES, SYSTEM_PRIORITY_CLASSES
from .errors import (
    NAMESPACE_MISMATCH,
    APIError,
    Cause,
    already_exists,
    bad_request,
    conflict,
    invalid,
    not_found,
    precondition_failed,
)
from .registry import Registry
from .resources import ResourceType
from .selectors import FieldSelector, LabelSelector
from .watch import Change, WatchHub

# Fields of metadata that only the server sets.
_SERVER_METADATA = (
    "uid",
    "creationTimestamp",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
    "generation",
)


# Built-in kinds whose registry strategy keeps metadata.generation (as of Kubernetes 1.32; Pods do not
# yet); custom resources always do.
_GENERATION_KINDS = (
    ("apps", "deployments"),
    ("apps", "replicasets"),
    ("policy", "poddisruptionbudgets"),
    CRD_STORAGE,
)


def _has_generation(rtype: ResourceType) -> bool:
    return rtype.custom or rtype.storage in _GENERATION_KINDS


def _generation_part(rtype: ResourceType, obj: dict[str, Any]) -> Any:
    """What a change of bumps the generation, as each strategy's PrepareForUpdate compares: a custom
    resource's every field but metadata (and status, where it has a status subresource); a Deployment's
    spec and annotations; otherwise the spec."""
    if rtype.custom:
        skip = (
            ("apiVersion", "kind", "metadata", "status")
            if rtype.has_status
            else ("apiVersion", "kind", "metadata")
        )
        return {k: v for k, v in obj.items() if k not in skip}
    if rtype.storage == ("apps", "deployments"):
        return (obj.get("spec"), obj["metadata"].get("annotations"))
    return obj.get("spec")


QUOTAS = ("", "resourcequotas")
NODES = ("", "nodes")


def _key(namespace: str | None, name: str) -> tuple[str, str]:
    return (namespace or "", name)


class Store:
    def __init__(
        self,
        *,
        pod_graceful_deletion: bool = True,
        history_limit: int = 10_000,
        pod_kill_margin: float | None = 10.0,
    ) -> None:
        self.registry = Registry()
        self.hub = WatchHub(history_limit)
        self.pod_graceful_deletion = pod_graceful_deletion
        self.pod_kill_margin = pod_kill_margin
        self.rv = 0
        # storage (group, plural) → (namespace or "", name) → object
        self.objects: defaultdict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = defaultdict(dict)
        namespaces = self.registry.lookup("", "v1", "namespaces")
        assert namespaces is not None
        for name in INITIAL_NAMESPACES:
            self.create(namespaces, None, {"metadata": {"name": name}})
        priority_classes = self.registry.lookup("scheduling.k8s.io", "v1", "priorityclasses")
        assert priority_classes is not None
        for priority_class in SYSTEM_PRIORITY_CLASSES:
            self.create(priority_classes, None, priority_class)

    @staticmethod
    def timestamp(offset_seconds: float = 0) -> str:
        return (datetime.now(UTC) + timedelta(seconds=offset_seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")

    # -- reads -------------------------------------------------------------------------------------

    def contains(self, storage: tuple[str, str], namespace: str | None, name: str) -> bool:
        return _key(namespace, name) in self.objects[storage]

    def uid_of(self, storage: tuple[str, str], namespace: str | None, name: str) -> str | None:
        obj = self.objects[storage].get(_key(namespace, name))
        return obj["metadata"]["uid"] if obj is not None else None

    def get(self, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.objects[rtype.storage].get(_key(namespace, name))
        if obj is None:
            raise not_found(rtype.plural, rtype.group, name)
        return self._view(rtype, obj)

    def list(
        self, rtype: ResourceType, namespace: str | None, labels: LabelSelector, fields: FieldSelector
    ) -> list[dict[str, Any]]:
        """Matching objects ordered by (namespace, name), the order `continue` tokens rely on."""
        return [
            self._view(rtype, obj)
            for (ns, _), obj in sorted(self.objects[rtype.storage].items())
            if (namespace is None or ns == namespace) and labels.matches(obj) and fields.matches(obj)
        ]

    @staticmethod
    def _view(rtype: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        """The object under the API version it is read through (CRD versions share one storage)."""
        return obj if obj.get("apiVersion") == rtype.api_version else {**obj, "apiVersion": rtype.api_version}

    # -- writes ------------------------------------------------------------------------------------

    def create(
        self,
        rtype: ResourceType,
        namespace: str | None,
        body: Any,
        *,
        dry_run: bool = False,
        strict: bool = False,
    ) -> dict[str, Any]:
        obj = checked_body(rtype, body)
        meta = obj["metadata"]
        if rtype.namespaced:
            if meta.get("namespace") not in (None, "", namespace):
                raise bad_request(NAMESPACE_MISMATCH)
            if not namespace:
                raise bad_request(f"{rtype.kind} objects are namespaced: the request needs a namespace")
            namespaces.admit_create(self, rtype, namespace, meta.get("name") or "")
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = generated_name(meta["generateName"])
            while self.contains(rtype.storage, namespace, meta["name"]):
                meta["name"] = generated_name(meta["generateName"])
        check_name(rtype, meta.get("name"))
        given_version = meta.get("resourceVersion")
        for key in (*_SERVER_METADATA, "resourceVersion", "managedFields", "selfLink"):
            meta.pop(key, None)
        meta.update(uid=str(uuid.uuid4()), creationTimestamp=self.timestamp())
        if _has_generation(rtype):
            meta["generation"] = 1
        if rtype.has_status and rtype.storage != NODES:
            obj.pop("status", None)
        obj = admit(rtype, obj, None, strict=strict, objects=self.objects)
        if rtype.storage == PODS:  # validating admission: after the name is generated
            podsecurity.admit_pod(self.objects[NAMESPACES].get(_key(None, str(namespace))), obj)
            in_namespace = [o for (ns, _), o in self.objects[PODS].items() if ns == namespace]
            quotas = [o for (ns, _), o in self.objects[QUOTAS].items() if ns == namespace]
            quota.admit_pod(quotas, in_namespace, obj)
        # Storage comes last, after validation and admission: etcd3's store refuses a resourceVersion (an
        # error that is no API status, so a 500 with no reason), then an existing key (AlreadyExists).
        if given_version:
            raise APIError(500, "", "resourceVersion should not be set on objects to be created")
        if self.contains(rtype.storage, namespace, meta["name"]):
            raise already_exists(rtype.plural, rtype.group, meta["name"])
        if dry_run:
            return obj
        self.commit(rtype.storage, obj, "ADDED", None)
        if rtype.storage == NAMESPACES:
            # kube-controller-manager's ServiceAccount controller: a `default` account in each namespace.
            accounts = self.registry.lookup("", "v1", "serviceaccounts")
            assert accounts is not None
            self.create(accounts, meta["name"], {"metadata": {"name": "default"}})
        if rtype.storage == CRD_STORAGE:
            self.registry.register_crd(obj)
        if meta.get("ownerReferences"):
            # The garbage collector deletes a dependent whose owners are all gone, also one created after
            # they went (a controller acting on a stale read): it checks each owner's uid.
            deletion.collect_garbage(self)
        return obj

    def update(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        body: Any,
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        strict: bool = False,
    ) -> dict[str, Any]:
        new = checked_body(rtype, body)
        meta = new["metadata"]
        # endpoints/handlers/update.go: the body's namespace (rest.EnsureObjectNamespaceMatchesRequestNamespace),
        # then its name (checkName), before the object is read.
        if rtype.namespaced and meta.get("namespace") not in (None, "", namespace):
            raise bad_request(NAMESPACE_MISMATCH)
        if meta.get("name") != name:
            raise bad_request(
                f"the name of the object ({meta.get('name') or ''}) does not match the name on the URL ({name})"
            )
        current = self.get(rtype, namespace, name)
        # registry.Store.Update: the body's uid is a precondition (rest.DefaultUpdatedObjectInfo), checked
        # against the stored object first; a 409 as storage's precondition failure.
        uid = meta.get("uid")
        if uid and uid != current["metadata"]["uid"]:
            raise precondition_failed(
                rtype.plural,
                rtype.group,
                name,
                f"Precondition failed: UID in precondition: {uid}, UID in object meta: {current['metadata']['uid']}",
            )
        # Custom resources and CRDs do not allow unconditional updates (AllowUnconditionalUpdate false).
        if not meta.get("resourceVersion") and (rtype.custom or rtype.storage == CRD_STORAGE):
            cause = Cause(
                "metadata.resourceVersion",
                "FieldValueInvalid",
                "Invalid value: 0: must be specified for an update",
            )
            raise invalid(rtype.plural, rtype.group, name, [cause])
        return self.write(rtype, current, new, subresource=subresource, dry_run=dry_run, strict=strict)

    def patch(
        self,
        rtype: ResourceType,
        namespace: str | None,
        name: str,
        content_type: str,
        raw: bytes,
        *,
        subresource: str | None = None,
        field_manager: str | None = None,
        dry_run: bool = False,
        strict: bool = False,
    ) -> tuple[dict[str, Any], bool]:
        """(the object, or the Scale for `/scale`; whether it was created by server-side apply)."""
        patch_type, document = patching.parse_patch(content_type, raw)
        if patch_type == patching.APPLY:
            if not field_manager:
                cause = Cause(
                    "fieldManager", "FieldValueRequired", "Required value: is required for apply patch"
                )
                raise invalid("PatchOptions", "meta.k8s.io", "", [cause])
            # The field manager's Apply: the applied configuration names the version it is written in.
            version = document.get("apiVersion", "") if isinstance(document, dict) else ""
            if version != rtype.api_version:
                raise bad_request(
                    f"Incorrect version specified in apply patch. Specified patch version: {version}, "
                    f"expected: {rtype.api_version}"
                )
            if subresource is None and not self.contains(rtype.storage, namespace, name):
                document.setdefault("metadata", {})["name"] = name
                return self.create(rtype, namespace, document, dry_run=dry_run, strict=strict), True
        if subresource == "scale":
            return scale.write_scale(
                self, rtype, namespace, name, patch_type, document, dry_run=dry_run
            ), False
        current = self.get(rtype, namespace, name)
        new = checked_body(rtype, patching.apply_patch(patch_type, current, document, custom=rtype.custom))
        # endpoints/handlers/patch.go checks the patched object's name and namespace (checkName).
        patched_name, patched_namespace = new["metadata"].get("name") or "", new["metadata"].get("namespace")
        if patched_name != name:
            raise bad_request(
                f"the name of the object ({patched_name}) does not match the name on the URL ({name})"
            )
        if namespace and patched_namespace not in (None, "", namespace):
            raise bad_request(
                f"the namespace of the object ({patched_namespace}) does not match the namespace on the request "
                f"({namespace})"
            )
        return self.write(rtype, current, new, subresource=subresource, dry_run=dry_run, strict=strict), False

    def write(
        self,
        rtype: ResourceType,
        current: dict[str, Any],
        new: dict[str, Any],
        *,
        subresource: str | None = None,
        dry_run: bool = False,
        strict: bool = False,
    ) -> dict[str, Any]:
        """Replace `current` with (the allowed part of) `new`: the single path of every update."""
        current_meta = current["metadata"]
        if new["metadata"].get("resourceVersion") not in (None, "", current_meta["resourceVersion"]):
            raise conflict(rtype.plural, rtype.group, current_meta["name"])
        new_uid = new["metadata"].get("uid")
        if new_uid and new_uid != current_meta["uid"]:  # ValidateObjectMetaUpdate
            cause = Cause(
                "metadata.uid", "FieldValueInvalid", f'Invalid value: "{new_uid}": field is immutable'
            )
            raise invalid(rtype.kind, rtype.group, current_meta["name"], [cause])
        if subresource == "status":
            result = {k: v for k, v in copy.deepcopy(current).items() if k != "status"}
            if "status" in new:
                result["status"] = new["status"]
        else:
            result = self._merge_server_fields(rtype, current, new)
        result["metadata"]["resourceVersion"] = current_meta["resourceVersion"]
        result["metadata"].pop("managedFields", None)
        result = admit(rtype, result, current, strict=strict)
        if (
            _has_generation(rtype)
            and (subresource != "status" or not rtype.has_status)
            and _generation_part(rtype, result) != _generation_part(rtype, current)
        ):
            result["metadata"]["generation"] = current_meta.get("generation", 0) + 1
        if result == current or dry_run:
            return result
        if (
            current_meta.get("deletionTimestamp")
            and not result["metadata"].get("finalizers")
            and not current_meta.get("deletionGracePeriodSeconds")
        ):
            return deletion.remove(self, rtype.storage, result, deletion.DeleteOptions())
        self.commit(rtype.storage, result, "MODIFIED", current)
        if rtype.storage == CRD_STORAGE:
            self.registry.register_crd(result)
        return result

    def _merge_server_fields(
        self, rtype: ResourceType, current: dict[str, Any], new: dict[str, Any]
    ) -> dict[str, Any]:
        """`new` with the fields a client may not change through the main endpoint taken from `current`."""
        current_meta, meta = current["metadata"], new["metadata"]
        for key in ("name", "namespace", *_SERVER_METADATA):
            if key in current_meta:
                meta[key] = current_meta[key]
            else:
                meta.pop(key, None)
        if rtype.storage == NAMESPACES:  # namespaceStrategy.PrepareForUpdate: spec.finalizers via /finalize
            new["spec"] = {**(new.get("spec") or {})}
            new["spec"].pop("finalizers", None)
            if (current.get("spec") or {}).get("finalizers"):
                new["spec"]["finalizers"] = current["spec"]["finalizers"]
        if rtype.has_status:
            new.pop("status", None)
            if "status" in current:
                new["status"] = copy.deepcopy(current["status"])
        if current_meta.get("deletionTimestamp"):
            added = sorted(set(meta.get("finalizers") or ()) - set(current_meta.get("finalizers") or ()))
            if added:
                message = f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers {added}"
                cause = Cause("metadata.finalizers", "FieldValueForbidden", message)
                raise invalid(rtype.kind, rtype.group, current_meta["name"], [cause])
        return new

    def commit(
        self, storage: tuple[str, str], obj: dict[str, Any], kind: str, old: dict[str, Any] | None
    ) -> None:
        """Store (or, for DELETED, drop) `obj` under a new resourceVersion and publish the change."""
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        key = _key(obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if kind == "DELETED":
            self.objects[storage].pop(key, None)
        else:
            self.objects[storage][key] = obj
        self.hub.publish(Change(self.rv, storage, kind, obj, old))

    def compact(self) -> None:
        self.hub.compact(self.rv)
