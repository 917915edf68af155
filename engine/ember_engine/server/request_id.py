"""Every answer carries an `X-Request-Id`: the client's own when it sent one (a router in front forwards the
one it gave the request), else one made here, so that a client can name a request in a report and find it
in the engine's log. An ASGI layer, so streams and the errors of every layer below carry it too."""

from __future__ import annotations

import uuid

from ember_engine.server.body_limit import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
SCOPE_KEY = "ember.request_id"
MAX_LENGTH = 256  # a longer (or unprintable) id is not taken: the request gets one of its own


def usable(value: str) -> bool:
    """Whether a client's id can be sent back as a header value as it is."""
    return 0 < len(value) <= MAX_LENGTH and all(" " < c <= "~" for c in value)


def new_id() -> str:
    return uuid.uuid4().hex


def request_id(scope: Scope) -> str | None:
    return scope.get(SCOPE_KEY)


class RequestId:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == HEADER), "")
        rid = given if usable(given) else new_id()
        scope[SCOPE_KEY] = rid

        async def stamped(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != HEADER]
                message["headers"] = [*headers, (HEADER, rid.encode())]
            await send(message)

        await self.app(scope, receive, stamped)
