"""A pass may be handed a status older than the one the pass before it wrote: kopf hands the timer the body
it last saw, and a pod event's pass writes status itself, while the timer waits for the lock. The
conditions' lastTransitionTime is carried from what the last pass rendered, not from that older status, so
a condition that did not flip keeps its time."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import kopf
import pytest

from ember_operator import handlers
from ember_operator.handlers import Reconciler, Settings

META = {"name": "svc", "namespace": "ns", "uid": "uid-1", "generation": 1}
SPEC = {"model": {"name": "m", "source": "/m"}, "resources": {"gpus": 0}}


def _reconciler() -> Reconciler:
    reconciler = Reconciler(Settings())

    class _Kube:
        def list_groups(self, namespace: str, selector: str) -> list[dict[str, Any]]:
            return []  # no LeaderWorkerSet: every other child is made sure of by the stand-ins below

    async def _kube() -> Any:
        return _Kube()

    async def _nothing(*args: Any, **kwargs: Any) -> Any:
        return None

    async def _no_troubles(*args: Any, **kwargs: Any) -> list[Any]:
        return []

    reconciler.kube = _kube  # type: ignore[method-assign]
    for name in ("_fallback_url", "_routing_urls", "_ensure", "_routers", "_put_back_groups"):
        setattr(reconciler, name, _nothing)
    reconciler._apply = _no_troubles  # type: ignore[method-assign]
    return reconciler


def _conditions(reconciler: Reconciler, status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    memory = reconciler._memory(META["uid"], status)
    body = kopf.Body({"metadata": META, "spec": SPEC})  # type: ignore[arg-type]
    patch = kopf.Patch()
    asyncio.run(reconciler._pass(body, SPEC, body.meta, status, patch, memory, {}))
    return {c["type"]: c for c in patch.status["conditions"]}


def test_a_pass_handed_an_older_status_keeps_the_transition_times_the_last_pass_wrote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reconciler = _reconciler()
    clock = [datetime(2026, 1, 1, 0, 0, 10, tzinfo=UTC)]
    monkeypatch.setattr(handlers, "_now", lambda: clock[0])
    first = _conditions(reconciler, {})
    assert first["Reconciling"]["status"] == "True", first["Reconciling"]
    assert first["Reconciling"]["lastTransitionTime"] == "2026-01-01T00:00:10Z"
    clock[0] = datetime(2026, 1, 1, 0, 0, 12, tzinfo=UTC)
    # The status the first pass was given: the write it made has not reached this pass's body.
    second = _conditions(reconciler, {})
    for kind, c in first.items():
        if second[kind]["status"] == c["status"]:
            assert second[kind]["lastTransitionTime"] == c["lastTransitionTime"], (kind, second[kind])
