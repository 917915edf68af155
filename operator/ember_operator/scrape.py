"""Reading engine pods' Prometheus /metrics: the three autoscaling gauges, the fallback and shed counters; and the
router pods': requests held (scale from zero) and sent to the fallback.

An engine's page is ~30 KB, nearly all histograms the autoscaler never reads. `parse_sample` looks only at
the lines of the four series it needs (a prefix test per line) instead of parsing every family, and runs in
a worker thread, so a scrape of many pods does not hold up the event loop. One `Scraper` keeps one
connection per pod open for the operator's life (`httpget.Getter`), from one scrape to the next.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

from ember_operator.autoscaler import PodLoad
from ember_operator.httpget import Getter, HTTPStatusError


@dataclass(frozen=True, slots=True)
class PodSample:
    load: PodLoad
    fallback_served: float  # ember:fallback_requests_total{outcome="served"}, a counter
    shed: float = 0.0  # ember:requests_shed_total for want of capacity (`CAPACITY_SHEDS`), a counter


_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache",
}
_FALLBACK = "ember:fallback_requests_total"
_SHED = "ember:requests_shed_total"
# refusals for want of capacity; not a client over its own limit, nor an engine draining or starting
CAPACITY_SHEDS = ('reason="queue_full"', 'reason="queue_wait"')
_PREFIXES = (*_GAUGES, _FALLBACK, _SHED)


def _series(line: str) -> tuple[str, str, float] | None:
    """(name, labels text, value) of a sample line in the text exposition format; None for others."""
    brace = line.find("{")
    if brace >= 0:
        close = line.rfind("}")
        if close < brace:
            return None
        name, labels, rest = line[:brace], line[brace + 1 : close], line[close + 1 :]
    else:
        name, _, rest = line.partition(" ")
        labels = ""
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])  # Prometheus writes NaN and +Inf as float() reads them
    except ValueError:
        return None
    return name.strip(), labels, value


def parse_sample(text: str) -> PodSample:
    """The sample in one /metrics page (series summed over their labels); a missing gauge is an error."""
    values: dict[str, float] = {}
    fallback = shed = 0.0
    for line in text.splitlines():
        if not line.startswith(_PREFIXES):
            continue
        parsed = _series(line)
        if parsed is None:
            continue
        name, labels, value = parsed
        if name in _GAUGES:
            key = _GAUGES[name]
            values[key] = values.get(key, 0.0) + (0.0 if math.isnan(value) else value)
        elif name == _FALLBACK and 'outcome="served"' in labels:
            fallback += value
        elif name == _SHED and any(reason in labels for reason in CAPACITY_SHEDS):
            shed += value
    missing = sorted(name for name, key in _GAUGES.items() if key not in values)
    if missing:
        raise ValueError(f"no {', '.join(missing)} in /metrics")
    return PodSample(PodLoad(values["waiting"], values["running"], values["kv_cache"]), fallback, shed)


class Scraper:
    """Scrapes pods concurrently, each through its own kept-open connection (call `close` at the end)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._getter = Getter(timeout)

    async def close(self) -> None:
        await self._getter.close()

    async def _page(self, url: str) -> str | Exception:
        try:
            return (await self._getter.get(url)).decode("utf-8", "replace")
        except HTTPStatusError as e:
            return ValueError(str(e))
        except TimeoutError:
            return ValueError(f"TimeoutError: no answer from {url} within {self.timeout:g} s")
        except (OSError, ValueError) as e:
            return ValueError(f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} from {url}")

    async def scrape(self, urls: dict[str, str]) -> dict[str, PodSample | str]:
        """Each pod's sample, or why it could not be had."""
        self._getter.close_idle()
        pages = await asyncio.gather(*(self._page(u) for u in urls.values()))
        results = await asyncio.to_thread(_parse_all, list(zip(urls.values(), pages, strict=True)))
        return dict(zip(urls, results, strict=True))

    async def router_fallback(self, urls: dict[str, str]) -> dict[str, float]:
        """What each router pod at `urls` (by pod name) has sent to the fallback itself and had served
        (`ember_router:fallback_requests_total{outcome="served"}`); a router that cannot be read is left out."""
        pages = await asyncio.gather(*(self._page(u) for u in urls.values()))
        out = {}
        for pod, page in zip(urls, pages, strict=True):
            if isinstance(page, Exception):
                continue
            try:
                out[pod] = parse_router_fallback(page)
            except ValueError:
                continue
        return out

    async def pending(self, urls: list[str]) -> float:
        """Requests held by the routers at `urls` (their /metrics pages), summed; a router that cannot be
        read counts nothing."""
        pages = await asyncio.gather(*(self._page(u) for u in urls))
        return sum(_pending_or_nothing(p) for p in pages)


def _parse_all(pages: list[tuple[str, str | Exception]]) -> list[PodSample | str]:
    out: list[PodSample | str] = []
    for _url, page in pages:
        if isinstance(page, Exception):
            out.append(str(page))
            continue
        try:
            out.append(parse_sample(page))
        except ValueError as e:
            out.append(f"ValueError: {e}")
    return out


PENDING = "ember_router:pending_requests"


def parse_pending(text: str) -> float:
    """`ember_router:pending_requests` from a router's /metrics page; ValueError when it is not there."""
    for line in text.splitlines():
        if line.startswith(PENDING):
            series = _series(line)
            if series is not None and series[0] == PENDING:
                return series[2]
    raise ValueError(f"no {PENDING} in /metrics")


ROUTER_FALLBACK = "ember_router:fallback_requests_total"


def parse_router_fallback(text: str) -> float:
    """A router's requests served by the fallback it sent them to, from its /metrics page; ValueError when
    the counter is not there."""
    served, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(ROUTER_FALLBACK):
            series = _series(line)
            if series is not None and series[0] == ROUTER_FALLBACK:
                found = True
                if 'outcome="served"' in series[1]:
                    served += series[2]
    if not found:
        raise ValueError(f"no {ROUTER_FALLBACK} in /metrics")
    return served


def _pending_or_nothing(page: str | Exception) -> float:
    if isinstance(page, Exception):
        return 0.0
    try:
        return parse_pending(page)
    except ValueError:
        return 0.0
