"""A skeleton OpenAPI v3 document: just enough for kubectl to trust the server with validation.

Before `kubectl apply`/`create` sends an object, kubectl looks in `/openapi/v3` for the object's PATCH
operation and its `fieldValidation` query parameter. Found, it leaves validation to the server (and
sends `fieldValidation=Strict`); not found, it validates on the client against `/openapi/v2` and fails
when that is missing. So every served kind gets one PATCH operation here, tagged with its
group/version/kind, and nothing else: no schemas. The request bodies list no strategic merge patch, so
kubectl computes built-in patches from its compiled-in types and uses JSON merge patches for custom
resources. `/openapi/v2` stays a 404, and `kubectl explain` has nothing to show.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .registry import Registry
from .resources import ResourceType

_PATCH_TYPES = ("application/json-patch+json", "application/merge-patch+json", "application/apply-patch+yaml")


def _prefix(group: str, version: str) -> str:
    return f"api/{version}" if not group else f"apis/{group}/{version}"


def _patch_path(rtype: ResourceType) -> tuple[str, dict[str, Any]]:
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


def group_version_document(registry: Registry, group: str, version: str) -> dict[str, Any] | None:
    types = registry.in_group_version(group, version)
    if not types:
        return None
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.32.0"},
        "paths": dict(_patch_path(rtype) for rtype in types),
        "components": {"schemas": {}},
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


def document(registry: Registry, rest: list[str]) -> dict[str, Any] | None:
    """The document at `/openapi/v3/<rest>`, if there is one."""
    if not rest:
        return root_document(registry)
    if rest[0] == "api" and len(rest) == 2:
        return group_version_document(registry, "", rest[1])
    if rest[0] == "apis" and len(rest) == 3:
        return group_version_document(registry, rest[1], rest[2])
    return None
