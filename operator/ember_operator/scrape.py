"""Reading engine pods' Prometheus /metrics: the three autoscaling gauges and the fallback counter."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

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


def parse_sample(text: str) -> PodSample:
    """The sample in one /metrics page (series summed over their labels); a missing gauge is an error."""
    values: dict[str, float] = {}
    fallback = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _GAUGES:
                key = _GAUGES[s.name]
                values[key] = values.get(key, 0.0) + s.value
            elif s.name == "ember:fallback_requests_total" and s.labels.get("outcome") == "served":
                fallback += s.value
    missing = sorted(name for name, key in _GAUGES.items() if key not in values)
    if missing:
        raise ValueError(f"no {', '.join(missing)} in /metrics")
    return PodSample(PodLoad(values["waiting"], values["running"], values["kv_cache"]), fallback)


async def scrape_pod(client: httpx.AsyncClient, url: str) -> PodSample:
    response = await client.get(url)
    response.raise_for_status()
    return parse_sample(response.text)


async def scrape_pods(urls: dict[str, str], timeout: float) -> dict[str, PodSample | str]:
    """Each pod's sample, or why it could not be had, scraped concurrently."""
    async with httpx.AsyncClient(timeout=timeout) as client:

        async def one(url: str) -> PodSample | str:
            try:
                return await scrape_pod(client, url)
            except httpx.HTTPStatusError as e:
                return f"HTTP {e.response.status_code} from {url}"
            except (httpx.HTTPError, ValueError) as e:
                return f"{type(e).__name__}: {e}" if str(e) else f"{type(e).__name__} from {url}"

        results = await asyncio.gather(*(one(u) for u in urls.values()))
    return dict(zip(urls, results, strict=True))


PENDING = "ember_router:pending_requests"


def parse_pending(text: str) -> float:
    """`ember_router:pending_requests` from a router's /metrics page; ValueError when it is not there."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == PENDING:
                return float(s.value)
    raise ValueError(f"no {PENDING} in /metrics")


async def scrape_pending(urls: list[str], timeout: float) -> float:
    """Requests held by the routers at `urls` (their /metrics pages), summed; a router that cannot be read
    counts nothing."""
    async with httpx.AsyncClient(timeout=timeout) as client:

        async def one(url: str) -> float:
            try:
                response = await client.get(url)
                response.raise_for_status()
                return parse_pending(response.text)
            except (httpx.HTTPError, ValueError):
                return 0.0

        return sum(await asyncio.gather(*(one(u) for u in urls)))
