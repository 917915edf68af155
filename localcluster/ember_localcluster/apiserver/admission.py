"""What the server checks and fills in before an object is stored: the body, the name, kind rules.

* The body must be an object whose apiVersion/kind (when given) match the URL.
* Names are checked as ValidateObjectMeta checks them, with kube-apiserver's messages: RFC 1123
  subdomains, RFC 1123 labels for Namespaces, DNS-1035 labels for Services, path segments for RBAC
  objects; `generateName` gets five random lowercase alphanumerics, as in Kubernetes. Label keys and
  values as ValidateLabels checks them; annotations as ValidateAnnotations does (keys qualified names
  once lower-cased, keys and values together at most 256 KiB).
* Custom resources are pruned, defaulted and validated against their CRD's schema (`schema.py`).
* CRDs are checked enough to be registered and get `Established`/`NamesAccepted` conditions.
* Pods' tolerations, nodeSelector, topology spread constraints and pod affinity terms' topology keys and
  weights are checked as kube-apiserver checks them (`podspec.py`), and a
  Pod's spec is immutable but for a few fields; Deployment and ReplicaSet selectors (`updates.py`).
* New Pods are admitted as kube-apiserver's ServiceAccount, Priority and RuntimeClass plugins admit them:
  what they name must exist (403 Forbidden with each plugin's message), and they get
  `serviceAccountName`, `priority` and `preemptionPolicy` filled in; DefaultTolerationSeconds adds
  tolerations of the `node.kubernetes.io/not-ready` and `unreachable` NoExecute taints for 300 s.
* New Pods start `Pending` and new Namespaces `Active`, since no controller here would set that;
  Services get core/v1's default `type: ClusterIP`; a Pod's containers and init containers get their
  limits as the requests they do not name (SetDefaults_Pod).
"""

from __future__ import annotations

import copy
import json
import secrets
import string
from collections.abc import Mapping
from typing import Any

from ember_operator.labels import (
    dns_1035_errors,
    dns_label_errors,
    label_key_errors,
    path_segment_errors,
    subdomain_errors,
)

from . import schema
from .errors import APIError, Cause, bad_request, invalid, invalid_value, strict_decoding
from .podspec import label_causes, pod_spec_causes
from .quantities import canonicalize
from .resources import ResourceType, crd_causes
from .updates import WORKLOADS, pod_update_causes, workload_causes

CRD_STORAGE = ("apiextensions.k8s.io", "customresourcedefinitions")
NAMESPACES = ("", "namespaces")
PODS = ("", "pods")
SERVICES = ("", "services")
SERVICE_ACCOUNTS = ("", "serviceaccounts")
PRIORITY_CLASSES = ("scheduling.k8s.io", "priorityclasses")
RUNTIME_CLASSES = ("node.k8s.io", "runtimeclasses")
PREEMPT_LOWER_PRIORITY = "PreemptLowerPriority"
MIRROR_POD_ANNOTATION = "kubernetes.io/config.mirror"
ANNOTATIONS_MAX_BYTES = 256 * 1024  # apimachinery's TotalAnnotationSizeLimitB

# The store's objects: storage (group, plural) → (namespace or "", name) → object.
Objects = Mapping[tuple[str, str], Mapping[tuple[str, str], dict[str, Any]]]

_NAME_CHARS = string.ascii_lowercase + string.digits
_OWNER_FIELDS = ("apiVersion", "kind", "name", "uid")
# meta/v1 ObjectMeta's fields.
_OBJECT_META = frozenset(
    (
        "name",
        "generateName",
        "namespace",
        "selfLink",
        "uid",
        "resourceVersion",
        "generation",
        "creationTimestamp",
        "deletionTimestamp",
        "deletionGracePeriodSeconds",
        "labels",
        "annotations",
        "ownerReferences",
        "finalizers",
        "managedFields",
    )
)

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # every namespace is labelled with its name


