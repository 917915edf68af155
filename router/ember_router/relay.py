"""Pieces of the router's answers: a stream relayed event by event (so that an engine that breaks off
mid-stream can be followed by a whole error event), and the router's own errors in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

# An SSE event ends with a blank line: two line ends, each LF, CRLF or CR (the format allows all three).
_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r", b"\n\r\n", b"\r\n\n")


class EventFramer:
    """Cuts a byte stream into whole SSE events: `feed` returns what ends at an event's end, keeping the
    rest for the next chunk (engines write whole events, so this holds nothing back in practice)."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = self._held + chunk
        cut = max((i + len(end) for end in _ENDS if (i := data.rfind(end)) >= 0), default=0)
        self._held = data[cut:]
        return data[:cut]

    def rest(self) -> bytes:
        """What came after the last whole event (passed on where the stream ended cleanly)."""
        held, self._held = self._held, b""
        return held


class StreamIdle(Exception):
    """The upstream sent nothing of a stream for the stream idle timeout."""


async def chunks(content: aiohttp.StreamReader, idle: float | None) -> AsyncIterator[bytes]:
    """A body's pieces as they come; raises StreamIdle when the next takes longer than `idle` seconds (None:
    no limit but the session's own read deadline, whose TimeoutError passes as it is)."""
    while True:
        if idle is None:
            chunk = await content.readany()
        else:
            deadline = asyncio.timeout(idle)
            try:
                async with deadline:
                    chunk = await content.readany()
            except TimeoutError:
                if deadline.expired():
                    raise StreamIdle from None
                raise
        if not chunk:
            return
        yield chunk


def error_event(message: str, code: str) -> bytes:
    """A stream's last events where the server could not finish it, as the engines end theirs: the error,
    then `[DONE]`."""
    error = {"message": message, "type": "upstream_error", "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\ndata: [DONE]\n\n".encode()


def error_response(
    status: int, message: str, type_: str, code: str | None, retry_after: int | None = None
) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": code}}
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return web.json_response(body, status=status, headers=headers)


_CODES = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """The HTTP errors of the router itself (an unknown route, a wrong method, a body over its limit) in
    OpenAI's shape, as the engines answer them."""
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        response = error_response(e.status, e.text or e.reason, kind, _CODES.get(e.status))
        if e.status == 405 and "Allow" in e.headers:
            response.headers["Allow"] = e.headers["Allow"]
        return response
