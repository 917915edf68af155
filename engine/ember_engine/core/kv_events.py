"""Prefix-cache events: which block hashes the cache stored and removed, for routers that place requests
where their prefix is cached.

The block hash (`chain_hash`) is stable across processes and machines: a router that tokenizes a prompt
the way the engine does computes the same chain and can look it up in what engines announced. Events are
kept in a bounded log with sequence numbers; a reader that fell behind the log's start gets a snapshot of
every hash the cache holds instead. The engine thread writes, any thread may read (deque appends and
copies are atomic in CPython; the snapshot retries while the cache changes under it).
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

STORED, REMOVED = "stored", "removed"


def chain_hash(
    parent: int | None, token_ids: Sequence[int], extra: str | None = None, adapter: str | None = None
) -> int:
    """The key of a full block: its tokens, the key of the block before it, a cache salt, and the LoRA
    adapter that computed it (its name length-prefixed, so that no salt can spell an adapter's key)."""
    h = hashlib.blake2b(digest_size=8)
    h.update((parent if parent is not None else 0).to_bytes(8, "little", signed=False))
    h.update(b"\x01" if parent is not None else b"\x00")
    h.update(array("q", token_ids).tobytes())
    if adapter is not None:
        name = adapter.encode("utf-8", "surrogatepass")
        h.update(b"\x03" + len(name).to_bytes(4, "little") + name)
    if extra is not None:
        h.update(b"\x02" + extra.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "little")


def prefix_hashes(
    token_ids: Sequence[int], block_size: int, extra: str | None = None, adapter: str | None = None
) -> list[int]:
    """The chained keys of every full block of `token_ids`."""
    out: list[int] = []
    for i in range(len(token_ids) // block_size):
        out.append(
            chain_hash(
                out[-1] if out else None, token_ids[i * block_size : (i + 1) * block_size], extra, adapter
            )
        )
    return out


@dataclass(frozen=True, slots=True)
class EventBatch:
    seq: int  # the sequence number of the latest event; pass it as `since` next time
    events: list[tuple[str, int]]  # (STORED | REMOVED, hash), oldest first
    snapshot: list[int] | None = None  # set when `since` was too old: every hash held now (events empty)


class KVEvents:
    def __init__(self, capacity: int = 200_000) -> None:
        self._log: deque[tuple[int, str, int]] = deque(maxlen=capacity)
        self._counter = itertools.count(1)
        self.seq = 0

    def record(self, kind: str, block_hash: int) -> None:
        self.seq = next(self._counter)
        self._log.append((self.seq, kind, block_hash))

    def since(self, seq: int, holding: Callable[[], Iterable[int]]) -> EventBatch:
        """Events after `seq`; a snapshot from `holding()` when `seq` is older than the log (or 0)."""
        log = list(self._log)
        latest = log[-1][0] if log else self.seq
        if seq == latest:
            return EventBatch(latest, [])
        if seq <= 0 or not log or seq < log[0][0] - 1 or seq > latest:
            for _ in range(10):
                try:
                    held = list(holding())
                    break
                except RuntimeError:  # the engine thread changed the cache while it was read
                    continue
            else:
                held = []
            return EventBatch(latest, [], held)
        return EventBatch(latest, [(kind, h) for s, kind, h in log if s > seq])
