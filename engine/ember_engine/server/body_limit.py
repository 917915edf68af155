"""An ASGI layer in front of the API: stamps each request's arrival, and answers a body over the limit with
413 before the application sees it.

A declared Content-Length over the limit is refused before a byte of the body is read; a chunked body is
read up to the limit and refused as soon as it passes it. Bodies within the limit are buffered here and
handed to the application unchanged (FastAPI reads the whole body before validating it anyway).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BODY_BYTES = 16 << 20
ARRIVAL_KEY = "ember.arrival"  # the scope key holding time.monotonic() at the request's arrival


def arrival_of(scope: Scope) -> float | None:
    return scope.get(ARRIVAL_KEY)


class BodyLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[ARRIVAL_KEY] = time.monotonic()
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(send, declared)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await self._refuse(send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed, body
            if not replayed:
                replayed = True
                message = {"type": "http.request", "body": body, "more_body": False}
                body = b""
                return message
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more bytes"
        message = (
            f"body: {size} exceed the limit of {self.max_body_bytes} bytes "
            "(ember serve --max-request-body-bytes)"
        )
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": "body_too_large"}
        await send_json(send, 413, {"error": error}, [(b"connection", b"close")])


async def send_json(
    send: Send, status: int, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """A whole JSON answer, sent by an ASGI layer before (or instead of) the application."""
    payload = json.dumps(body).encode()
    start = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": [*start, *(headers or [])]})
    await send({"type": "http.response.body", "body": payload})


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
