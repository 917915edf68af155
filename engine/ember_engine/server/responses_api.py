"""OpenAI's Responses API on one engine: `POST /v1/responses` (whole or streamed), run as a chat request
(`responses_request`) and answered in the Responses shapes (`responses_output`); with a response store
(`ember serve --responses-store N`), `previous_response_id`, `GET` and `DELETE /v1/responses/{id}`.

The store is this server's memory: the last N responses and the conversation each ends (fewer where
they would pass `--responses-store-bytes`), gone when the server stops. Without one, responses are not
kept (`store: false` in each), and a request that asks for keeping or continuing one is refused by name."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ember_engine.server.answers import _TicketedStream
from ember_engine.server.protocol import APIError, ChatCompletionRequest
from ember_engine.server.responses_output import (
    Shell,
    StreamEvents,
    from_chat,
    input_items,
    output_messages,
)
from ember_engine.server.responses_request import RESPONSE_ID_HEADER, ResponsesBody, chat_body, input_messages
from ember_engine.server.state import ServerState

Serve = Callable[[ServerState, Request, ChatCompletionRequest, bool], Awaitable[Response]]
# The chat request's field names, as the Responses API spells them, in the errors a request gets.
_SPELLED = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


@dataclass(slots=True)
class Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the conversation it ends, as chat messages (a continuation's start)
    items: list[dict[str, Any]]  # its own input, as items (`input_items`)
    nbytes: int = 0  # as JSON text, set when stored


class ResponseStore:
    """The last `size` responses, by id, and fewer where together they would pass `max_bytes`, each counted
    as the JSON text of the response, the conversation it ends and its input items (each keeps its whole
    conversation, so a long chat's continuations grow the store fastest). The newest is kept whatever its
    size."""

    def __init__(self, size: int, max_bytes: int) -> None:
        self.size = size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def put(self, stored: Stored) -> None:
        self.delete(stored.response["id"])
        stored.nbytes = len(json.dumps([stored.response, stored.messages, stored.items]))
        self._items[stored.response["id"]] = stored
        self.nbytes += stored.nbytes
        while len(self._items) > self.size or (self.nbytes > self.max_bytes and len(self._items) > 1):
            self.nbytes -= self._items.popitem(last=False)[1].nbytes

    def get(self, response_id: str) -> Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        gone = self._items.pop(response_id, None)
        if gone is not None:
            self.nbytes -= gone.nbytes
        return gone is not None


def _not_found(response_id: str) -> APIError:
    return APIError(
        404, f"response {response_id!r} not found", param="response_id", code="response_not_found"
    )


def _spelled(param: str) -> str:
    head, _, rest = param.partition(".")
    if head == "messages":  # the chat messages' indices are not the input's: the field alone
        return "input"
    return _SPELLED.get(head, head) + (f".{rest}" if rest else "")


def _respelled(exc: APIError) -> APIError:
    param = None if exc.param is None else _spelled(exc.param)
    if param == exc.param:
        return exc
    message = exc.message
    if exc.param and message.startswith(exc.param):
        message = f"{param}{message[len(exc.param) :]}"
    return APIError(exc.status, message, exc.type, param, exc.code, exc.headers)


def add_responses_routes(app: FastAPI, state: ServerState, serve: Serve) -> None:
    @app.post("/v1/responses", response_model=None)
    async def create(request: Request, given: ResponsesBody) -> Response:
        body = given.fields()
        store = state.responses
        wanted = body.get("store")
        if wanted and store is None:
            raise APIError(
                400, "store: this server keeps no responses (ember serve --responses-store N)", param="store"
            )
        history: list[dict[str, Any]] = []
        previous = body.get("previous_response_id")
        if previous is not None:
            if store is None:
                raise APIError(
                    400,
                    "previous_response_id: this server keeps no responses (ember serve --responses-store N)",
                    param="previous_response_id",
                )
            found = store.get(previous)
            if found is None:
                raise APIError(
                    404,
                    f"previous_response_id: no stored response {previous!r}",
                    param="previous_response_id",
                    code="response_not_found",
                )
            history = found.messages
        keep = store is not None and wanted is not False
        try:
            chat = ChatCompletionRequest.model_validate(chat_body(body, history))
        except ValidationError as exc:
            errors = [
                {**e, "loc": tuple(_spelled(".".join(map(str, e["loc"]))).split("."))} for e in exc.errors()
            ]
            raise RequestValidationError(errors) from None
        named = body["model"] in state.loras or body["model"] in state.model_names
        shell = Shell(body, body["model"] if named else state.model_name, keep)
        try:
            answer = await serve(state, request, chat, True)
        except APIError as exc:
            raise _respelled(exc) from None
        conversation = [*history, *input_messages(body["input"])]

        def kept(response: dict[str, Any]) -> None:
            if keep and store is not None and response["status"] != "failed":
                messages = conversation + output_messages(response["output"])
                store.put(Stored(response, messages, input_items(body["input"])))

        if isinstance(answer, _TicketedStream):  # ours (a fallback's relayed answer is already its own)
            obfuscate = bool((body.get("stream_options") or {}).get("include_obfuscation"))
            answer.body_iterator = _events(answer.body_iterator, StreamEvents(shell, obfuscate), kept)
        elif isinstance(answer, JSONResponse) and answer.status_code == 200:
            chat_answer = json.loads(bytes(answer.body))
            if chat_answer.get("object") == "chat.completion":
                response = from_chat(shell, chat_answer)
                kept(response)
                headers = {k: v for k, v in answer.headers.items() if k.lower() == "warning"}
                answer = JSONResponse(response, headers=headers)
        if keep and answer.status_code == 200:  # where it is kept: a router sends continuations here
            answer.headers[RESPONSE_ID_HEADER] = shell.id
        return answer

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> JSONResponse:
        found = state.responses.get(response_id) if state.responses is not None else None
        if found is None:
            raise _not_found(response_id)
        return JSONResponse(found.response)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(
        response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> JSONResponse:
        """OpenAI's list: newest first unless `order=asc`, `limit` (1 to 100) at a time after the item `after`."""
        found = state.responses.get(response_id) if state.responses is not None else None
        if found is None:
            raise _not_found(response_id)
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit: must be 1 to 100, got {limit}", param="limit")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order: must be 'asc' or 'desc', got {order!r}", param="order")
        items = found.items if order == "asc" else found.items[::-1]
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise APIError(400, f"after: no input item {after!r} in this response", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return JSONResponse(
            {
                "object": "list",
                "data": page,
                "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None,
                "has_more": len(items) > limit,
            }
        )

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> JSONResponse:
        if state.responses is None or not state.responses.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})


async def _events(
    chat: AsyncIterable[Any], events: StreamEvents, kept: Callable[[dict[str, Any]], None]
) -> AsyncIterator[str]:
    """The Responses events of a chat stream's server-sent events."""
    for event in events.start():
        yield event
    async for raw in chat:
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        for line in text.splitlines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                continue
            for event in events.chunk(json.loads(data)):
                yield event
    for event in events.end():
        yield event
    if events.final is not None:
        kept(events.final)
