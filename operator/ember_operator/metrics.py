"""The operator's own Prometheus series (served by `ember operator --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

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
DESIRED = Gauge("ember:operator_desired_replicas", "The active target.", ["namespace", "name"])
POD_CHANGES = Counter(
    "ember:operator_pod_changes",
    "Pods created, promoted, demoted and deleted.",
    ["namespace", "name", "change"],
)
