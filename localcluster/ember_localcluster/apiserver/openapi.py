"""The OpenAPI documents: `/openapi/v3` (its index, and one document per group/version) and `/openapi/v2`.

Custom resources are published as kube-apiserver publishes them: each served version's schema and list
schema under `components.schemas` (v3) or `definitions` (v2), built by `openapi_crd.py`, with the meta/v1
types they point at (`openapi_meta.py`), and their paths with every operation (list, create, delete
collection, read, replace, delete and patch, and those of `/status` and `/scale` where the version has
them), each tagged `x-kubernetes-action` and `x-kubernetes-group-version-kind`. So `kubectl explain` works
on them, and CRDs created or deleted at run time appear or go at the next request.

Built-in kinds have no schema here (none of upstream's is bundled), so `kubectl explain pods` fails; each
gets, in its v3 document only, its PATCH operation with the `fieldValidation` parameter, which is what
kubectl looks for before it leaves validation to the server (sending `fieldValidation=Strict`) rather than
validating on the client. No operation lists a strategic merge patch, so kubectl computes built-in patches
from its compiled-in types and JSON merge patches for custom resources.

Both are JSON only: a request whose Accept names neither JSON nor a wildcard (client-go asks for v2 as
protobuf, `application/com.github.proto-openapi.spec.v2@v1.0+protobuf`) gets 406 Not Acceptable, as
kube-openapi answers a type it cannot produce.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from . import openapi_crd
from .openapi_meta import META, SCALE, definitions
from .registry import Registry
from .resources import ResourceType

_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml")
_BODY_TYPES = ("application/json", "application/yaml")
_QUERY = {
    "get": ("resourceVersion",),
    "list": (
        "allowWatchBookmarks",
        "continue",
        "fieldSelector",
        "labelSelector",
        "limit",
        "resourceVersion",
        "resourceVersionMatch",
        "sendInitialEvents",
        "timeoutSeconds",
        "watch",
    ),
    "post": ("dryRun", "fieldManager", "fieldValidation"),
    "put": ("dryRun", "fieldManager", "fieldValidation"),
    "patch": ("dryRun", "fieldManager", "fieldValidation", "force"),
    "delete": ("dryRun", "gracePeriodSeconds", "orphanDependents", "propagationPolicy"),
    "deletecollection": (
        "continue",
        "dryRun",
        "fieldSelector",
        "gracePeriodSeconds",
        "labelSelector",
        "limit",
        "orphanDependents",
        "propagationPolicy",
        "resourceVersion",
        "resourceVersionMatch",
        "sendInitialEvents",
        "timeoutSeconds",
    ),
}
_INTEGER_QUERY = ("gracePeriodSeconds", "limit", "timeoutSeconds")
_BOOLEAN_QUERY = ("allowWatchBookmarks", "force", "orphanDependents", "sendInitialEvents", "watch")


def _prefix(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def _v3_ref(name: str) -> str:
    return f"#/components/schemas/{name}"


def _v2_ref(name: str) -> str:
    return f"#/definitions/{name}"


def _query_type(name: str) -> str:
    return "integer" if name in _INTEGER_QUERY else "boolean" if name in _BOOLEAN_QUERY else "string"


def _operation(
    rtype: ResourceType,
    action: str,
    operation_id: str,
    *,
    v3: bool,
    path_params: tuple[str, ...],
    body: str | None,
    answer: str,
    extra_codes: tuple[str, ...] = (),
) -> dict[str, Any]:
    """One operation of a custom resource's path, in v3's or v2's shape."""
    ref = _v3_ref if v3 else _v2_ref
    media = _PATCH_TYPES if action == "patch" else _BODY_TYPES
    params: list[dict[str, Any]] = []
    for name in path_params:
        described = "the object's name" if name == "name" else "the namespace"
        param = {"name": name, "in": "path", "required": True, "description": described}
        params.append({**param, "schema": {"type": "string"}} if v3 else {**param, "type": "string"})
    for name in _QUERY[action]:
        param = {"name": name, "in": "query"}
        kind = _query_type(name)
        params.append(
            {**param, "schema": {"type": kind, "uniqueItems": True}} if v3 else {**param, "type": kind}
        )
    operation: dict[str, Any] = {"operationId": operation_id, "parameters": params}
    codes = ("200", *extra_codes)
    if v3:
        if body is not None:
            content = {m: {"schema": {"$ref": ref(body)}} for m in media}
            operation["requestBody"] = {"content": content, "required": action != "delete"}
        content = {m: {"schema": {"$ref": ref(answer)}} for m in _BODY_TYPES}
        operation["responses"] = {code: {"description": "OK", "content": content} for code in codes}
    else:
        operation["consumes"] = list(media)
        operation["produces"] = list(_BODY_TYPES)
        if body is not None:
            body_param = {"name": "body", "in": "body", "required": action != "delete"}
            params.append({**body_param, "schema": {"$ref": ref(body)}})
        operation["responses"] = {
            code: {"description": "OK", "schema": {"$ref": ref(answer)}} for code in codes
        }
    operation["x-kubernetes-action"] = action
    operation["x-kubernetes-group-version-kind"] = openapi_crd.gvk(rtype, rtype.kind)[0]
    return operation


