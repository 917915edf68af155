"""Custom resources against their CRD's structural `openAPIV3Schema`: prune, default, validate.

The order is the real server's: unknown fields are pruned (unless a node sets
`x-kubernetes-preserve-unknown-fields`), nulls of non-nullable fields are dropped, `default`s fill in
missing fields top-down (so a defaulted `{}` object then gets its children's defaults), and the result
is validated: types, `required`, `enum`, `minimum`/`maximum` (with `exclusiveMinimum`/`exclusiveMaximum`),
`minLength`/`maxLength`, `pattern`, `minItems`/`maxItems`, `minProperties`/`maxProperties`, uniqueness of
`x-kubernetes-list-type: set|map` lists, and the CEL rules of `x-kubernetes-validations` (a node's rules
run only when the node passed the structural checks, which keeps a type error from drowning in rule
failures). Errors carry the real server's field paths and wording (`spec.replicas.max: Invalid value: 0:
spec.replicas.max in body should be greater than or equal to 1`).

`apiVersion`, `kind` and `metadata` at the root are the server's business and are never pruned.
Left out: `format` checks, `oneOf`/`anyOf`/`allOf`/`not`, validation ratcheting, and correlating old
list items for transition rules inside lists (those rules see no `oldSelf` there and are skipped).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import re2

from .cel import check_rules
from .errors import Cause

_ROOT_KEPT = ("apiVersion", "kind", "metadata")


def normalize(obj: dict[str, Any], schema: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """A pruned and defaulted copy of `obj`, and the paths of the unknown fields pruned from it."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEPT}
    pruned: list[str] = []
    result = _prune(body, schema, "", pruned)
    _default(result, schema)
    for key in _ROOT_KEPT:
        if key in obj:
            result[key] = copy.deepcopy(obj[key])
    return result, pruned


def _root_view(obj: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """What the schema validates. Root-level CEL rules also see `self.metadata`, holding only `name` and
    `generateName`, as apiextensions-apiserver gives them."""
    body = {k: v for k, v in obj.items() if k not in _ROOT_KEPT}
    if schema.get("x-kubernetes-validations"):
        meta = obj.get("metadata") or {}
        body["metadata"] = {k: meta[k] for k in ("name", "generateName") if k in meta}
    return body


def validate(obj: dict[str, Any], old: dict[str, Any] | None, schema: dict[str, Any]) -> list[Cause]:
    body = _root_view(obj, schema)
    previous = _root_view(old, schema) if old is not None else None
    causes: list[Cause] = []
    _validate(body, previous, schema, "", causes)
    return causes


def prune_unknown(value: Any, schema: dict[str, Any], pruned: list[str]) -> Any:
    """`value` pruned by `schema` alone (no root fields kept), the paths of what was dropped in `pruned`."""
    return _prune(value, schema, "", pruned)


def validate_value(value: Any, old: Any, schema: dict[str, Any], causes: list[Cause]) -> None:
    """Validate one value against one schema node; causes carry paths relative to the value."""
    _validate(value, old, schema, "", causes)


def _child_schema(schema: dict[str, Any], key: str) -> dict[str, Any] | None:
    properties = schema.get("properties") or {}
    if key in properties:
        return properties[key]
    additional = schema.get("additionalProperties")
    return additional if isinstance(additional, dict) else None


def _keeps_unknown(schema: dict[str, Any]) -> bool:
    return (
        bool(schema.get("x-kubernetes-preserve-unknown-fields")) or schema.get("additionalProperties") is True
    )


def _prune(value: Any, schema: dict[str, Any], path: str, pruned: list[str]) -> Any:
    if isinstance(value, dict):
        embedded = schema.get("x-kubernetes-embedded-resource")
        result = {}
        for key, item in value.items():
            child = _child_schema(schema, key)
            if child is None:
                if _keeps_unknown(schema) or (embedded and key in _ROOT_KEPT):
                    result[key] = copy.deepcopy(item)
                else:
                    pruned.append(_join(path, key))
                continue
            if item is None and not child.get("nullable"):
                continue
            result[key] = _prune(item, child, _join(path, key), pruned)
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(item, schema["items"], f"{path}[{i}]", pruned) for i, item in enumerate(value)]
    return copy.deepcopy(value)


