"""Request bodies in Kubernetes' protobuf encoding (`application/vnd.kubernetes.protobuf`), read into the
JSON-shaped dict a JSON body of the same object gives.

The wire format is protobuf's: each field a varint key (`number << 3 | wire type`), then a varint (type 0),
8 bytes (1), a length-prefixed run of bytes (2: strings, bytes, nested messages, map entries, packed
numbers) or 4 bytes (5). Negative int32/int64 values are ten-byte two's complement varints: Kubernetes'
messages never use zigzag. A body is the 4-byte magic `k8s\\x00` and a `runtime.Unknown` message
(typeMeta{apiVersion, kind} = 1, raw = 2, contentEncoding = 3, contentType = 4); `raw` is the typed
object's message, which carries no apiVersion/kind of its own (they come from `typeMeta`).

The typed messages are read through the field tables of `protoschema.py`, as kube-apiserver's generated
unmarshallers read them into Go structs and then as Go's JSON encoder writes those structs: Go's protobuf
encoder writes every non-pointer field, empty strings and zeros included, and the JSON encoder leaves the
zero values of `omitempty` fields out again, so a decoded object holds what `kubectl create ... -o json`
prints. A field number the tables do not know is refused (415, naming the message and the number) rather
than dropped; so is a kind without tables. Bytes that are not a well-formed message are a 400.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from .errors import APIError, bad_request
from .protoschema import ALWAYS, INLINE, KINDS, MESSAGES, PTR, Field, qualified

MAGIC = b"k8s\x00"
MEDIA_TYPE = "application/vnd.kubernetes.protobuf"

VARINT, FIXED64, BYTES, FIXED32 = 0, 1, 2, 5
# The Go zero value a non-pointer field without omitempty has when the wire leaves it out.
ZERO: dict[str, Any] = {"string": "", "bytes": "", "bool": False, "int32": 0, "int64": 0}


class WireError(ValueError):
    """Bytes that are not a well-formed protobuf message."""


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` (an unsigned 64-bit value) and the position after it."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise WireError("unexpected end of data in a varint")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value & ((1 << 64) - 1), pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than ten bytes")


def fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for each field of a message, in wire order."""
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError("field number 0")
        value: int | bytes
        if wire == VARINT:
            value, pos = read_varint(data, pos)
        elif wire == BYTES:
            length, pos = read_varint(data, pos)
            if pos + length > len(data):
                raise WireError(f"field {number}: length {length} runs past the end of the data")
            value, pos = data[pos : pos + length], pos + length
        elif wire in (FIXED64, FIXED32):
            size = 8 if wire == FIXED64 else 4
            if pos + size > len(data):
                raise WireError(f"field {number}: unexpected end of data")
            value, pos = int.from_bytes(data[pos : pos + size], "little"), pos + size
        else:
            raise WireError(f"field {number}: unsupported wire type {wire}")
        yield number, wire, value


def signed(value: int, bits: int) -> int:
    """A varint's two's-complement value as a signed integer of `bits` bits (int32 keeps the low 32)."""
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


def decode_body(body: bytes) -> dict[str, Any]:
    """A protobuf request body as the JSON-shaped object; APIError 400/415 for what cannot be read."""
    if not body.startswith(MAGIC):
        raise bad_request(
            f"provided data does not appear to be a protobuf message, expected prefix {list(MAGIC)}"
        )
    try:
        unknown = _message(body[len(MAGIC) :], "runtime.Unknown")
        type_meta = unknown.get("typeMeta", {})
        api_version, kind = type_meta.get("apiVersion", ""), type_meta.get("kind", "")
        if unknown.get("contentEncoding"):
            raise _unsupported(f"content encoding {unknown['contentEncoding']!r} of a protobuf body")
        message = KINDS.get((api_version, kind))
        if message is None:
            understood = ", ".join(f"{v} {k}" for v, k in KINDS)
            raise _unsupported(
                f"a protobuf body of {api_version} {kind} (this server reads protobuf of {understood})"
            )
        raw = base64.b64decode(unknown.get("raw", ""))
        return {"apiVersion": api_version, "kind": kind, **_message(raw, message)}
    except WireError as error:
        raise bad_request(f"the protobuf body could not be decoded: {error}") from None


