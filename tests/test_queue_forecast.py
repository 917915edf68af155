"""The queue-wait forecast: the pure queue simulation, and the observer measuring a real engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_engine.core.config import EngineConfig
from ember_engine.core.llm_engine import LLMEngine
from ember_engine.core.outputs import CompletionOutput, RequestOutput
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.server.queue_forecast import Forecast, ForecastObserver, Seats


def test_waiting_requests_take_seats_in_the_order_they_free() -> None:
    f = Forecast(
        time=10.0,
        remaining_s=(3.0, 1.0, 2.0),
        free_seats=0,
        service_s=10.0,
    )
    # Three seats free at 1, 2 and 3 s; the fourth in line takes the seat its predecessor freed at 1 + 10.
    assert f.start_times(5, now=10.0) == [1.0, 2.0, 3.0, 11.0, 12.0]
    assert f.start_times(0, now=10.0) == []


def test_requests_that_end_together_free_their_seats_together() -> None:
    # Eight requests admitted together, with equal lengths, end together at 2.8 s: the first eight in line
    # start then, the next eight a whole request later. A drain rate (8 per 2.8 s) would put position 12 at
    # 4.2 s and position 0 at 0.35 s; both are wrong.
    f = Forecast(
        time=0.0,
        remaining_s=(2.8,) * 8,
        free_seats=0,
        service_s=2.8,
    )
    waits = f.start_times(16, now=0.0)
    assert waits[:8] == [pytest.approx(2.8)] * 8
    assert waits[8:] == [pytest.approx(5.6)] * 8


def test_free_seats_start_at_once_and_time_passes_since_the_forecast() -> None:
    f = Forecast(
        time=5.0,
        remaining_s=(1.5, 4.0),
        free_seats=2,
        service_s=3.0,
    )
    assert f.start_times(3, now=5.0) == [0.0, 0.0, 1.5]
    # Half a second later every running request is half a second closer to its end; none goes below 0.
    assert f.start_times(4, now=5.5) == [0.0, 0.0, 1.0, 3.0]
    assert f.start_times(3, now=9.0) == [0.0, 0.0, 0.0]


def test_a_newcomer_to_an_empty_queue_still_waits_for_a_seat() -> None:
    f = Forecast(time=0.0, remaining_s=(2.0, 3.5), free_seats=0, service_s=3.0)
    assert f.wait(0, now=0.0) == 2.0  # first in line: the first seat to free
    assert f.wait(2, now=0.0) == 5.0  # third: the seat the first one freed, once more


def test_the_queue_ahead_counts_the_engines_and_what_is_on_its_way() -> None:
    # The engine had 3 critical (0) and 4 batch (2) requests waiting and had taken in 10 critical and 6
    # batch requests; since then 12 critical, 9 standard (1) and 6 batch requests were submitted in all.
    f = Forecast(0.0, (1.0,), 0, 1.0, waiting_by_priority={0: 3, 2: 4}, taken_in_by_priority={0: 10, 2: 6})
    submitted = {0: 12, 1: 9, 2: 6}
    assert f.ahead(0, submitted) == 3 + 2  # two critical ones not taken in yet
    assert f.ahead(1, submitted) == 3 + 2 + 9
    assert f.ahead(2, submitted) == 3 + 2 + 9 + 4
    assert f.ahead(-1, submitted) == 0


def test_under_first_come_first_served_every_priority_is_ahead() -> None:
    f = Forecast(0.0, (1.0,), 0, 1.0, waiting_by_priority={0: 3, 2: 4}, taken_in_by_priority={}, fcfs=True)
    assert f.ahead(0, {1: 2}) == 3 + 4 + 2


def test_nothing_to_forecast_from_gives_no_wait() -> None:
    f = Forecast(
        time=0.0,
        remaining_s=(),
        free_seats=0,
        service_s=1.0,
    )
    assert f.start_times(3, now=0.0) == [0.0, 0.0, 0.0]


def test_the_observer_rejects_a_bad_weight() -> None:
    with pytest.raises(ValueError, match="alpha"):
        ForecastObserver(step_alpha=0)


def test_step_time_is_read_at_the_batch_size_or_scaled_up_from_a_smaller_one() -> None:
    observer = ForecastObserver()
    assert observer.step_s_at(4) is None
    observer.step_s = {2: 0.1, 8: 0.3}
    assert observer.step_s_at(8) == 0.3
    assert observer.step_s_at(3) == pytest.approx(0.1 * 3 / 2)  # nearest is 2: scaled in proportion
    assert observer.step_s_at(1) == 0.1  # a smaller batch than any measured: not scaled down
    assert observer.step_s_at(16) == pytest.approx(0.6)
    assert observer.step_s_at(5) == pytest.approx(0.1 * 5 / 2)  # equally near: the smaller size


def test_the_observer_follows_a_real_engine(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), max_num_seqs=2, max_num_batched_tokens=64))
    observer = ForecastObserver(step_alpha=0.5, length_alpha=0.5)
    for i, max_tokens in enumerate((3, 9, 7)):
        engine.add_request(f"r{i}", [1 + i, 2, 3, 4], SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def step(now: float) -> None:
        outputs = engine.step()
        observer.observe(engine, engine.stats(), outputs, {0: 3}, now)

    now = 100.0
    step(now)  # both seats' prompts in one step; the third request waits
    assert observer.step_s == {} and observer.forecast is None  # one step measures no gap yet
    assert observer.tokens_per_step == 1.0

    now += 0.2
    step(now)
    assert observer.step_s == {2: pytest.approx(0.2)}
    f = observer.forecast
    assert f is not None and f.time == now and f.fcfs
    assert f.free_seats == 0 and f.waiting_by_priority == {0: 1} and f.taken_in_by_priority == {0: 3}
    # Without a finished request, each is expected to run to max_tokens: 3 - 2 and 9 - 2 steps left.
    assert sorted(f.remaining_s) == [pytest.approx(1 * 0.2), pytest.approx(7 * 0.2)]
    # A newcomer is expected to be like the running ones: one prompt step plus (3 + 9) / 2 tokens.
    assert f.service_s == pytest.approx((1 + 6) * 0.2)

    now += 0.4
    step(now)  # r0 ends on its own with 3 tokens
    assert observer.step_s == {2: pytest.approx(0.5 * 0.4 + 0.5 * 0.2)}
    assert observer.output_tokens == 3
    f = observer.forecast
    assert f is not None
    # Typical length 3 now: r1, at 3 of 9, is expected to produce one more (never less than one), not 6.
    assert f.remaining_s == (pytest.approx(1 * 0.3),)
    assert f.free_seats == 1  # r0's seat: r2 takes it in the next step
    assert f.service_s == pytest.approx((1 + 3) * 0.3)

    # The engine finishes everything; once it is idle, the gap before its next step is not a step time.
    while engine.has_unfinished_requests():
        now += 0.3
        step(now)
    measured = dict(observer.step_s)
    engine.add_request("late", [7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    now += 50.0
    step(now)
    assert observer.step_s == measured
    f = observer.forecast
    assert f is not None and f.free_seats == 1 and len(f.remaining_s) == 1

    # Tokens per step: averaged over the samples that gained any (speculative decoding gains several).
    spec = [
        RequestOutput("a", None, [1], [CompletionOutput(0, delta_token_ids=[5, 6, 7])]),
        RequestOutput("b", None, [1], [CompletionOutput(0, delta_token_ids=[5]), CompletionOutput(1)]),
    ]
    before = observer.tokens_per_step
    engine.step()
    observer.observe(engine, engine.stats(), spec, {0: 4}, now + 0.1)
    assert observer.tokens_per_step == pytest.approx(0.5 * 2.0 + 0.5 * before)


def test_with_requests_waiting_for_kv_blocks_no_seat_is_free(tiny_model: Path) -> None:
    # Room for two 40-token requests only (16-token blocks): the third waits for memory, not for a seat.
    engine = LLMEngine(EngineConfig(model=str(tiny_model), max_num_seqs=8, num_kv_blocks=6))
    observer = ForecastObserver()
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i] * 40, SamplingParams(max_tokens=4, ignore_eos=True))
    for now in (0.0, 0.1):
        outputs = engine.step()
        observer.observe(engine, engine.stats(), outputs, {0: 3}, now)
    assert engine.scheduler.blocked_on_memory and len(engine.scheduler.running) == 2
    f = observer.forecast
    assert f is not None and f.free_seats == 0 and f.waiting_by_priority == {0: 1}
    assert f.wait(0, now=0.1) == pytest.approx(min(f.remaining_s))  # the first to end frees the room


def test_n_samples_count_as_seats_and_pending_siblings_as_waiting(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model), max_num_seqs=8))
    observer = ForecastObserver()
    engine.add_request("g", [3, 4, 5, 6], SamplingParams(n=3, max_tokens=4, ignore_eos=True, temperature=1.0))
    observer.observe(engine, engine.stats(), [], {0: 3}, 0.0)
    observer.step_s = {1: 0.1}  # as if measured
    observer.observe(engine, engine.stats(), [], {0: 3}, 0.0)  # before any step: all three samples wait
    f = observer.forecast
    assert f is not None and f.waiting_by_priority == {0: 3}


def test_a_busy_engine_gets_a_new_forecast_at_most_every_interval(tiny_model: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(tiny_model)))
    observer = ForecastObserver(min_interval_s=0.05)
    engine.add_request("r", [3, 4, 5], SamplingParams(max_tokens=50, ignore_eos=True))

    def step(now: float) -> None:
        outputs = engine.step()
        observer.observe(engine, engine.stats(), outputs, {0: 1}, now)

    step(0.0)
    step(0.02)  # the first step time: the first forecast
    first = observer.forecast
    assert first is not None and first.time == 0.02
    step(0.04)
    assert observer.forecast is first and observer.step_s == {1: pytest.approx(0.02)}  # measured, not rebuilt
    step(0.08)
    assert observer.forecast is not first and observer.forecast is not None
    engine.abort_request("r")
    observer.observe(engine, engine.stats(), [], {0: 1}, 0.09)  # idle: rebuilt at once, nothing running
    assert observer.forecast is not None and observer.forecast.remaining_s == ()


def test_seats_count_as_waiting_only_what_free_seats_cannot_take() -> None:
    seats = Seats(free=3, waiting_by_priority={1: 2}, taken_in_by_priority={0: 5, 1: 4})
    # In the engine's queue: 2 of priority 1; handed over since: 1 of 0 and 2 of 1; not yet handed: 1 of 2.
    # The three free seats go to the most important: 0's one and two of 1's four.
    assert seats.waiting({0: 6, 1: 6}, {2: 1}) == {1: 2, 2: 1}
    assert Seats(free=8).waiting({0: 3}, {0: 4}) == {}
    assert Seats(free=0, waiting_by_priority={0: 1}).waiting({}, {0: 0}) == {0: 1}