def checked_body(rtype: ResourceType, body: Any) -> dict[str, Any]:
    """A private copy of a request body, with apiVersion and kind filled in."""
    if not isinstance(body, dict) or not isinstance(body.get("metadata", {}), dict):
        raise bad_request(f"the body of the request is not a valid {rtype.kind} object")
    for key, expected in (("apiVersion", rtype.api_version), ("kind", rtype.kind)):
        if body.get(key) not in (None, "", expected):
            raise bad_request(
                f"the {key} in the data ({body[key]}) does not match the expected {key} ({expected})"
            )
    if not rtype.custom:
        for key in ("spec", "status"):
            if body.get(key) is not None and not isinstance(body[key], dict):
                raise bad_request(
                    f"cannot unmarshal {type(body[key]).__name__} into Go struct field {rtype.kind}.{key}"
                )
    obj = copy.deepcopy(body)
    obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
    obj.setdefault("metadata", {})
    return obj


def generated_name(prefix: str) -> str:
    return prefix + "".join(secrets.choice(_NAME_CHARS) for _ in range(5))


def check_name(rtype: ResourceType, name: Any) -> None:
    """ValidateObjectMeta's name check with the kind's name function, and its messages."""
    if not name:
        cause = Cause(
            "metadata.name", "FieldValueRequired", "Required value: name or generateName is required"
        )
        raise invalid(rtype.kind, rtype.group, "", [cause])
    if not isinstance(name, str):  # a decoding error
        version = rtype.api_version.split("/")[-1]
        raise bad_request(
            f'{rtype.kind} in version "{version}" cannot be handled as a {rtype.kind}: json: cannot unmarshal '
            f"{_json_type(name)} into Go struct field ObjectMeta.metadata.name of type string"
        )
    if rtype.storage == NAMESPACES:
        errors = dns_label_errors(name)
    elif rtype.storage == SERVICES:
        errors = dns_1035_errors(name)
    elif rtype.group == "rbac.authorization.k8s.io":
        errors = path_segment_errors(name)
    else:
        errors = subdomain_errors(name)
    if errors:
        causes = [
            Cause("metadata.name", "FieldValueInvalid", f"Invalid value: {json.dumps(name)}: {e}")
            for e in errors
        ]
        raise invalid(rtype.kind, rtype.group, name, causes)


def _kind_causes(rtype: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None) -> list[Cause]:
    if rtype.storage == PODS:
        return pod_spec_causes(obj.get("spec")) + (pod_update_causes(old, obj) if old is not None else [])
    if rtype.storage in WORKLOADS:
        return workload_causes(obj, old)
    return []


def _json_type(value: Any) -> str:
    return {bool: "bool", int: "number", float: "number", list: "array", dict: "object"}.get(
        type(value), "string"
    )


def admit(
    rtype: ResourceType,
    obj: dict[str, Any],
    old: dict[str, Any] | None,
    *,
    strict: bool = False,
    objects: Objects | None = None,
) -> dict[str, Any]:
    """The object as it would be stored; `strict` (fieldValidation=Strict) refuses unknown fields.
    `objects` (the store's, by storage and (namespace, name)) is what a new Pod's references resolve in."""
    name = obj["metadata"]["name"]
    # Decoding into ObjectMeta: unknown fields dropped, or refused when Strict (for a custom resource in
    # one error with those pruning drops, metadata's first, each part sorted).
    unknown = sorted(k for k in obj["metadata"] if k not in _OBJECT_META)
    for key in unknown:
        del obj["metadata"][key]
    unknown_paths = [f"metadata.{key}" for key in unknown]
    custom_schema = rtype.schema if rtype.custom else None
    if strict and unknown_paths and custom_schema is None:
        raise strict_decoding(unknown_paths)
    causes = _metadata_causes(obj["metadata"])
    if causes:
        raise invalid(rtype.kind, rtype.group, name, causes)
    if custom_schema is not None:
        normalized, pruned = schema.normalize(obj, custom_schema)
        if strict and (unknown_paths or pruned):
            raise strict_decoding(unknown_paths + sorted(pruned))
        causes = schema.validate(normalized, old, custom_schema)
        if causes:
            raise invalid(rtype.kind, rtype.group, name, causes)
        return normalized
    canonicalize(rtype, obj)
    if rtype.storage == PODS:
        _default_requests(obj.get("spec"))
        if old is None and objects is not None and isinstance(obj.get("spec"), dict):
            _admit_new_pod(obj, objects)
    if rtype.storage == PRIORITY_CLASSES:  # SetDefaults_PriorityClass
        obj.setdefault("preemptionPolicy", PREEMPT_LOWER_PRIORITY)
    causes = _kind_causes(rtype, obj, old)
    if causes:
        raise invalid(rtype.kind, rtype.group, name, causes)
    if rtype.storage == NAMESPACES:  # SetDefaults_Namespace: on every write, whatever it says
        obj["metadata"]["labels"] = {**(obj["metadata"].get("labels") or {}), NAMESPACE_NAME_LABEL: name}
    if rtype.storage == CRD_STORAGE:
        causes = crd_causes(obj)
        if causes:
            raise invalid(rtype.kind, rtype.group, name, causes)
        obj["status"] = _crd_status(obj)
    elif old is None and rtype.storage == PODS:
        obj["status"] = {"phase": "Pending"}
    elif old is None and rtype.storage == NAMESPACES:  # namespaceStrategy.PrepareForCreate
        obj["status"] = {"phase": "Active"}
        spec = obj["spec"] = obj.get("spec") or {}
        if "kubernetes" not in (spec.get("finalizers") or []):
            spec["finalizers"] = [*(spec.get("finalizers") or []), "kubernetes"]
    elif rtype.storage == SERVICES and isinstance(obj.get("spec"), dict):
        obj["spec"].setdefault("type", "ClusterIP")  # core/v1 defaulting (SetDefaults_Service)
    return obj


