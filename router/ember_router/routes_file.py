"""The model-routing rules of a routes file (`ember router --routes`), re-read while the router runs.

The operator writes the file into the ConfigMap the router pods mount, with each target's address, so a
target that publishes its address later, or a changed rule, reaches running routers without a new pod.
A file is compared by content (a ConfigMap update swaps a symlink and may keep the mtime); one that cannot
be read or parsed is logged and the last good rules stay.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from ember_engine.server.content_watch import ContentWatch
from ember_router.rules import Rule, parse_routes

log = logging.getLogger("ember.router")


def _parse(data: bytes | None, error: OSError | None) -> tuple[tuple[Rule, str], ...]:
    if data is None:
        raise ValueError(f"cannot read it: {error}")
    return parse_routes(data.decode())  # a UnicodeDecodeError is a ValueError


class RoutesFile:
    def __init__(self, path: str | Path) -> None:
        """Read the file; ValueError naming the file and what is wrong with it."""
        self.path = Path(path)
        self._watch = ContentWatch(self.path)
        _, data, error = self._watch.look()
        try:
            self.routes = _parse(data, error)
        except ValueError as e:
            raise ValueError(f"{self.path}: {e}") from None

    def check(self) -> bool:
        """Re-read the file; True when different rules took effect."""
        changed, data, error = self._watch.look()
        if not changed:  # also keeps a bad file from being reported on every look
            return False
        try:
            routes = _parse(data, error)
        except ValueError as e:
            log.warning("routes file %s: %s; keeping the last good rules", self.path, e)
            return False
        if routes == self.routes:
            return False
        self.routes = routes
        log.info("routes file %s: %d rule(s) now in effect", self.path, len(routes))
        return True

    async def run(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.check()
