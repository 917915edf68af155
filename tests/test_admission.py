"""Admission decisions (shed reasons, priority order, fallback eligibility) and the queue-wait estimator."""

from __future__ import annotations

import math
from typing import Any

import pytest

from ember_engine.admission import Admit, QueueState, QueueWaitEstimator, Shed, decide
from ember_engine.policy import Policy

CRITICAL, STANDARD, BATCH = 0, 1, 2  # the default priority classes


def make_policy(fallback: dict[str, Any] | None = None, **shedding: Any) -> Policy:
    return Policy.model_validate({"loadShedding": {"retryAfterSeconds": 7, **shedding}, "fallback": fallback})


def make_state(
    by_priority: dict[int, int] | None = None, wait: float = 0.0, draining: bool = False, ready: bool = True
) -> QueueState:
    by_priority = by_priority or {}
    return QueueState(sum(by_priority.values()), by_priority, wait, draining, ready)


FALLBACK = {"url": "http://small:8000"}


def shed(decision: Admit | Shed) -> Shed:
    assert isinstance(decision, Shed), decision
    return decision


@pytest.mark.parametrize(
    ("state", "reason", "condition"),
    [
        (make_state(draining=True), "draining", "Unavailable"),
        (make_state(ready=False), "not_ready", "Unavailable"),
        (make_state({CRITICAL: 10}), "queue_full", "Overloaded"),
        (make_state({CRITICAL: 5}, wait=3.0), "queue_wait", "Overloaded"),
    ],
)
def test_shed_reasons_are_503_and_fall_back_when_the_policy_says_so(
    state: QueueState, reason: str, condition: str
) -> None:
    limits = {"maxQueueDepth": 10, "maxQueueWaitSeconds": 2.0}
    decision = shed(decide(make_policy(FALLBACK, **limits), state, CRITICAL))
    assert (decision.status, decision.reason, decision.retry_after_s) == (503, reason, 7)
    assert decision.fallback_eligible is True
    other = "Overloaded" if condition == "Unavailable" else "Unavailable"
    only_other = make_policy({**FALLBACK, "when": [other]}, **limits)
    assert shed(decide(only_other, state, CRITICAL)).fallback_eligible is False
    no_url = make_policy(None, **limits)  # `when` defaults to both conditions, but there is nowhere to go
    assert shed(decide(no_url, state, CRITICAL)).fallback_eligible is False


def test_messages_name_the_limit_and_the_observed_value() -> None:
    policy = make_policy(maxQueueDepth=10, maxQueueWaitSeconds=2.0, maxConcurrentPerClient=3)
    full = shed(decide(policy, make_state({CRITICAL: 12}), CRITICAL)).message
    assert "12 requests waiting" in full and "maxQueueDepth 10" in full
    slow = shed(decide(policy, make_state({CRITICAL: 5}, wait=2.5), CRITICAL)).message
    assert "2.50s" in slow and "maxQueueWaitSeconds 2" in slow
    busy = shed(decide(policy, make_state(), CRITICAL, client_in_flight=4)).message
    assert "4 requests in flight" in busy and "maxConcurrentPerClient is 3" in busy


def test_client_limit_is_429_and_never_falls_back() -> None:
    policy = make_policy(FALLBACK, maxConcurrentPerClient=3)
    assert decide(policy, make_state(), STANDARD, client_in_flight=2) == Admit()
    decision = shed(decide(policy, make_state(), STANDARD, client_in_flight=3))
    assert (decision.status, decision.reason, decision.retry_after_s) == (429, "client_limit", 7)
    assert decision.fallback_eligible is False


def test_unavailability_is_reported_before_the_client_limit() -> None:
    policy = make_policy(FALLBACK, maxConcurrentPerClient=1)
    assert shed(decide(policy, make_state(draining=True), STANDARD, client_in_flight=5)).reason == "draining"


def test_zero_disables_every_limit() -> None:
    policy = make_policy(FALLBACK)  # all limits default to 0
    huge = make_state({CRITICAL: 10_000, STANDARD: 10_000, BATCH: 10_000}, wait=math.inf)
    for priority in (CRITICAL, STANDARD, BATCH):
        assert decide(policy, huge, priority, client_in_flight=10_000) == Admit()


def first_shed_size(policy: Policy, priority: int, wait_per_request: float) -> int:
    """Grow a queue with one waiting request per class at a time; return its size when `priority` is shed."""
    for per_class in range(1, 1000):
        by_priority = {CRITICAL: per_class, STANDARD: per_class, BATCH: per_class}
        state = make_state(by_priority, wait=wait_per_request * 3 * per_class)
        if isinstance(decide(policy, state, priority), Shed):
            return 3 * per_class
    raise AssertionError("never shed")