def _default_requests(spec: Any) -> None:
    """core/v1 SetDefaults_Pod: each container's and init container's limits fill in the requests it does
    not name (a Pod's only, not a template's)."""
    if not isinstance(spec, dict):
        return
    for key in ("containers", "initContainers"):
        for container in spec.get(key) or []:
            resources = container.get("resources") if isinstance(container, dict) else None
            if (
                isinstance(resources, dict)
                and isinstance(resources.get("limits"), dict)
                and resources["limits"]
            ):
                requests = resources.get("requests")
                requests = resources["requests"] = requests if isinstance(requests, dict) else {}
                for name, value in resources["limits"].items():
                    requests.setdefault(name, value)


def _admit_new_pod(pod: dict[str, Any], objects: Objects) -> None:
    """The mutating admission plugins of kube-apiserver that resolve what a new Pod names, in their order,
    each refusing it with 403 Forbidden and the plugin's message: ServiceAccount (the account, `default`
    when none is named, must exist), Priority (`spec.priority` and `spec.preemptionPolicy` from the
    PriorityClass named, else from the global default one, else 0 and PreemptLowerPriority; a pod that
    sets other values is refused) and RuntimeClass (the class named must exist)."""
    meta, spec = pod["metadata"], pod["spec"]
    name, namespace = str(meta["name"]), str(meta["namespace"])

    def forbidden(message: str) -> APIError:
        return APIError(
            403, "Forbidden", f'pods "{name}" is forbidden: {message}', {"name": name, "kind": "pods"}
        )

    if MIRROR_POD_ANNOTATION not in (meta.get("annotations") or {}):
        account = spec.get("serviceAccountName") or spec.get("serviceAccount") or "default"
        spec["serviceAccountName"] = spec["serviceAccount"] = account  # v1 keeps the deprecated name too
        if (namespace, account) not in objects[SERVICE_ACCOUNTS]:
            raise forbidden(
                f'error looking up service account {namespace}/{account}: serviceaccount "{account}" not found'
            )

    class_name = spec.get("priorityClassName")
    if class_name:
        priority_class = objects[PRIORITY_CLASSES].get(("", class_name))
        if priority_class is None:
            raise forbidden(f"no PriorityClass with name {class_name} was found")
    else:  # the global default with the lowest value, if any
        defaults = [pc for pc in objects[PRIORITY_CLASSES].values() if pc.get("globalDefault")]
        priority_class = min(defaults, key=lambda pc: pc.get("value", 0)) if defaults else None
        if priority_class is not None:
            spec["priorityClassName"] = priority_class["metadata"]["name"]
    priority = priority_class.get("value", 0) if priority_class is not None else 0
    policy = priority_class.get("preemptionPolicy") if priority_class is not None else None
    policy = policy or PREEMPT_LOWER_PRIORITY
    if spec.get("priority") is not None and spec["priority"] != priority:
        raise forbidden(
            f"the integer value of priority ({spec['priority']}) must not be provided in pod spec; priority "
            f"admission controller computed {priority} from the given PriorityClass name"
        )
    if spec.get("preemptionPolicy") is not None and spec["preemptionPolicy"] != policy:
        raise forbidden(
            f"the string value of PreemptionPolicy ({spec['preemptionPolicy']}) must not be provided in pod "
            f"spec; priority admission controller computed {policy} from the given PriorityClass name"
        )
    spec["priority"], spec["preemptionPolicy"] = priority, policy

    _default_toleration_seconds(spec)

    runtime_class = spec.get("runtimeClassName")
    if runtime_class and ("", runtime_class) not in objects[RUNTIME_CLASSES]:
        raise forbidden(f'pod rejected: RuntimeClass "{runtime_class}" not found')


