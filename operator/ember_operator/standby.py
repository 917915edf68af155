"""Whether this replica stands by while a peer works (kopf peering), read from the peering objects by the
rule kopf pauses on.

A paused replica runs no pass, so the per-service gauges it published (`metrics.py`) would stay as they
were: its pod is still scraped behind the operator's metrics Service, and an alert on a condition the
active replica cleared long ago would go on firing. While this replica stands by it publishes none.

kopf pauses a replica while the peering object's status holds a live peer (last seen within its lifetime)
of higher priority, or one of the same priority: two entries of this replica's priority then, its own
among them (kopf pauses both). This reads the same entries, so it needs no replica's identity."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from ember_operator.pods import parse_time

log = logging.getLogger("ember.operator")

PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"
DEFAULT_LIFETIME = 60  # seconds: what kopf assumes of an entry that does not say


def outranked(entries: dict[str, Any], priority: int, now: datetime) -> bool:
    """Whether a peering object's status (`{identity: {priority, lifetime, lastseen}}`) pauses a replica of
    `priority`."""
    same = 0
    for entry in entries.values():
        if not isinstance(entry, dict):
            continue  # an entry being removed
        try:
            seen = parse_time(entry.get("lastseen")) or now
        except ValueError:  # not a time: kopf would refuse the entry too, so it counts as just seen
            seen = now
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=UTC)  # as kopf reads a time without a zone
        if seen + timedelta(seconds=int(entry.get("lifetime") or DEFAULT_LIFETIME)) <= now:
            continue  # dead: kopf ignores it (and cleans it up)
        theirs = int(entry.get("priority") or 0)
        if theirs > priority:
            return True
        same += theirs == priority
    return same > 1


class Standby:
    """Follows the peering objects every `interval` seconds; `on_pause` runs each time while this replica
    stands by (cheap and idempotent: it clears what passes publish)."""

    def __init__(
        self,
        list_peerings: Callable[[str | None], list[dict[str, Any]]],
        name: str,
        priority: int,
        interval: float,
        on_pause: Callable[[], None],
    ) -> None:
        self._list = list_peerings  # (namespace, None: cluster-wide) -> the peering objects named `name`
        self._name = name
        self._priority = priority
        self._interval = interval
        self._on_pause = on_pause
        self.paused = False

    def check(self, namespaces: Iterable[str | None]) -> bool:
        """Read the peering objects of `namespaces` (None: the cluster-wide one) and say whether this replica
        stands by; an object that cannot be read leaves the last verdict as it was."""
        now = datetime.now(UTC)
        verdicts = []
        for namespace in namespaces:
            try:
                objects = self._list(namespace)
                named = [o for o in objects if (o.get("metadata") or {}).get("name") == self._name]
                verdicts += [outranked(o.get("status") or {}, self._priority, now) for o in named]
            except Exception as e:  # the API server away, no peering CRD, an entry unreadable: as it was
                log.debug("peering %s in %s not read: %s", self._name, namespace or "the cluster", e)
                return self.paused
        paused = any(verdicts)
        if paused != self.paused:
            log.info("%s", "standing by: a peer works" if paused else "no longer standing by")
        self.paused = paused
        if paused:
            self._on_pause()
        return paused

    async def run(self, namespaces: Callable[[], Iterable[str | None]]) -> None:
        while True:
            await asyncio.to_thread(self.check, list(namespaces()))
            await asyncio.sleep(self._interval)
