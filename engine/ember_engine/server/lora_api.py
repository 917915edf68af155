"""LoRA adapters loaded and unloaded while the server runs, with vLLM's endpoints and bodies:
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter {"lora_name"}`.
Off unless `ember serve --allow-runtime-lora-updates`: they read any directory the server can, as the
server's user. Each answers as vLLM's do, a line of text, or an OpenAI-style error naming the field."""

from __future__ import annotations

import asyncio

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict

from ember_engine.core.adapter_updates import AdapterInUse, add_adapter, remove_adapter
from ember_engine.core.config import adapter_name_problem
from ember_engine.model.lora_files import AdapterError, read_adapter
from ember_engine.server.errors import still_loading
from ember_engine.server.protocol import APIError
from ember_engine.server.state import ServerState
from ember_engine.server.tokenize_api import CheckedBody


class _Body(CheckedBody):  # a lone surrogate names no file, and no answer can hold it
    model_config = ConfigDict(extra="forbid", strict=True)


class LoadLoraRequest(_Body):
    lora_name: str
    lora_path: str


class UnloadLoraRequest(_Body):
    lora_name: str


def add_lora_routes(app: FastAPI, state: ServerState) -> None:
    def engine():  # -> AsyncEngine
        if not state.lora_updates:
            raise APIError(
                404,
                "runtime LoRA updates are off on this server (ember serve --allow-runtime-lora-updates)",
                code="not_found",
            )
        if state.engine is None:
            raise still_loading(state.policy.policy.load_shedding.retry_after_seconds)
        return state.engine

    @app.post("/v1/load_lora_adapter")
    async def load(body: LoadLoraRequest) -> PlainTextResponse:
        ae = engine()
        name = body.lora_name
        if (problem := adapter_name_problem(name)) is not None:
            raise APIError(400, f"lora_name: {problem}", param="lora_name")
        if name in state.model_names or name in state.loras:
            what = "the model's own name" if name in state.model_names else "already loaded"
            raise APIError(400, f"lora_name: {name!r} is {what}", param="lora_name")
        config = ae.engine.model_config
        try:
            adapter = await asyncio.to_thread(read_adapter, name, body.lora_path, config)
            await ae.call(lambda e: add_adapter(e, adapter))
        except AdapterError as exc:
            raise APIError(400, f"lora_path: {exc}", param="lora_path") from exc
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from exc
        state.loras[name] = body.lora_path
        state.metrics.set_loras_loaded(len(state.loras))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(body: UnloadLoraRequest) -> PlainTextResponse:
        ae = engine()
        name = body.lora_name
        try:
            await ae.call(lambda e: remove_adapter(e, name))
        except KeyError:
            raise APIError(
                404, f"lora_name: no adapter {name!r} is loaded", param="lora_name", code="not_found"
            ) from None
        except AdapterInUse as exc:
            raise APIError(409, str(exc), param="lora_name", code="adapter_in_use") from exc
        state.loras.pop(name, None)
        state.metrics.set_loras_loaded(len(state.loras))
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
