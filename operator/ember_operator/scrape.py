"""Reading engine pods' Prometheus /metrics: the three autoscaling gauges and the fallback counter.

An engine's page is ~30 KB, nearly all histograms the autoscaler never reads. `parse_sample` looks only at
the lines of the four series it needs (a prefix test per line) instead of parsing every family, and runs in
a worker thread, so a scrape of many pods does not hold up the event loop. One `Scraper` keeps one HTTP
client for the operator's life: its connections to the pods stay open from one scrape to the next.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass

import httpx

from ember_operator.autoscaler import PodLoad


@dataclass(frozen=True, slots=True)
class PodSample:
    load: PodLoad
    fallback_served: float  # ember:fallback_requests{outcome="served"}, a counter


_GAUGES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_cache",
}
_FALLBACK = "ember:fallback_requests_total"
_PREFIXES = (*_GAUGES, _FALLBACK)


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
    fallback = 0.0
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
    missing = sorted(name for name, key in _GAUGES.items() if key not in values)
    if missing:
        raise ValueError(f"no {', '.join(missing)} in /metrics")
    return PodSample(PodLoad(values["waiting"], values["running"], values["kv_cache"]), fallback)


class Scraper:
    """Scrapes pods concurrently through one client, kept open between scrapes (call `close` at the end)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            limits = httpx.Limits(max_connections=256, max_keepalive_connections=4096, keepalive_expiry=60.0)
            self._client = httpx.AsyncClient(timeout=self.timeout, limits=limits)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _page(self, url: str) -> str | Exception:
        try:
            response = await self._http().get(url)
            response.raise_for_status()
            return response.text
        except httpx.HTTPStatusError as e:
            return ValueError(f"HTTP {e.response.status_code} from {url}")
        except httpx.HTTPError as e:
            return ValueError(f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} from {url}")

    async def scrape(self, urls: dict[str, str]) -> dict[str, PodSample | str]:
        """Each pod's sample, or why it could not be had."""
        pages = await asyncio.gather(*(self._page(u) for u in urls.values()))
        results = await asyncio.to_thread(_parse_all, list(zip(urls.values(), pages, strict=True)))
        return dict(zip(urls, results, strict=True))


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
