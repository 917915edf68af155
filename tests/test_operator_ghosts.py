"""The uids of pods kopf's index holds but a LIST lacks (deleted, the index never told) are kept only
while the index still holds them."""

from __future__ import annotations

import asyncio

from ember_operator.handlers import Reconciler, Settings


def _pod(uid: str) -> dict[str, object]:
    return {"metadata": {"name": uid, "namespace": "ns", "uid": uid, "labels": {}}}


def test_ghosts_the_index_dropped_are_forgotten() -> None:
    reconciler = Reconciler(Settings())
    reconciler._ghosts = {"gone-1", "gone-2"}
    memory = reconciler._memory("uid-1", {})
    index = {("ns", "svc"): [_pod("gone-1"), _pod("live")]}

    async def pods() -> list[dict[str, object]]:
        pods_of = await reconciler._pods_of(None, index, "ns", "svc", memory, {})  # type: ignore[arg-type]
        return pods_of(None)

    assert [p["metadata"]["name"] for p in asyncio.run(pods())] == ["live"]  # type: ignore[index]
    assert reconciler._ghosts == {"gone-1"}, "a ghost the index no longer holds is kept for good"
