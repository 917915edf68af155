"""When would a request joining the queue now start? A forecast from what the engine is running.

A waiting request starts when a running one ends and frees its seat. The engine knows how far along each
running request is, so instead of dividing the queue by an average drain rate, the forecast plays the
queue forward: every seat frees when its request is expected to end, each freed seat goes to the next
waiting request, which then holds it for a typical request's duration. This keeps the estimate right
when requests end in bunches (requests admitted together, with similar lengths, finish together), where
a rate is wrong both ways: a waiting request may start in the next step, or only after every running
request has ended.

Durations come from measurements taken after every step:
- the time per step, an EWMA of the wall time between consecutive steps while the engine is busy (this
  includes the prompt chunks that share the steps, and whatever else competes for the host), kept per
  batch size and read at the size the engine's requests make (up to max_num_seqs);
- the tokens a request gains per step in which it gains any (1, more with speculative decoding), an
  EWMA over the samples that gained tokens in each step;
- how many tokens requests produce, an EWMA of the output lengths of requests that ended on their own;
  before one has, each request's max_tokens.

A running request's expected remaining steps are its remaining prompt chunks plus its expected remaining
output: its expected length (the smaller of max_tokens and the typical length; never less than what it
has already produced plus one) minus what it has produced. A waiting request is expected to hold a seat
for one prompt step plus a typical output. Seats under max_num_seqs count as free at once, unless the
engine's latest schedule left requests waiting for KV blocks: then a seat frees only when a request ends.

`ForecastObserver` measures after each step, in the engine thread, and builds a `Forecast` at most every
`min_interval_s` while the engine is busy; `Forecast.start_times` is pure, so the arithmetic is testable
without an engine or a clock. It also keeps `Seats`, the engine's free seats and queue as of then, from
its first step on (a forecast needs measured step times first): what the queue-depth limit counts.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember_engine.core.llm_engine import EngineStats, LLMEngine
    from ember_engine.core.outputs import RequestOutput


@dataclass(frozen=True, slots=True)
class Forecast:
    time: float  # monotonic seconds when it was taken
    remaining_s: tuple[float, ...]  # each running request's expected time to its end, as of `time`
    free_seats: int  # seats a newcomer could take at once
    service_s: float  # how long a request that starts later is expected to hold its seat
    # The engine's queue then (samples not yet running, by priority), how many samples it had taken in,
    # and whether it schedules first come first served (else by priority, then arrival).
    waiting_by_priority: Mapping[int, int] = field(default_factory=dict)
    taken_in_by_priority: Mapping[int, int] = field(default_factory=dict)
    fcfs: bool = False

    def ahead(self, priority: int, submitted_by_priority: Mapping[int, int]) -> int:
        """How many samples a newcomer of `priority` queues behind, given how many have been submitted to
        the engine so far: those waiting in the engine, or not yet taken in, when the forecast was made,
        under priority scheduling only those at least as important."""

        def counts(p: int) -> bool:
            return self.fcfs or p <= priority

        waiting = sum(n for p, n in self.waiting_by_priority.items() if counts(p))
        in_transit = sum(
            max(0, n - self.taken_in_by_priority.get(p, 0))
            for p, n in submitted_by_priority.items()
            if counts(p)
        )
        return waiting + in_transit

    def wait(self, ahead: int, now: float) -> float:
        """Expected wait, from `now`, of a newcomer with `ahead` requests queued in front of it."""
        return self.start_times(ahead + 1, now)[-1]

    def start_times(self, n: int, now: float) -> list[float]:
        """Expected wait, from `now`, of the requests at queue positions 0..n-1 (0 starts next), counting
        only requests that are not running yet."""
        if n <= 0:
            return []
        elapsed = max(0.0, now - self.time)
        seats = [0.0] * self.free_seats + [max(0.0, r - elapsed) for r in self.remaining_s]
        if not seats:  # nothing runs and nothing can start: there is no evidence to forecast from
            return [0.0] * n
        heapq.heapify(seats)
        waits = []
        for _ in range(n):
            start = heapq.heappop(seats)
            waits.append(start)
            heapq.heappush(seats, start + self.service_s)
        return waits


@dataclass(frozen=True, slots=True)
class Seats:
    """The engine's free seats and queue as of its latest observed step, as the queue-depth limit counts
    them: a request a free seat takes at once does not wait, so it is not in the queue."""

    free: int  # seats a newcomer could take at once (none while requests wait for KV blocks)
    waiting_by_priority: Mapping[int, int] = field(default_factory=dict)  # samples in the engine's queue
    taken_in_by_priority: Mapping[int, int] = field(default_factory=dict)  # samples taken in by then

    def waiting(self, submitted: Mapping[int, int], unsubmitted: Mapping[int, int]) -> dict[int, int]:
        """Samples that will wait for a seat, by priority: those in the engine's queue, those handed to it
        since (`submitted` counts every sample ever handed over) and those admitted but not yet handed
        over, less what the free seats take, the most important first (as the engine schedules)."""
        pending: Counter[int] = Counter(self.waiting_by_priority)
        for p, n in submitted.items():
            pending[p] += max(0, n - self.taken_in_by_priority.get(p, 0))
        pending.update({p: n for p, n in unsubmitted.items() if n > 0})
        free = self.free
        out = {}
        for p in sorted(pending):
            took = min(free, pending[p])
            free -= took
            if pending[p] > took:
                out[p] = pending[p] - took
        return out


class ForecastObserver:
    """Measures the engine after each step (in its thread) and publishes the latest `Forecast`."""

    def __init__(
        self, step_alpha: float = 0.1, length_alpha: float = 0.2, min_interval_s: float = 0.05
    ) -> None:
        if not (0 < step_alpha <= 1 and 0 < length_alpha <= 1) or min_interval_s < 0:
            raise ValueError(
                f"need weights in (0, 1] and min_interval_s >= 0, got step_alpha={step_alpha}, "
                f"length_alpha={length_alpha}, min_interval_s={min_interval_s}"
            )
        self.step_alpha, self.length_alpha = step_alpha, length_alpha
        # Building a forecast walks every running request, which a fast step cannot afford each time; one
        # at most this often is fresh enough, as Forecast.start_times counts the time since it was made.
        self.min_interval_s = min_interval_s
        # EWMA of the wall time per step while busy, by the number of requests in the step: a step costs
        # more with more requests in it (on a CPU, roughly in proportion), and a queue forms exactly when
        # the batch has grown past the sizes measured so far.
        self.step_s: dict[int, float] = {}
        self.output_tokens: float | None = None  # EWMA of the output length of requests that ended themselves
        self.tokens_per_step: float | None = None  # EWMA of the tokens a sample gains in a step that adds any
        self.forecast: Forecast | None = None  # None until a step time has been measured
        self.seats: Seats | None = None  # None until the engine's first step
        self._seats_time = -math.inf
        self._steps_seen = 0  # engine.num_steps at the previous step
        self._busy_since: float | None = None  # when the previous step ended, if work was left

    @staticmethod
    def _ewma(old: float | None, sample: float, alpha: float) -> float:
        return sample if old is None else alpha * sample + (1 - alpha) * old

    def step_s_at(self, batch: int) -> float | None:
        """Expected step time with `batch` requests: measured at that size, else from the nearest size
        measured, scaled up in proportion when that one is smaller."""
        if not self.step_s:
            return None
        if batch in self.step_s:
            return self.step_s[batch]
        nearest = min(self.step_s, key=lambda k: (abs(k - batch), k))
        return self.step_s[nearest] * max(1.0, batch / nearest)

    def observe(
        self,
        engine: LLMEngine,
        stats: EngineStats,
        outputs: Sequence[RequestOutput],
        taken_in: Mapping[int, int],
        now: float,
    ) -> None:
        """Record the engine after a step (`stats` taken after it, `outputs` its updates; hooks also run
        after an abort, with the aborted request's final update); `taken_in` counts the samples the engine
        has taken in so far, by priority (AsyncEngine.taken_in)."""
        stepped = stats.num_steps != self._steps_seen
        gained = []
        for out in outputs:
            for o in out.outputs:
                if out.finished and o.finish_reason in ("stop", "length"):
                    self.output_tokens = self._ewma(self.output_tokens, len(o.token_ids), self.length_alpha)
                if stepped and o.delta_token_ids:
                    gained.append(len(o.delta_token_ids))
        if gained:
            self.tokens_per_step = self._ewma(
                self.tokens_per_step, sum(gained) / len(gained), self.step_alpha
            )
        busy = engine.has_unfinished_requests()
        if stepped:
            if self._busy_since is not None and stats.num_steps == self._steps_seen + 1:
                # The engine steps back to back while it has work, so the gap between two busy steps is
                # one step's whole cost as a request experiences it.
                b = stats.last_batch_size
                self.step_s[b] = self._ewma(self.step_s.get(b), now - self._busy_since, self.step_alpha)
            self._steps_seen = stats.num_steps
            self._busy_since = now if busy else None
        elif not busy:  # an abort emptied the engine: it will idle
            self._busy_since = None
        if busy and not self._due(now):  # (an idle engine's forecast is cheap, and must show it idle)
            return
        self._seats_time = now
        scheduler, config = engine.scheduler, engine.config
        waiting = [*scheduler.waiting, *(r for g in engine.groups.values() for r in g.pending)]
        free = 0 if scheduler.blocked_on_memory else max(0, config.max_num_seqs - len(scheduler.running))
        self.seats = Seats(free, Counter(r.priority for r in waiting), dict(taken_in))
        # The batch the queued requests will run in: everything in the engine, up to max_num_seqs.
        step_s = self.step_s_at(
            max(1, min(engine.config.max_num_seqs, len(scheduler.running) + len(waiting)))
        )
        if step_s is not None:
            self.forecast = self._build(engine, now, step_s, self.seats)

    def _due(self, now: float) -> bool:
        return self.forecast is None or now - self._seats_time >= self.min_interval_s

    def _build(self, engine: LLMEngine, now: float, step_s: float, seats: Seats) -> Forecast:
        config, scheduler = engine.config, engine.scheduler
        budget = config.max_num_batched_tokens
        per_step = self.tokens_per_step or 1.0
        typical = self.output_tokens
        running = scheduler.running
        remaining = []
        for req in running:
            produced = req.num_output_tokens
            prompt_left = max(0, req.num_prompt_tokens - req.num_computed_tokens)
            expected = req.max_tokens if typical is None else min(req.max_tokens, max(typical, produced + 1))
            steps = math.ceil(prompt_left / budget) + max(0, expected - produced) / per_step
            remaining.append(steps * step_s)
        if typical is None:  # no request has ended yet: assume newcomers look like the running ones
            typical = sum(r.max_tokens for r in running) / len(running) if running else 1.0
        return Forecast(
            now,
            tuple(remaining),
            seats.free,
            (1 + typical / per_step) * step_s,
            seats.waiting_by_priority,
            seats.taken_in_by_priority,
            scheduler.policy == "fcfs",
        )
