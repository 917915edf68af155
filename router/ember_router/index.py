"""Which engine holds which prefix: block hash -> engines, built from the engines' own prefix-cache events.

Each engine announces the chained hashes of the full blocks it caches and evicts (`GET /v1/kv_events`);
a prompt's longest cached prefix on an engine is the number of its leading block hashes that engine holds.
Where an engine's events cannot be read, the router records what it sent there instead (`assume`), aged
out oldest first, so routing stays sticky without them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, assumed_per_engine: int = 50_000) -> None:
        self._held: dict[str, set[int]] = {}  # engine -> hashes it reported
        self._assumed: dict[str, OrderedDict[int, None]] = {}  # engine -> hashes the router sent it
        self._limit = assumed_per_engine

    def engines(self) -> list[str]:
        return sorted({*self._held, *self._assumed})

    def reset(self, engine: str, hashes: Iterable[int]) -> None:
        """The engine's complete set (a snapshot): it replaces what was known and what was assumed."""
        self._held[engine] = set(hashes)
        self._assumed.pop(engine, None)

    def stored(self, engine: str, block_hash: int) -> None:
        self._held.setdefault(engine, set()).add(block_hash)

    def removed(self, engine: str, block_hash: int) -> None:
        self._held.get(engine, set()).discard(block_hash)

    def assume(self, engine: str, hashes: Sequence[int]) -> None:
        """Record that `hashes` were sent to `engine` (used only while its events are unavailable)."""
        seen = self._assumed.setdefault(engine, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self._limit:
            seen.popitem(last=False)

    def forget(self, engine: str) -> None:
        self._held.pop(engine, None)
        self._assumed.pop(engine, None)

    def matched_blocks(self, engine: str, hashes: Sequence[int], events_live: bool = True) -> int:
        """How many leading blocks of a prompt (its chained `hashes`) the engine is known to hold."""
        held: set[int] | OrderedDict[int, None] = (
            self._held.get(engine, set()) if events_live else self._assumed.get(engine, OrderedDict())
        )
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n
