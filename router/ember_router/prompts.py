"""A request's prompt as the engines will see it: the same chat template and tokenizer, so the router's
block hashes are the engines' block hashes."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from ember_engine.core.kv_events import prefix_hashes
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.chat import ChatTemplateError
from ember_engine.server.chat_prompt import chat_prompt_ids
from ember_engine.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from ember_engine.server.tools import plan_tools


def prompt_token_ids(tokenizer: Tokenizer, body: Any, chat: bool) -> list[int] | None:
    """The first prompt's token ids, or None when the body is not a request the engine would accept (it is
    then routed by load, and the engine answers the error)."""
    try:
        if chat:
            request = ChatCompletionRequest.model_validate(body)
            tools = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
            return chat_prompt_ids(tokenizer, request, tools)
        completion = CompletionRequest.model_validate(body)
        prompts = completion.prompts()
        if not prompts:
            return None
        first = prompts[0]
        return tokenizer.encode(first) if isinstance(first, str) else list(first)
    except (ValidationError, ChatTemplateError, APIError, ValueError, TypeError):
        return None


def request_hashes(
    tokenizer: Tokenizer, body: Any, chat: bool, block_size: int | None
) -> tuple[list[int], int]:
    """(The prompt's chained block hashes, its token count); empty when it cannot be read."""
    ids = prompt_token_ids(tokenizer, body, chat)
    if ids is None or not block_size:
        return [], len(ids or [])
    salt = body.get("cache_salt") if isinstance(body, dict) else None
    return prefix_hashes(ids, block_size, salt if isinstance(salt, str) else None), len(ids)
