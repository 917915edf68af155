"""Hand a request this engine will not serve to the fallback model's server, relaying its answer."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse

log = logging.getLogger("ember.fallback")

SERVED_BY = "x-ember-served-by"


class FallbackFailed(Exception):
    pass


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
        self, base_url: str, model: str | None, path: str, body: dict[str, Any], timeout: float
    ) -> Response:
        """POST the request there with `model` rewritten; streams are relayed chunk by chunk. Raises
        FallbackFailed when the fallback cannot answer (unreachable, or an error status)."""
        base = base_url.rstrip("/")
        try:
            name = await self._model_for(base, model, timeout)
            payload = {**body, "model": name} if name else dict(body)
            request = self.client.build_request("POST", f"{base}{path}", json=payload, timeout=timeout)
            resp = await self.client.send(request, stream=True)
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            raise FallbackFailed(f"fallback {base} unreachable: {exc}") from exc
        if resp.status_code >= 400:
            await resp.aread()
            await resp.aclose()
            raise FallbackFailed(f"fallback {base} answered {resp.status_code}")
        headers = {SERVED_BY: "fallback"}
        media_type = resp.headers.get("content-type", "application/json")
        if not payload.get("stream"):
            content = await resp.aread()
            await resp.aclose()
            return Response(content, status_code=resp.status_code, media_type=media_type, headers=headers)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            except httpx.HTTPError as exc:  # the fallback broke mid-stream: end the stream readably
                log.warning("fallback stream from %s broke: %s", base, exc)
                yield b'data: {"error": {"message": "fallback stream interrupted", "type": "overloaded"}}\n\n'
                yield b"data: [DONE]\n\n"
            finally:
                await resp.aclose()

        return StreamingResponse(
            relay(), status_code=resp.status_code, media_type=media_type, headers=headers
        )