def _custom_paths(rtype: ResourceType, *, v3: bool) -> dict[str, dict[str, Any]]:
    """kube-apiserver's routes of one custom resource version."""
    kind, status = rtype.kind, META + "Status"
    one, many = openapi_crd.definition_name(rtype, kind), openapi_crd.definition_name(rtype, rtype.list_kind)
    scoped = "Namespaced" if rtype.namespaced else ""
    base = f"/{_prefix(rtype.group, rtype.version)}"
    collection = (
        f"{base}/namespaces/{{namespace}}/{rtype.plural}" if rtype.namespaced else f"{base}/{rtype.plural}"
    )
    scope_params: tuple[str, ...] = ("namespace",) if rtype.namespaced else ()
    named = (*scope_params, "name")

    def op(
        action: str, verb: str, params: tuple[str, ...], body: str | None, answer: str, *codes: str
    ) -> Any:
        return _operation(
            rtype,
            action,
            f"{verb}{scoped}{kind}",
            v3=v3,
            path_params=params,
            body=body,
            answer=answer,
            extra_codes=codes,
        )

    paths: dict[str, dict[str, Any]] = {}
    if rtype.namespaced:
        every = _operation(
            rtype, "list", f"list{kind}ForAllNamespaces", v3=v3, path_params=(), body=None, answer=many
        )
        paths[f"{base}/{rtype.plural}"] = {"get": every}
    paths[collection] = {
        "get": op("list", "list", scope_params, None, many),
        "post": op("post", "create", scope_params, one, one, "201", "202"),
        "delete": op("deletecollection", "deletecollection", scope_params, META + "DeleteOptions", status),
    }
    paths[f"{collection}/{{name}}"] = {
        "get": op("get", "read", named, None, one),
        "put": op("put", "replace", named, one, one, "201"),
        "patch": op("patch", "patch", named, META + "Patch", one),
        "delete": op("delete", "delete", named, META + "DeleteOptions", status, "202"),
    }
    for sub, target in (("status", one), ("scale", SCALE)):
        if (sub == "status" and not rtype.has_status) or (sub == "scale" and rtype.scale is None):
            continue
        suffix = sub.capitalize()
        ops = {
            "get": _operation(
                rtype,
                "get",
                f"read{scoped}{kind}{suffix}",
                v3=v3,
                path_params=named,
                body=None,
                answer=target,
            ),
            "put": _operation(
                rtype,
                "put",
                f"replace{scoped}{kind}{suffix}",
                v3=v3,
                path_params=named,
                body=target,
                answer=target,
                extra_codes=("201",),
            ),
            "patch": _operation(
                rtype,
                "patch",
                f"patch{scoped}{kind}{suffix}",
                v3=v3,
                path_params=named,
                body=META + "Patch",
                answer=target,
            ),
        }
        paths[f"{collection}/{{name}}/{sub}"] = ops
    return paths


