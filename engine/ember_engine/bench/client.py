"""One streamed completion request as the client sees it: send it, read its SSE stream, time it.

A failure is counted under its kind: the HTTP status of a response other than 2xx ("503"), "timeout" (still
running at --timeout), "stream_error" (an error event inside a 200 stream), "incomplete_stream" (the
stream ended without `data: [DONE]` or without any text), "malformed_stream" (a data line that is not a
JSON object), or the name of the transport error ("ConnectError").
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `ember --help` must not need httpx
    import httpx

SERVED_BY = "x-ember-served-by"


@dataclass(slots=True)
class Outcome:
    """One request as the client saw it. Times are seconds from sending; ttft, itl and output_tokens
    mean something only for a success (failure is None)."""

    latency: float  # to the end of the stream, or to the error
    failure: str | None = None  # None, or the kind of failure (see the module's docstring)
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    served_by: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None  # a single token has no decode time to share out
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(slots=True)
class Event:
    """What the benchmark needs from one SSE data line."""

    text: str = ""
    usage_tokens: int | None = None
    error: str | None = None
    done: bool = False


def parse_sse_line(line: str) -> Event | None:
    """None for lines that carry nothing here (blank separators, `: keep-alive` comments, `event:`
    fields). Raises ValueError for a data line that is not a JSON object."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return Event(done=True)
    obj = json.loads(data)
    if not isinstance(obj, dict):
        raise ValueError(f"SSE data is not a JSON object: {data[:80]!r}")
    if obj.get("error") is not None:
        err = obj["error"]
        return Event(error=str(err.get("message", err) if isinstance(err, dict) else err))
    text = "".join(c.get("text") or "" for c in obj.get("choices") or [])
    usage = obj.get("usage") or {}
    return Event(text=text, usage_tokens=usage.get("completion_tokens"))


async def _stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], start: float
) -> Outcome:
    async with client.stream("POST", url, json=body, headers=headers) as resp:
        if not resp.is_success:
            latency = time.perf_counter() - start
            await resp.aread()  # so the connection can be reused
            return Outcome(latency, str(resp.status_code))
        stamps: list[float] = []
        usage: int | None = None
        end: float | None = None
        async for line in resp.aiter_lines():
            event = parse_sse_line(line)
            now = time.perf_counter()
            if event is None or end is not None:
                continue  # read on to the end of the body rather than drop a keep-alive connection
            if event.error is not None:
                return Outcome(now - start, "stream_error")
            if event.done:
                end = now
            if event.text:
                stamps.append(now)
            if event.usage_tokens is not None:
                usage = event.usage_tokens
    if end is None or not stamps:
        return Outcome(time.perf_counter() - start, "incomplete_stream")
    return Outcome(
        end - start,
        ttft=stamps[0] - start,
        itl=[b - a for a, b in pairwise(stamps)],
        output_tokens=usage if usage is not None else len(stamps),
        served_by=resp.headers.get(SERVED_BY),
    )


async def send(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], timeout: float
) -> Outcome:
    import httpx

    start = time.perf_counter()
    try:
        # httpx's own timeouts bound each read, not the whole request; a slow trickle must still end here.
        async with asyncio.timeout(timeout):
            return await _stream(client, url, body, headers, start)
    except TimeoutError:
        failure = "timeout"
    except httpx.HTTPError as exc:
        failure = type(exc).__name__
    except ValueError:
        failure = "malformed_stream"
    return Outcome(time.perf_counter() - start, failure=failure)
