"""A Responses API request (`POST /v1/responses`) as the chat request ember runs for it.

The body's input (a string, or a list of message, `function_call` and `function_call_output` items),
its `instructions` (a system message first), a stored conversation it continues (`previous_response_id`),
its function tools, `text.format` and `max_output_tokens` become the chat request's messages, tools,
`response_format` and `max_tokens`; ember's sampling extensions pass through as they are. What the
Responses API has and ember does not do (hosted tools, reasoning, background runs, ...) is refused by
name. Pure: the server and the router (whose prefix hashes must be the engine's) both use it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ember_engine.server.protocol import APIError
from ember_engine.server.text_checks import valid_unicode

# Fields of the Responses API ember refuses when set, and why.
_NO_REASONING = "this server runs no reasoning model"
REFUSED: dict[str, str] = {
    "background": "background responses are not supported: send the request and wait, or stream it",
    "conversation": "conversations are not kept by this server: send the items, or previous_response_id",
    "prompt": "stored prompt templates are not supported: send the input itself",
    "reasoning": _NO_REASONING,
    "max_tool_calls": "not supported: a response holds the calls of one turn",
    "context_management": "not supported by this server",
}
# Chat-completions fields that have a Responses API spelling.
CHAT_ONLY: dict[str, str] = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include ['message.output_text.logprobs'] and top_logprobs",
    "n": "one request per output (a response has one)",
    "functions": "tools",
    "function_call": "tool_choice",
}
# Fields this module turns into chat fields (the rest of the body passes through to the chat request).
OWN = {
    "input",
    "instructions",
    "max_output_tokens",
    "text",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "include",
    "top_logprobs",
    "store",
    "previous_response_id",
    "stream_options",
    "truncation",
    "metadata",
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "service_tier",
}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# The response header naming the response an answer is: a router keeps which engine has it stored.
RESPONSE_ID_HEADER = "x-ember-response-id"


class ResponsesBody(BaseModel):
    """The body's declared fields, typed as OpenAI types them (the server's schema, and a first check);
    `chat_body` reads the rest. Undeclared fields are kept: ember's extensions pass on to the chat request."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return valid_unicode(data)

    def fields(self) -> dict[str, Any]:
        """The body as sent: the fields given (a null as given) and the undeclared ones."""
        return self.model_dump(exclude_unset=True)


def _asks(value: Any) -> bool:
    """Whether a field asks for something: not null, false, nor an object whose values are (`reasoning:
    {"effort": null}`, `background: false` are what a client sends for "none"). One level: a body may nest
    as deep as the JSON parser allows."""
    if isinstance(value, dict):
        return any(v is not None and v is not False for v in value.values())
    return value is not None and value is not False


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _text(content: Any, where: str, kinds: tuple[str, ...]) -> str:
    """A message's content: a string, or a list of text parts of the given kinds."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(where, "must be a string or a list of content parts")
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            what = (
                f"content part of type {kind!r}" if isinstance(kind, str) else "a content part without a type"
            )
            raise _bad(f"{where}.{j}", f"{what} is not supported here: this model takes {' or '.join(kinds)}")
        text = part.get("text")
        if not isinstance(text, str):
            raise _bad(f"{where}.{j}.text", "must be a string")
        out.append(text)
    return "".join(out)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """The request's `input` as chat messages; APIError naming the item that cannot be one."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("input", "must be a string or a non-empty list of items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise _bad(where, "must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"{where}.role", "must be 'user', 'assistant', 'system' or 'developer'")
            kinds = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content", kinds)})
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise _bad(where, "a function_call item needs call_id, name and arguments (strings)")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"{where}.call_id", "must be a string")
            text = _text(output, f"{where}.output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _bad(f"{where}.type", f"items of type {kind!r} are not supported by this server")
    return messages


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", "must be a list")
    out = []
    for i, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools.{i}.type", f"{kind!r} tools are not supported: only 'function' tools are")
        assert isinstance(tool, dict)
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise _bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise _bad("text", "must be an object")
    if text.get("verbosity") not in (None, "medium"):  # OpenAI's default: what the model does anyway
        raise _bad(
            "text.verbosity", "only 'medium' is served: the model's length is set by max_output_tokens"
        )
    unknown = sorted(set(text) - {"format", "verbosity"})
    if unknown:
        raise _bad(f"text.{unknown[0]}", "unknown field")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format.schema", "must be a JSON schema (an object)")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise _bad("text.format.type", "must be 'text', 'json_object' or 'json_schema'")


def _check_metadata(value: Any) -> None:
    """OpenAI's limits: up to 16 keys of up to 64 characters, string values of up to 512."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 16:
        raise _bad("metadata", "must be an object of up to 16 keys")
    for key, v in value.items():
        if len(key) > 64 or not isinstance(v, str) or len(v) > 512:
            raise _bad(f"metadata.{key[:64]}", "keys of up to 64 characters, values strings of up to 512")


def chat_body(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat request a Responses API body runs as; `history` the stored conversation it continues
    (the messages before its input). APIError naming a field that is refused or malformed."""
    for name, why in REFUSED.items():
        if _asks(body.get(name)):
            raise _bad(name, why)
    for name, instead in CHAT_ONLY.items():
        if name in body:
            raise _bad(name, f"not a Responses API field: use {instead}")
    if body.get("truncation") not in (None, "disabled"):
        raise _bad("truncation", "only 'disabled' is supported: a prompt longer than the model is refused")
    if body.get("service_tier") not in (None, "auto", "default"):
        raise _bad("service_tier", "only 'auto' and 'default' are served here")
    include = body.get("include") or []
    if not isinstance(include, list) or any(v != LOGPROBS_INCLUDE for v in include):
        raise _bad("include", f"only {LOGPROBS_INCLUDE!r} is supported")
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise _bad("stream_options", "only allowed when stream is true")
        if not isinstance(options, dict) or set(options) - {"include_obfuscation"}:
            raise _bad("stream_options", "only include_obfuscation is supported")
    for name in ("user", "safety_identifier", "prompt_cache_key"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise _bad(name, "must be a string")
    _check_metadata(body.get("metadata"))
    out = {k: v for k, v in body.items() if k not in OWN}
    messages = list(history or [])
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise _bad("instructions", "must be a string")
        messages.insert(0, {"role": "system", "content": instructions})
    if "input" not in body:
        raise _bad("input", "is required")
    out["messages"] = messages + input_messages(body["input"])
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    tools = _tools(body.get("tools"))
    if tools:
        out["tools"] = tools
        out["tool_choice"] = _tool_choice(body.get("tool_choice"))
        if body.get("parallel_tool_calls") is not None:
            out["parallel_tool_calls"] = body["parallel_tool_calls"]
    elif body.get("tool_choice") not in (None, "none", "auto"):
        raise _bad("tool_choice", "requires tools")
    response_format = _response_format(body.get("text"))
    if response_format is not None:
        out["response_format"] = response_format
    top = body.get("top_logprobs")
    if top is not None or LOGPROBS_INCLUDE in include:
        out["logprobs"] = True
        out["top_logprobs"] = 0 if top is None else top
    if body.get("stream"):
        out["stream_options"] = {"include_usage": True}  # the final event carries the usage
    return out
