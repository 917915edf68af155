"""The router's `/v1/models`: the models a client can name through it. Its engines' own list (the first
Ready engine's), or, while none is Ready (a service at zero replicas that holds requests until one is),
an entry for the name the engines serve when the router was told it (`--served-model-name`); then each
name a model-routing rule sends elsewhere (`models`), once, in the rules' order. Pure: the proxy fetches
the engines' list and passes it here."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ember_router.rules import Rule


def routed_names(rules: Iterable[Rule]) -> list[str]:
    """The model names the rules send elsewhere by name, each once, in the rules' order."""
    names: list[str] = []
    for rule in rules:
        names += [m for m in rule.models if m not in names]
    return names


def entry(name: str, created: int) -> dict[str, Any]:
    """A model object (OpenAI's shape) for a name the router knows only by name."""
    return {"id": name, "object": "model", "created": created, "owned_by": "ember"}


def listing(own: Sequence[dict[str, Any]], routed: Sequence[str], created: int) -> dict[str, Any]:
    """The list: the engines' entries as they gave them, then a bare entry for each routed name not
    among them."""
    have = {m.get("id") for m in own}
    return {"object": "list", "data": [*own, *(entry(n, created) for n in routed if n not in have)]}
