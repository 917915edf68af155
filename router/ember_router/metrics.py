"""The router's Prometheus metrics (`ember_router:` prefix), in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# 1.5 and 2 s: edges near a time-to-first-token objective, so a p99 read there is not interpolated across
# (1, 2.5] (as the engine's histograms)
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 2.5, 5, 10, 30, 60, 120)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            "ember_router:decisions",
            "Routing decisions by engine and reason",
            ["engine", "reason"],
            registry=r,
        )
        self.shed = Counter(
            "ember_router:shed_requests",
            "Requests the router shed itself: no engine could take them (fleet_overloaded) or none became "
            "ready in time (no_engine_ready)",
            ["reason"],
            registry=r,
        )
        self.fallback = Counter(
            "ember_router:fallback_requests",
            "Requests no engine could take, sent to the fallback by the router (outcome: served whole; failed: "
            "it could not be reached, answered an error status, or broke off its answer; cancelled: the "
            "client left first)",
            ["outcome"],
            registry=r,
        )
        # Every series from the start, at 0: a rate over a series that appears with its first event misses it.
        for reason in ("fleet_overloaded", "no_engine_ready"):
            self.shed.labels(reason)
        for outcome in ("served", "failed", "cancelled"):
            self.fallback.labels(outcome)
        self.engine_sheds_retried = Counter(
            "ember_router:engine_sheds_retried",
            "Engine sheds (503 overloaded, counted in that engine's ember:requests_shed_total) the router "
            "did not pass on: it sent the request to another engine or the fallback, or shed it itself",
            registry=r,
        )
        self.retries = Counter(
            "ember_router:retries", "Requests sent to another engine after an overloaded answer", registry=r
        )
        self.pending = Gauge(
            "ember_router:pending_requests",
            "Requests held because no engine is Ready (scale from zero reads this)",
            registry=r,
        )
        self.routed = Counter(
            "ember_router:routed_requests",
            "Requests that a routing rule sent to another InferenceService",
            ["rule", "target"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "ember_router:upstream_errors",
            "Requests whose engine could not be reached",
            ["engine"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "ember_router:prompt_tokens",
            "Prompt tokens of the requests an engine took (a 2xx answer), every prompt of a batch, as the "
            "engines count them in vllm:prompt_tokens_total",
            registry=r,
        )
        self.predicted_hit_tokens = Counter(
            "ember_router:predicted_prefix_hit_tokens",
            "Of those prompt tokens, the ones the engine that took the request was expected to hold in its "
            "prefix cache",
            registry=r,
        )
        self.ttft = Histogram(
            "ember_router:time_to_first_token_seconds",
            "Streamed requests only (stream: true, answered 2xx): from the request's arrival at the router to "
            "the first event of the response, the one that carries the first token",
            buckets=_LATENCY,
            registry=r,
        )
        self.e2e = Histogram(
            "ember_router:e2e_request_latency_seconds",
            "From arrival at the router to the response's end",
            buckets=_LATENCY,
            registry=r,
        )
        self.overhead = Histogram(
            "ember_router:routing_seconds",
            "Time the router spent before sending a request on (parsing, tokenizing, choosing)",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1),
            registry=r,
        )
        self.engines_ready = Gauge(
            "ember_router:engines_ready", "Engines Ready behind the router", registry=r
        )
