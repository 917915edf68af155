"""What a request's output must match, as llguidance's grammar text: the part of constrained decoding that
needs no torch, so that the router reads requests (tools, response formats) without it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

_ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
# No free whitespace between JSON tokens: a model cannot pad its answer until max_tokens runs out.
_COMPACT: Any = {"whitespace_flexible": False}


# llguidance's error when a mask allows nothing, not even EOS: no text continues the output so far.
DEAD_END_ERROR = "NoExtensionBias"
# A request's error when its output reached such a dead end (the constraint's fault, not the engine's).
DEAD_END = "the constraint admits no continuation of the output so far"


class GrammarError(ValueError):
    """The constraint cannot be compiled; the message names the problem."""


@dataclass(frozen=True, slots=True)
class Constraint:
    kind: ConstraintKind
    value: Any = None  # a schema (dict or JSON text), a regex, a list of strings, or Lark source

    def lark(self) -> str:
        """The constraint as llguidance's grammar text; GrammarError when it is malformed."""
        from llguidance import LLMatcher

        try:
            if self.kind == "json_object":
                return LLMatcher.grammar_from_json_schema(_ANY_JSON_OBJECT, defaults=_COMPACT)
            if self.kind == "json_schema":
                schema = json.loads(self.value) if isinstance(self.value, str) else self.value
                if not isinstance(schema, dict):
                    raise GrammarError("a JSON schema must be an object")
                return LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(str(self.value))
            if self.kind == "choice":
                choices = list(self.value or [])
                if not choices or not all(isinstance(c, str) for c in choices):
                    raise GrammarError("choice must be a non-empty list of strings")
                return LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                )
            return LLMatcher.grammar_from_lark(str(self.value))
        except (ValueError, TypeError) as exc:
            if isinstance(exc, GrammarError):
                raise
            raise GrammarError(str(exc)) from exc