def _builtin_patch_path(rtype: ResourceType) -> tuple[str, dict[str, Any]]:
    scope = "namespaces/{namespace}/" if rtype.namespaced else ""
    path = f"/{_prefix(rtype.group, rtype.version)}/{scope}{rtype.plural}/{{name}}"
    operation = {
        "operationId": f"patch{rtype.kind}",
        "parameters": [
            {"name": name, "in": "query", "schema": {"type": "string", "uniqueItems": True}}
            for name in ("dryRun", "fieldManager", "fieldValidation")
        ],
        "requestBody": {
            "content": {media: {"schema": {"type": "object"}} for media in _PATCH_TYPES},
            "required": True,
        },
        "responses": {"200": {"description": "OK"}},
        "x-kubernetes-action": "patch",
        "x-kubernetes-group-version-kind": {
            "group": rtype.group,
            "version": rtype.version,
            "kind": rtype.kind,
        },
    }
    return path, {"patch": operation}


def _schemas(types: list[ResourceType], *, v3: bool) -> dict[str, dict[str, Any]]:
    ref = _v3_ref if v3 else _v2_ref
    schemas: dict[str, dict[str, Any]] = {}
    for rtype in types:
        schemas[openapi_crd.definition_name(rtype, rtype.kind)] = openapi_crd.kind_schema(rtype, ref, v3=v3)
        schemas[openapi_crd.definition_name(rtype, rtype.list_kind)] = openapi_crd.list_schema(
            rtype, ref, v3=v3
        )
    if schemas:
        schemas.update(definitions(ref, v3=v3))
    return dict(sorted(schemas.items()))


def group_version_document(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    paths: dict[str, Any] = {}
    for rtype in types:
        if rtype.custom:
            paths.update(_custom_paths(rtype, v3=True))
        else:
            path, operations = _builtin_patch_path(rtype)
            paths[path] = operations
    custom = [rtype for rtype in types if rtype.custom]
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.32.0"},
        "paths": paths,
        "components": {"schemas": _schemas(custom, v3=True)},
    }


def root_document(registry: Registry) -> dict[str, Any]:
    paths = {}
    for group, versions in registry.group_versions().items():
        for version in versions:
            document = group_version_document(registry, group, version)
            digest = hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16].upper()
            prefix = _prefix(group, version)
            paths[prefix] = {"serverRelativeURL": f"/openapi/v3/{prefix}?hash={digest}"}
    return {"paths": paths}


def v2_document(registry: Registry) -> dict[str, Any]:
    """`/openapi/v2`: one Swagger 2.0 document with every served custom resource version."""
    custom = [rtype for rtype in registry.types.values() if rtype.custom]
    paths: dict[str, Any] = {}
    for rtype in custom:
        paths.update(_custom_paths(rtype, v3=False))
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes", "version": "v1.32.0"},
        "paths": dict(sorted(paths.items())),
        "definitions": _schemas(custom, v3=False),
    }


def document(registry: Registry, rest: list[str]) -> dict[str, Any] | None:
    """The document at `/openapi/v3/<rest>`, if there is one."""
    if not rest:
        return root_document(registry)
    if rest[0] == "api" and len(rest) == 2:
        return group_version_document(registry, "", rest[1])
    if rest[0] == "apis" and len(rest) == 3:
        return group_version_document(registry, rest[1], rest[2])
    return None


def accepts_json(accept: str) -> bool:
    """Whether an Accept header lets the server answer JSON (an empty one does)."""
    if not accept.strip():
        return True
    for clause in accept.split(","):
        media = clause.split(";")[0].strip().lower()
        if media in ("application/json", "*/*", "application/*"):
            return True
    return False
