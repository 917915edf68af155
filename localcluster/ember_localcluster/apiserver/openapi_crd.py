"""A custom resource version's published schemas, as apiextensions-apiserver's OpenAPI builder makes them.

The kind's schema is the version's `openAPIV3Schema` with `x-kubernetes-int-or-string` unfolded into
`anyOf: [{type: integer}, {type: string}]` (where no `anyOf` is written), `apiVersion` and `kind` as
TypeMeta's, `metadata` pointing at meta/v1's ObjectMeta, and `x-kubernetes-group-version-kind`; its list
kind holds `items` of it and ListMeta. Definition names are REST-friendly: the group's parts reversed, then
version and kind (`dev.ember.v1alpha1.InferenceService`).

OpenAPI v2 cannot say all of that, so, as the builder's v2 conversion does: `allOf`, `anyOf`, `oneOf` and
`not` go; a nullable node loses its type, items and properties (and is no longer required by its parent);
a node that preserves unknown fields loses its items and properties, and its type when that is object; an
array without items loses its type. A root that preserves unknown fields is published in v2 as a bare
object.
"""

from __future__ import annotations

import copy
from typing import Any

from .openapi_meta import META, Ref, referring, type_meta
from .resources import ResourceType

_JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
_PRESERVE = "x-kubernetes-preserve-unknown-fields"


def definition_name(rtype: ResourceType, kind: str) -> str:
    return ".".join([*reversed(rtype.group.split(".")), rtype.version, kind])


def gvk(rtype: ResourceType, kind: str) -> list[dict[str, str]]:
    return [{"group": rtype.group, "kind": kind, "version": rtype.version}]


def _children(node: dict[str, Any]) -> list[dict[str, Any]]:
    found = list((node.get("properties") or {}).values())
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            found.append(node[key])
    return [child for child in found if isinstance(child, dict)]


def _unfold(node: dict[str, Any]) -> None:
    if node.get("x-kubernetes-int-or-string") and "anyOf" not in node:
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    for child in _children(node):
        _unfold(child)


def _to_v2(node: dict[str, Any]) -> None:
    for key in _JUNCTORS:
        node.pop(key, None)
    if node.pop("nullable", False):
        for key in ("type", "items", "properties"):
            node.pop(key, None)
    if node.get(_PRESERVE):
        node.pop("items", None)
        node.pop("properties", None)
        if node.get("type") == "object":
            del node["type"]
    if node.get("type") == "array" and "items" not in node:
        del node["type"]
    properties = node.get("properties") or {}
    nullable = {
        name for name, child in properties.items() if isinstance(child, dict) and child.get("nullable")
    }
    additional = node.get("additionalProperties")
    if isinstance(additional, dict) and additional.get("nullable"):
        node.pop("required", None)
    elif nullable and node.get("required"):
        node["required"] = [name for name in node["required"] if name not in nullable]
        if not node["required"]:
            del node["required"]
    for child in _children(node):
        _to_v2(child)


def kind_schema(rtype: ResourceType, ref: Ref, *, v3: bool) -> dict[str, Any]:
    schema: dict[str, Any] = copy.deepcopy(rtype.schema) if rtype.schema is not None else {"type": "object"}
    if not v3 and schema.get(_PRESERVE):
        return {"type": "object", "x-kubernetes-group-version-kind": gvk(rtype, rtype.kind)}
    _unfold(schema)
    if not v3:
        _to_v2(schema)
    properties = schema.setdefault("properties", {})
    properties["metadata"] = referring(ref, META + "ObjectMeta", "Standard object metadata.", v3=v3)
    properties.update(type_meta())
    schema["x-kubernetes-group-version-kind"] = gvk(rtype, rtype.kind)
    return schema


def list_schema(rtype: ResourceType, ref: Ref, *, v3: bool) -> dict[str, Any]:
    return {
        "description": f"{rtype.list_kind} is a list of {rtype.kind}",
        "type": "object",
        "required": ["items"],
        "properties": {
            **type_meta(),
            "items": {
                "type": "array",
                "items": {"$ref": ref(definition_name(rtype, rtype.kind))},
                "description": f"The {rtype.plural}.",
            },
            "metadata": referring(ref, META + "ListMeta", "Standard list metadata.", v3=v3),
        },
        "x-kubernetes-group-version-kind": gvk(rtype, rtype.list_kind),
    }
