"""Admission control: whether a new request is served, shed, or sent to the fallback.

The decision is a pure function of the policy and a snapshot of the queue, so that it is testable without a
server, an engine or a clock.

Priority-aware shedding. The policy's distinct class priorities, sorted, give each class a rank i of k
(0 = most important). A request of priority p counts only the waiting requests at least as important
(priority <= p): under the engine's priority scheduling those are the ones it waits behind. Its class is
shed once that count reaches ceil(maxQueueDepth * (k - i) / k), or once the forecast of its own queue wait
(queue_forecast.Forecast.wait, scaled by WaitCalibration.factor) reaches maxQueueWaitSeconds * (k - i) / k. The most important class gets the full limits and the least
important 1/k of them, and since a lower class also counts everything above it, a growing queue sheds the
least important class first and the most important last. The total queue is thereby bounded by about
maxQueueDepth * (k + 1) / 2, reached only when every class fills its own share.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from ember_engine.server.policy import Policy

# Which fallback condition (Policy.fallback.when) covers each shed reason; client_limit is absent on purpose:
# a client over its own limit would otherwise just move its excess onto the fallback.
_CONDITION = {
    "queue_full": "Overloaded",
    "queue_wait": "Overloaded",
    "draining": "Unavailable",
    "not_ready": "Unavailable",
}
SHED_REASONS = (*_CONDITION, "client_limit")  # every reason a request is shed for


@dataclass(frozen=True, slots=True)
class QueueState:
    num_waiting: int
    num_waiting_by_priority: Mapping[int, int]  # must cover every waiting request
    # How long this newcomer would wait, from queue_forecast (behind the waiting requests at least as
    # important as itself); 0 when there is nothing to forecast from (only the depth limit applies).
    estimated_wait_s: float
    draining: bool
    ready: bool
    wait_factor: float = 1.0  # the calibration the forecast is scaled by (WaitCalibration.factor)

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
    reason: str  # one of SHED_REASONS: queue_full | queue_wait | draining | not_ready | client_limit
    message: str
    retry_after_s: int
    fallback_eligible: bool  # the policy has a fallback URL and its `when` covers this reason


def _shed(policy: Policy, status: int, reason: str, message: str) -> Shed:
    fallback = policy.fallback
    eligible = fallback.url is not None and _CONDITION.get(reason) in fallback.when
    return Shed(status, reason, message, policy.load_shedding.retry_after_seconds, eligible)


def _share(policy: Policy, priority: int) -> float:
    """The fraction (k - i)/k of each queue limit that a request of this priority may fill."""
    levels = sorted(c.priority for c in policy.load_shedding.priority_classes)
    k = len(levels)
    rank = min(bisect.bisect_left(levels, priority), k - 1)  # between two classes: the less important one
    return (k - rank) / k


def wait_limit_s(policy: Policy, priority: int) -> float:
    """The longest queue wait a request of this priority is admitted for; 0 when the policy sets none."""
    return policy.load_shedding.max_queue_wait_seconds * _share(policy, priority)


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

    share = _share(policy, priority)
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
        wait_limit = wait_limit_s(policy, priority)
        wait = state.estimated_wait_s * state.wait_factor
        if wait >= wait_limit:
            return _shed(
                policy,
                503,
                "queue_wait",
                f"estimated queue wait {wait:.2f}s at priority <= {priority}; the limit for this priority "
                f"is {wait_limit:.2f}s (maxQueueWaitSeconds {shedding.max_queue_wait_seconds:g})",
            )
    return Admit()


class WaitCalibration:
    """How far short the wait forecast runs, as a factor to scale it by before it meets the limit.

    Each admitted request's forecast wait is compared with the wait it then had. The factor is a high
    quantile of actual / forecast over the latest comparisons, so that the limit holds for all but that
    share of the requests admitted close to it. A comparison arrives only when a request starts, up to a
    whole wait limit after its admission; meanwhile a request still waiting past its forecast already
    shows that forecasts run short, so the factor is at least the largest waited-so-far / forecast of the
    requests still waiting. It never goes below 1: a forecast that runs long costs some goodput, one
    corrected downwards on the strength of a calm spell overshoots the limit when the load turns. Only
    requests whose calibrated forecast was at least half their limit are compared: those are the ones a
    decision turns on, and a ratio to a forecast near zero says little. Until `min_samples` comparisons
    exist the quantile part is `initial`: a forecast not yet checked against this machine is trusted only
    up to two thirds of the limit. The factor is capped at `bounds[1]`. Times are passed in, so that it is
    testable without a clock.
    """

    def __init__(
        self,
        quantile: float = 0.99,
        window: int = 100,
        min_samples: int = 20,
        bounds: tuple[float, float] = (1.0, 4.0),
        initial: float = 1.5,
    ) -> None:
        if (
            not 0 < quantile <= 1
            or window < 1
            or not 1 <= min_samples <= window
            or not 0 < bounds[0] <= 1 <= bounds[1]
            or not bounds[0] <= initial <= bounds[1]
        ):
            raise ValueError(
                f"need 0 < quantile <= 1, 1 <= min_samples <= window and 0 < low <= 1 <= high, initial "
                f"within the bounds; got {quantile}, {min_samples}, {window}, {bounds}, {initial}"
            )
        self.quantile, self.min_samples, self.bounds = quantile, min_samples, bounds
        self._ratios: deque[float] = deque(maxlen=window)
        # request -> (admitted at, its forecast, its limit), until it starts or leaves
        self._waiting: dict[object, tuple[float, float, float]] = {}
        self.quantile_factor = initial  # from the completed comparisons alone

    def admitted(self, key: object, forecast_s: float, limit_s: float, now: float) -> None:
        """A request admitted at `now` with this uncalibrated forecast under its priority's limit."""
        if limit_s > 0 and forecast_s > 0 and forecast_s * self.factor(now) >= limit_s / 2:
            self._waiting[key] = (now, forecast_s, limit_s)

    def started(self, key: object, waited_s: float) -> None:
        """It started after waiting `waited_s` in the queue."""
        entry = self._waiting.pop(key, None)
        if entry is not None:
            self._compare(waited_s / entry[1])

    def forget(self, key: object, now: float) -> None:
        """It left (finished, or gave up waiting) without starting. If it had waited past its forecast, that
        much is known: the ratio so far is compared (a request whose wait overran its forecast long enough
        for the client to give up is just the kind of miss to learn from)."""
        entry = self._waiting.pop(key, None)
        if entry is not None and now - entry[0] > entry[1]:
            self._compare((now - entry[0]) / entry[1])

    def _compare(self, ratio: float) -> None:
        self._ratios.append(ratio)
        if len(self._ratios) >= self.min_samples:
            ordered = sorted(self._ratios)
            self.quantile_factor = ordered[min(len(ordered) - 1, math.ceil(self.quantile * len(ordered)) - 1)]

    def factor(self, now: float) -> float:
        overdue = 0.0
        for key, (since, forecast, limit) in list(self._waiting.items()):
            if now - since > 10 * limit:  # neither started nor left after ten limits: stop counting it
                del self._waiting[key]
            else:
                overdue = max(overdue, (now - since) / forecast)
        return min(max(self.quantile_factor, overdue, self.bounds[0]), self.bounds[1])
