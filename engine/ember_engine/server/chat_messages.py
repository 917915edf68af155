"""A chat request's messages as the OpenAI API defines them: roles, text content, an assistant's earlier tool
calls and a tool message's answer; each refused by name where OpenAI refuses it, and rendered as chat
templates read them."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    """An assistant's earlier tool call, as OpenAI requires it in a conversation."""

    model_config = ConfigDict(extra="ignore", strict=True)

    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    # tool calling (server/tools.py): an assistant's earlier calls, and a tool message's answer
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = Field(default=None, validate_default=True)
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_given(cls, v: str | list[TextPart] | None, info: ValidationInfo) -> Any:
        """As OpenAI: only an assistant's content may be absent (it was rendered as an empty turn)."""
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of text parts)")
        return v

    @field_validator("tool_call_id")
    @classmethod
    def _call_answered(cls, v: str | None, info: ValidationInfo) -> str | None:
        """As OpenAI: a tool message names the call it answers."""
        if v is None and info.data.get("role") == "tool":
            raise ValueError("a tool message needs tool_call_id (the id of the call it answers)")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_message(self) -> dict[str, Any]:
        # "developer" is the newer name of "system"; templates know only the latter.
        msg: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(),
        }
        if self.tool_calls:
            msg["tool_calls"] = [_template_call(c.model_dump()) for c in self.tool_calls]
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            msg["name"] = self.name
        return msg


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier tool call as templates read it: `function.arguments` as an object (the
    OpenAI wire form is JSON text; text that is not JSON stays text), also at the top level."""
    fn = call["function"]
    with contextlib.suppress(json.JSONDecodeError):
        fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "name": fn["name"], "arguments": fn["arguments"]}
