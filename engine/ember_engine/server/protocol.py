"""The OpenAI request bodies ember accepts, and their translation into SamplingParams.

Undeclared fields are kept aside (`model_extra`) for `unknown_fields`, which refuses or warns; ember's extensions
(`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `priority`, `timeout`, ...) travel
as extra body fields, the way the `openai` client's `extra_body` sends them.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    field_validator,
    model_validator,
)

from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.server.chat_messages import ChatMessage
from ember_engine.server.text_checks import valid_unicode

MAX_N = 16
# An integer written out in ASCII digits: str.isdigit() also takes "²" and other digits int() refuses.
INTEGER = re.compile(r"-?[0-9]+")


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far in every chunk


RESERVED_TEMPLATE_NAMES = frozenset({"messages", "bos_token", "eos_token", "raise_exception"})


def checked_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """chat_template_kwargs, minus none of the names the server itself passes to the template."""
    clash = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_NAMES)
    if clash:
        raise APIError(
            400, f"chat_template_kwargs: {clash[0]!r} is set by the server", param="chat_template_kwargs"
        )
    return dict(kwargs or {})


class _SamplingFields(BaseModel):
    # Undeclared fields are kept (model_extra) so the server can refuse or warn about them. Strict, as
    # OpenAI checks types: a value of another JSON type is refused, not converted (`max_tokens: true` ran
    # 1 token, completions' `logprobs: true` gave one top logprob, `stream: "yes"` streamed); an integer
    # is still a number.
    model_config = ConfigDict(extra="allow", strict=True)

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # ember / vLLM extensions
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: str | StrictInt | None = None  # a priority class name (or its number; not a bool)
    timeout: float | None = Field(default=None, gt=0.0, allow_inf_nan=False)  # seconds; the deadline
    cache_salt: str | None = None
    # structured outputs (server/structured.py): OpenAI's response_format and vLLM's spellings
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias added to its logit
    return_tokens_as_token_ids: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # vLLM's: each prompt token's logprob
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: the model's)
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these token ids
    bad_words: list[str] | None = None  # vLLM's: words never generated

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        data = valid_unicode(data)
        if isinstance(data, dict):  # OpenAI's fields are nullable: null is "not given", so the default
            fields = cls.model_fields
            data = {
                k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()
            }
        return data

    @model_validator(mode="after")
    def _stream_options_with_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:  # as OpenAI and vLLM refuse it
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else v or []
        if len(items) > 16 or any(not s for s in items):
            raise ValueError("stop must be a non-empty string or a list of up to 16 non-empty strings")
        return v

    def sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's parameters; `prompt_logprobs` the top k the prompt's tokens need (the field's, or
        more for another use of them)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            return SamplingParams(
                n=self.n,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                repetition_penalty=self.repetition_penalty,
                frequency_penalty=self.frequency_penalty,
                presence_penalty=self.presence_penalty,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                stop=stop,
                stop_token_ids=list(self.stop_token_ids or []),
                include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=_logit_bias(self.logit_bias),
            )
        except ValueError as exc:
            field = str(exc).split(":", 1)[0]
            raise APIError(400, str(exc), param=field) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not INTEGER.fullmatch(key):
            raise APIError(400, f"logit_bias: key {key!r} is not a token id", param="logit_bias")
        out[int(key)] = value
    return out


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt: must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise APIError(
                400, "suffix: not supported by this server (no fill-in-the-middle)", param="suffix"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400,
                f"best_of: only best_of == n ({self.n}) is supported, got {self.best_of}",
                param="best_of",
            )
        # With echo, logprobs covers the prompt's tokens too (the first has none), as OpenAI's legacy
        # completions and vLLM give them.
        prompt_logprobs = self.prompt_logprobs
        if self.echo_logprobs is not None:
            prompt_logprobs = max(self.echo_logprobs, prompt_logprobs or 0)
        # OpenAI's and vLLM's default for completions (chat runs to the context limit instead).
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        return self.sampling_params(max_tokens, self.logprobs, prompt_logprobs)

    @property
    def echo_logprobs(self) -> int | None:
        """The top k each echoed prompt token's logprobs carry; None when they are not given."""
        return self.logprobs if self.echo else None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """A part other than text (an image, audio, a file) is refused naming its type and place, rather
        than failing as "not a valid string"."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"messages.{i}.content.{j}: content part of type {kind!r} is not supported: "
                        "this model takes text only"
                    )
        return data

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_message() for m in self.messages]

    def to_sampling_params(self) -> SamplingParams:
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message: cannot be true while add_generation_prompt is (set it false)",
                param="continue_final_message",
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: requires logprobs to be true", param="top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self.sampling_params(self.max_completion_tokens or self.max_tokens, logprobs)
