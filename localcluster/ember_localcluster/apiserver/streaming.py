"""Serving one watch request: newline-delimited JSON events on a chunked response.

* `resourceVersion=N` (not "0"): the history after N, then live events; N older than the compaction
  point gets an in-stream `ERROR` 410 Expired, as the real server sends it.
* no resourceVersion, or "0": a synthetic ADDED for every current object, then live events.
* `sendInitialEvents=true`: ADDED for every current object, then a BOOKMARK annotated
  `k8s.io/initial-events-end: "true"` (kopf's `initial_streaming` mode ends its first phase on it).
* `allowWatchBookmarks=true`: a BOOKMARK with the current resourceVersion whenever the stream has been
  idle for the server's bookmark interval, so clients resume from a recent point.
* `timeoutSeconds`: the stream ends cleanly after that long; without it the stream stays open.
* The server's test hooks can end a stream cleanly (`CLOSE`) or with an ERROR 410 (`EXPIRE`).

With a Table `Accept` header (`kubectl get -w`), each object is sent as a one-row Table.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from .errors import APIError, bad_request
from .resources import ResourceType
from .store import Store
from .tables import to_table, wants_table
from .watch import CLOSE, EXPIRE, Event, Watcher


@dataclass(slots=True)
class _Stream:
    response: web.StreamResponse
    rtype: ResourceType
    table: str | None
    include_object: str

    async def send(self, kind: str, obj: dict[str, Any]) -> None:
        if self.table is not None and kind in ("ADDED", "MODIFIED", "DELETED"):
            meta = {"resourceVersion": obj["metadata"]["resourceVersion"]}
            obj = to_table(self.rtype, [obj], self.table, self.include_object, meta)
        await self.response.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")


def _bookmark(store: Store, rtype: ResourceType, *, initial_end: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": str(store.rv)}
    if initial_end:
        meta["annotations"] = {"k8s.io/initial-events-end": "true"}
    return {"kind": rtype.kind, "apiVersion": rtype.api_version, "metadata": meta}


async def serve_watch(
    request: web.Request, store: Store, watcher: Watcher, timeout: int | None, bookmark_interval: float
) -> web.StreamResponse:
    query, rtype, hub = request.query, watcher.rtype, store.hub
    since = query.get("resourceVersion", "")
    initial = query.get("sendInitialEvents") == "true"
    error: APIError | None = None
    backlog: list[Event] = []
    # No await from here to the subscription: a change in between would be lost.
    if initial or since in ("", "0"):
        backlog = [
            ("ADDED", obj) for obj in store.list(rtype, watcher.namespace, watcher.labels, watcher.fields)
        ]
        if initial:
            backlog.append(("BOOKMARK", _bookmark(store, rtype, initial_end=True)))
    else:
        try:
            backlog = hub.backlog(watcher, int(since))
        except ValueError:
            raise bad_request(f"invalid resourceVersion: {since!r}") from None
        except APIError as expired:
            error = expired
    if error is None:
        hub.watchers.add(watcher)
    response = web.StreamResponse(headers={"Content-Type": "application/json"})
    response.enable_chunked_encoding()
    try:
        await response.prepare(request)
        table = wants_table(request.headers.get("Accept", ""))
        stream = _Stream(response, rtype, table, query.get("includeObject", "Metadata"))
        if error is not None:
            await stream.send("ERROR", error.status())
            return response
        for event in backlog:
            await stream.send(*event)
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1")
        await _follow(request, store, watcher, stream, timeout, bookmarks, bookmark_interval)
        with contextlib.suppress(ConnectionError):
            await response.write_eof()
    except ConnectionError:
        pass  # the client went away
    finally:
        hub.watchers.discard(watcher)
    return response


async def _follow(
    request: web.Request,
    store: Store,
    watcher: Watcher,
    stream: _Stream,
    timeout: int | None,
    bookmarks: bool,
    bookmark_interval: float,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout if timeout else None
    while True:
        wait = bookmark_interval if deadline is None else min(bookmark_interval, deadline - loop.time())
        if wait <= 0:
            return
        try:
            item = await asyncio.wait_for(watcher.queue.get(), timeout=wait)
        except TimeoutError:
            # aiohttp does not cancel handlers on disconnect: an idle stream checks for itself.
            if request.transport is None or request.transport.is_closing():
                return
            if bookmarks and (deadline is None or loop.time() < deadline):
                await stream.send("BOOKMARK", _bookmark(store, watcher.rtype))
            continue
        if item == CLOSE:
            return
        if item == EXPIRE:
            expired = APIError(
                410, "Expired", "too old resource version: the watch was expired by the server"
            )
            await stream.send("ERROR", expired.status())
            return
        assert isinstance(item, tuple)
        await stream.send(*item)
