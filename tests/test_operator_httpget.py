"""The operator's scrape client (`httpget.Getter`) against uvicorn, the engines' own server: a kept-open
connection the server has since closed for idleness is not reused."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from waiting import free_port

from ember_operator.httpget import Getter

KEEP_ALIVE = 1  # seconds uvicorn keeps an idle connection open (the engines run its default, 5)


async def _app(scope, receive, send) -> None:  # type: ignore[no-untyped-def]
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    config = uvicorn.Config(
        _app, host="127.0.0.1", port=port, log_level="warning", timeout_keep_alive=KEEP_ALIVE
    )
    served = uvicorn.Server(config)
    thread = threading.Thread(target=served.run, daemon=True)
    thread.start()
    while not served.started:
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/metrics"
    served.should_exit = True
    thread.join(10)


def test_a_connection_the_server_closed_while_idle_is_not_reused(server: str) -> None:
    """Each scrape after the server's keep-alive had passed failed ("IncompleteReadError"): with the default
    interval of 15 s every other scrape of every engine, so metrics flapped unavailable and the scaling
    decisions of those passes were lost."""

    async def scrape() -> list[bytes]:
        getter = Getter(timeout=5)
        try:
            got = [await getter.get(server)]
            await asyncio.sleep(KEEP_ALIVE + 0.5)  # the server closes the idle connection
            got.append(await getter.get(server))
            got.append(await getter.get(server))  # and the new one is kept
            return got
        finally:
            await getter.close()

    assert asyncio.run(scrape()) == [b"ok", b"ok", b"ok"]


def test_a_get_runs_in_its_callers_task() -> None:
    """`asyncio.wait_for` ran each GET in a task of its own: cancelled as that task failed (an operator
    stopping while a pod refused a scrape), its `ConnectionRefusedError` was left unread, and kopf, which
    re-raises what any task left over at shutdown ended with, made the operator's exit an error."""

    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # never answers

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        getter = Getter(timeout=0.5)
        get = asyncio.create_task(getter.get(f"http://127.0.0.1:{port}/metrics"))
        await asyncio.sleep(0.2)
        mine = {t for t in asyncio.all_tasks() if t.get_coro().__name__ != "silent"}  # (the server's own)
        assert mine == {asyncio.current_task(), get}
        with pytest.raises(TimeoutError):
            await get
        await getter.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
