"""The operator's own Prometheus series (served by `ember operator --metrics-port`).

Besides what it does (reconciles, scaling decisions, scrape failures, pod changes), it publishes each
InferenceService's state as gauges, so that dashboards and alerts need nothing but Prometheus: the pod
counts, the autoscaler's target and inputs, and its conditions (1 while true, labelled with the reason).
"""

from __future__ import annotations

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, generate_latest

RECONCILES = Counter(
    "ember:operator_reconciles", "Reconcile passes over InferenceServices.", ["namespace", "name", "result"]
)
SCALING_DECISIONS = Counter(
    "ember:operator_scaling_decisions",
    "Autoscaler decisions that changed the active target.",
    ["namespace", "name", "direction"],
)
SCRAPE_FAILURES = Counter(
    "ember:operator_scrape_failures", "Engine /metrics scrapes that failed.", ["namespace", "name"]
)
SCRAPES_DROPPED = Counter(
    "ember:operator_scrapes_dropped",
    "Engine /metrics reads dropped: the pod was deleted or went unready while it was read.",
    ["namespace", "name"],
)
DESIRED = Gauge("ember:operator_desired_replicas", "The active target.", ["namespace", "name"])
POD_CHANGES = Counter(
    "ember:operator_pod_changes",
    "Pods created, promoted, demoted and deleted.",
    ["namespace", "name", "change"],
)
ACTIVE = Gauge(
    "ember:operator_active_replicas", "Active engine pods (serving or starting).", ["namespace", "name"]
)
READY = Gauge("ember:operator_ready_replicas", "Ready active engine pods.", ["namespace", "name"])
WARM = Gauge("ember:operator_warm_replicas", "Pods in the warm pool.", ["namespace", "name"])
QUEUE = Gauge(
    "ember:operator_autoscaler_queue_depth",
    "Requests waiting per Ready active pod, as the autoscaler last scraped them; absent when none was read.",
    ["namespace", "name"],
)
KV = Gauge(
    "ember:operator_autoscaler_kv_cache_utilization",
    "KV-cache use per Ready active pod (0..1), as the autoscaler last scraped it; absent when none was read.",
    ["namespace", "name"],
)
CONDITION = Gauge(
    "ember:operator_condition",
    "1 while the InferenceService's condition is True, else 0; reason as in status.",
    ["namespace", "name", "condition", "reason"],
)
_PER_SERVICE = (DESIRED, ACTIVE, READY, WARM, QUEUE, KV)
_reasons: dict[tuple[str, str, str], str] = {}  # (namespace, name, condition) -> the reason published


def publish_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    """The gauges from the status a reconcile pass wrote. The scaling-decision counters exist from the
    first pass, at 0: a dashboard then shows no decisions rather than no data, and increase() sees the
    first decision (a series first scraped at 1 shows no increase)."""
    for direction in ("up", "down"):
        SCALING_DECISIONS.labels(namespace, name, direction)
    for gauge, field in ((ACTIVE, "replicas"), (READY, "readyReplicas"), (WARM, "warmReplicas")):
        gauge.labels(namespace, name).set(status.get(field) or 0)
    inputs = (status.get("autoscaler") or {}).get("inputs") or {}
    for gauge, field in ((QUEUE, "queueDepth"), (KV, "kvCacheUtilization")):
        if inputs.get(field) is not None:
            gauge.labels(namespace, name).set(inputs[field])
        else:  # no pod gave this reading: no series, rather than the last value or a made-up 0
            with contextlib.suppress(KeyError):  # not published
                gauge.remove(namespace, name)
    for c in status.get("conditions") or []:
        key = (namespace, name, str(c["type"]))
        reason = c.get("reason") or ""
        previous = _reasons.get(key)
        if previous is not None and previous != reason:
            CONDITION.remove(namespace, name, c["type"], previous)  # one series per condition
        _reasons[key] = reason
        CONDITION.labels(namespace, name, c["type"], reason).set(1 if c.get("status") == "True" else 0)


def forget(namespace: str, name: str) -> None:
    """Drop a deleted InferenceService's gauges, so that no alert fires for what is gone."""
    for gauge in _PER_SERVICE:
        with contextlib.suppress(KeyError):  # never published (no status written yet)
            gauge.remove(namespace, name)
    for key in [k for k in _reasons if k[:2] == (namespace, name)]:
        CONDITION.remove(namespace, name, key[2], _reasons.pop(key))


def forget_all() -> None:
    """Drop every InferenceService's gauges: this replica stands by while a peer works (`standby.py`)."""
    for gauge in (*_PER_SERVICE, CONDITION):
        gauge.clear()
    _reasons.clear()


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: Any) -> None:
        pass


def serve(port: int, addr: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve /metrics in Prometheus's text format, whatever the scraper accepts: prometheus_client's own
    server answers an OpenMetrics request with the names' ':' escaped to '_' (`ember_operator_...`), which
    would break every query and alert written against `ember:operator_...`."""
    server = ThreadingHTTPServer((addr, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ember-operator-metrics", daemon=True).start()
    return server
