"""Every request through the router has an `X-Request-Id`: the client's own when it sent a usable one, else
one made here; it goes upstream with the request (the engine's log and its answer carry the same id) and
back on every answer, the router's own errors included."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ember_engine.server.request_id import new_id, usable

HEADER = "X-Request-Id"


@web.middleware
async def request_ids(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    rid = request.headers.get(HEADER, "")
    if not usable(rid):
        rid = new_id()
        headers = request.headers.copy()
        headers[HEADER] = rid
        request = request.clone(headers=headers)
    response = await handler(request)
    if not response.prepared:  # a stream began in the handler: `stamp` gave it the id
        response.headers[HEADER] = rid
    return response


async def stamp(request: web.Request, response: web.StreamResponse) -> None:
    """`on_response_prepare` of an answer the handler streams: its id is the request's (as the handler saw
    it), whatever the upstream's answer said."""
    rid = request.headers.get(HEADER)
    if rid is not None:
        response.headers[HEADER] = rid
