"""Which engine holds which prefix: block hash -> engines, built from the engines' own prefix-cache events.

Each engine announces the chained hashes of the full blocks it caches and evicts (`GET /v1/kv_events`);
a prompt's longest cached prefix on an engine is the number of its leading block hashes that engine holds.
Where an engine's events cannot be read, the router records what it sent there instead (`assume`), aged
out oldest first, so routing stays sticky without them. Where they can, what the router has just sent counts
as held for a short while (`sent`): the engine announces a prompt's blocks only once it has computed them,
and a second request for the same prefix that arrives meanwhile should follow the first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self, assumed_per_engine: int = 50_000) -> None:
        self._held: dict[str, set[int]] = {}  # engine -> hashes it reported
        self._assumed: dict[str, OrderedDict[int, None]] = {}  # engine -> hashes the router sent it
        self._sent: dict[str, dict[int, float]] = {}  # engine -> hash -> until when it counts as held
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
        self._sent.get(engine, {}).pop(block_hash, None)

    def sent(self, engine: str, hashes: Sequence[int], now: float, hold_for: float) -> None:
        """Count `hashes` as held by `engine` for `hold_for` seconds from `now` (or until its events say
        otherwise): the router has just sent it that prompt, whose blocks the engine announces once computed."""
        pending = self._sent.setdefault(engine, {})
        if len(pending) > self._limit:  # drop what has expired
            for h in [h for h, until in pending.items() if until < now]:
                del pending[h]
        for h in hashes:
            pending[h] = now + hold_for

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
        self._sent.pop(engine, None)

    def matched_blocks(
        self, engine: str, hashes: Sequence[int], events_live: bool = True, now: float | None = None
    ) -> int:
        """How many leading blocks of a prompt (its chained `hashes`) the engine is known to hold; with `now`,
        blocks just sent there (`sent`, not yet expired) count too."""
        held: set[int] | OrderedDict[int, None] = (
            self._held.get(engine, set()) if events_live else self._assumed.get(engine, OrderedDict())
        )
        pending = self._sent.get(engine, {}) if now is not None else {}
        n = 0
        for h in hashes:
            if h not in held and not (now is not None and pending.get(h, -1.0) >= now):
                break
            n += 1
        return n
