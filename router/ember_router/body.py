"""A request's body as the router reads it: a JSON object, or a 400 that no engine could answer otherwise."""

from __future__ import annotations

import json
from typing import Any


class BadBody(ValueError):
    """The body is not a JSON object: the message of the 400 to answer."""


def read_body(raw: bytes) -> dict[str, Any] | None:
    """The body's JSON object; None where it is nested deeper than the parser takes (the engine, whose parser
    takes more, decides). Raises BadBody for malformed JSON or JSON that is not an object."""
    try:
        body = json.loads(raw)
    except RecursionError:
        return None
    except ValueError as exc:  # json.JSONDecodeError, UnicodeDecodeError
        raise BadBody(f"body: malformed JSON ({exc})") from None
    if not isinstance(body, dict):
        raise BadBody(f"body: must be a JSON object, got {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"
