"""Structured-output request fields -> one `Constraint`, and its compilation off the event loop.

Accepted spellings: OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's
`structured_outputs` object (`json`, `json_object`, `regex`, `choice`, `grammar`) and vLLM's older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may be given; a field
ember cannot honour is refused by name.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable
from threading import Lock
from typing import Any

from ember_engine.sample.grammar import Constraint, Grammar, GrammarCompiler, GrammarError
from ember_engine.server.protocol import APIError
from ember_engine.server.tools import NAME, NAME_RULE

_BACKENDS = {None, "auto", "llguidance", "guidance"}
_STRUCTURED_KEYS = {"json", "json_object", "regex", "choice", "grammar"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _response_format(value: Any) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise _bad("response_format", "must be an object with a 'type'")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _bad("response_format", "type 'json_schema' needs a 'json_schema' object")
        name = spec.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name):  # as OpenAI (vLLM too requires one)
            raise _bad("response_format.json_schema.name", f"{NAME_RULE}, got {name!r}")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise _bad("response_format", "json_schema.schema must be a JSON schema object")
        return Constraint("json_schema", schema)
    raise _bad("response_format", f"type {kind!r} is not supported (text, json_object, json_schema)")


def _structured_outputs(value: Any) -> Constraint | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _bad("structured_outputs", "must be an object")
    unknown = sorted(k for k, v in value.items() if k not in _STRUCTURED_KEYS and v not in (None, False))
    if unknown:
        raise _bad("structured_outputs", f"{', '.join(unknown)} not supported ({sorted(_STRUCTURED_KEYS)})")
    given = [k for k in sorted(_STRUCTURED_KEYS) if value.get(k) not in (None, False)]
    if len(given) > 1:
        raise _bad("structured_outputs", f"give one of {given}, not several")
    if not given:
        return None
    return _constraint_for(given[0], value[given[0]], "structured_outputs")


def _constraint_for(key: str, value: Any, param: str) -> Constraint:
    if key == "json":
        schema = value
        if isinstance(value, str):
            try:
                schema = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _bad(param, f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, dict):
            raise _bad(param, "the JSON schema must be an object")
        return Constraint("json_schema", schema)
    if key == "json_object":
        return Constraint("json_object")
    if key == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise _bad(param, "choice must be a non-empty list of strings")
        return Constraint("choice", list(value))
    if not isinstance(value, str) or not value:
        raise _bad(param, f"{key} must be a non-empty string")
    return Constraint("regex" if key == "regex" else "grammar", value)


def request_constraint(body: Any) -> tuple[str, Constraint] | None:
    """The one constraint a request body asks for and the field that asked (None: free text); APIError
    naming the field."""
    found: list[tuple[str, Constraint]] = []
    if body.response_format is not None:
        c = _response_format(body.response_format)
        if c is not None:
            found.append(("response_format", c))
    c = _structured_outputs(body.structured_outputs)
    if c is not None:
        found.append(("structured_outputs", c))
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            found.append((f"guided_{key}", _constraint_for(key, value, f"guided_{key}")))
    if body.guided_decoding_backend not in _BACKENDS:
        raise _bad("guided_decoding_backend", f"{body.guided_decoding_backend!r}: ember uses llguidance")
    if len(found) > 1:
        names = [n for n, _ in found]
        raise _bad(names[1], f"only one structured-output field may be given, got {names}")
    return found[0] if found else None


class CompileCache:
    """Compiled grammars by constraint (a repeated schema compiles once); compiles in a worker thread so
    the event loop keeps serving while a large schema compiles."""

    def __init__(self, compiler: Callable[[], GrammarCompiler], size: int = 256) -> None:
        self.compiler = compiler  # built on first use, in the worker thread (it reads the whole vocabulary)
        self.size = size
        self._cache: OrderedDict[str, Grammar] = OrderedDict()
        self._lock = Lock()

    def _compile(self, constraint: Constraint) -> Grammar:
        key = json.dumps([constraint.kind, constraint.value])  # a schema's key order orders its output
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        grammar = self.compiler().compile(constraint)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.size:
                self._cache.popitem(last=False)
        return grammar

    async def compile(self, constraint: Constraint, param: str) -> Grammar:
        try:
            return await asyncio.to_thread(self._compile, constraint)
        except GrammarError as exc:
            # A forced call's grammar is ember's own, around the tools' schemas: its listing is no help.
            why = str(exc).split("\n", 1)[0] if param == "tool_choice" else str(exc)
            raise _bad(param, f"cannot compile the {constraint.kind.replace('_', ' ')}: {why}") from None
