"""A replica that resumes (its InferenceServices listed again after a pause) takes up the memory status
holds, once, before the pass: the spec it takes in that pass is kept."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
import pytest

from ember_operator.handlers import Reconciler, Settings


class _Listed(Exception):
    """Raised where the pass has read its pods: what the memory holds then is what it goes on with."""


class _Kube:
    def list_pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        return []


class _Pending:
    def pods(self, pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
        raise _Listed


def test_a_resumed_replica_keeps_the_spec_it_took_in_the_pass() -> None:
    reconciler = Reconciler(Settings())
    kube = _Kube()

    async def _kube() -> Any:
        return kube

    async def _nothing(*args: Any, **kwargs: Any) -> Any:
        return None

    reconciler.kube = _kube  # type: ignore[method-assign]
    for name in ("_fallback_url", "_routing_urls", "_ensure", "_routers"):
        setattr(reconciler, name, _nothing)
    meta = {"name": "svc", "namespace": "ns", "uid": "uid-1", "generation": 1}
    memory = reconciler._memory("uid-1", {})
    memory.pending = _Pending()  # type: ignore[assignment]
    memory.stale = memory.relist = True  # listed again after a pause
    body = kopf.Body({"metadata": meta, "spec": {}})  # type: ignore[arg-type]
    raw = {"model": {"name": "m", "source": "/m"}}
    with pytest.raises(_Listed):
        asyncio.run(reconciler._pass(body, raw, body.meta, {}, kopf.Patch(), memory, {}))
    assert memory.last_spec is not None, "the spec taken in the pass was forgotten"
    assert not memory.stale
