"""The shared types the published custom resource schemas point at, under kube-apiserver's definition names:
meta/v1's ObjectMeta and ListMeta (with what they refer to: Time, FieldsV1, ManagedFieldsEntry,
OwnerReference), Status, DeleteOptions and Patch, and autoscaling/v1's Scale. Their fields are the
Kubernetes 1.32 types' fields, with their JSON types and formats; the descriptions are short ones of this
server's. Built-in kinds themselves (Pod, ConfigMap, ...) have no schema here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

META = "io.k8s.apimachinery.pkg.apis.meta.v1."
SCALE = "io.k8s.api.autoscaling.v1.Scale"

Ref = Callable[[str], str]  # a definition name -> its `$ref` in the document being built


def _string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


def _integer(description: str, fmt: str = "int64") -> dict[str, Any]:
    return {"type": "integer", "format": fmt, "description": description}


def _boolean(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description}


def _strings_map(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": {"type": "string", "default": ""},
        "description": description,
    }


def referring(ref: Ref, name: str, description: str, *, v3: bool) -> dict[str, Any]:
    """A field whose type is another definition: in OpenAPI v3 a `$ref` takes no siblings, so it is
    wrapped in `allOf`, as kube-openapi writes it; v2 keeps the description beside the `$ref`."""
    if v3:
        return {"allOf": [{"$ref": ref(name)}], "description": description}
    return {"$ref": ref(name), "description": description}


def type_meta() -> dict[str, dict[str, Any]]:
    return {
        "apiVersion": _string(
            "The versioned schema this object is written in (group/version, or v1 for core)."
        ),
        "kind": _string("The kind of object this is, in CamelCase."),
    }


def definitions(ref: Ref, *, v3: bool) -> dict[str, dict[str, Any]]:
    """Every shared definition, by name."""

    def to(name: str, description: str) -> dict[str, Any]:
        return referring(ref, name, description, v3=v3)

    def array_of(name: str, description: str, **extra: Any) -> dict[str, Any]:
        return {"type": "array", "items": {"$ref": ref(name)}, "description": description, **extra}

    time = META + "Time"
    object_meta = {
        "description": "The metadata every persisted object has: its name, namespace, labels, owners and more.",
        "type": "object",
        "properties": {
            "annotations": _strings_map("Unstructured key/value data kept with the object."),
            "creationTimestamp": to(time, "When the server created the object. Set by the server."),
            "deletionGracePeriodSeconds": _integer(
                "Seconds the object is given to stop before it is removed."
            ),
            "deletionTimestamp": to(time, "When the object is to be deleted. Set by the server on delete."),
            "finalizers": {
                "type": "array",
                "items": {"type": "string", "default": ""},
                "description": "What must happen before the object is removed from storage.",
                "x-kubernetes-list-type": "set",
                "x-kubernetes-patch-strategy": "merge",
            },
            "generateName": _string(
                "A prefix the server completes into a unique name when no name is given."
            ),
            "generation": _integer("A sequence number of the desired state's versions. Set by the server."),
            "labels": _strings_map("Key/value pairs that selectors match."),
            "managedFields": array_of(
                META + "ManagedFieldsEntry",
                "Which field managers set which fields.",
                **{"x-kubernetes-list-type": "atomic"},
            ),
            "name": _string("Unique within a namespace; cannot be changed."),
            "namespace": _string("The namespace the object lives in; empty for cluster-scoped objects."),
            "ownerReferences": array_of(
                META + "OwnerReference",
                "The objects this one depends on; it is garbage-collected when all of them are gone.",
                **{
                    "x-kubernetes-list-map-keys": ["uid"],
                    "x-kubernetes-list-type": "map",
                    "x-kubernetes-patch-merge-key": "uid",
                    "x-kubernetes-patch-strategy": "merge",
                },
            ),
            "resourceVersion": _string(
                "An opaque version of the object, for optimistic concurrency and watches."
            ),
            "selfLink": _string("Deprecated and not set."),
            "uid": _string("Unique in time and space for this object. Set by the server."),
        },
    }
    defs: dict[str, dict[str, Any]] = {
        META + "ObjectMeta": object_meta,
        META + "ListMeta": {
            "description": "The metadata of a list: its resourceVersion and the token to continue it.",
            "type": "object",
            "properties": {
                "continue": _string("Set when the list was cut short: pass it to get the rest."),
                "remainingItemCount": _integer("How many items the rest of the list holds, when known."),
                "resourceVersion": _string("The version of the collection the list was read at."),
                "selfLink": _string("Deprecated and not set."),
            },
        },
        time: {"description": "A time, written in RFC 3339 form.", "type": "string", "format": "date-time"},
        META + "FieldsV1": {
            "description": "A set of fields, in the structured-merge-diff encoding.",
            "type": "object",
        },
        META + "ManagedFieldsEntry": {
            "description": "The fields one manager set through one operation.",
            "type": "object",
            "properties": {
                "apiVersion": _string("The version of the object the fields are named in."),
                "fieldsType": _string('The encoding of fieldsV1; only "FieldsV1".'),
                "fieldsV1": to(META + "FieldsV1", "The set of fields."),
                "manager": _string("The field manager."),
                "operation": _string('The operation: "Apply" or "Update".'),
                "subresource": _string("The subresource written through, if any."),
                "time": to(time, "When the fields were last changed."),
            },
        },
        META + "OwnerReference": {
            "description": "An object this one depends on; it must be in the same namespace, or cluster-scoped.",
            "type": "object",
            "required": ["apiVersion", "kind", "name", "uid"],
            "properties": {
                "apiVersion": _string("The owner's API version."),
                "blockOwnerDeletion": _boolean(
                    "Whether foreground deletion of the owner waits for this object."
                ),
                "controller": _boolean("Whether the owner is this object's managing controller."),
                "kind": _string("The owner's kind."),
                "name": _string("The owner's name."),
                "uid": _string("The owner's uid."),
            },
            "x-kubernetes-map-type": "atomic",
        },
        META + "Status": {
            "description": "The answer of a call that returns no object, and of every failed call.",
            "type": "object",
            "properties": {
                **type_meta(),
                "code": _integer("The HTTP status code.", "int32"),
                "details": to(META + "StatusDetails", "More about the failure or success, by reason."),
                "message": _string("A description of the status."),
                "metadata": to(META + "ListMeta", "Standard list metadata."),
                "reason": _string("A machine-readable reason for a failure, e.g. NotFound."),
                "status": _string('"Success" or "Failure".'),
            },
            "x-kubernetes-group-version-kind": [{"group": "", "kind": "Status", "version": "v1"}],
        },
        META + "StatusDetails": {
            "description": "What a Status is about.",
            "type": "object",
            "properties": {
                "causes": array_of(
                    META + "StatusCause",
                    "The causes of the failure, field by field.",
                    **{"x-kubernetes-list-type": "atomic"},
                ),
                "group": _string("The group of the resource."),
                "kind": _string("The kind of the resource."),
                "name": _string("The name of the object."),
                "retryAfterSeconds": _integer("Seconds to wait before trying again.", "int32"),
                "uid": _string("The uid of the object."),
            },
        },
        META + "StatusCause": {
            "description": "One cause of a failure.",
            "type": "object",
            "properties": {
                "field": _string("The field the cause is about, as a path."),
                "message": _string("A description of the cause."),
                "reason": _string("A machine-readable reason."),
            },
        },
        META + "DeleteOptions": {
            "description": "Options of a DELETE, in its body or its query.",
            "type": "object",
            "properties": {
                **type_meta(),
                "dryRun": {
                    "type": "array",
                    "items": {"type": "string", "default": ""},
                    "description": 'Only "All": answer as the delete would, and change nothing.',
                    "x-kubernetes-list-type": "atomic",
                },
                "gracePeriodSeconds": _integer("Seconds the object is given to stop; 0 deletes it at once."),
                "ignoreStoreReadErrorWithClusterBreakingPotential": _boolean(
                    "Delete an object that cannot be read from storage (not modelled here)."
                ),
                "orphanDependents": _boolean("Deprecated: use propagationPolicy Orphan."),
                "preconditions": to(META + "Preconditions", "What must hold for the delete to proceed."),
                "propagationPolicy": _string('How dependents go: "Orphan", "Background" or "Foreground".'),
            },
        },
        META + "Preconditions": {
            "description": "Conditions a delete checks before it proceeds.",
            "type": "object",
            "properties": {
                "resourceVersion": _string("The resourceVersion the object must have."),
                "uid": _string("The uid the object must have."),
            },
        },
        META + "Patch": {"description": "A patch, in the request's patch content type.", "type": "object"},
        SCALE: {
            "description": "The scale subresource: desired and observed replicas.",
            "type": "object",
            "properties": {
                **type_meta(),
                "metadata": to(META + "ObjectMeta", "Standard object metadata."),
                "spec": to(SCALE + "Spec", "The desired scale."),
                "status": to(SCALE + "Status", "The observed scale."),
            },
            "x-kubernetes-group-version-kind": [{"group": "autoscaling", "kind": "Scale", "version": "v1"}],
        },
        SCALE + "Spec": {
            "description": "The desired scale.",
            "type": "object",
            "properties": {"replicas": _integer("The desired number of replicas.", "int32")},
        },
        SCALE + "Status": {
            "description": "The observed scale.",
            "type": "object",
            "required": ["replicas"],
            "properties": {
                "replicas": _integer("The observed number of replicas.", "int32"),
                "selector": _string("The label selector of the replicas, in its string form."),
            },
        },
    }
    return defs