def _default(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, child in (schema.get("properties") or {}).items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
        for key, item in value.items():
            child = _child_schema(schema, key)
            if child is not None:
                _default(item, child)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _default(item, schema["items"])


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "null"


def _type_ok(value: Any, schema: dict[str, Any]) -> bool:
    if value is None:
        return bool(schema.get("nullable"))
    actual = _type_name(value)
    if schema.get("x-kubernetes-int-or-string"):
        return actual in ("integer", "string")
    wanted = schema.get("type")
    if not wanted:
        return True
    return actual == wanted or (wanted == "number" and actual == "integer")


def _show(value: Any) -> str:
    """A value as the Go server prints it in `Invalid value: ...`."""
    return (
        json.dumps(value)
        if isinstance(value, (str, int, float, bool)) or value is None
        else f'"{_type_name(value)}"'
    )


def _go_value(value: Any) -> str:
    """A list item's identity as apiextensions-apiserver's list-type check reports a duplicate
    (`field.Duplicate`, printed with Go's %#v): a set's item as itself ("a", 1, true), a map list's key
    fields as `map[string]interface {}{"name":"a"}` (keys sorted, ", " between entries)."""
    if isinstance(value, dict):
        entries = ", ".join(f"{_go_value(k)}:{_go_value(v)}" for k, v in sorted(value.items()))
        return f"map[string]interface {{}}{{{entries}}}"
    if value is None:
        return "interface {}(nil)"
    return json.dumps(value, ensure_ascii=False)


def _matches(pattern: str, value: str) -> bool:
    """`pattern` as the Go server reads it: RE2 syntax and meaning (`$` is the end of the text, never
    before a last newline as in Python's `re`; `.` takes no newline)."""
    try:
        return re2.search(pattern, value) is not None
    except re2.error:
        return False  # a pattern RE2 cannot compile refuses every value rather than none


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _invalid(path: str, shown: Any, detail: str) -> Cause:
    """The OpenAPI validator's wording: `Invalid value: <value>: <path> in body <detail>`."""
    return Cause(path, "FieldValueInvalid", f"Invalid value: {shown}: {path} in body {detail}")


def _validate(value: Any, old: Any, schema: dict[str, Any], path: str, causes: list[Cause]) -> None:
    if not _type_ok(value, schema):
        actual = json.dumps(_type_name(value))
        message = f"Invalid value: {actual}: {path} in body must be of type {schema.get('type')}: {actual}"
        causes.append(Cause(path, "FieldValueTypeInvalid", message))
        return
    if value is None:
        return
    before, shown = len(causes), _show(value)
    if "enum" in schema and value not in schema["enum"]:
        supported = ", ".join(json.dumps(str(v)) for v in schema["enum"])
        message = f"Unsupported value: {shown}: supported values: {supported}"
        causes.append(Cause(path, "FieldValueNotSupported", message))
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        _check_bounds(value, schema, path, causes)
    elif isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            causes.append(_invalid(path, shown, f"should be at least {schema['minLength']} chars long"))
        if "maxLength" in schema and len(value) > schema["maxLength"]:
            message = f"Too long: may not be more than {schema['maxLength']} bytes"
            causes.append(Cause(path, "FieldValueTooLong", message))
        if "pattern" in schema and not _matches(schema["pattern"], value):
            causes.append(_invalid(path, shown, f"should match '{schema['pattern']}'"))
    elif isinstance(value, list):
        _validate_list(value, schema, path, causes)
    elif isinstance(value, dict):
        _validate_object(value, old if isinstance(old, dict) else None, schema, path, causes)
    rules = schema.get("x-kubernetes-validations")
    # Rules assume a well-typed node; over a broken one they only add noise to the real error.
    if rules and len(causes) == before:
        causes.extend(check_rules(rules, value, old, path, schema.get("type") or _type_name(value)))


def _check_bounds(value: float, schema: dict[str, Any], path: str, causes: list[Cause]) -> None:
    if "minimum" in schema:
        exclusive = schema.get("exclusiveMinimum") is True
        if value < schema["minimum"] or (exclusive and value == schema["minimum"]):
            relation = "greater than" if exclusive else "greater than or equal to"
            causes.append(_invalid(path, _show(value), f"should be {relation} {schema['minimum']}"))
    if "maximum" in schema:
        exclusive = schema.get("exclusiveMaximum") is True
        if value > schema["maximum"] or (exclusive and value == schema["maximum"]):
            relation = "less than" if exclusive else "less than or equal to"
            causes.append(_invalid(path, _show(value), f"should be {relation} {schema['maximum']}"))


def _validate_list(value: list[Any], schema: dict[str, Any], path: str, causes: list[Cause]) -> None:
    if len(value) < schema.get("minItems", 0):
        causes.append(_invalid(path, len(value), f"should have at least {schema['minItems']} items"))
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        message = f"Too many: {len(value)}: must have at most {schema['maxItems']} items"
        causes.append(Cause(path, "FieldValueTooMany", message))
    list_type = schema.get("x-kubernetes-list-type")
    keys = schema.get("x-kubernetes-list-map-keys") or ()
    seen: list[Any] = []
    for index, item in enumerate(value):
        identity = {k: item.get(k) for k in keys} if list_type == "map" and isinstance(item, dict) else item
        if list_type in ("set", "map") and identity in seen:
            message = f"Duplicate value: {_go_value(identity)}"
            causes.append(Cause(f"{path}[{index}]", "FieldValueDuplicate", message))
        seen.append(identity)
        if isinstance(schema.get("items"), dict):
            _validate(item, None, schema["items"], f"{path}[{index}]", causes)


def _validate_object(
    value: dict[str, Any], old: dict[str, Any] | None, schema: dict[str, Any], path: str, causes: list[Cause]
) -> None:
    for key in schema.get("required") or ():
        if key not in value:
            causes.append(Cause(_join(path, key), "FieldValueRequired", "Required value"))
    if len(value) < schema.get("minProperties", 0):
        causes.append(
            _invalid(path, len(value), f"should have at least {schema['minProperties']} properties")
        )
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        message = f"Too many: {len(value)}: must have at most {schema['maxProperties']} items"
        causes.append(Cause(path, "FieldValueTooMany", message))
    properties = schema.get("properties") or {}
    for key, item in value.items():
        child = _child_schema(schema, key)
        if child is None:
            continue
        # Keys of an additionalProperties map print as subscripts, as the real server prints them.
        child_path = _join(path, key) if key in properties else f"{path}[{key}]"
        _validate(item, old.get(key) if old is not None else None, child, child_path, causes)