NOT_READY_TAINT = "node.kubernetes.io/not-ready"
UNREACHABLE_TAINT = "node.kubernetes.io/unreachable"
DEFAULT_TOLERATION_SECONDS = 300  # --default-not-ready-toleration-seconds, --default-unreachable-...


def _default_toleration_seconds(spec: dict[str, Any]) -> None:
    """The DefaultTolerationSeconds plugin: a pod that does not tolerate the not-ready or the unreachable
    NoExecute taint (a toleration with that key or none, and effect NoExecute or none) gets a toleration
    of it for 300 s, so taint eviction moves it 5 minutes after its node is lost."""
    tolerations = spec.get("tolerations")
    tolerations = tolerations if isinstance(tolerations, list) else []
    for key in (NOT_READY_TAINT, UNREACHABLE_TAINT):
        if not any(
            isinstance(t, dict) and t.get("key", "") in (key, "") and t.get("effect", "") in ("NoExecute", "")
            for t in tolerations
        ):
            tolerations.append(
                {
                    "key": key,
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": DEFAULT_TOLERATION_SECONDS,
                }
            )
    if tolerations:
        spec["tolerations"] = tolerations


def _annotation_causes(annotations: dict[str, str]) -> list[Cause]:
    """ValidateAnnotations: each key a qualified name once lower-cased (the key shown as written), and
    keys and values together at most TotalAnnotationSizeLimitB bytes."""
    causes = [
        invalid_value("metadata.annotations", json.dumps(key), message)
        for key in annotations
        for message in label_key_errors(key.lower())
    ]
    size = sum(len(key.encode()) + len(value.encode()) for key, value in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        message = f"Too long: may not be more than {ANNOTATIONS_MAX_BYTES} bytes"
        causes.append(Cause("metadata.annotations", "FieldValueTooLong", message))
    return causes


def _metadata_causes(meta: dict[str, Any]) -> list[Cause]:
    """The shapes the rest of the server relies on (selectors, finalizers, garbage collection)."""
    causes = []
    for key in ("labels", "annotations"):
        value = meta.get(key)
        if value is not None and not (
            isinstance(value, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
        ):
            causes.append(
                Cause(
                    f"metadata.{key}",
                    "FieldValueInvalid",
                    "Invalid value: must be a map of strings to strings",
                )
            )
    if not causes and isinstance(meta.get("labels"), dict):
        causes += label_causes(meta["labels"], "metadata.labels")
    if not causes and isinstance(meta.get("annotations"), dict):
        causes += _annotation_causes(meta["annotations"])
    finalizers = meta.get("finalizers")
    if finalizers is not None and not (
        isinstance(finalizers, list) and all(isinstance(f, str) for f in finalizers)
    ):
        causes.append(
            Cause("metadata.finalizers", "FieldValueInvalid", "Invalid value: must be a list of strings")
        )
    references = meta.get("ownerReferences")
    if references is not None and not (
        isinstance(references, list)
        and all(
            isinstance(ref, dict) and all(isinstance(ref.get(k), str) for k in _OWNER_FIELDS)
            for ref in references
        )
    ):
        needed = ", ".join(_OWNER_FIELDS)
        causes.append(
            Cause(
                "metadata.ownerReferences",
                "FieldValueInvalid",
                f"Invalid value: each reference needs {needed}",
            )
        )
    return causes


def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
    spec = crd["spec"]
    conditions = [
        {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastTransitionTime": crd["metadata"]["creationTimestamp"],
        }
        for kind, reason, message in (
            ("NamesAccepted", "NoConflicts", "no conflicts found"),
            ("Established", "InitialNamesAccepted", "the initial names have been accepted"),
        )
    ]
    stored = [v["name"] for v in spec["versions"] if v.get("storage")]
    return {"conditions": conditions, "acceptedNames": spec["names"], "storedVersions": stored}
