"""kube-apiserver's refusals of a CRD schema that is not structural, and of defaults its schema refuses.

Three passes, in upstream's order, each reproducing one part of apiextensions-apiserver:

- `openapi_causes`: `ValidateCustomResourceDefinitionOpenAPISchema` with `specStandardValidatorV3` and
  `validateMapListKeysMapSet` (pkg/apis/apiextensions/validation): unsupported keywords and types,
  `properties` beside `additionalProperties`, the list-type and map-type extensions, list-map keys
  that are not scalar, required-or-defaulted, non-nullable item properties, and defaults where none
  may be (the root's `metadata`, `apiVersion` and `kind`).
- `structural_causes`: `ValidateStructural` (pkg/apiserver/schema): every node typed, arrays with `items`,
  an object root without `additionalProperties`, and `anyOf`/`allOf`/`oneOf`/`not` that only restrict
  values, never declare types or fields (`validateNestedValueValidation`), nor fields the schema does
  not declare outside them (`validateStructuralCompleteness`). Sorted as upstream sorts them.
- `default_causes`: `structuraldefaulting.ValidateDefaults`: each `default` (under `properties` and
  `items`; never under `additionalProperties`) must hold no field pruning would drop, must pass the
  schema it sits on as written (its children's own defaults are not filled in first), and then the CEL
  rules of that schema, the default serving as both `self` and `oldSelf`.

Left out: `format`, `pattern`s Go's regexp cannot compile, the metadata coercion of defaults inside an
`x-kubernetes-embedded-resource`, and the CEL cost budget while rules run on defaults.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from . import schema as objects
from .errors import Cause, forbidden, invalid_value, not_supported, required

_TYPES = ("array", "boolean", "integer", "number", "object", "string")
_META = ("apiVersion", "kind", "metadata")
_INT_OR_STRING = [{"type": "integer"}, {"type": "string"}]
_JUNCTORS = ("allOf", "anyOf", "oneOf")


def _go(value: Any, nested: bool = False) -> str:
    """A JSON value as Go prints it in `Invalid value: ...`: `%v`/`%q` for scalars, `%#v` for the rest."""
    if value is None:
        return "interface {}(nil)" if nested else '"null"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e21:
            return str(int(value))
        mantissa, _, exponent = repr(value).partition("e")
        return f"{mantissa}e{int(exponent):+03d}" if exponent else mantissa
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[]interface {}{" + ", ".join(_go(v, True) for v in value) + "}"
    items = ", ".join(f"{json.dumps(k)}:{_go(value[k], True)}" for k in sorted(value))
    return "map[string]interface {}{" + items + "}"


def _go_strings(values: list[Any]) -> str:
    return "[]string{" + ", ".join(json.dumps(str(v)) for v in values) + "}"


def _schema(node: Any) -> dict[str, Any] | None:
    return node if isinstance(node, dict) else None


# -- ValidateCustomResourceDefinitionOpenAPISchema -------------------------------------------------------


def openapi_causes(node: Any, path: str) -> list[Cause]:
    """Upstream's `ValidateCustomResourceDefinitionOpenAPISchema` from the schema's root."""
    causes: list[Cause] = []
    _openapi(node, path, causes, root=True, in_meta=False, no_defaults=None)
    return causes


def _keyword_causes(node: dict[str, Any], path: str, in_meta: bool, no_defaults: str | None) -> list[Cause]:
    """`specStandardValidatorV3.validate`: what a CRD schema node may not say at all."""
    causes = []
    kind = node.get("type")
    if isinstance(kind, str) and kind and kind not in _TYPES:
        causes.append(not_supported(f"{path}.type", _go(kind), _TYPES))
    if "default" in node and no_defaults is not None:
        causes.append(forbidden(f"{path}.default", f"must not be set {no_defaults}".rstrip()))
    for keyword in ("id", "additionalItems", "patternProperties", "definitions", "dependencies", "$ref"):
        if node.get(keyword) not in (None, "", {}):
            causes.append(forbidden(f"{path}.{keyword}", f"{keyword} is not supported"))
    if kind == "null":
        causes.append(forbidden(f"{path}.type", "type cannot be set to null, use nullable as an alternative"))
    if isinstance(node.get("items"), list) and node["items"]:
        causes.append(forbidden(f"{path}.items", "items must be a schema object and not an array"))
    if in_meta and node.get("x-kubernetes-embedded-resource"):
        causes.append(
            forbidden(f"{path}.x-kubernetes-embedded-resource", "must not be used inside of resource meta")
        )
    return causes


def _openapi(
    node: Any, path: str, causes: list[Cause], root: bool, in_meta: bool, no_defaults: str | None
) -> None:
    schema = _schema(node)
    if schema is None:
        return
    causes += _keyword_causes(schema, path, in_meta, no_defaults)
    if schema.get("uniqueItems") is True:
        message = "uniqueItems cannot be set to true since the runtime complexity becomes quadratic"
        causes.append(forbidden(f"{path}.uniqueItems", message))
    properties: dict[str, Any] = schema["properties"] if isinstance(schema.get("properties"), dict) else {}
    if "additionalProperties" in schema:
        additional = schema["additionalProperties"]
        if properties and (additional is False or isinstance(additional, dict)):
            message = "additionalProperties and properties are mutual exclusive"
            causes.append(forbidden(f"{path}.additionalProperties", message))
        reason = "inside additionalProperties applying to object metadata" if in_meta else no_defaults
        _openapi(additional, f"{path}.additionalProperties", causes, False, in_meta, reason)
    for key, child in properties.items():
        child_meta, child_reason = in_meta, no_defaults
        if (root or schema.get("x-kubernetes-embedded-resource")) and key in _META:
            child_meta = True
            if root:
                child_reason = f"in top-level {key}"
        _openapi(child, f"{path}.properties[{key}]", causes, False, child_meta, child_reason)
    _openapi(schema.get("not"), f"{path}.not", causes, False, in_meta, no_defaults)
    for junctor in _JUNCTORS:
        for index, branch in enumerate(schema.get(junctor) or ()):
            _openapi(branch, f"{path}.{junctor}[{index}]", causes, False, in_meta, no_defaults)
    _openapi(schema.get("items"), f"{path}.items", causes, False, in_meta, no_defaults)
    causes += _extension_causes(schema, path)


def _extension_causes(schema: dict[str, Any], path: str) -> list[Cause]:
    """The `x-kubernetes-*` checks of `ValidateCustomResourceDefinitionOpenAPISchema`, then
    `validateMapListKeysMapSet`."""
    causes = []
    kind = schema.get("type") or ""
    if schema.get("x-kubernetes-preserve-unknown-fields") is False:
        causes.append(
            invalid_value(
                f"{path}.x-kubernetes-preserve-unknown-fields", "false", "must be true or undefined"
            )
        )
    map_type = schema.get("x-kubernetes-map-type")
    if map_type is not None and kind != "object":
        detail = "must be object if x-kubernetes-map-type is specified"
        causes.append(
            invalid_value(f"{path}.type", _go(kind), detail) if kind else required(f"{path}.type", detail)
        )
    if map_type is not None and map_type not in ("atomic", "granular"):
        causes.append(not_supported(f"{path}.x-kubernetes-map-type", _go(map_type), ("atomic", "granular")))
    list_type = schema.get("x-kubernetes-list-type")
    items = _schema(schema.get("items"))
    if list_type is not None and kind != "array":
        detail = "must be array if x-kubernetes-list-type is specified"
        causes.append(
            invalid_value(f"{path}.type", _go(kind), detail) if kind else required(f"{path}.type", detail)
        )
    elif list_type == "set" and items is not None:
        detail = "must be atomic as item of a list with x-kubernetes-list-type=set"
        item_list_type = items.get("x-kubernetes-list-type")
        if items.get("type") == "array" and item_list_type not in (None, "atomic"):
            causes.append(invalid_value(f"{path}.items.x-kubernetes-list-type", _go(item_list_type), detail))
        elif items.get("type") == "object" and items.get("x-kubernetes-map-type") != "atomic":
            causes.append(invalid_value(f"{path}.items.x-kubernetes-map-type", _go(item_list_type), detail))
    if list_type is not None and list_type not in ("atomic", "set", "map"):
        causes.append(
            not_supported(f"{path}.x-kubernetes-list-type", _go(list_type), ("atomic", "set", "map"))
        )
    keys = schema.get("x-kubernetes-list-map-keys") or []
    if keys:
        detail = "must be map if x-kubernetes-list-map-keys is non-empty"
        if list_type is None:
            causes.append(required(f"{path}.x-kubernetes-list-type", detail))
        elif list_type != "map":
            causes.append(invalid_value(f"{path}.x-kubernetes-list-type", _go(list_type), detail))
    if list_type == "map":
        causes += _list_map_causes(schema, items, keys, path)
    if list_type in ("set", "map") and items is not None:
        causes += _map_set_item_causes(items, list_type, keys, path)
    return causes


def _list_map_causes(
    schema: dict[str, Any], items: dict[str, Any] | None, keys: list[Any], path: str
) -> list[Cause]:
    causes = []
    if not keys:
        causes.append(
            required(
                f"{path}.x-kubernetes-list-map-keys", "must not be empty if x-kubernetes-list-type is map"
            )
        )
    if "items" not in schema:
        causes.append(required(f"{path}.items", "must have a schema if x-kubernetes-list-type is map"))
        return causes
    if items is None:
        return causes
    if items.get("type") != "object":
        detail = "must be object if parent array's x-kubernetes-list-type is map"
        causes.append(invalid_value(f"{path}.items.type", _go(items.get("type") or ""), detail))
        return causes
    properties = items.get("properties") or {}
    seen: set[str] = set()
    for key in keys:
        if key in properties:
            if (properties[key] or {}).get("type") in ("array", "object"):
                # upstream shows the item's type here, not the key's
                detail = "must be a scalar type if parent array's x-kubernetes-list-type is map"
                causes.append(
                    invalid_value(f"{path}.items.properties[{key}].type", _go(items["type"]), detail)
                )
        else:
            detail = "entries must all be names of item properties"
            causes.append(invalid_value(f"{path}.x-kubernetes-list-map-keys", _go_strings(keys), detail))
        if key in seen:
            detail = "must not contain duplicate entries"
            causes.append(invalid_value(f"{path}.x-kubernetes-list-map-keys", _go_strings(keys), detail))
        seen.add(key)
    return causes


def _map_set_item_causes(items: dict[str, Any], list_type: str, keys: list[Any], path: str) -> list[Cause]:
    """`validateMapListKeysMapSet`: items of a set or map, and the keys of a map, are never null, and every
    key is required or defaulted."""
    causes = []
    if items.get("nullable"):
        causes.append(
            forbidden(
                f"{path}.items.nullable", f"cannot be nullable when x-kubernetes-list-type is {list_type}"
            )
        )
    if list_type != "map":
        return causes
    must_have = set(items.get("required") or ())
    properties = items.get("properties") or {}
    for key in keys:
        prop = _schema(properties.get(key))
        if prop is None:
            continue
        where = f"{path}.items.properties[{key}]"
        if key not in must_have and "default" not in prop:
            detail = "this property is in x-kubernetes-list-map-keys, so it must have a default or be a required property"
            causes.append(required(f"{where}.default", detail))
        if prop.get("nullable"):
            causes.append(
                forbidden(
                    f"{where}.nullable",
                    "this property is in x-kubernetes-list-map-keys, so it cannot be nullable",
                )
            )
    return causes


# -- ValidateStructural ---------------------------------------------------------------------------------


def structural_causes(root: Any, path: str) -> list[Cause]:
    """Upstream's `ValidateStructural`: `validateStructuralInvariants` then `validateStructuralCompleteness`,
    sorted by their text as upstream sorts them."""
    causes: list[Cause] = []
    _invariants(root, "root", path, causes)
    if isinstance(root, dict):
        _completeness(root, root, path, path, causes)
    return sorted(causes, key=lambda c: c.render())


def _invariants(node: Any, level: str, path: str, causes: list[Cause]) -> None:
    schema = _schema(node)
    if schema is None:
        return
    kind = schema.get("type") or ""
    if kind == "array" and "items" not in schema:
        causes.append(required(f"{path}.items", "must be specified"))
    _invariants(schema.get("items"), "item", f"{path}.items", causes)
    for key, child in (schema.get("properties") or {}).items():
        _invariants(child, "field", f"{path}.properties[{key}]", causes)
    embedded = bool(schema.get("x-kubernetes-embedded-resource"))
    if "additionalProperties" in schema:
        if level == "root":
            causes.append(forbidden(f"{path}.additionalProperties", "must not be used at the root"))
        _invariants(schema["additionalProperties"], "field", f"{path}.additionalProperties", causes)
        if embedded:
            detail = "must not be used if x-kubernetes-embedded-resource is set"
            causes.append(forbidden(f"{path}.additionalProperties", detail))
    int_or_string = bool(schema.get("x-kubernetes-int-or-string"))
    preserve = bool(schema.get("x-kubernetes-preserve-unknown-fields"))
    if int_or_string and preserve:
        detail = "must be false if x-kubernetes-int-or-string is true"
        causes.append(invalid_value(f"{path}.x-kubernetes-preserve-unknown-fields", "true", detail))
    if int_or_string and embedded:
        detail = "must be false if x-kubernetes-int-or-string is true"
        causes.append(invalid_value(f"{path}.x-kubernetes-embedded-resource", "true", detail))
    _value_validation(schema, level, path, causes)
    if embedded and kind != "object":
        detail = "must be object if x-kubernetes-embedded-resource is true"
        causes.append(
            invalid_value(f"{path}.type", _go(kind), detail) if kind else required(f"{path}.type", detail)
        )
    elif not kind and not int_or_string and not preserve:
        where = {
            "root": "at the root",
            "item": "for specified array items",
            "field": "for specified object fields",
        }[level]
        causes.append(required(f"{path}.type", f"must not be empty {where}"))
    if level == "root" and kind and kind != "object":
        causes.append(invalid_value(f"{path}.type", _go(kind), "must be object at the root"))
    if level == "root" or embedded:
        for key in ("kind", "apiVersion"):
            child = _schema((schema.get("properties") or {}).get(key))
            if child is not None and child.get("type") != "string":
                causes.append(
                    invalid_value(
                        f"{path}.properties[{key}].type", _go(child.get("type") or ""), "must be string"
                    )
                )
    if embedded and not preserve and not schema.get("properties"):
        detail = "must not be empty if x-kubernetes-embedded-resource is true without x-kubernetes-preserve-unknown-fields"
        causes.append(required(f"{path}.properties", detail))


def _value_validation(schema: dict[str, Any], level: str, path: str, causes: list[Cause]) -> None:
    """`validateValueValidation`: the junctors of one node, with int-or-string's two allowed patterns."""
    any_of = schema.get("anyOf") or []
    all_of = schema.get("allOf") or []
    if any_of != _INT_OR_STRING:
        for index, branch in enumerate(any_of):
            _nested(branch, level, f"{path}.anyOf[{index}]", causes)
    for index, branch in enumerate(all_of):
        skip_any_of = index == 0 and isinstance(branch, dict) and branch.get("anyOf") == _INT_OR_STRING
        _nested(branch, level, f"{path}.allOf[{index}]", causes, skip_any_of)
    for index, branch in enumerate(schema.get("oneOf") or []):
        _nested(branch, level, f"{path}.oneOf[{index}]", causes)
    _nested(schema.get("not"), level, f"{path}.not", causes)


