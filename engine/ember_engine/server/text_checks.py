"""Checks on the text inside a parsed request body, before anything reads it."""

from __future__ import annotations

import re
from typing import Any

_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(body: Any) -> str | None:
    """Where the first string holding a lone UTF-16 surrogate is (JSON's `\\ud800` escape parses into one,
    yet no UTF-8 text can hold it), as "field.sub[2]: ..."; None when there is none. Iterative: a body
    may nest as deep as the JSON parser allows."""
    todo: list[tuple[str, Any]] = [("", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, str):
            found = _SURROGATE.search(value)
            if found is not None:
                return (
                    f"{path or 'body'}: holds a lone surrogate \\u{ord(found.group()):04x} at character "
                    f"{found.start()}, which is not valid Unicode text"
                )
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                todo.append((f"{path}.{key}" if path else str(key), item))
                todo.append((path or "body", key))
        elif isinstance(value, list):
            todo.extend((f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


def valid_unicode(body: Any) -> Any:
    """`body` itself when no string in it holds a lone surrogate; else ValueError saying where (a request
    model's first check: no answer could quote such text back)."""
    problem = lone_surrogate(body)
    if problem is not None:
        raise ValueError(problem)
    return body
