"""Admission control: whether a new request is served, shed, or sent to the fallback.

The decision is a pure function of the policy and a snapshot of the queue, so that it is testable without a
server, an engine or a clock.

Priority-aware shedding. The policy's distinct class priorities, sorted, give each class a rank i of k
(0 = most important). A request of priority p counts only the waiting requests at least as important
(priority <= p): under the engine's priority scheduling those are the ones it waits behind. Its class is
shed once that count reaches ceil(maxQueueDepth * (k - i) / k), or once its share of the estimated queue wait
reaches maxQueueWaitSeconds * (k - i) / k. The most important class gets the full limits and the least
important 1/k of them, and since a lower class also counts everything above it, a growing queue sheds the
least important class first and the most important last. The total queue is thereby bounded by about
maxQueueDepth * (k + 1) / 2, reached only when every class fills its own share.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ember_engine.policy import Policy

# Which fallback condition (Policy.fallback.when) covers each shed reason; client_limit is absent on purpose:
# a client over its own limit would otherwise just move its excess onto the fallback.
_CONDITION = {
    "queue_full": "Overloaded",
    "queue_wait": "Overloaded",
    "draining": "Unavailable",
    "not_ready": "Unavailable",
}


@dataclass(frozen=True, slots=True)
class QueueState:
    num_waiting: int
    num_waiting_by_priority: Mapping[int, int]  # must cover every waiting request
    # How long a request joining the back of the queue would wait (num_waiting + 1 positions: with every
    # slot busy it starts only after all those ahead of it and one more have left), from
    # QueueWaitEstimator.estimate(num_waiting + 1).
    estimated_wait_s: float
    draining: bool
    ready: bool

    def __post_init__(self) -> None:
        # An empty or partial breakdown would silently exempt requests from shedding.
        if sum(self.num_waiting_by_priority.values()) != self.num_waiting:
            raise ValueError(
                f"num_waiting_by_priority sums to {sum(self.num_waiting_by_priority.values())}, "
                f"not num_waiting={self.num_waiting}"
            )


@dataclass(frozen=True, slots=True)
class Admit:
    pass


@dataclass(frozen=True, slots=True)
class Shed:
    status: int  # 503 for overload or unavailability, 429 for a client over its own limit
    reason: str  # queue_full | queue_wait | draining | not_ready | client_limit
    message: str
    retry_after_s: int
    fallback_eligible: bool  # the policy has a fallback URL and its `when` covers this reason


def _shed(policy: Policy, status: int, reason: str, message: str) -> Shed:
    fallback = policy.fallback
    eligible = fallback.url is not None and _CONDITION.get(reason) in fallback.when
    return Shed(status, reason, message, policy.load_shedding.retry_after_seconds, eligible)


def decide(policy: Policy, state: QueueState, priority: int, client_in_flight: int = 0) -> Admit | Shed:
    """Admit or shed a new request of numeric `priority` from a client with `client_in_flight` requests
    already in flight (not counting this one).

    Unavailability is checked first (it is the pod's state, not the client's fault), then the client's own
    limit (so that its excess is refused rather than sent to the fallback), then the queue limits.
    """
    if state.draining:
        return _shed(policy, 503, "draining", "server is draining; not accepting new requests")
    if not state.ready:
        return _shed(policy, 503, "not_ready", "server is not ready yet")
    shedding = policy.load_shedding
    limit = shedding.max_concurrent_per_client
    if limit and client_in_flight >= limit:
        return _shed(
            policy,
            429,
            "client_limit",
            f"client has {client_in_flight} requests in flight; maxConcurrentPerClient is {limit}",
        )

    levels = sorted(c.priority for c in shedding.priority_classes)
    k = len(levels)
    rank = min(bisect.bisect_left(levels, priority), k - 1)  # between two classes: the less important one
    share = (k - rank) / k
    ahead = sum(n for p, n in state.num_waiting_by_priority.items() if p <= priority)

    if shedding.max_queue_depth:
        depth_limit = math.ceil(shedding.max_queue_depth * share)
        if ahead >= depth_limit:
            return _shed(
                policy,
                503,
                "queue_full",
                f"queue full: {ahead} requests waiting at priority <= {priority}; the limit for this "
                f"priority is {depth_limit} (maxQueueDepth {shedding.max_queue_depth})",
            )
    if shedding.max_queue_wait_seconds:
        wait_limit = shedding.max_queue_wait_seconds * share
        # This request's position counts only those at least as important ahead of it.
        wait = state.estimated_wait_s * (ahead + 1) / (state.num_waiting + 1)
        if wait >= wait_limit:
            return _shed(
                policy,
                503,
                "queue_wait",
                f"estimated queue wait {wait:.2f}s at priority <= {priority}; the limit for this priority "
                f"is {wait_limit:.2f}s (maxQueueWaitSeconds {shedding.max_queue_wait_seconds:g})",
            )
    return Admit()


class QueueWaitEstimator:
    """Estimated time a new request would wait: waiting requests ÷ the rate at which requests leave the queue.

    The rate is measured only over time when the queue was non-empty: while it is empty, requests start as
    fast as they arrive, which says nothing about how fast a backlog drains. It is averaged per window of
    `window_s` such time by an EWMA with weight `alpha` on the newest window. Before the first window closes
    the rate seen so far is used; with no request ever having left a non-empty queue the estimate is 0 (no
    evidence of a backlog; the depth limit still applies). A queue that stops moving drives the rate towards
    0 and the estimate up, to infinity when no request has left it at all.
    """

    def __init__(self, window_s: float = 1.0, alpha: float = 0.3) -> None:
        if window_s <= 0 or not 0 < alpha <= 1:
            raise ValueError(f"need window_s > 0 and 0 < alpha <= 1, got {window_s}, {alpha}")
        self.window_s = window_s
        self.alpha = alpha
        self.rate: float | None = None  # requests/s leaving a non-empty queue; None before the first window
        self._last: tuple[float, int, int] | None = None  # (now, num_waiting, num_started_total)
        self._busy_s = 0.0  # non-empty-queue time and departures in the current window
        self._busy_started = 0

    def observe(self, now: float, num_waiting: int, num_started_total: int) -> None:
        """Record the queue after an engine step; num_started_total counts every request that ever left it."""
        if self._last is not None:
            last_now, last_waiting, last_started = self._last
            if last_waiting > 0:
                self._busy_s += max(0.0, now - last_now)
                # max(): a counter that went backwards (an engine restart) contributes nothing.
                self._busy_started += max(0, num_started_total - last_started)
            if self._busy_s >= self.window_s:
                sample = self._busy_started / self._busy_s
                self.rate = (
                    sample if self.rate is None else self.alpha * sample + (1 - self.alpha) * self.rate
                )
                self._busy_s, self._busy_started = 0.0, 0
        self._last = (now, num_waiting, num_started_total)

    def estimate(self, num_waiting: int) -> float:
        if num_waiting <= 0:
            return 0.0
        rate = self.rate
        if rate is None:
            if not self._busy_started or self._busy_s <= 0:
                return 0.0
            rate = self._busy_started / self._busy_s
        return num_waiting / rate if rate > 0 else math.inf