@pytest.mark.parametrize(
    ("limits", "wait_per_request"),
    [({"maxQueueDepth": 64}, 0.0), ({"maxQueueWaitSeconds": 2.0}, 0.01)],
)
def test_a_growing_queue_sheds_batch_then_standard_then_critical(
    limits: dict[str, float], wait_per_request: float
) -> None:
    policy = make_policy(**limits)
    sizes = [first_shed_size(policy, p, wait_per_request) for p in (BATCH, STANDARD, CRITICAL)]
    assert sizes[0] < sizes[1] < sizes[2]
    if "maxQueueDepth" in limits:
        # ceil(64 * share) requests at least as important: batch 22 of all, standard 43 of two thirds,
        # critical 64 of one third.
        assert sizes == [24, 66, 192]


def test_a_request_competes_only_with_requests_at_least_as_important() -> None:
    policy = make_policy(maxQueueDepth=30, maxQueueWaitSeconds=1.0)
    batch_backlog = make_state({BATCH: 500}, wait=50.0)
    assert decide(policy, batch_backlog, CRITICAL) == Admit()
    assert decide(policy, batch_backlog, STANDARD) == Admit()
    assert shed(decide(policy, batch_backlog, BATCH)).reason == "queue_full"
    # A priority less important than every class ranks with the least important (limit 10 of the 30).
    assert shed(decide(policy, make_state({CRITICAL: 10}), 7)).reason == "queue_full"
    assert decide(policy, make_state({CRITICAL: 10}), CRITICAL) == Admit()


def test_queue_state_must_account_for_every_waiting_request() -> None:
    with pytest.raises(ValueError, match="sums to 0, not num_waiting=5"):
        QueueState(5, {}, 0.0, False, True)


def run_steady(
    est: QueueWaitEstimator, start: float, seconds: float, waiting: int, rate: float, started: int
) -> tuple[float, int]:
    """Observe a queue held at `waiting` while `rate` requests/s leave it, every 0.1 s."""
    for step in range(1, round(seconds * 10) + 1):
        est.observe(start + step / 10, waiting, started + math.floor(rate * step / 10 + 1e-9))
    return start + seconds, started + math.floor(rate * seconds + 1e-9)


def test_estimator_before_any_measurement() -> None:
    est = QueueWaitEstimator()
    assert est.estimate(5) == 0.0  # nothing measured: no evidence of a backlog
    est.observe(0.0, 5, 0)
    est.observe(0.5, 5, 5)  # half a window: the rate seen so far is used
    assert est.estimate(5) == pytest.approx(0.5)
    stuck = QueueWaitEstimator()
    stuck.observe(0.0, 5, 0)
    stuck.observe(2.0, 5, 0)  # a full window in which nothing left the queue
    assert stuck.estimate(5) == math.inf


def test_estimator_on_a_synthetic_trace() -> None:
    est = QueueWaitEstimator(window_s=1.0, alpha=0.3)
    now, started = run_steady(est, 0.0, 10, waiting=20, rate=10, started=0)
    assert est.estimate(20) == pytest.approx(2.0, rel=0.02)  # 20 waiting / 10 per s
    assert est.estimate(5) == pytest.approx(0.5, rel=0.02)

    # The queue drains; then requests start as fast as they arrive, which says nothing about capacity.
    est.observe(now + 0.1, 0, started + 20)
    assert est.estimate(0) == 0.0
    now, started = run_steady(est, now + 0.1, 20, waiting=0, rate=1, started=started + 20)
    assert est.estimate(20) == pytest.approx(2.0, rel=0.05)

    # Throughput halves under a backlog: the EWMA converges to the new rate.
    now, started = run_steady(est, now, 20, waiting=20, rate=5, started=started)
    assert est.estimate(20) == pytest.approx(4.0, rel=0.02)


def test_estimator_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="window_s"):
        QueueWaitEstimator(window_s=0)
    with pytest.raises(ValueError, match="alpha"):
        QueueWaitEstimator(alpha=1.5)


def test_a_newcomer_to_an_empty_queue_still_waits_for_a_free_slot() -> None:
    # With every slot busy, even the first in line waits for one request to end: the estimate is for the
    # newcomer's own position, so an empty queue with a slow drain can already exceed the limit.
    one_class = [{"name": "only", "priority": 0}]
    policy = make_policy(maxQueueWaitSeconds=3, priorityClasses=one_class, defaultPriorityClass="only")
    assert isinstance(decide(policy, make_state({}, wait=2.0), 0), Admit)
    assert shed(decide(policy, make_state({}, wait=3.5), 0)).reason == "queue_wait"
    # Behind four others the newcomer is fifth: the estimate for the back of the queue applies in full.
    assert shed(decide(policy, make_state({0: 4}, wait=3.5), 0)).reason == "queue_wait"
    assert isinstance(decide(policy, make_state({0: 4}, wait=2.9), 0), Admit)
