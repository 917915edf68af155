"""Label and field selectors, parsed from the `labelSelector` / `fieldSelector` query strings.

Label selectors support the whole string syntax: `k=v`, `k==v`, `k!=v`, `k in (a,b)`, `k notin (a,b)`,
`k` (exists), `!k` (does not exist) and `k>n` / `k<n`. As in Kubernetes, `!=` and `notin` also match
objects without the label.

Field selectors are generic: any dotted path (`metadata.name`, `status.phase`, `spec.nodeName`,
`involvedObject.uid`, ...) compared with `=`, `==` or `!=` to the field's string form, a missing field
reading as "". A real server accepts only a fixed list of fields per kind and rejects the others; this
one accepts any path, which is a superset of what clients send.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import bad_request

_SET_REQ = re.compile(r"^\s*(\S+)\s+(in|notin)\s*\((.*)\)\s*$")
_CMP_REQ = re.compile(r"^\s*([^!=<>\s]+)\s*(==|=|!=|<|>)\s*(.*?)\s*$")
_EXISTS_REQ = re.compile(r"^\s*(!?)\s*([^!=<>\s(),]+)\s*$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside parentheses (set values contain commas)."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [part for part in parts if part.strip()]


@dataclass(slots=True, frozen=True)
class LabelSelector:
    requirements: tuple[Callable[[dict[str, str]], bool], ...] = ()

    def matches(self, obj: dict[str, Any]) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return all(requirement(labels) for requirement in self.requirements)


def _requirement(text: str) -> Callable[[dict[str, str]], bool]:
    if m := _SET_REQ.match(text):
        key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",")}
        if op == "in":
            return lambda labels: labels.get(key) in values
        return lambda labels: labels.get(key) not in values
    if m := _CMP_REQ.match(text):
        key, op, value = m.groups()
        if op in ("=", "=="):
            return lambda labels: labels.get(key) == value
        if op == "!=":
            return lambda labels: labels.get(key) != value
        try:
            bound = int(value)
        except ValueError:
            raise bad_request(
                f"unable to parse requirement: for 'gt', 'lt' operators, the value must be an integer: {text!r}"
            ) from None
        if op == ">":
            return lambda labels: key in labels and labels[key].isdigit() and int(labels[key]) > bound
        return lambda labels: key in labels and labels[key].isdigit() and int(labels[key]) < bound
    if m := _EXISTS_REQ.match(text):
        negated, key = m.groups()
        if negated:
            return lambda labels: key not in labels
        return lambda labels: key in labels
    raise bad_request(f"unable to parse requirement: {text!r}")


def parse_label_selector(text: str | None) -> LabelSelector:
    if not text:
        return LabelSelector()
    return LabelSelector(tuple(_requirement(part) for part in _split_top_level(text)))


def render_label_selector(selector: dict[str, Any]) -> str:
    """A `LabelSelector` object (matchLabels/matchExpressions) as the equivalent string."""
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expression in selector.get("matchExpressions") or ():
        key, op, values = expression["key"], expression["operator"], expression.get("values") or []
        if op == "Exists":
            parts.append(key)
        elif op == "DoesNotExist":
            parts.append(f"!{key}")
        else:
            parts.append(f"{key} {op.lower()} ({','.join(sorted(values))})")
    return ",".join(parts)


def field_value(obj: dict[str, Any], path: str) -> str:
    node: Any = obj
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        return ""
    if isinstance(node, bool):
        return "true" if node else "false"
    return str(node)


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


@dataclass(slots=True, frozen=True)
class FieldSelector:
    # (path, wanted value, equal?) triples.
    terms: tuple[tuple[str, str, bool], ...] = ()

    def matches(self, obj: dict[str, Any]) -> bool:
        return all((field_value(obj, path) == value) == equal for path, value, equal in self.terms)


def parse_field_selector(text: str | None) -> FieldSelector:
    if not text:
        return FieldSelector()
    terms = []
    # Values may escape commas and equals signs with a backslash.
    for part in re.split(r"(?<!\\),", text):
        if not part.strip():
            continue
        m = re.match(r"^\s*([A-Za-z0-9_.\-/]+)\s*(==|=|!=)(.*)$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        path, op, value = m.groups()
        terms.append((path, _unescape(value.strip()), op != "!="))
    return FieldSelector(tuple(terms))
