"""The engines behind the router and what it knows of each: readiness, queue, KV use, cached prefixes.

`EnginePool` polls every engine concurrently on one reused HTTP client. An ember engine answers it all in
one short request, `/v1/load?since=N`: ready or not, its queue and KV use, and the prefix cache's changes
since the last poll (a snapshot when the router fell behind or the engine restarted). Any other
OpenAI-compatible engine (a 404 there, asked again now and then) is polled as vLLM's are: `/ready`, the few
series the router needs from `/metrics`, and `/v1/kv_events` if it has one; an engine whose events cannot
be read (prefix caching off, no such endpoint) is routed by the router's own record of what it sent there.
"""

from __future__ import annotations

import asyncio
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
_GAUGES = (_WAITING, _RUNNING, _KV)
# Polls of an engine without `/v1/load` between two tries of it (an engine may be upgraded in place).
REPROBE_POLLS = 50


def read_gauges(text: str) -> dict[str, float]:
    """The router's few series from a Prometheus text page (summed over label sets)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(_GAUGES):
            sample = _sample(line)
            if sample is not None and sample[0] in _GAUGES:
                out[sample[0]] = out.get(sample[0], 0.0) + sample[1]
    return out


def _sample(line: str) -> tuple[str, float] | None:
    """(name, value) of a sample line in the text format: `name{labels} value [timestamp]`, its fields apart
    by any blanks; None for a line that is not one."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")  # a label value may hold blanks and braces; the label set ends at the last
        if close < brace:
            return None
        name, fields = line[:brace], line[close + 1 :].split()
    else:
        name, *fields = line.split()
    if not fields:
        return None
    try:
        return name.strip(), float(fields[0])  # the value; a timestamp may follow
    except ValueError:
        return None


@dataclass
class Engine:
    url: str
    state: EngineState
    seq: int = 0
    events_live: bool = False
    block_size: int | None = None
    load_api: bool | None = None  # whether it answers `/v1/load`; None: not known yet
    polls_without_load_api: int = 0


@dataclass
class EnginePool:
    urls: list[str]
    poll_interval: float = 0.2
    timeout: float = 1.0
    index: PrefixIndex = field(default_factory=PrefixIndex)
    engines: dict[str, Engine] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)  # what the router's own requests carry (its key)

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
            try:
                await self.poll_once(session)
            except Exception:  # whatever one pass met, the engines are polled again
                log.exception("polling the engines failed; polling goes on")
            await asyncio.sleep(self.poll_interval)

    async def poll_once(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self._poll(session, e) for e in list(self.engines.values())))

    async def _get(self, session: aiohttp.ClientSession, url: str, **params: Any) -> tuple[int, str]:
        timeout = aiohttp.ClientTimeout(total=self.timeout)
        async with session.get(url, params=params or None, headers=self.headers, timeout=timeout) as response:
            return response.status, await response.text()

    async def _poll(self, session: aiohttp.ClientSession, engine: Engine) -> None:
        try:
            asks = engine.load_api is not False or engine.polls_without_load_api >= REPROBE_POLLS
            if asks and await self._poll_load(session, engine):
                return
            engine.polls_without_load_api += 1
            await self._poll_separately(session, engine)
        except (ValueError, KeyError, TypeError, ArithmeticError) as exc:  # an answer not as it should be
            log.warning("engine %s answered a poll with something unreadable: %s", engine.url, exc)
            engine.events_live = False
            if engine.load_api:  # its readiness came in that answer too
                engine.state.ready = False

    async def _poll_load(self, session: aiohttp.ClientSession, engine: Engine) -> bool:
        """One request: `/v1/load`. False if the engine has no such endpoint (poll it the other way)."""
        try:
            status, text = await self._get(session, f"{engine.url}/v1/load", since=str(engine.seq))
        except (aiohttp.ClientError, TimeoutError):
            engine.state.ready = False
            return True
        if status == 404:
            engine.load_api = False
            engine.polls_without_load_api = 0
            return False
        engine.load_api = True
        engine.state.ready = status == 200
        if status != 200:
            return True
        body = _object(json.loads(text), "load")
        engine.state.waiting = float(body["num_requests_waiting"])
        engine.state.running = float(body["num_requests_running"])
        engine.state.kv_usage = float(body["kv_cache_usage_perc"])
        loaded = body.get("lora_adapters")  # an engine from before it was reported: not known
        engine.state.adapters = frozenset(map(str, loaded)) if isinstance(loaded, list) else None
        self._take_events(engine, body["kv_events"])
        return True

    async def _poll_separately(self, session: aiohttp.ClientSession, engine: Engine) -> None:
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
        self._take_events(engine, json.loads(text))

    def _take_events(self, engine: Engine, answer: Any) -> None:
        """Apply an engine's prefix-cache changes (a `/v1/kv_events` answer) to the index."""
        body = _object(answer, "kv_events")
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


def _object(value: Any, what: str) -> dict[str, Any]:
    """A JSON answer that must be an object (TypeError, read as an unreadable answer, where it is not)."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} is {type(value).__name__}, not an object")
    return value
