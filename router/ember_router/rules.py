"""Model routing rules: which InferenceService a request goes to, as a pure function of the request.

A `Rule` names a `target` and the conditions a request must meet, all of them (an unset condition always
holds): the prompt's token count within [`min_prompt_tokens`, `max_prompt_tokens`], the request's
`max_tokens` (or `max_completion_tokens`) within [`min_max_tokens`, `max_max_tokens`] (a request that sets
neither has no bound, so only rules without a max_tokens condition match it), a header equal to a value
(`header`, `header_value`; names compared case-insensitively, as HTTP does; no value: present at all), and
the requested model name among `models`. `decide()` takes the first rule that matches, in order, and says
which rule (by name) and target, or None: the request stays with this service.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml


@dataclass(frozen=True, slots=True)
class Rule:
    name: str
    target: str
    min_prompt_tokens: int | None = None
    max_prompt_tokens: int | None = None
    min_max_tokens: int | None = None
    max_max_tokens: int | None = None
    header: str | None = None
    header_value: str | None = None
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    prompt_tokens: int
    max_tokens: int | None
    headers: Mapping[str, str]  # names lower-cased
    model: str | None


def _within(value: int | None, low: int | None, high: int | None) -> bool:
    if low is None and high is None:
        return True
    if value is None:
        return False
    return (low is None or value >= low) and (high is None or value <= high)


def matches(rule: Rule, request: Request) -> bool:
    if not _within(request.prompt_tokens, rule.min_prompt_tokens, rule.max_prompt_tokens):
        return False
    if not _within(request.max_tokens, rule.min_max_tokens, rule.max_max_tokens):
        return False
    if rule.header is not None:
        value = request.headers.get(rule.header.lower())
        if value is None or (rule.header_value is not None and value != rule.header_value):
            return False
    return not rule.models or request.model in rule.models


def decide(rules: Sequence[Rule], request: Request) -> Rule | None:
    """The first rule the request matches, or None."""
    return next((rule for rule in rules if matches(rule, request)), None)


_FIELDS = {
    "minPromptTokens": "min_prompt_tokens",
    "maxPromptTokens": "max_prompt_tokens",
    "minMaxTokens": "min_max_tokens",
    "maxMaxTokens": "max_max_tokens",
    "header": "header",
    "headerValue": "header_value",
}


def parse_route(text: str) -> tuple[Rule, str]:
    """`ember router --route` JSON: {"name", "target", "url", and conditions: minPromptTokens,
    maxPromptTokens, minMaxTokens, maxMaxTokens, header, headerValue, models}; ValueError naming what is
    wrong."""
    return route_from(json.loads(text))


def parse_routes(text: str) -> tuple[tuple[Rule, str], ...]:
    """A routes file (`ember router --routes`): a YAML (or JSON) list of the objects `--route` takes, in
    order, with distinct names; ValueError naming what is wrong."""
    try:
        docs = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"not YAML: {e}") from None
    if docs is None:
        return ()
    if not isinstance(docs, list):
        raise ValueError("a routes file is a list of routes")
    routes = tuple(route_from(doc) for doc in docs)
    names = [rule.name for rule, _ in routes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"route names must be distinct: {', '.join(twice)}")
    return routes


def route_from(doc: object) -> tuple[Rule, str]:
    """One route from its decoded object (see `parse_route`)."""
    if not isinstance(doc, dict):
        raise ValueError("a route is a JSON object")
    unknown = set(doc) - {"name", "target", "url", "models", *_FIELDS}
    if unknown:
        raise ValueError(f"unknown route field(s): {', '.join(sorted(unknown))}")
    for key in ("name", "target", "url"):
        if not isinstance(doc.get(key), str) or not doc[key]:
            raise ValueError(f"a route needs {key!r} (a non-empty string)")
    kwargs: dict[str, object] = {}
    for key, attr in _FIELDS.items():
        if key in doc:
            value = doc[key]
            wanted = str if key.startswith("header") else int
            if not isinstance(value, wanted) or isinstance(value, bool):
                kind = "a string" if wanted is str else "an integer"
                raise ValueError(f"route {doc['name']}: {key} must be {kind}")
            if isinstance(value, int) and value < 0:  # as the CRD's routing refuses it (minimum 0)
                raise ValueError(f"route {doc['name']}: {key} must be >= 0, got {value}")
            kwargs[attr] = value
    models = doc.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
        raise ValueError(f"route {doc['name']}: models must be a list of names")
    rule = Rule(doc["name"], doc["target"], models=tuple(models), **kwargs)  # type: ignore[arg-type]
    return rule, doc["url"]


def requested_max_tokens(body: object) -> int | None:
    """The output bound an OpenAI request asks for: `max_completion_tokens`, else `max_tokens`, else
    `max_output_tokens` (the Responses API's)."""
    if not isinstance(body, dict):
        return None
    for key in ("max_completion_tokens", "max_tokens", "max_output_tokens"):  # the last: Responses API
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
