"""What a router polls: the prefix cache's changes (`/v1/kv_events`) and, in one small answer, readiness,
load, the LoRA adapters loaded and those changes together (`/v1/load`), so a router in front of many engines costs each of them one
short request per poll instead of three, one of them the whole Prometheus page."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ember_engine.server.errors import still_loading
from ember_engine.server.state import ServerState


def kv_events_body(state: ServerState, since: int) -> dict[str, Any]:
    """The prefix cache's changes after event `since` (0, or a `since` that left the log: a snapshot)."""
    assert state.engine is not None
    bm = state.engine.engine.block_manager
    batch = bm.events.since(since, lambda: tuple(bm.cached))
    body: dict[str, Any] = {
        "block_size": bm.block_size,
        "enabled": bm.enable_prefix_caching,
        "seq": batch.seq,
        "events": [[kind, h] for kind, h in batch.events],
    }
    if batch.snapshot is not None:
        body["snapshot"] = batch.snapshot
    return body


def add_load_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0) -> JSONResponse:
        """The prefix cache's changes after event `since` (0: a snapshot of every cached block hash), for
        routers that send a request where its prefix is cached."""
        if state.engine is None:
            raise still_loading(state.policy.policy.load_shedding.retry_after_seconds)
        return JSONResponse(kv_events_body(state, since))

    @app.get("/v1/load")
    async def load(since: int = 0) -> JSONResponse:
        """Ready or not (503, as `/ready`), the gauges a router weighs (named as on `/metrics`) and the
        prefix cache's changes after event `since`."""
        if state.engine is None or not state.ready:
            return JSONResponse({"status": state.status}, status_code=503)
        stats = state.engine.stats()
        return JSONResponse(
            {
                "status": "ready",
                "num_requests_running": stats.num_running,
                "num_requests_waiting": stats.num_waiting,
                "kv_cache_usage_perc": stats.kv_cache_usage,
                "lora_adapters": sorted(state.loras),  # a request may name these as its model
                "kv_events": kv_events_body(state, since),
            }
        )
