"""What ember's chat path answers (a `chat.completion` body, or its stream of chunks) in the Responses
API's shapes: a `response` object whose output is a message item and function_call items, and the
stream's typed events (`response.created` ... `response.completed`), each numbered."""

from __future__ import annotations

import json
import secrets
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ember_engine.server.responses_request import LOGPROBS_INCLUDE


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def _text_part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}


def _message(item_id: str, status: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": parts}


@dataclass
class Shell:
    """One response's id and the request's settings it echoes."""

    body: dict[str, Any]  # the Responses API request
    model: str
    store: bool
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    @property
    def logprobs(self) -> bool:
        return self.body.get("top_logprobs") is not None or LOGPROBS_INCLUDE in (
            self.body.get("include") or []
        )

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: dict[str, Any] | None = None,
        finish: str | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        fmt = (b.get("text") or {}).get("format") or {"type": "text"}
        incomplete = {"reason": "max_output_tokens"} if finish == "length" else None
        if incomplete is not None and status == "completed":
            status = "incomplete"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "max_tool_calls": None,
            "metadata": b.get("metadata") or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "previous_response_id": b.get("previous_response_id"),
            "prompt_cache_key": b.get("prompt_cache_key"),
            "reasoning": None,
            "safety_identifier": b.get("safety_identifier"),
            "service_tier": "default",
            "store": self.store,
            "temperature": b.get("temperature", 1.0),
            "text": {"format": fmt},
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": b.get("tools") or [],
            "top_logprobs": b.get("top_logprobs"),
            "top_p": b.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": usage,
            "user": b.get("user"),
        }


def from_chat(shell: Shell, chat: dict[str, Any]) -> dict[str, Any]:
    """The response object of a `chat.completion` body (one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        lps = (choice.get("logprobs") or {}).get("content") or [] if shell.logprobs else []
        output.append(_message(new_id("msg"), "completed", [_text_part(message.get("content") or "", lps)]))
    output.extend(_function_call(c) for c in calls)
    return shell.response("completed", output, usage_of(chat.get("usage")), choice["finish_reason"])


def input_items(value: Any) -> list[dict[str, Any]]:
    """A request's `input` as the items `GET /v1/responses/{id}/input_items` lists, each with an id."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    items = []
    for item in value:
        kind = item.get("type", "message")
        if kind == "message":
            content = item["content"]
            part = "output_text" if item["role"] == "assistant" else "input_text"
            parts = [{"type": part, "text": content}] if isinstance(content, str) else content
            items.append(
                {
                    "type": "message",
                    "id": new_id("msg"),
                    "role": item["role"],
                    "content": parts,
                    "status": "completed",
                }
            )
        else:
            prefix = "fc" if kind == "function_call" else "fco"
            items.append({**item, "id": item.get("id") or new_id(prefix), "status": "completed"})
    return items


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the chat messages a later turn continues from (`previous_response_id`)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        else:
            call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"]}}
            call["function"]["arguments"] = item["arguments"]
            if messages and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


class StreamEvents:
    """The Responses API events of one chat stream: `start()` first, `chunk()` for each chat chunk (or
    error body), `end()` once the chat stream is done; each returns the server-sent events to send."""

    def __init__(self, shell: Shell, obfuscate: bool = False) -> None:
        self.shell, self.obfuscate = shell, obfuscate
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # items done
        self.message: dict[str, Any] | None = None  # the message item being written
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None
        self.final: dict[str, Any] | None = None  # the response as it ended

    def _event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'), allow_nan=False)}\n\n"

    def _delta(self, kind: str, **fields: Any) -> str:
        if self.obfuscate:  # random padding, so a delta's size does not tell its text's length
            fields["obfuscation"] = secrets.token_urlsafe(secrets.randbelow(12) + 1)
        return self._event(kind, **fields)

    def start(self) -> list[str]:
        shown = self.shell.response("in_progress", [])
        return [
            self._event("response.created", response=shown),
            self._event("response.in_progress", response=shown),
        ]

    def _open_message(self) -> list[str]:
        self.message = _message(new_id("msg"), "in_progress", [_text_part("", [])])
        index = len(self.output)
        added = {**self.message, "content": []}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event(
                "response.content_part.added",
                item_id=self.message["id"],
                output_index=index,
                content_index=0,
                part=_text_part("", []),
            ),
        ]

    def _close_message(self) -> list[str]:
        if self.message is None:
            return []
        message, self.message = self.message, None
        part, index = message["content"][0], len(self.output)
        message["status"] = "completed"
        self.output.append(message)
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"]),
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=index, item=message),
        ]

    def _call(self, call: dict[str, Any]) -> list[str]:
        events = self._close_message()
        item, index = _function_call(call), len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        events += [
            self._event(
                "response.output_item.added",
                output_index=index,
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._delta("response.function_call_arguments.delta", **where, delta=item["arguments"]),
            self._event(
                "response.function_call_arguments.done",
                **where,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]
        self.output.append(item)
        return events

    def chunk(self, data: dict[str, Any]) -> list[str]:
        if "error" in data:  # the chat stream ended with an error body
            return self._fail(data["error"])
        if not data.get("choices"):  # the usage chunk
            self.usage = usage_of(data.get("usage"))
            return []
        choice = data["choices"][0]
        delta = choice.get("delta") or {}
        events: list[str] = []
        text = delta.get("content") or ""
        lps = (choice.get("logprobs") or {}).get("content") or [] if self.shell.logprobs else []
        if text or lps:
            if self.message is None:
                events += self._open_message()
            assert self.message is not None
            part = self.message["content"][0]
            part["text"] += text
            part["logprobs"] += lps
            events.append(
                self._delta(
                    "response.output_text.delta",
                    item_id=self.message["id"],
                    output_index=len(self.output),
                    content_index=0,
                    delta=text,
                    logprobs=lps,
                )
            )
        for call in delta.get("tool_calls") or []:
            events += self._call(call)
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            if not self.output and self.message is None:  # nothing was said: an empty message, as unstreamed
                events += self._open_message()
            events += self._close_message()
        return events

    def _fail(self, error: dict[str, Any]) -> list[str]:
        events = [
            self._event(
                "error", code=error.get("code"), message=error.get("message", ""), param=error.get("param")
            )
        ]
        failure = {"code": error.get("code") or "server_error", "message": error.get("message", "")}
        self.final = self.shell.response("failed", self.output, self.usage, error=failure)
        return [*events, self._event("response.failed", response=self.final)]

    def end(self) -> list[str]:
        if self.final is not None:  # failed: its events are sent
            return []
        events = self._close_message()
        self.final = self.shell.response("completed", self.output, self.usage, self.finish)
        kind = "response.incomplete" if self.final["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=self.final)]
