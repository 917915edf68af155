"""Prometheus metrics for one engine process.

The names are vLLM's, so its dashboards, KEDA triggers and the Gateway API inference extension read ember
unchanged; ember's own series use the `ember:` prefix. Each instance has its own registry, so several
engines (or tests) can live in one process.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from ember_engine.server.admission import SHED_REASONS
from ember_engine.server.request_histograms import LATENCY, TOKENS, FinishedRequests

if TYPE_CHECKING:
    from ember_engine.core.llm_engine import EngineStats
    from ember_engine.core.outputs import RequestMetrics, RequestOutput

_BATCH = tuple(2**i for i in range(11))  # 1 .. 1024 requests
_ITERATION = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's edges

# EngineStats keeps these as running totals; the counters advance by the difference.
_TOTALS = {
    "prompt_tokens": ("vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("vllm:generation_tokens", "Number of generation tokens processed."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens."),
    "prefix_cache_preempted_queries": (
        "ember:prefix_cache_preempted_queries",
        "Prefix cache queries of preempted requests admitted again, in queried tokens.",
    ),
    "prefix_cache_preempted_hits": (
        "ember:prefix_cache_preempted_hits",
        "Prefix cache hits of preempted requests admitted again, in cached tokens.",
    ),
    "num_preemptions": ("vllm:num_preemptions", "Cumulative number of preemptions."),
}


_SPEC_TOTALS = {
    "num_drafts": ("vllm:spec_decode_num_drafts", "Verifications of a request's proposals."),
    "num_draft_tokens": ("vllm:spec_decode_num_draft_tokens", "Proposed tokens verified."),
    "num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted."),
}


class EngineMetrics:
    def __init__(
        self, model_name: str, spec_positions: int = 0, loras: int | None = None, max_loras: int | None = None
    ) -> None:
        """`spec_positions`: K, the most tokens proposed per step, with speculative decoding; 0 without.
        `loras`: how many LoRA adapters are loaded; None where the server takes none (no
        `vllm:lora_requests_info` then). `max_loras`: the most adapters a step may run (None: any)."""
        self.registry = CollectorRegistry()
        self._model = model_name
        reg, ml = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ml, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ml, registry=reg).labels(model_name)

        def hist(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, ml, buckets=buckets, registry=reg).labels(model_name)

        self._running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self._waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self._kv = gauge("vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        self._draining = gauge("ember:draining", "1 while the server drains before shutting down.")
        self._totals = {field: counter(name, doc) for field, (name, doc) in _TOTALS.items()}
        self._seen = dict.fromkeys(_TOTALS, 0)
        self._deadline = counter("ember:deadline_aborts", "Requests aborted at their deadline.")
        self._spec_totals = {field: counter(name, doc) for field, (name, doc) in _SPEC_TOTALS.items()}
        # Positions 0..K-1 with speculative decoding; without, no series, and so no family either.
        self._spec_per_pos: Counter | None = None
        if spec_positions:
            self._spec_positions(spec_positions)
        self._spec_seen = dict.fromkeys(_SPEC_TOTALS, 0)
        self._spec_pos_seen: dict[int, int] = {}
        self._spec_enabled = gauge(
            "ember:spec_decode_enabled", "1 while the adaptive controller has speculative decoding on."
        )
        self._success = Counter(
            "vllm:request_success", "Count of finished requests.", [*ml, "finished_reason"], registry=reg
        )
        self._shed = Counter(
            "ember:requests_shed",
            "Requests refused by load shedding.",
            [*ml, "reason", "priority"],
            registry=reg,
        )
        self._over_limit = Counter(
            "ember:queue_wait_over_limit",
            "Admitted requests that waited in the queue longer than their priority's wait limit.",
            [*ml, "priority"],
            registry=reg,
        )
        self._wait_forecast = gauge(
            "ember:estimated_queue_wait_seconds",
            "Forecast queue wait of a request joining the back of the queue now.",
        )
        self._fallback = Counter(
            "ember:fallback_requests",
            "Requests sent to the fallback backend.",
            [*ml, "outcome"],
            registry=reg,
        )
        # Created up front so that rate() sees these series from zero, not from their first event; the shed
        # and wait-limit series are per priority class, made by add_priority_classes.
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        for outcome in ("served", "failed", "cancelled"):
            self._fallback.labels(model_name, outcome)
        self._ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", LATENCY)
        self._itl = hist("vllm:inter_token_latency_seconds", "Time between token updates.", LATENCY)
        self._step = hist("ember:step_seconds", "Wall time of an engine step.", LATENCY)
        self._batch_size = hist("ember:batch_size", "Requests per engine step.", _BATCH)
        self._batch_tokens = hist("ember:batch_tokens", "Tokens per engine step.", TOKENS)
        self._iteration = hist("vllm:iteration_tokens_total", "Tokens per engine step.", _ITERATION)
        self._finished = FinishedRequests(hist)
        # vLLM's `vllm:lora_requests_info`: one series, whose labels name the adapters of the requests
        # running and waiting (comma-separated) and count those loaded (all may share a batch), its value the time
        # they were last seen (what the inference gateway's LoRA-affinity scorer reads). A series whose
        # labels no longer hold is removed, not left behind.
        self._lora_info: Gauge | None = None
        self._lora_max = "0"
        self._lora_cap = max_loras
        self._lora_labels: tuple[str, str, str] | None = None
        if loras is not None:
            names = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
            self._lora_info = Gauge(
                "vllm:lora_requests_info", "Running stats on LoRA requests.", names, registry=reg
            )

        # record_step runs in the engine thread, record_stats and log_line wherever the server calls them.
        self._lock = threading.Lock()
        if loras is not None:
            self.set_loras_loaded(loras)
        self._latest: EngineStats | None = None
        # request id -> each sample's latest token time, while it runs
        self._last_token: dict[str, list[float | None]] = {}
        self._steps = 0
        self._logged = (time.monotonic(), 0, dict(self._seen))

    def record_step(self, stats: EngineStats, outputs: Sequence[RequestOutput]) -> None:
        """Call in the engine thread after each step, with the stats taken after that step."""
        self.record_stats(stats)
        if stats.num_steps > self._steps:  # hooks also run for aborts, which are not steps
            self._steps = stats.num_steps
            self._step.observe(stats.last_step_seconds)
            self._batch_size.observe(stats.last_batch_size)
            self._batch_tokens.observe(stats.last_batch_tokens)
            self._iteration.observe(stats.last_batch_tokens)
        now = time.monotonic()
        for out in outputs:
            m = out.metrics
            if m is not None:
                self._observe_tokens(out, m)
            if out.finished:
                self._last_token.pop(out.request_id, None)
                self._success.labels(self._model, out.finish_reason or "abort").inc()
                if m is not None:
                    self._finished.observe(out, m, now)

    def _observe_tokens(self, out: RequestOutput, m: RequestMetrics) -> None:
        """TTFT at a request's first token; an inter-token gap at each later update of each sample, from
        that sample's own previous update (the samples of n > 1 decode side by side, and end apart)."""
        times = m.sample_token_times or ((m.first_token_time, m.last_token_time),)
        last_seen = self._last_token.get(out.request_id)
        for i, c in enumerate(out.outputs):
            last = times[i][1]
            if not c.delta_token_ids or last is None:
                continue
            if last_seen is None:
                last_seen = self._last_token[out.request_id] = [None] * len(out.outputs)
                if m.first_token_time is not None:
                    self._ttft.observe(m.first_token_time - m.arrival_time)
            prev = last_seen[i]
            if prev is not None:
                self._itl.observe(last - prev)
            last_seen[i] = last

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges and counters only; safe from any thread, e.g. before each scrape."""
        self._running.set(stats.num_running)
        self._waiting.set(stats.num_waiting)
        self._kv.set(stats.kv_cache_usage)
        with self._lock:
            self._latest = stats
            for field, counter in self._totals.items():
                _advance(counter, self._seen, field, getattr(stats, field))
            if stats.spec is not None:
                self._record_spec(stats)
            if self._lora_info is not None:
                waiting, running = ",".join(stats.waiting_loras), ",".join(stats.running_loras)
                self._set_lora_labels((self._lora_max, waiting, running))

    def _record_spec(self, stats: EngineStats) -> None:
        # Called under the lock, like the other totals.
        spec = stats.spec
        assert spec is not None
        self._spec_enabled.set(1 if stats.spec_enabled else 0)
        for field, counter in self._spec_totals.items():
            _advance(counter, self._spec_seen, field, getattr(spec, field))
        per_pos = self._spec_positions(len(spec.accepted_per_position))
        for pos, value in enumerate(spec.accepted_per_position):
            _advance(per_pos.labels(self._model, str(pos)), self._spec_pos_seen, pos, value)

    def _spec_positions(self, k: int) -> Counter:
        """The per-position counter with positions 0..k-1 (at 0 until their first acceptance); registered
        by the first call, which is the engine's first speculative stats where K was not given."""
        if self._spec_per_pos is None:
            self._spec_per_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted proposals by their position in the proposal.",
                ["model_name", "position"],
                registry=self.registry,
            )
        for pos in range(k):
            self._spec_per_pos.labels(self._model, str(pos))
        return self._spec_per_pos

    def add_priority_classes(self, names: Iterable[str]) -> None:
        """Every shed reason's series and the wait-limit misses' series of these priority classes, at 0
        until their first event. A class no longer in the policy keeps its series (a counter that vanished
        would read as a reset)."""
        for name in names:
            self._over_limit.labels(self._model, name)
            for reason in SHED_REASONS:
                self._shed.labels(self._model, reason, name)

    def set_loras_loaded(self, count: int) -> None:
        """The adapters loaded now: `max_lora`, as many as may share a step, unless `max_loras` caps it."""
        if self._lora_info is None:
            return
        with self._lock:
            self._lora_max = str(count if self._lora_cap is None else self._lora_cap)
            _, waiting, running = self._lora_labels or ("", "", "")
            self._set_lora_labels((self._lora_max, waiting, running))

    def _set_lora_labels(self, labels: tuple[str, str, str]) -> None:
        # Under the lock: the series of these labels, stamped now; the previous one goes if they differ.
        assert self._lora_info is not None
        if self._lora_labels is not None and labels != self._lora_labels:
            self._lora_info.remove(*self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*labels).set_to_current_time()

    def record_shed(self, reason: str, priority: str) -> None:
        self._shed.labels(self._model, reason, priority).inc()

    def record_wait_over_limit(self, priority: str) -> None:
        self._over_limit.labels(self._model, priority).inc()

    def set_estimated_wait(self, seconds: float) -> None:
        self._wait_forecast.set(seconds)

    def record_fallback(self, outcome: str) -> None:
        self._fallback.labels(self._model, outcome).inc()

    def record_deadline_abort(self) -> None:
        self._deadline.inc()

    def set_draining(self, draining: bool) -> None:
        self._draining.set(int(draining))

    def set_cache_config(
        self,
        *,
        block_size: int,
        num_gpu_blocks: int,
        cache_dtype: str,
        enable_prefix_caching: bool,
        gpu_memory_utilization: float,
    ) -> None:
        """vLLM's `vllm:cache_config_info`: 1, with the KV cache's configuration as its labels (as vLLM
        writes them: values as strings, no model_name). The Gateway API inference extension's scheduler
        reads a replica's KV capacity from num_gpu_blocks and block_size. Set once, when the engine has
        sized its cache."""
        labels = {
            "block_size": str(block_size),
            "cache_dtype": cache_dtype,
            "enable_prefix_caching": str(enable_prefix_caching),
            "gpu_memory_utilization": str(gpu_memory_utilization),
            "num_gpu_blocks": str(num_gpu_blocks),
        }
        info = Gauge(
            "vllm:cache_config_info", "The KV cache's configuration.", list(labels), registry=self.registry
        )
        info.labels(**labels).set(1)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def log_line(self) -> str | None:
        """A summary with rates since the previous call; None when no step ran in between."""
        now, steps = time.monotonic(), self._steps
        with self._lock:
            stats, seen = self._latest, dict(self._seen)
        since, logged_steps, before = self._logged
        self._logged = (now, steps, seen)
        if stats is None or steps == logged_steps:
            return None
        elapsed = max(now - since, 1e-9)
        queries = seen["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = seen["prefix_cache_hits"] - before["prefix_cache_hits"]
        spec = ""
        if stats.spec is not None:
            rate = stats.spec.acceptance_rate
            spec = (
                f", speculation: {'on' if stats.spec_enabled else 'off'}, "
                f"acceptance: {'-' if rate is None else f'{rate:.1%}'}"
            )
        return (
            f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
            f"KV cache: {stats.kv_cache_usage:.1%}, "
            f"prompt: {(seen['prompt_tokens'] - before['prompt_tokens']) / elapsed:.1f} tok/s, "
            f"generation: {(seen['generation_tokens'] - before['generation_tokens']) / elapsed:.1f} tok/s, "
            f"prefix cache hit rate: {hits / queries if queries else 0.0:.1%}{spec}"
        )


def _advance(counter: Counter, seen: dict, key: object, value: int) -> None:
    """Move a counter up to an engine total. A snapshot older than one already seen (another thread's)
    must not count twice."""
    if value > seen.get(key, 0):
        counter.inc(value - seen.get(key, 0))
        seen[key] = value
