"""Engine outputs as OpenAI response objects and stream chunks (completions and chat)."""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ember_engine.core.outputs import CompletionOutput, Logprob
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.tools import ToolStream, parse_tool_calls


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event; a payload holding a float JSON cannot write (NaN, infinity) raises
    ValueError rather than sending one."""
    data = (
        payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), allow_nan=False)
    )
    return f"data: {data}\n\n"


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class Formatter:
    """Builds one response's objects; `chat` selects the chat shapes."""

    model: str
    tokenizer: Tokenizer
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    echo: list[str] | None = None  # completions' echo: each prompt's text, put before its choices' text
    n: int = 1  # choices per prompt (choice index // n is the prompt's)
    token_ids_as_text: bool = False  # return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    tool_calls: bool | None = None  # chat with tools: None off, else whether parallel calls are kept
    constraint: str | None = None  # the request field whose constraint the output follows
    prompt_logprobs: int | None = None  # the request's `prompt_logprobs`: returned, with this top k
    echo_logprobs: int | None = None  # completions' echo with logprobs: the prompt's come first, top k
    # per prompt (choice index // n): its token ids and the engine's prompt logprobs, once an output came
    prompts: dict[int, tuple[list[int], list[Logprob | None]]] = field(default_factory=dict)
    _tool_streams: dict[int, ToolStream] = field(default_factory=dict)
    _text_offsets: dict[int, int] = field(
        default_factory=dict
    )  # streamed completions: text so far, by choice

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _token(self, token_id: int) -> str:
        if self.token_ids_as_text:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _bytes(self, token_id: int) -> list[int]:
        return list(self.tokenizer.token_bytes(token_id))

    def _echoed(self, index: int, text: str) -> str:
        return text if self.echo is None else self.echo[index // self.n] + text

    def logprobs(
        self, items: list[Logprob] | None, text_offset: int = 0, lead: int | None = None
    ) -> dict[str, Any] | None:
        """OpenAI's logprobs object of `items`; for completions, after `lead`, a token without one."""
        if items is None:
            return None
        if self.chat:
            content = []
            for lp in items:
                tok = self._token(lp.token_id)
                top = [
                    {"token": self._token(t), "logprob": _number(v), "bytes": self._bytes(t)}
                    for t, v in lp.top
                ]
                content.append(
                    {
                        "token": tok,
                        "logprob": _number(lp.logprob),
                        "bytes": self._bytes(lp.token_id),
                        "top_logprobs": top,
                    }
                )
            return {"content": content}
        tokens, offsets, offset = [], [], text_offset
        ids = [lp.token_id for lp in items] if lead is None else [lead, *(lp.token_id for lp in items)]
        for token_id in ids:
            tok = self._token(token_id)
            tokens.append(tok)
            offsets.append(offset)
            offset += len(tok)
        none: list[None] = [] if lead is None else [None]  # the prompt's first token has no logprob
        return {
            "tokens": tokens,
            "token_logprobs": [*none, *(_number(lp.logprob) for lp in items)],
            "top_logprobs": [*none, *(self._top_with_sampled(lp) for lp in items)],
            "text_offset": offsets,
        }

    def _echoed_logprobs(self, index: int, items: list[Logprob] | None, text_offset: int = 0) -> dict | None:
        """A completion choice's logprobs, after its prompt's when echo asked for them."""
        if self.echo_logprobs is None or index // self.n not in self.prompts:
            return self.logprobs(items, text_offset)
        token_ids, entries = self.prompts[index // self.n]
        k = self.echo_logprobs
        prompt = [Logprob(e.token_id, e.logprob, e.top[:k], e.rank) for e in entries[1:] if e is not None]
        return self.logprobs([*prompt, *(items or [])], text_offset, lead=token_ids[0])

    def prompt_logprobs_field(self, prompt: int) -> list[dict[str, Any] | None] | None:
        """vLLM's `prompt_logprobs` of a prompt: null for its first token, then for each token a map from
        token id to logprob, rank and text, holding the token's own and the top k."""
        if self.prompt_logprobs is None or prompt not in self.prompts:
            return None
        out: list[dict[str, Any] | None] = [None]
        for e in self.prompts[prompt][1][1:]:
            assert e is not None
            entry = {
                str(t): {"logprob": _number(v), "rank": r + 1, "decoded_token": self._token(t)}
                for r, (t, v) in enumerate(e.top[: self.prompt_logprobs])
            }
            entry[str(e.token_id)] = {
                "logprob": _number(e.logprob),
                "rank": e.rank,
                "decoded_token": self._token(e.token_id),
            }
            out.append(entry)
        return out

    def _top_with_sampled(self, lp: Logprob) -> dict[str, Any]:
        """A completion token's top logprobs, best first, always with the sampled token's (so up to
        logprobs + 1 of them, as OpenAI gives)."""
        top = lp.top if any(t == lp.token_id for t, _ in lp.top) else [*lp.top, (lp.token_id, lp.logprob)]
        out = {self._token(t): _number(v) for t, v in sorted(top, key=lambda tv: -tv[1])}
        out[self._token(lp.token_id)] = _number(lp.logprob)  # its own, where two ids spell the same text
        return out

    def chunk(
        self, index: int, out: CompletionOutput, new_logprobs: list[Logprob] | None, first: bool
    ) -> dict:
        finish = _finish(out.finish_reason)
        if self.chat:
            delta: dict[str, Any] = {"content": out.delta_text}
            if self.tool_calls is not None:
                stream = self._tool_streams.setdefault(index, ToolStream(self.tool_calls))
                before = len(stream.calls)
                delta["content"], calls = stream.feed(out.delta_text, final=finish is not None)
                if calls:
                    delta["tool_calls"] = [c.to_dict(before + k) for k, c in enumerate(calls)]
                if stream.calls and finish == "stop":
                    finish = "tool_calls"
            if first:
                delta["role"] = "assistant"
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": self.logprobs(new_logprobs),
                "finish_reason": finish,
            }
            body = self._envelope("chat.completion.chunk", [choice])
            if first and self.prompt_logprobs is not None:  # on a choice's first chunk, as in the answer
                body["prompt_logprobs"] = self.prompt_logprobs_field(index // self.n)
            return body
        offset = self._text_offsets.get(index, 0)
        logprobs = (
            self._echoed_logprobs(index, new_logprobs, offset)
            if first
            else self.logprobs(new_logprobs, offset)
        )
        if logprobs is not None:
            self._text_offsets[index] = offset + sum(len(t) for t in logprobs["tokens"])
        choice = {
            "index": index,
            "text": self._echoed(index, out.delta_text) if first else out.delta_text,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        if out.stop_reason is not None:
            choice["stop_reason"] = out.stop_reason
        if first and self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs_field(index // self.n)
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        body = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        body["usage"] = usage.to_dict()
        return body

    def response(self, outputs: list[tuple[int, CompletionOutput]], usage: Usage) -> dict[str, Any]:
        choices = []
        for index, out in sorted(outputs, key=lambda p: p[0]):
            finish = _finish(out.finish_reason)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": out.text}
                if self.tool_calls is not None:
                    content, calls = parse_tool_calls(out.text, self.tool_calls)
                    if calls:
                        message = {
                            "role": "assistant",
                            "content": content or None,
                            "tool_calls": [c.to_dict() for c in calls],
                        }
                        finish = "tool_calls" if finish == "stop" else finish
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": self.logprobs(out.logprobs),
                        "finish_reason": finish,
                    }
                )
            else:
                choice = {
                    "index": index,
                    "text": self._echoed(index, out.text),
                    "logprobs": self._echoed_logprobs(index, out.logprobs),
                    "finish_reason": finish,
                }
                if out.stop_reason is not None:
                    choice["stop_reason"] = out.stop_reason
                if self.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self.prompt_logprobs_field(index // self.n)
                choices.append(choice)
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        if self.chat and self.prompt_logprobs is not None:  # one prompt: on the answer, as vLLM puts it
            body["prompt_logprobs"] = self.prompt_logprobs_field(0)
        body["usage"] = usage.to_dict()
        return body


# A token the sampling constraint (a grammar, a choice) rules out has probability 0: its logprob, -inf,
# is not a JSON number, and is sent as this (vLLM's value for it).
RULED_OUT_LOGPROB = -9999.0


def _number(logprob: float) -> float:
    if math.isnan(logprob):  # the model computed no number at all (e.g. NaN weights)
        raise ValueError("the model computed a logprob that is NaN")
    return max(logprob, RULED_OUT_LOGPROB)


def _finish(reason: str | None) -> str | None:
    # Aborts never reach a client as a finish reason: a deadline becomes an error instead.
    return reason if reason in ("stop", "length") else None
