"""The engines behind the router and what it knows of each: readiness, queue, KV use, cached prefixes.

`EnginePool` polls every engine concurrently on one reused HTTP client: `/ready`, the few series it needs
from `/metrics`, and the prefix cache's changes since the last poll (`/v1/kv_events?since=N`, a snapshot
when it fell behind or the engine restarted). An engine whose events cannot be read (an older engine,
prefix caching off) is routed by the router's own record of what it sent there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from ember_router.index import PrefixIndex
from ember_router.policy import EngineState

log = logging.getLogger("ember.router")

_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_KV = "vllm:kv_cache_usage_perc"


def read_gauges(text: str) -> dict[str, float]:
    """The router's few series from a Prometheus text page (summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((_WAITING, _RUNNING, _KV)):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            with contextlib.suppress(ValueError, IndexError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@dataclass
class Engine:
    url: str
    state: EngineState
    seq: int = 0
    events_live: bool = False
    block_size: int | None = None


@dataclass
class EnginePool:
    urls: list[str]
    poll_interval: float = 0.2
    timeout: float = 1.0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    engines: dict[str, Engine] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for url in self.urls:
            self.add(url)

    def add(self, url: str) -> None:
        url = url.rstrip("/")
        if url not in self.engines:
            # Not Ready until its first successful poll.
            self.engines[url] = Engine(url, EngineState(url, ready=False))

    def sync(self, urls: set[str] | list[str] | dict[str, str]) -> None:
        """Make the engines exactly `urls` (e.g. what discovery found): new ones join, gone ones leave."""
        wanted = {u.rstrip("/") for u in (urls.values() if isinstance(urls, dict) else urls)}
        for url in wanted - set(self.engines):
            self.add(url)
        for url in set(self.engines) - wanted:
            self.remove(url)

    def remove(self, url: str) -> None:
        self.engines.pop(url.rstrip("/"), None)
        self.index.forget(url.rstrip("/"))

    @property
    def block_size(self) -> int | None:
        sizes = {e.block_size for e in self.engines.values() if e.block_size}
        return min(sizes) if sizes else None

    def states(self) -> list[EngineState]:
        return [e.state for e in self.engines.values()]

    async def run(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.poll_once(session)
            await asyncio.sleep(self.poll_interval)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._poll(session, e) for e in list(self.engines.values())))

    async def _get(self, session: aiohttp.ClientSession, url: str, **params: Any) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with session.get(url, params=params or None, timeout=timeout) as response:
            return response.status, await response.text()

    async def _poll(self, session: aiohttp.ClientSession, engine: Engine) -> None:
        try:
            status, _ = await self._get(session, f"{engine.url}/ready")
            engine.state.ready = status == 200
            status, text = await self._get(session, f"{engine.url}/metrics")
            if status == 200:
                gauges = read_gauges(text)
                engine.state.waiting = gauges.get(_WAITING, 0.0)
                engine.state.running = gauges.get(_RUNNING, 0.0)
                engine.state.kv_usage = gauges.get(_KV, 0.0)
        except (aiohttp.ClientError, TimeoutError):
            engine.state.ready = False
            return
        try:
            status, text = await self._get(session, f"{engine.url}/v1/kv_events", since=str(engine.seq))
        except (aiohttp.ClientError, TimeoutError):
            engine.events_live = False
            return
        if status != 200:
            engine.events_live = False
            return
        body = json.loads(text)
        if not body.get("enabled", True):
            engine.events_live = False
            return
        engine.block_size = int(body["block_size"])
        if body["seq"] < engine.seq and "snapshot" not in body:
            engine.seq = 0  # the engine restarted: ask for a snapshot next time
            return
        if "snapshot" in body:
            self.index.reset(engine.url, body["snapshot"])
        for kind, h in body["events"]:
            if kind == "stored":
                self.index.stored(engine.url, h)
            else:
                self.index.removed(engine.url, h)
        engine.seq = body["seq"]
        engine.events_live = True