_NESTED_FORBIDDEN = (
    ("type", "must be empty to be structural"),
    ("additionalProperties", "must be undefined to be structural"),
    ("default", "must be undefined to be structural"),
    ("title", "must be empty to be structural"),
    ("description", "must be empty to be structural"),
    ("nullable", "must be false to be structural"),
    ("externalDocs", "must be undefined to be structural"),
    ("x-kubernetes-preserve-unknown-fields", "must be false to be structural"),
    ("x-kubernetes-embedded-resource", "must be false to be structural"),
    ("x-kubernetes-int-or-string", "must be false to be structural"),
    ("x-kubernetes-list-map-keys", "must be empty to be structural"),
    ("x-kubernetes-list-type", "must be undefined to be structural"),
    ("x-kubernetes-map-type", "must be undefined to be structural"),
    ("x-kubernetes-validations", "must be empty to be structural"),
)


def _nested(node: Any, level: str, path: str, causes: list[Cause], skip_any_of: bool = False) -> None:
    """`validateNestedValueValidation`: inside a junctor only value checks, no structure."""
    schema = _schema(node)
    if schema is None:
        return
    if skip_any_of:
        schema = {k: v for k, v in schema.items() if k != "anyOf"}
    _value_validation(schema, level, path, causes)
    _nested(schema.get("items"), level, f"{path}.items", causes)
    for key, child in (schema.get("properties") or {}).items():
        _nested(child, "field", f"{path}.properties[{key}]", causes)
    for keyword, detail in _NESTED_FORBIDDEN:
        if schema.get(keyword) not in (None, False, "", [], {}) or (
            keyword == "additionalProperties" and keyword in schema
        ):
            causes.append(forbidden(f"{path}.{keyword}", detail))
    if "metadata" in (schema.get("properties") or {}):
        causes.append(forbidden(f"{path}.properties[metadata]", "must not be specified in a nested context"))


