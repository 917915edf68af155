"""Tool calling: the request's tools and tool_choice, the grammar that enforces a required or named call,
and the parser that finds calls in the model's text (also incrementally, for streams).

Calls are written the way the chat template shows the model its earlier calls, one block each:
`<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`. With `tool_choice` `required` or a named
function the output is constrained to such blocks, whose arguments follow each function's JSON schema.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from ember_engine.sample.constraint import Constraint
from ember_engine.server.protocol import APIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# As OpenAI checks a function's (and a response format's) name.
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NAME_RULE = "must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-'"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What a chat request does with tools: render them, parse calls, and maybe force a call."""

    tools: list[dict[str, Any]]  # the function definitions, as the template receives them
    parse: bool  # tool_choice is not "none"
    parallel: bool
    constraint: Constraint | None  # set for "required" and a named function


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise APIError(
                400, f"tools[{i}]: must be {{'type': 'function', 'function': {{...}}}}", param="tools"
            )
        name, where = fn.get("name"), f"tools[{i}].function.name"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise APIError(400, f"{where}: {NAME_RULE}, got {name!r}", param=where)
        if name in out:  # the template would show the model only one of them
            first = next(j for j, t in enumerate(tools) if t["function"]["name"] == name)
            raise APIError(400, f"{where}: {name!r} is also tools[{first}]'s name", param=where)
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools[{i}].function.parameters: must be a JSON schema", param="tools")
        try:  # against its metaschema (2020-12 unless its `$schema` says), as OpenAI checks it
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            where = "".join(f"[{p!r}]" for p in e.path)
            raise APIError(
                400,
                f"tools[{i}].function.parameters: not a JSON schema: {e.message} (at {where or 'its root'})",
                param="tools",
            ) from None
        out[name] = {**fn, "parameters": params}
    return out


def call_grammar(functions: dict[str, dict[str, Any]], parallel: bool) -> Constraint:
    """A Lark grammar (llguidance's dialect, with inline JSON schemas) for one call block, or several
    separated by newlines, each naming one of `functions` with arguments that follow its schema."""
    rules = []
    for i, (name, fn) in enumerate(functions.items()):
        # The arguments are a rule of their own, their schema whole at its root, so that its `$ref`s into
        # its own `$defs` (every nested pydantic model has them) resolve.
        head = json.dumps(
            f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ', ensure_ascii=False
        )
        arguments = {**fn["parameters"], "x-guidance": {"whitespace_flexible": False}}
        rules += [f'fn{i}: {head} args{i} "}}"', f"args{i}: %json {json.dumps(arguments)}"]
    alternatives = " | ".join(f"fn{i}" for i in range(len(functions)))
    repeat = ' ("\\n" call)*' if parallel else ""
    source = "\n".join(
        [f"start: call{repeat}", f'call: "{OPEN}\\n" body "\\n{CLOSE}"', f"body: {alternatives}", *rules]
    )
    return Constraint("grammar", source)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan | None:
    """None when the request has no tools; APIError naming the field for a bad one."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: requires tools", param="tool_choice")
        if parallel is not None:  # as OpenAI: only allowed when tools are given
            raise APIError(
                400, "parallel_tool_calls: only allowed when tools are given", param="parallel_tool_calls"
            )
        return None
    functions = _functions(tools)
    parallel = True if parallel is None else parallel
    choice = "auto" if tool_choice is None else tool_choice
    rendered = [{"type": "function", "function": fn} for fn in functions.values()]
    if choice in ("auto", "none"):
        return ToolPlan(rendered, choice == "auto", parallel, None)
    if choice == "required":
        return ToolPlan(rendered, True, parallel, call_grammar(functions, parallel))
    name = None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
    if not isinstance(name, str):
        raise APIError(
            400,
            "tool_choice: must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
            param="tool_choice",
        )
    if name not in functions:
        raise APIError(400, f"tool_choice: no tool named {name!r}", param="tool_choice")
    return ToolPlan(rendered, True, False, call_grammar({name: functions[name]}, False))


def _parse_block(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, parallel: bool = True) -> tuple[str, list[ToolCall]]:
    """(content outside the call blocks, the calls). A block that does not parse stays in the content."""
    content: list[str] = []
    calls: list[ToolCall] = []
    rest = text
    while True:
        start = rest.find(OPEN)
        end = rest.find(CLOSE, start + len(OPEN)) if start >= 0 else -1
        if start < 0 or end < 0:
            content.append(rest)
            break
        call = _parse_block(rest[start + len(OPEN) : end].strip())
        if call is None or (calls and not parallel):
            content.append(rest[: end + len(CLOSE)])
        else:
            content.append(rest[:start])
            calls.append(call)
        rest = rest[end + len(CLOSE) :]
    joined = "".join(content)
    # Whitespace at the end goes with calls; at the start it stays (as vLLM's Hermes parser keeps the text
    # before a call as written): a stream has sent it before it knows whether a call follows.
    return (joined.rstrip() if calls else joined), calls


class ToolStream:
    """Incremental parsing for a stream: `feed` returns (content delta, finished calls). Text that could
    still become a call block is held back until it is decided."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self._buffer = ""
        self.calls: list[ToolCall] = []
        # Whitespace at the end of the text so far, sent once more text follows: an answer with calls has
        # no whitespace at its end (`parse_tool_calls`), and the stream's content adds up to the same.
        self._held = ""

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._buffer += delta
        out: list[str] = []
        new: list[ToolCall] = []
        while self._buffer:
            start = self._buffer.find(OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buffer, OPEN)
                out.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            out.append(self._buffer[:start])
            self._buffer = self._buffer[start:]
            end = self._buffer.find(CLOSE)
            if end < 0:
                if final:
                    out.append(self._buffer)
                    self._buffer = ""
                break
            block = self._buffer[: end + len(CLOSE)]
            self._buffer = self._buffer[end + len(CLOSE) :]
            call = _parse_block(block[len(OPEN) : -len(CLOSE)].strip())
            if call is None or (self.calls and not self.parallel):
                out.append(block)
            else:
                self.calls.append(call)
                new.append(call)
        text = self._held + "".join(out)
        body = text.rstrip() if self.calls or not final else text
        self._held = "" if final else text[len(body) :]
        return body, new


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
