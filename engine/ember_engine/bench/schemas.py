"""The JSON schemas of `ember bench serve --structured`: nested objects, arrays, enums, numbers and
patterned strings, each small enough for a short answer, so that a valid document fits the token budget."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


_STR: dict[str, Any] = {"type": "string", "maxLength": 12}
_INT: dict[str, Any] = {"type": "integer", "minimum": 0, "maximum": 9999}
_NUM: dict[str, Any] = {"type": "number", "minimum": -1000, "maximum": 1000}
_BOOL: dict[str, Any] = {"type": "boolean"}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _pattern(regex: str) -> dict[str, Any]:
    return {"type": "string", "pattern": regex}


def _array(items: dict[str, Any], lo: int = 1, hi: int = 3) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": lo, "maxItems": hi}


SCHEMAS: list[dict[str, Any]] = [
    _obj({"name": _STR, "age": _INT}),
    _obj({"city": _STR, "temperature": _NUM, "unit": _enum("celsius", "fahrenheit")}),
    _obj({"ok": _BOOL}),
    _obj({"sku": _pattern(r"^[A-Z]{3}-[0-9]{4}$"), "quantity": _INT}),
    _obj({"date": _pattern(r"^20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]$"), "event": _STR}),
    _obj({"tags": _array(_STR)}),
    _obj({"scores": _array(_NUM, 2, 4)}),
    _obj({"point": _obj({"x": _NUM, "y": _NUM})}),
    _obj({"user": _obj({"id": _INT, "email": _pattern(r"^[a-z]{1,8}@[a-z]{1,8}\.(com|org)$")})}),
    _obj({"status": _enum("queued", "running", "done", "failed"), "progress": _NUM}),
    _obj({"color": _enum("red", "green", "blue"), "hex": _pattern(r"^#[0-9a-f]{6}$")}),
    _obj({"items": _array(_obj({"name": _STR, "price": _NUM}), 1, 2)}),
    _obj({"matrix": _array(_array(_INT, 2, 2), 2, 2)}),
    _obj({"title": _STR, "draft": _BOOL, "words": _INT}),
    _obj({"lat": {"type": "number", "minimum": -90, "maximum": 90}, "lon": _NUM}),
    _obj({"version": _pattern(r"^[0-9]{1,2}\.[0-9]{1,2}\.[0-9]{1,3}$")}),
    _obj(
        {"answer": _enum("yes", "no", "unsure"), "confidence": {"type": "number", "minimum": 0, "maximum": 1}}
    ),
    _obj({"order": _obj({"id": _INT, "lines": _array(_obj({"sku": _STR, "qty": _INT}), 1, 2)})}),
    _obj({"phone": _pattern(r"^\+[0-9]{2} [0-9]{3} [0-9]{4}$")}),
    _obj({"name": _STR, "nickname": _STR}, required=["name"]),
    _obj({"weekday": _enum("mon", "tue", "wed", "thu", "fri", "sat", "sun"), "hour": _INT}),
    _obj({"range": _obj({"low": _INT, "high": _INT}), "inclusive": _BOOL}),
    _obj({"ids": _array(_INT, 1, 4), "unique": _BOOL}),
    _obj({"author": _obj({"first": _STR, "last": _STR}), "year": _INT}),
    _obj({"ip": _pattern(r"^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$")}),
    _obj({"level": {"type": "integer", "enum": [1, 2, 3]}, "label": _STR}),
    _obj({"rgb": _array({"type": "integer", "minimum": 0, "maximum": 255}, 3, 3)}),
    _obj({"meta": _obj({"created": _pattern(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$"), "owner": _STR}), "size": _INT}),
    _obj({"kind": _enum("cat", "dog"), "legs": _INT, "tame": _BOOL}),
    _obj({"choices": _array(_enum("a", "b", "c"), 1, 3)}),
    _obj({"total": _NUM, "currency": _pattern(r"^[A-Z]{3}$")}),
    _obj({"tree": _obj({"value": _INT, "children": _array(_obj({"value": _INT}), 0, 2)})}),
]
