"""What a ReplicaSet controller waits to see before it acts on a ReplicaSet again: kube-controller-manager's
`ControllerExpectations` (`pkg/controller/controller_utils.go`), in the form its ReplicaSet controller uses
(`UIDTrackingControllerExpectations`: creates counted, deletes tracked pod by pod).

After creating N pods the controller expects N pod additions, after deleting some pods their deletions;
until its informer has delivered them (or a create or delete failed, which counts as seen) its cache is
stale, and it does not create or delete for that ReplicaSet again, only writes its status. Expectations
older than upstream's `ExpectationsTimeout` (five minutes) count as met, so a lost event cannot wedge a
ReplicaSet for good.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Hashable, Iterable

__all__ = ["EXPECTATIONS_TIMEOUT", "Expectations"]

EXPECTATIONS_TIMEOUT = 300.0  # seconds, upstream's ExpectationsTimeout


@dataclasses.dataclass
class _Pending:
    adds: int
    deletes: set[str]
    since: float


class Expectations:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pending: dict[Hashable, _Pending] = {}

    def expect(self, key: Hashable, adds: int = 0, deletes: Iterable[str] = ()) -> None:
        """Record the creates and deletes just asked of the API server (replacing what was recorded)."""
        self._pending[key] = _Pending(adds, set(deletes), self._clock())

    def created(self, key: Hashable) -> None:
        """A pod of `key` appeared in the cache, or a create failed."""
        pending = self._pending.get(key)
        if pending is not None:
            pending.adds -= 1

    def deleted(self, key: Hashable, pod: str) -> None:
        """Pod `pod` of `key` is going (its deletionTimestamp) or gone, or its delete failed."""
        pending = self._pending.get(key)
        if pending is not None:
            pending.deletes.discard(pod)

    def satisfied(self, key: Hashable) -> bool:
        """Whether the controller may act on `key`: nothing is pending, everything was seen, or what is
        pending has expired."""
        pending = self._pending.get(key)
        if pending is None or (pending.adds <= 0 and not pending.deletes):
            return True
        return self._clock() - pending.since > EXPECTATIONS_TIMEOUT

    def forget(self, key: Hashable) -> None:
        """The ReplicaSet is gone."""
        self._pending.pop(key, None)