def _completeness(
    node: dict[str, Any], structure: dict[str, Any] | None, s_path: str, v_path: str, causes: list[Cause]
) -> None:
    """`validateValueValidationCompleteness`: what a junctor names must be declared outside it."""
    if structure is None:
        causes.append(required(s_path, f"because it is defined in {v_path}"))
        return
    branches = [(node.get("not"), f"{v_path}.not")]
    for junctor in _JUNCTORS:
        branches += [(b, f"{v_path}.{junctor}[{i}]") for i, b in enumerate(node.get(junctor) or [])]
    for branch, where in branches:
        if isinstance(branch, dict):
            _nested_completeness(branch, structure, s_path, where, causes)


def _nested_completeness(
    branch: dict[str, Any], structure: dict[str, Any] | None, s_path: str, v_path: str, causes: list[Cause]
) -> None:
    if structure is None:
        causes.append(required(s_path, f"because it is defined in {v_path}"))
        return
    _completeness(branch, structure, s_path, v_path, causes)
    if isinstance(branch.get("items"), dict):
        _nested_completeness(
            branch["items"], _schema(structure.get("items")), f"{s_path}.items", f"{v_path}.items", causes
        )
    declared = structure.get("properties") or {}
    for key, child in (branch.get("properties") or {}).items():
        if key not in declared:
            where = f"{v_path}.properties[{key}]"
            causes.append(required(f"{s_path}.properties[{key}]", f"because it is defined in {where}"))
        elif isinstance(child, dict):
            _nested_completeness(
                child,
                _schema(declared[key]),
                f"{s_path}.properties[{key}]",
                f"{v_path}.properties[{key}]",
                causes,
            )


