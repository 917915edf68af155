"""Watch fan-out: the change history, per-stream filters and queues, compaction.

Every committed write becomes one `Change` carrying exactly the resourceVersion the write returned;
kopf waits for that echo before it runs its next handler. A watch that names a resourceVersion is
replayed from the history, then fed live; one older than the compaction point gets the real server's
`410 Expired`. Filters apply to both the old and the new state, so an object that starts or stops
matching a selector arrives as ADDED or DELETED, as Kubernetes reports it.

The hub is used only on the server's event loop; the gap between computing a backlog and subscribing
has no `await`, so no change can slip between them.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .errors import expired
from .resources import ResourceType
from .selectors import FieldSelector, LabelSelector

# Sentinels a watcher's queue may carry instead of an event.
CLOSE = "close"
EXPIRE = "expire"

Event = tuple[str, dict[str, Any]]


@dataclass(slots=True)
class Change:
    rv: int
    storage: tuple[str, str]
    type: str  # ADDED, MODIFIED or DELETED
    obj: dict[str, Any]
    old: dict[str, Any] | None = None


@dataclass(slots=True, eq=False)
class Watcher:
    rtype: ResourceType
    namespace: str | None
    labels: LabelSelector
    fields: FieldSelector
    queue: asyncio.Queue[Event | str] = field(default_factory=asyncio.Queue)

    def matches(self, obj: dict[str, Any] | None) -> bool:
        if obj is None:
            return False
        if self.namespace is not None and obj["metadata"].get("namespace") != self.namespace:
            return False
        return self.labels.matches(obj) and self.fields.matches(obj)

    def view(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The object as this stream's API version presents it."""
        if obj.get("apiVersion") == self.rtype.api_version:
            return obj
        return {**obj, "apiVersion": self.rtype.api_version}

    def translate(self, change: Change) -> Event | None:
        if change.storage != self.rtype.storage:
            return None
        if change.type == "DELETED":
            return ("DELETED", self.view(change.obj)) if self.matches(change.obj) else None
        before, after = self.matches(change.old), self.matches(change.obj)
        if after:
            return ("MODIFIED" if before else "ADDED", self.view(change.obj))
        return ("DELETED", self.view(change.obj)) if before else None


class WatchHub:
    def __init__(self, history_limit: int) -> None:
        self.history: deque[Change] = deque()
        self.history_limit = history_limit
        # Changes with rv <= compacted may be missing from the history.
        self.compacted = 0
        self.watchers: set[Watcher] = set()

    def publish(self, change: Change) -> None:
        self.history.append(change)
        while len(self.history) > self.history_limit:
            self.compacted = self.history.popleft().rv
        for watcher in self.watchers:
            event = watcher.translate(change)
            if event is not None:
                watcher.queue.put_nowait(event)

    def backlog(self, watcher: Watcher, since: int) -> list[Event]:
        if since < self.compacted:
            raise expired(since, self.compacted + 1)
        events = (watcher.translate(change) for change in self.history if change.rv > since)
        return [event for event in events if event is not None]

    def compact(self, current_rv: int) -> None:
        self.history.clear()
        self.compacted = current_rv

    def signal_all(self, sentinel: str) -> None:
        for watcher in self.watchers:
            watcher.queue.put_nowait(sentinel)
