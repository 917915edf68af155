"""Hand a request this engine will not serve to the fallback model's server, relaying its answer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from ember_engine.server.protocol import APIError

log = logging.getLogger("ember.fallback")

SERVED_BY = "x-ember-served-by"
_INTERRUPTED = APIError(503, "fallback stream interrupted", type="overloaded", code="fallback_interrupted")


class FallbackFailed(Exception):
    pass


def _reason(exc: Exception) -> str:
    """The exception's text, or its type's name where it has none (httpx's timeouts, some connect errors)."""
    return str(exc) or type(exc).__name__


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class RelayedStream(StreamingResponse):
    """A stream relayed from the fallback. However it ends (also when the client is gone before it
    starts: Starlette then never runs the body) the fallback's response is closed and `on_close` runs."""

    def __init__(self, upstream: httpx.Response, body: AsyncIterator[bytes], media_type: str) -> None:
        headers = {SERVED_BY: "fallback"}
        super().__init__(body, status_code=upstream.status_code, media_type=media_type, headers=headers)
        self.upstream = upstream
        self.on_close: Callable[[], None] | None = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            if self.on_close is not None:
                self.on_close()


class Fallback:
    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self._discovered: dict[str, str] = {}  # base url -> the model it serves

    async def _model_for(self, base: str, configured: str | None, timeout: float) -> str | None:
        """The fallback server's model name: configured, or the first one its /v1/models lists."""
        if configured:
            return configured
        if base not in self._discovered:
            resp = await self.client.get(f"{base}/v1/models", timeout=timeout)
            resp.raise_for_status()
            models = resp.json().get("data") or []
            if not models:
                return None
            self._discovered[base] = models[0]["id"]
        return self._discovered[base]

    async def forward(
        self,
        base_url: str,
        model: str | None,
        path: str,
        body: dict[str, Any],
        timeout: float,
        client: Request | None = None,
    ) -> Response:
        """POST the request there with `model` rewritten; streams are relayed chunk by chunk. Raises
        FallbackFailed when the fallback cannot answer (unreachable, an error status, or a non-streaming
        answer that breaks off). When `client`, the request being relayed, disconnects before the answer
        starts, the request to the fallback is closed, which aborts it there, and the answer is a 499."""
        base = base_url.rstrip("/")
        if client is None:
            return await self._forward(base, model, path, body, timeout)
        work = asyncio.create_task(self._forward(base, model, path, body, timeout))
        gone = asyncio.create_task(_disconnected(client))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, FallbackFailed):
                    await work
        if work in done:
            return work.result()
        return Response(status_code=499)  # nobody is listening

    async def _forward(
        self, base: str, model: str | None, path: str, body: dict[str, Any], timeout: float
    ) -> Response:
        try:
            name = await self._model_for(base, model, timeout)
            payload = {**body, "model": name} if name else dict(body)
            request = self.client.build_request("POST", f"{base}{path}", json=payload, timeout=timeout)
            resp = await self.client.send(request, stream=True)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise FallbackFailed(f"fallback {base} unreachable: {_reason(exc)}") from exc
        if resp.status_code >= 400:
            try:
                with contextlib.suppress(httpx.HTTPError):
                    await resp.aread()
            finally:
                await resp.aclose()
            raise FallbackFailed(f"fallback {base} answered {resp.status_code}")
        headers = {SERVED_BY: "fallback"}
        media_type = resp.headers.get("content-type", "application/json")
        if not payload.get("stream"):
            try:
                content = await resp.aread()
            except httpx.HTTPError as exc:
                raise FallbackFailed(f"fallback {base} broke off its answer: {_reason(exc)}") from exc
            finally:
                await resp.aclose()
            return Response(content, status_code=resp.status_code, media_type=media_type, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_bytes():  # decoded: the answer goes on without its encoding
                    yield chunk
            except httpx.HTTPError as exc:  # the fallback broke mid-stream: end the stream readably
                log.warning("fallback stream from %s broke: %s", base, _reason(exc))
                yield f"data: {json.dumps(_INTERRUPTED.body())}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                await resp.aclose()

        return RelayedStream(resp, relay(), media_type)