# -- ValidateDefaults -----------------------------------------------------------------------------------


def default_causes(root: dict[str, Any], path: str) -> list[Cause]:
    """Upstream's `ValidateDefaults` over a structural schema, the root treated as an embedded resource."""
    causes: list[Cause] = []
    _defaults({**root, "x-kubernetes-embedded-resource": True}, path, causes)
    return causes


def _defaults(schema: dict[str, Any], path: str, causes: list[Cause]) -> None:
    if "default" in schema:
        causes += _one_default(schema, schema["default"], f"{path}.default")
    # not into additionalProperties: defaults are forbidden there
    if isinstance(schema.get("items"), dict):
        _defaults(schema["items"], f"{path}.items", causes)
    for key, child in (schema.get("properties") or {}).items():
        if isinstance(child, dict):
            _defaults(child, f"{path}.properties[{key}]", causes)


def _without(schema: Any, keywords: tuple[str, ...]) -> Any:
    """A copy of a schema tree without the given keywords at any node."""
    if isinstance(schema, list):
        return [_without(s, keywords) for s in schema]
    if not isinstance(schema, dict):
        return schema
    result = {k: v for k, v in schema.items() if k not in keywords}
    for key in ("items", "additionalProperties", "not"):
        if isinstance(result.get(key), dict):
            result[key] = _without(result[key], keywords)
    if isinstance(result.get("properties"), dict):
        result["properties"] = {k: _without(v, keywords) for k, v in result["properties"].items()}
    return result


def _one_default(schema: dict[str, Any], value: Any, where: str) -> list[Cause]:
    """One default: pruned (`pruning.Prune` must leave it as it is), then `ValidateCustomResource` against
    its schema, and only if that passes, the CEL validator with the default as `self` and `oldSelf`."""
    causes = []
    unknown: list[str] = []
    objects.prune_unknown(copy.deepcopy(value), schema, unknown)
    if unknown:
        causes.append(invalid_value(where, _go(value), "must not have unknown fields"))
    # the list-type uniqueness checks are not part of this validation upstream
    plain = _without(schema, ("x-kubernetes-list-type",))
    found: list[Cause] = []
    objects.validate_value(value, None, _without(plain, ("x-kubernetes-validations",)), found)
    if not found:
        objects.validate_value(value, value, plain, found)
    for cause in found:
        relative = "" if cause.field == "<nil>" else cause.field
        field = where if not relative else where + (relative if relative.startswith("[") else f".{relative}")
        causes.append(Cause(field, cause.reason, cause.message))
    return causes
