"""The endpoints beside generation, as vLLM's server has them: /tokenize, /detokenize, /v1/models/{id} and
/version."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from ember_engine import __version__
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.chat import ChatTemplateError, render_chat
from ember_engine.server.chat_messages import ChatMessage
from ember_engine.server.errors import still_loading
from ember_engine.server.protocol import APIError, checked_template_kwargs
from ember_engine.server.state import ServerState
from ember_engine.server.text_checks import lone_surrogate
from ember_engine.server.tools import plan_tools


class CheckedBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    def model_post_init(self, _: Any) -> None:
        problem = lone_surrogate(self.model_dump())
        if problem is not None:
            raise APIError(400, problem, param=problem.split(":", 1)[0])


class TokenizeRequest(CheckedBody):
    """Either `prompt` (text, tokenized as completions do) or `messages` (rendered as chat does)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None  # rendered as chat renders them
    return_token_strs: bool = False


class DetokenizeRequest(CheckedBody):
    model: str | None = None
    tokens: list[int]


def _check_model(state: ServerState, model: str | None) -> None:
    state.lora_of(model)  # an adapter tokenizes as its model does


def _tokenize(tok: Tokenizer, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "prompt: give either prompt or messages", param="prompt")
    if body.messages is None:
        assert body.prompt is not None
        return tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    messages = [m.template_message() for m in body.messages]
    plan = plan_tools(body.tools, None, None)
    try:
        text = render_chat(
            tok,
            messages,
            body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            extra=checked_template_kwargs(body.chat_template_kwargs),
            tools=None if plan is None else plan.tools,
        )
    except ChatTemplateError as exc:
        raise APIError(400, f"{exc.param}: {exc}", param=exc.param) from exc
    return tok.encode(text, add_special_tokens=False)


def add_tokenize_routes(app: FastAPI, state: ServerState) -> None:
    def engine_tokenizer() -> tuple[Tokenizer, int]:
        if state.engine is None:  # answered as completions are while loading (they are shed: not_ready)
            raise still_loading(state.policy.policy.load_shedding.retry_after_seconds)
        return state.engine.tokenizer, state.engine.engine.max_model_len

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        tok, max_len = engine_tokenizer()
        ids = await asyncio.to_thread(_tokenize, tok, body)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": max_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = [tok.decode([t], skip_special_tokens=False) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        _check_model(state, body.model)
        tok, _ = engine_tokenizer()
        vocab = state.engine.engine.model_config.vocab_size if state.engine else 0
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(
                400, f"tokens: token id {bad} is outside the vocabulary (size {vocab})", param="tokens"
            )
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens, False)}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id not in state.model_names and model_id not in state.loras:
            raise APIError(
                404, f"model: {model_id!r} is not served here", param="model", code="model_not_found"
            )
        return model_card(state, model_id)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def model_card(state: ServerState, name: str | None = None) -> dict[str, Any]:
    """The entry of `/v1/models` of one of the model's names (None: its first), or a LoRA adapter's: its
    `parent` the model, its `root` its directory (as vLLM lists adapters)."""
    max_len = state.engine.engine.max_model_len if state.engine else None
    lora = name if name in state.loras else None
    card = {
        "id": name or state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "ember",
        "max_model_len": max_len,
    }
    if lora is not None:
        card.update(root=state.loras[lora], parent=state.model_name)
    return card
