"""The router's API-key check (`ember router --api-key`, or EMBER_API_KEY): the engine's rule
(`ember_engine.server.api_keys`) as an aiohttp middleware, before a body is read."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from ember_engine.server.api_keys import CHALLENGE, ApiKeys, refusal_body

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def key_check(keys: ApiKeys) -> Middleware:
    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        why = keys.refusal(request.path, request.headers.getall("Authorization", []))
        if why is None:
            return await handler(request)
        return web.json_response(refusal_body(why), status=401, headers={"WWW-Authenticate": CHALLENGE})

    return check
