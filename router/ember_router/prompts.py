"""A request's prompt as the engines will see it: the same chat template and tokenizer, so the router's
block hashes are the engines' block hashes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ember_engine.core.kv_events import prefix_hashes
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.chat import ChatTemplateError
from ember_engine.server.chat_prompt import chat_prompt_ids
from ember_engine.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ember_engine.server.tools import plan_tools


def prompts_token_ids(tokenizer: Tokenizer, body: Any, chat: bool) -> list[list[int]] | None:
    """Every prompt's token ids (a chat request has one, a completion one or more), or None when the body
    is not a request the engine would accept (it is then routed by load, and the engine answers the error)."""
    try:
        if chat:
            conversation = ChatCompletionRequest.model_validate(body)
            tools = plan_tools(conversation.tools, conversation.tool_choice, conversation.parallel_tool_calls)
            prompts = [chat_prompt_ids(tokenizer, conversation, tools)]
            k = conversation.truncate_prompt_tokens
        else:
            request = CompletionRequest.model_validate(body)
            prompts = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in request.prompts()]
            k = request.truncate_prompt_tokens
    except (ValidationError, ChatTemplateError, APIError, ValueError, TypeError):
        return None
    # `truncate_prompt_tokens`: the engine serves each prompt's last k tokens (-1, the model's length, is
    # not known here: those prompts are taken whole, as the engine takes any prompt within its length)
    if k is not None and k >= 1:
        prompts = [ids[-k:] for ids in prompts]
    return prompts or None


def prompt_token_ids(tokenizer: Tokenizer, body: Any, chat: bool) -> list[int] | None:
    """The first prompt's token ids (the one a request is routed by), or None as above."""
    prompts = prompts_token_ids(tokenizer, body, chat)
    return prompts[0] if prompts else None


@dataclass(frozen=True)
class Prompts:
    """A request's prompts as the engine will count them: each one's chained block hashes (empty when the
    block size is not known yet) and token count. The first prompt routes the request."""

    hashes: list[list[int]]
    lengths: list[int]

    @property
    def first_hashes(self) -> list[int]:
        return self.hashes[0] if self.hashes else []

    @property
    def first_tokens(self) -> int:
        return self.lengths[0] if self.lengths else 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def collects_prompt_logprobs(body: Any, chat: bool) -> bool:
    """Whether the engine computes the request's prompt logprobs (vLLM's `prompt_logprobs`, or completions'
    `echo` with `logprobs`): it then reads none of its prompt from the prefix cache."""
    if not isinstance(body, dict):
        return False
    echoed = not chat and body.get("echo") is True and body.get("logprobs") is not None
    return body.get("prompt_logprobs") is not None or echoed


def request_prompts(
    tokenizer: Tokenizer,
    body: Any,
    chat: bool,
    block_size: int | None,
    model: str | tuple[str, ...] | None = None,
) -> Prompts:
    """The request's prompts; none when it cannot be read. A request that collects prompt logprobs gives
    no hashes: no engine's cache serves it (it is routed by load), though its blocks are cached after.
    `model`: the name (or names) the engines serve their model by, when known; a request naming another
    model names a LoRA adapter, whose blocks the engines key by it."""
    prompts = prompts_token_ids(tokenizer, body, chat) or []
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    salt = salt if isinstance(salt, str) else None
    named = body.get("model") if isinstance(body, dict) else None
    names = (model,) if isinstance(model, str) else model
    adapter = named if names and isinstance(named, str) and named not in names else None
    if not block_size or collects_prompt_logprobs(body, chat):
        hashes: list[list[int]] = [[] for _ in prompts]
    else:
        hashes = [prefix_hashes(ids, block_size, salt, adapter) for ids in prompts]
    return Prompts(hashes, [len(ids) for ids in prompts])
