"""A stand-in OpenAI-compatible server for the router's fallback, on a thread of its own: what it answers is
set per test (`Answer`), and it keeps the headers of each request it gets and counts the streams whose
client left before their end."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web
from multidict import CIMultiDict

from ember_router.embedded import serving_app

MODEL = "fb-model"


@dataclass
class Answer:
    status: int = 200  # an error status answers an OpenAI-shaped error body
    retry_after: str | None = None  # the Retry-After of an error
    events: int = 5  # events of a stream before `[DONE]`
    break_after: int | None = None  # close the connection after this many events (or, not a stream, bytes)
    event_gap: float = 0.0  # seconds between events
    compress: bool = False  # compress as the request's Accept-Encoding allows
    force_gzip: bool = False  # gzip whatever the request allows
    head_delay: float = 0.0  # seconds before answering anything
    line_end: str = "\n"  # what ends each line of a stream (SSE allows LF, CRLF or CR)


@dataclass
class FakeFallback:
    url: str
    answer: Answer = field(default_factory=Answer)
    seen: list[CIMultiDict[str]] = field(default_factory=list)  # each request's headers
    left: int = 0  # streams whose client left before their end
    started: threading.Event = field(default_factory=threading.Event)  # a stream has begun

    async def _models(self, _request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.seen.append(CIMultiDict(request.headers))
        body = await request.json()
        a = self.answer
        await asyncio.sleep(a.head_delay)
        if a.status >= 400:
            headers = {"Retry-After": a.retry_after} if a.retry_after else None
            error = {
                "message": f"fallback says {a.status}",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            return web.json_response({"error": error}, status=a.status, headers=headers)
        if not body.get("stream"):
            whole = json.dumps(
                {
                    "id": "x",
                    "object": "text_completion",
                    "model": body.get("model"),
                    "choices": [{"index": 0, "text": "from the fallback " * 20, "finish_reason": "stop"}],
                }
            ).encode()
            if a.break_after is not None:  # a length it never sends in full
                response = web.StreamResponse(headers={"Content-Type": "application/json"})
                response.content_length = len(whole)
                await response.prepare(request)
                await response.write(whole[: a.break_after])
                assert request.transport is not None
                request.transport.close()
                return response
            response = web.Response(body=whole, content_type="application/json")
            self._compress(response)
            return response
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self._compress(stream)
        await stream.prepare(request)
        self.started.set()
        try:
            for i in range(a.events):
                chunk = {"id": "x", "object": "text_completion", "choices": [{"index": 0, "text": f"t{i} "}]}
                await stream.write(f"data: {json.dumps(chunk)}{a.line_end * 2}".encode())
                if a.break_after == i + 1:
                    assert request.transport is not None
                    request.transport.close()
                    return stream
                await asyncio.sleep(a.event_gap)
            await stream.write(f"data: [DONE]{a.line_end * 2}".encode())
        except (ConnectionResetError, asyncio.CancelledError):
            self.left += 1
            raise
        return stream

    def _compress(self, response: web.StreamResponse) -> None:
        if self.answer.force_gzip:
            response.enable_compression(web.ContentCoding.gzip)
        elif self.answer.compress:
            response.enable_compression()


@contextmanager
def fake_fallback() -> Iterator[FakeFallback]:
    fake = FakeFallback("")
    app = web.Application()
    app.router.add_get("/v1/models", fake._models)
    app.router.add_post("/v1/completions", fake._complete)
    app.router.add_post("/v1/chat/completions", fake._complete)
    with serving_app(app, name="fake-fallback") as url:
        fake.url = url
        yield fake
