"""Admission decisions: shed reasons, priority order, fallback eligibility."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import ClientDisconnect

from ember_engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ember_engine.server.admission import Admit, QueueState, Shed, WaitCalibration, decide
from ember_engine.server.answers import _TicketedStream
from ember_engine.server.fallback import Fallback
from ember_engine.server.metrics import EngineMetrics
from ember_engine.server.policy import Policy, PolicyWatcher
from ember_engine.server.state import ServerState, _Ticket

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
    batch_backlog = make_state({BATCH: 500})
    assert decide(policy, batch_backlog, CRITICAL) == Admit()
    assert decide(policy, batch_backlog, STANDARD) == Admit()
    assert shed(decide(policy, batch_backlog, BATCH)).reason == "queue_full"
    # A priority less important than every class ranks with the least important (limit 10 of the 30).
    assert shed(decide(policy, make_state({CRITICAL: 10}), 7)).reason == "queue_full"
    assert decide(policy, make_state({CRITICAL: 10}), CRITICAL) == Admit()


def test_queue_state_must_account_for_every_waiting_request() -> None:
    with pytest.raises(ValueError, match="sums to 0, not num_waiting=5"):
        QueueState(5, {}, 0.0, False, True)


def test_the_forecast_is_scaled_by_the_calibration_factor() -> None:
    policy = make_policy(maxQueueWaitSeconds=3.0)  # critical may wait 3 s, standard 2 s, batch 1 s
    assert decide(policy, QueueState(0, {}, 2.5, False, True), CRITICAL) == Admit()
    slow = shed(decide(policy, QueueState(0, {}, 2.5, False, True, wait_factor=1.25), CRITICAL))
    assert slow.reason == "queue_wait" and "3.12s" in slow.message  # 2.5 s * 1.25


def compare(cal: WaitCalibration, forecast: float, actual: float, limit: float = 3.0) -> None:
    key = object()
    cal.admitted(key, forecast, limit, now=0.0)
    cal.started(key, actual)


def test_wait_calibration_from_completed_comparisons() -> None:
    cal = WaitCalibration(quantile=0.9, window=10, min_samples=5, initial=1.25)
    assert cal.factor(0.0) == 1.25  # nothing compared yet: the cautious initial factor
    for _ in range(4):
        compare(cal, 2.0, 3.0)
    assert cal.factor(0.0) == 1.25  # too few comparisons yet
    compare(cal, 2.0, 3.0)
    assert cal.factor(0.0) == pytest.approx(1.5)
    compare(cal, 0.5, 3.0)  # far below half the limit, even calibrated (0.75 s): not a comparison
    assert cal.factor(0.0) == pytest.approx(1.5)
    for _ in range(10):  # a long run of forecasts that come true: the old misses leave the window
        compare(cal, 2.0, 2.0)
    assert cal.factor(0.0) == 1.0
    for _ in range(10):  # forecasts that run long never lower the factor below 1
        compare(cal, 2.0, 1.0)
    assert cal.factor(0.0) == 1.0
    for actual in [2.0] * 8 + [8.0, 20.0]:  # the 90th percentile of 10 is the 9th: 4.0, the upper bound
        compare(cal, 2.0, actual)
    assert cal.factor(0.0) == 4.0
    with pytest.raises(ValueError, match="quantile"):
        WaitCalibration(quantile=0)
    with pytest.raises(ValueError, match="initial"):
        WaitCalibration(initial=0.5)


def test_a_request_waiting_past_its_forecast_raises_the_factor_at_once() -> None:
    cal = WaitCalibration(initial=1.0, min_samples=3)
    late, early, tiny = object(), object(), object()
    cal.admitted(late, forecast_s=2.0, limit_s=3.0, now=10.0)
    cal.admitted(early, forecast_s=2.5, limit_s=3.0, now=11.0)
    cal.admitted(tiny, forecast_s=0.2, limit_s=3.0, now=10.0)  # too small a forecast to compare
    assert cal.factor(11.0) == 1.0  # nobody has waited past their forecast yet
    assert cal.factor(13.0) == pytest.approx(1.5)  # `late` has waited 3 s on a 2 s forecast
    cal.started(late, waited_s=3.2)
    assert cal.factor(13.0) == pytest.approx(1.0)  # one comparison is too few; `early` is within its 2.5 s
    cal.forget(early, now=13.0)  # it left within its forecast: nothing learned
    assert cal.factor(20.0) == 1.0
    # Two that gave up after overrunning their forecasts: with `late`'s, three comparisons (1.6, 1.5, 2.0),
    # and the 99th percentile of three is the largest.
    for key, left_at in ((object(), 17.0), (object(), 18.0)):
        cal.admitted(key, 2.0, 3.0, now=14.0)
        cal.forget(key, now=left_at)
    assert cal.factor(20.0) == pytest.approx(2.0)
    # One that neither starts nor leaves counts as overdue (up to the cap), until ten limits have passed.
    lost = object()
    cal.admitted(lost, 2.0, 3.0, now=100.0)
    assert cal.factor(125.0) == 4.0
    assert cal.factor(131.0) == pytest.approx(2.0)


def over_limit(state: ServerState) -> dict[str, float]:
    """Waits over the limit by priority class; every class of the policy has its series, at 0 at first."""
    return {
        s.labels["priority"]: s.value
        for family in text_string_to_metric_families(state.metrics.render()[0].decode())
        for s in family.samples
        if s.name == "ember:queue_wait_over_limit_total"
    }


def test_the_server_compares_each_admitted_requests_forecast_with_its_wait(tmp_path: Path) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text('{"loadShedding": {"maxQueueWaitSeconds": 3}}')  # standard: 2/3 of it, 2 s
    state = ServerState(
        "m",
        PolicyWatcher(policy_file),
        EngineMetrics("m"),
        Fallback(httpx.AsyncClient()),
        calibration=WaitCalibration(min_samples=3),
    )

    def admit_and_start(forecast_s: float, waited_s: float) -> None:
        ticket = _Ticket(state, STANDARD, "standard", None, 1, 1, forecast_s)
        ticket.submitting()
        assert ticket.wait_limit_s == pytest.approx(2.0)
        arrived = ticket.admitted_at
        times = RequestMetrics(arrived, arrived + waited_s, None, None, 1, 0, 0, 0)
        ticket.started(RequestOutput("r", None, [1], [CompletionOutput(0)], metrics=times))
        ticket.release()

    for _ in range(3):
        admit_and_start(forecast_s=1.5, waited_s=2.5)  # a forecast 1 s short, over the 2 s limit
    admit_and_start(forecast_s=0.1, waited_s=0.2)  # within the limit; too small a forecast to compare
    assert over_limit(state) == {"critical": 0, "standard": 3, "batch": 0}
    assert state.calibration.factor(time.monotonic()) == pytest.approx(2.5 / 1.5)
    assert sum(state.queued.values()) == 0 and state.in_flight == 0 and sum(state.unsubmitted.values()) == 0

    # A client that gives up while still queued, past its limit, is a miss too.
    gone = _Ticket(state, STANDARD, "standard", None, 2, 3, 1.0)
    assert state.unsubmitted[STANDARD] == 6  # two prompts, three samples each, not yet handed over
    gone.admitted_at -= 2.5  # as if admitted 2.5 s ago
    gone.release()
    assert sum(state.unsubmitted.values()) == 0 and sum(state.queued.values()) == 0
    assert over_limit(state) == {"critical": 0, "standard": 4, "batch": 0}


def test_a_stream_the_client_left_before_it_began_still_releases_its_ticket(tmp_path: Path) -> None:
    state = ServerState("m", PolicyWatcher(None), EngineMetrics("m"), Fallback(httpx.AsyncClient()))
    ticket = _Ticket(state, STANDARD, "standard", None, 1, 1, 0.0)
    began = False

    async def body() -> AsyncIterator[str]:
        nonlocal began
        began = True
        yield "data: [DONE]\n\n"

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        raise OSError("the client is gone")

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(_TicketedStream(body(), ticket)(scope, receive, send))
    assert not began and ticket.released and state.in_flight == 0 and sum(state.queued.values()) == 0
