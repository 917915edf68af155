"""The router inside another program (a benchmark, a test): its own event loop on a thread of its own."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from ember_router.proxy import Router


@contextmanager
def serving(router: Router, host: str = "127.0.0.1") -> Iterator[str]:
    """Serve `router` on a free port of `host` until the block ends; yields its base URL."""
    with serving_app(router.app(), host, name="router") as url:
        yield url


@contextmanager
def serving_app(app: web.Application, host: str = "127.0.0.1", name: str = "aiohttp") -> Iterator[str]:
    """Serve an aiohttp application (the router's, or a stand-in server of a test) on a free port of
    `host`, on a thread and event loop of its own, until the block ends; yields its base URL."""
    with socket.socket() as s:
        s.bind((host, 0))
        port = int(s.getsockname()[1])
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app, handler_cancellation=True)
    started = threading.Event()

    def serve() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(runner.setup())
        loop.run_until_complete(web.TCPSite(runner, host, port).start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True, name=name)
    thread.start()
    if not started.wait(30):
        raise TimeoutError(f"the {name} server did not start")
    try:
        yield f"http://{host}:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
