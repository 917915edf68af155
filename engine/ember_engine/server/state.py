"""What one server keeps between requests: `ServerState` (readiness, the queue as admission sees it,
the forecast and its calibration) and `_Ticket`, one admitted request's share of those counters."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ember_engine.async_engine import AsyncEngine
from ember_engine.core.llm_engine import LLMEngine
from ember_engine.core.outputs import RequestOutput
from ember_engine.server.admission import QueueState, WaitCalibration, wait_limit_s
from ember_engine.server.fallback import Fallback
from ember_engine.server.metrics import EngineMetrics
from ember_engine.server.policy import Policy, PolicyWatcher
from ember_engine.server.protocol import APIError
from ember_engine.server.queue_forecast import ForecastObserver, Seats


@dataclass
class ServerState:
    model_name: str
    policy: PolicyWatcher
    metrics: EngineMetrics
    fallback: Fallback
    engine: AsyncEngine | None = None  # set once the model is loaded and warmed up
    draining: bool = False
    in_flight: int = 0  # HTTP requests being served (drain waits for these)
    queued: Counter[int] = field(default_factory=Counter)  # admitted, no output yet, by priority
    # Samples admitted but not yet handed to the engine (AsyncEngine.generate runs when first iterated).
    unsubmitted: Counter[int] = field(default_factory=Counter)
    client_in_flight: Counter[str] = field(default_factory=Counter)
    forecast: ForecastObserver = field(default_factory=ForecastObserver)
    calibration: WaitCalibration = field(default_factory=WaitCalibration)
    grammars: Any = None  # structured.CompileCache, made on the first constrained request
    responses: Any = None  # responses_api.ResponseStore with `--responses-store N`; None keeps none
    loras: dict[str, str] = field(default_factory=dict)  # LoRA adapters served: name -> directory
    lora_updates: bool = False  # adapters may be loaded and unloaded while serving (lora_api)
    aliases: tuple[str, ...] = ()  # the model's other names (--served-model-name NAME ALIAS...)
    # Sampling defaults for fields a request leaves out (generation_defaults), from the generation config.
    sampling_defaults: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The shed and wait-limit series of each priority class from the start, and those of a new
        # policy's new classes as it takes effect.
        self._count_classes(self.policy.policy)
        then = self.policy.on_change

        def on_change(policy: Policy) -> None:
            self._count_classes(policy)
            if then is not None:
                then(policy)

        self.policy.on_change = on_change

    def _count_classes(self, policy: Policy) -> None:
        self.metrics.add_priority_classes(c.name for c in policy.load_shedding.priority_classes)

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model is served by: `model_name` (metrics' label) first."""
        return (self.model_name, *(a for a in self.aliases if a != self.model_name))

    def lora_of(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the model itself (or no name, where that is
        allowed); 404 (400 for "") for a name not served, as OpenAI and vLLM answer it."""
        if model is None or model in self.model_names:
            return None
        if model in self.loras:
            return model
        served = " or ".join(map(repr, self.model_names))
        if self.loras:
            served += " and its LoRA adapters " + ", ".join(map(repr, self.loras))
        raise APIError(
            404 if model else 400,
            f"model: {model!r} is not served here; this server serves {served}",
            param="model",
            code="model_not_found",
        )

    @property
    def ready(self) -> bool:
        return self.engine is not None and not self.draining and self.engine.fatal is None

    @property
    def status(self) -> str:
        """What /ready and /v1/load say: ready, draining, failed (the engine stopped for good) or loading."""
        if self.engine is not None and self.engine.fatal is not None:
            return "failed"
        return "ready" if self.ready else "draining" if self.draining else "loading"

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """The step hook (engine thread): metrics, and the forecast admission reads."""
        stats = engine.stats()
        self.metrics.record_step(stats, outputs)
        taken_in = self.engine.taken_in if self.engine is not None else {}
        self.forecast.observe(engine, stats, outputs, taken_in, time.monotonic())

    def queue_state(self, priority: int, samples: int = 1) -> QueueState:
        """The queue as a newcomer of `priority` with this many samples (prompts times n) would find it."""
        waiting = self.waiting()
        return QueueState(
            num_waiting=sum(waiting.values()),
            num_waiting_by_priority=waiting,
            estimated_wait_s=self.forecast_wait(priority, samples),
            draining=self.draining,
            ready=self.ready,
            wait_factor=self.calibration.factor(time.monotonic()),
        )

    def waiting(self) -> dict[int, int]:
        """Samples that will wait for a seat, by priority (those free seats take at once do not)."""
        engine = self.engine
        if engine is None:
            return dict(self.unsubmitted)
        seats = self.forecast.seats or Seats(engine.engine.config.max_num_seqs)  # nothing has run yet
        return seats.waiting(engine.submitted, self.unsubmitted)

    def forecast_wait(self, priority: int, samples: int = 1) -> float:
        """The queue wait forecast (uncalibrated) of a newcomer of `priority` until its last sample starts;
        0 with nothing to go on."""
        forecast, engine = self.forecast.forecast, self.engine
        if forecast is None or engine is None:
            return 0.0
        ahead = forecast.ahead(priority, engine.submitted + self.unsubmitted)
        return forecast.wait(ahead + max(1, samples) - 1, time.monotonic())


class _Ticket:
    """One admitted HTTP request's share of the server's counters, released exactly once."""

    def __init__(
        self,
        state: ServerState,
        priority: int,
        class_name: str,
        client: str | None,
        num_requests: int,  # engine requests (prompts)
        n: int,  # samples each
        forecast_s: float,  # the uncalibrated queue wait forecast that admitted it
    ) -> None:
        self.state, self.priority, self.class_name, self.client, self.n = (
            state,
            priority,
            class_name,
            client,
            n,
        )
        self.admitted_at = time.monotonic()
        self.wait_limit_s = wait_limit_s(state.policy.policy, priority)
        state.calibration.admitted(self, forecast_s, self.wait_limit_s, self.admitted_at)
        self.num_requests = self.unstarted = self.unsubmitted = num_requests
        state.in_flight += 1
        state.queued[priority] += num_requests
        state.unsubmitted[priority] += num_requests * n
        if client:
            state.client_in_flight[client] += 1
        self.released = False

    def submitting(self) -> None:
        """One of its engine requests is about to be handed to the engine."""
        self.unsubmitted -= 1
        self.state.unsubmitted[self.priority] -= self.n

    def started(self, out: RequestOutput) -> None:
        s = self.state
        self.unstarted -= 1
        s.queued[self.priority] -= 1
        m = out.metrics
        if self.wait_limit_s and m is not None and m.first_scheduled_time is not None:
            waited = m.first_scheduled_time - self.admitted_at
            s.calibration.started(self, waited)
            if waited > self.wait_limit_s:  # admission misjudged it
                s.metrics.record_wait_over_limit(self.class_name)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        s = self.state
        now = time.monotonic()
        s.queued[self.priority] -= self.unstarted
        s.unsubmitted[self.priority] -= self.unsubmitted * self.n
        s.in_flight -= 1
        s.calibration.forget(self, now)
        if (
            self.unstarted == self.num_requests
            and self.wait_limit_s
            and now - self.admitted_at > self.wait_limit_s
        ):
            s.metrics.record_wait_over_limit(self.class_name)  # it gave up (or timed out) queued, too late
        if self.client:
            s.client_in_flight[self.client] -= 1
            if s.client_in_flight[self.client] <= 0:  # one key per client ever seen would only grow
                del s.client_in_flight[self.client]
