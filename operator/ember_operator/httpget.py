"""HTTP/1.1 GET over asyncio streams, one kept-open connection per address, for scraping many pods.

A general client's connection pool pays for every pool member on each request (httpcore scans all its
connections to place one request), so scraping 1,000 pods through one client costs time quadratic in the
pods. Here each pod's address has its own connection, found by a dict lookup, used for one request at a
time and kept open for the next scrape; a connection that fails or that the server closes is dropped and
the next request opens a new one. Bodies are read by Content-Length, chunked transfer encoding, or to the
end of a closed connection.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

MAX_HEAD = 64 * 1024


class HTTPStatusError(Exception):
    def __init__(self, status: int, url: str) -> None:
        self.status = status
        super().__init__(f"HTTP {status} from {url}")


@dataclass(slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    used: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        self.writer.close()


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> tuple[bytes, bool]:
    """(body, whether the connection may be used again)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts = []
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":  # trailers
                    pass
                break
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        return b"".join(parts), headers.get("connection", "").lower() != "close"
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
        return body, headers.get("connection", "").lower() != "close"
    return await reader.read(), False


class _Unanswered(OSError):
    """A kept connection that ended before any byte of an answer (the server had closed it)."""


class Getter:
    """GETs through one kept-open connection per host and port. Call `close` at the end."""

    def __init__(self, timeout: float, idle: float = 120.0) -> None:
        self.timeout = timeout
        self.idle = idle  # connections unused this long are closed (their pods are likely gone)
        self._connections: dict[tuple[str, int], _Connection] = {}

    async def get(self, url: str) -> bytes:
        """The body of a 2xx answer; `HTTPStatusError` for others, `OSError`, `TimeoutError` or
        `ValueError` (a malformed answer) when there is none."""
        # In the caller's task: `asyncio.wait_for` would run it in one of its own, whose failure is left
        # unread when the caller is cancelled at that moment (and kopf re-raises such a task's at shutdown).
        async with asyncio.timeout(self.timeout):
            return await self._get(url)

    async def _get(self, url: str) -> bytes:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url}")
        key = (parts.hostname, parts.port or 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn = self._connections.get(key)
        # A server closes a connection idle past its keep-alive (uvicorn, the engines' server: 5 s): its end
        # of file is read, though our side is not closing yet. Such a connection is not used again.
        if conn is not None and (conn.writer.is_closing() or conn.reader.at_eof()):
            self._drop(key, conn)
            conn = None
        if conn is None:
            return await self._exchange(key, await self._open(key), path, url)
        try:
            return await self._exchange(key, conn, path, url)
        except _Unanswered:  # the server closed it as the request went: once more, on a new connection
            return await self._exchange(key, await self._open(key), path, url)

    async def _open(self, key: tuple[str, int]) -> _Connection:
        reader, writer = await asyncio.open_connection(*key, limit=MAX_HEAD)
        conn = self._connections[key] = _Connection(reader, writer)
        return conn

    async def _exchange(self, key: tuple[str, int], conn: _Connection, path: str, url: str) -> bytes:
        """One GET on `conn`; `_Unanswered` where the connection ended before any byte of an answer."""
        async with conn.lock:
            conn.used = time.monotonic()
            try:
                host = f"{key[0]}:{key[1]}" if ":" not in key[0] else f"[{key[0]}]:{key[1]}"
                conn.writer.write(
                    f"GET {path} HTTP/1.1\r\nHost: {host}\r\nAccept: text/plain\r\n\r\n".encode()
                )
                await conn.writer.drain()
                try:
                    head = await conn.reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError as e:
                    if e.partial:
                        raise
                    raise _Unanswered(f"the connection closed before an answer from {url}") from e
                lines = head.decode("latin-1").split("\r\n")
                status = int(lines[0].split(" ", 2)[1])
                headers = {}
                for line in lines[1:]:
                    name, sep, value = line.partition(":")
                    if sep:
                        headers[name.strip().lower()] = value.strip()
                body, reusable = await _read_body(conn.reader, headers)
            except (_Unanswered, ConnectionResetError, BrokenPipeError) as e:
                self._drop(key, conn)
                raise _Unanswered(f"the connection closed before an answer from {url}") from e
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, IndexError) as e:
                self._drop(key, conn)
                raise OSError(f"{type(e).__name__} from {url}") from e
            except (ValueError, asyncio.CancelledError):
                self._drop(key, conn)  # a timeout cancels mid-answer: the stream is out of step
                raise
            if not reusable:
                self._drop(key, conn)
        if not 200 <= status < 300:
            raise HTTPStatusError(status, url)
        return body

    def _drop(self, key: tuple[str, int], conn: _Connection) -> None:
        conn.close()
        if self._connections.get(key) is conn:
            del self._connections[key]

    def close_idle(self) -> None:
        cutoff = time.monotonic() - self.idle
        for key, conn in list(self._connections.items()):
            if conn.used < cutoff and not conn.lock.locked():
                self._drop(key, conn)

    async def close(self) -> None:
        for key, conn in list(self._connections.items()):
            self._drop(key, conn)
