"""The model-routing rules of a routes file (`ember router --routes`), re-read while the router runs.

The operator writes the file into the ConfigMap the router pods mount, with each target's address, so a
target that publishes its address later, or a changed rule, reaches running routers without a new pod.
A file is compared by content (a ConfigMap update swaps a symlink and may keep the mtime); one that cannot
be read or parsed is logged and the last good rules stay.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from pathlib import Path

from ember_router.rules import Rule, parse_routes

log = logging.getLogger("ember.router")


class RoutesFile:
    def __init__(self, path: str | Path) -> None:
        """Read the file; ValueError naming the file and what is wrong with it."""
        self.path = Path(path)
        self._seen, routes, problem = self._look()
        if routes is None:
            raise ValueError(f"{self.path}: {problem}")
        self.routes: tuple[tuple[Rule, str], ...] = routes

    def _look(self) -> tuple[str, tuple[tuple[Rule, str], ...] | None, str]:
        try:
            data = self.path.read_bytes()
        except OSError as e:
            return f"unreadable: {e}", None, f"cannot read it: {e}"
        seen = hashlib.sha256(data).hexdigest()
        try:
            return seen, parse_routes(data.decode()), ""
        except (ValueError, UnicodeDecodeError) as e:
            return seen, None, str(e)

    def check(self) -> bool:
        """Re-read the file; True when different rules took effect."""
        seen, routes, problem = self._look()
        if seen == self._seen:  # also keeps a bad file from being reported on every look
            return False
        self._seen = seen
        if routes is None:
            log.warning("routes file %s: %s; keeping the last good rules", self.path, problem)
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