def _unsupported(what: str) -> APIError:
    return APIError(415, "UnsupportedMediaType", f"the server does not understand {what}")


def _message(data: bytes, name: str) -> dict[str, Any]:
    table = MESSAGES[name]
    out: dict[str, Any] = {}
    for number, wire, value in fields(data):
        field = table.get(number)
        if field is None:
            raise _unsupported(f"field {number} of {qualified(name)} in a protobuf body")
        if field.mode == INLINE:
            out.update(_message(_bytes(value, field, name), field.kind))
        elif field.repeated:
            out.setdefault(field.name, []).extend(_repeated(wire, value, field, name))
        elif field.map_of:
            key, item = _entry(_bytes(value, field, name), field, name)
            out.setdefault(field.name, {})[key] = item
        else:
            out[field.name] = _value(wire, value, field.kind, field, name)
    for field in table.values():
        _finish(out, field)
    return out


def _finish(out: dict[str, Any], field: Field) -> None:
    """Go's JSON encoder on the decoded struct: omitempty zero values left out, absent ones filled in."""
    if field.mode == INLINE:
        return
    if field.name not in out:
        if field.mode == ALWAYS and (field.repeated or field.map_of):
            out[field.name] = None  # a nil slice or map without omitempty is null
        elif field.mode == ALWAYS and field.kind in ZERO:
            out[field.name] = ZERO[field.kind]
        return
    if field.mode in (ALWAYS, PTR):
        return
    value = out[field.name]
    collection = field.repeated or bool(field.map_of)
    empty = not value if collection else field.kind in ZERO and value == ZERO[field.kind]
    if empty:
        del out[field.name]


def _bytes(value: int | bytes, field: Field, message: str) -> bytes:
    if not isinstance(value, bytes):
        raise WireError(f"field {field.name} of {message}: expected a length-delimited value")
    return value


def _repeated(wire: int, value: int | bytes, field: Field, message: str) -> list[Any]:
    if field.kind in ("int32", "int64", "bool") and wire == BYTES:  # packed numbers
        assert isinstance(value, bytes)
        items, pos = [], 0
        while pos < len(value):
            number, pos = read_varint(value, pos)
            items.append(_value(VARINT, number, field.kind, field, message))
        return items
    return [_value(wire, value, field.kind, field, message)]


def _entry(data: bytes, field: Field, message: str) -> tuple[str, Any]:
    """A map entry: key = 1 (a string in every Kubernetes map), value = 2."""
    key: str = ""
    item: Any = ZERO.get(field.map_of, {})
    for number, wire, value in fields(data):
        if number == 1:
            key = _value(wire, value, "string", field, message)
        elif number == 2:
            item = _value(wire, value, field.map_of, field, message)
        else:
            raise _unsupported(
                f"field {number} of a {qualified(message)}.{field.name} entry in a protobuf body"
            )
    return key, item


def _value(wire: int, value: int | bytes, kind: str, field: Field, message: str) -> Any:
    if kind in ("int32", "int64", "bool"):
        if not isinstance(value, int) or wire != VARINT:
            raise WireError(f"field {field.name} of {message}: expected a varint")
        if kind == "bool":
            return value != 0
        return signed(value, 32 if kind == "int32" else 64)
    data = _bytes(value, field, message)
    if kind == "string":
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise WireError(f"field {field.name} of {message}: invalid UTF-8") from None
    if kind == "bytes":
        return base64.b64encode(data).decode()
    if kind == "Time":
        return _time(data)
    if kind == "Quantity":
        return _message(data, "resource.Quantity").get("string", "")
    if kind == "IntOrString":
        parts = _message(data, "intstr.IntOrString")
        return parts.get("strVal", "") if parts.get("type") == 1 else parts.get("intVal", 0)
    return _message(data, kind)


def _time(data: bytes) -> str | None:
    """metav1.Time: seconds = 1, nanos = 2; JSON keeps whole seconds; the zero time is null."""
    parts = _message(data, "meta.Timestamp")
    seconds = parts.get("seconds", 0)
    if not data or seconds == -62135596800:  # Go's zero time.Time, 0001-01-01T00:00:00Z
        return None
    try:
        return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    except (OverflowError, ValueError, OSError):
        raise WireError(f"time {seconds} is out of range") from None
