"""What a pass has made sure of and need not read again until something changes or a resync is due.

The Service, the policy ConfigMap and the PodDisruptionBudget are read (GET) and, if someone changed them,
put back. Reading each on every pass is what made an idle InferenceService cost several requests a tick.
`Known` remembers, per child, the desired object last made sure of and what the API server returned; a pass
whose desired object is the same skips the read. Every `resync` seconds everything is forgotten and read
again (kube-controller-manager's controllers resync their caches the same way). The operator also watches
the kinds it makes: an event on a child forgets that child (`forget_key`), so an edit or deletion by
someone else is put back at the owner's next pass. A fallback Service's endpoint is kept the same way.

Something else may still be about to fill in what a pass reads: a load balancer publishes the Service's
address in its status some time after it is created, and the routers' Deployment counts its pods Ready as
they start (a router that dies later shows through the Deployment's events). A result put as not settled is read again sooner,
after 1 s, then 2, 4, 8 and 16 s, so a published address shows within seconds; after that it waits for the
resync like a settled one, so a Service that never gets an address costs no more than one that did.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

UNSETTLED_READS = 5  # reads sooner than the resync of a result that is not settled: after 1, 2, 4, 8, 16 s


def fingerprint(desired: Any) -> str:
    return json.dumps(desired, sort_keys=True, default=str)


@dataclass(slots=True)
class Known:
    # key -> (fingerprint, result, time.monotonic() until which it holds)
    entries: dict[str, tuple[str, Any, float]] = field(default_factory=dict)
    unsettled: dict[str, int] = field(default_factory=dict)  # key -> reads in a row put as not settled
    resync: float = 60.0
    resync_at: float = 0.0  # time.monotonic() when everything is read again

    def begin(self, resync: float) -> None:
        """Start a pass: forget everything when a resync is due."""
        now = time.monotonic()
        self.resync = resync
        if now >= self.resync_at:
            self.entries.clear()
            self.resync_at = now + resync

    def get(self, key: str, desired: Any) -> tuple[bool, Any]:
        """(True, result) when `desired` is what was made sure of under `key`, and that still holds."""
        entry = self.entries.get(key)
        if entry is not None and entry[0] == fingerprint(desired) and time.monotonic() < entry[2]:
            return True, entry[1]
        return False, None

    def put(self, key: str, desired: Any, result: Any, settled: bool = True) -> None:
        until = self.resync_at
        if settled:
            self.unsettled.pop(key, None)
        else:
            n = self.unsettled[key] = self.unsettled.get(key, 0) + 1
            if n <= UNSETTLED_READS:
                until = min(until, time.monotonic() + 2.0 ** (n - 1))
        self.entries[key] = (fingerprint(desired), result, until)

    def drop(self, key: str, desired: Any, unless: Any = None) -> None:
        """Forget what `key` holds for `desired`, unless it is `unless` (None: whatever it is)."""
        entry = self.entries.get(key)
        if entry is not None and entry[0] == fingerprint(desired) and (unless is None or entry[1] != unless):
            del self.entries[key]

    def forget_key(self, key: str) -> None:
        """Forget what `key` holds, whatever it was made sure of as."""
        self.entries.pop(key, None)

    def forget(self) -> None:
        self.entries.clear()
