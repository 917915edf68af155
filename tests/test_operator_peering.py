"""The operator as one replica of several (kopf peering): paused while a peer of higher priority is alive,
it resumes from what the API server holds then, not from what it remembered before the pause.

The peer of higher priority is a keep-alive entry in the KopfPeering's status, as another replica writes
it; what that replica would do while this one is paused (scale the service down) the test does itself."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from operator_harness import NAMESPACE, operator_cluster, wait_for
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ember_operator.desired import ROLE_LABEL
from ember_operator.spec import GROUP, PLURAL, VERSION
from ember_operator.standby import outranked

PEERING = "ember-operator"
PEER = "replica-b"
API_VERSION = f"{GROUP}/{VERSION}"


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)


@pytest.fixture
def kopf_log() -> Iterator[Lines]:
    lines = Lines()
    logger = logging.getLogger("kopf")
    logger.addHandler(lines)
    try:
        yield lines
    finally:
        logger.removeHandler(lines)


def _service(api: Any) -> dict[str, Any]:
    obj = api.get(API_VERSION, "InferenceService", NAMESPACE, "ha")
    assert obj is not None
    return dict(obj)


def _pods(api: Any) -> list[dict[str, Any]]:
    return [
        p
        for p in api.list("v1", "Pod", NAMESPACE, label_selector="app.kubernetes.io/instance=ha")
        if not p["metadata"].get("deletionTimestamp")
    ]


def _published(name: str) -> dict[str, float]:
    """The operator's Ready-pods gauge and Ready condition gauge of service `name`, as it serves them."""
    found = {}
    for family in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for sample in family.samples:
            if sample.labels.get("name") != name:
                continue
            if sample.name == "ember:operator_ready_replicas":
                found["ready"] = sample.value
            elif sample.name == "ember:operator_condition" and sample.labels.get("condition") == "Ready":
                found["Ready"] = sample.value
    return found


def _peer(api: Any, entry: dict[str, Any] | None) -> None:
    api.patch("kopf.dev/v1", "KopfPeering", NAMESPACE, PEERING, {"status": {PEER: entry}})


def test_a_replica_resuming_after_a_pause_forgets_the_pods_deleted_meanwhile(
    tmp_path: Path, kopf_log: Lines
) -> None:
    with operator_cluster(tmp_path, peering=PEERING) as (api, _, custom):
        body = {
            "model": {"name": "ha", "source": "/models/ha"},
            "resources": {"gpus": 0},
            "replicas": {"min": 3, "max": 3},
            "warmPool": {"size": 0},
            "autoscaling": {"intervalSeconds": 1, "scaleDownStabilizationSeconds": 60},
        }
        custom.create_namespaced_custom_object(
            GROUP,
            VERSION,
            NAMESPACE,
            PLURAL,
            {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": {"name": "ha"}, "spec": body},
        )
        wait_for(lambda: (_service(api).get("status") or {}).get("readyReplicas") == 3, what="3 Ready pods")

        wait_for(lambda: _published("ha") == {"ready": 3.0, "Ready": 1.0}, what="the service's gauges")

        # A peer of higher priority appears: this replica pauses, and publishes no gauge of the service (the
        # peer's are the ones that count; these stayed at 3 Ready pods whatever the peer did).
        _peer(api, {"priority": 2, "lifetime": 600, "lastseen": datetime.now(UTC).isoformat()})
        wait_for(lambda: kopf_log.said("Pausing operations"), what="the replica paused")
        wait_for(lambda: _published("ha") == {}, what="no gauge of the service while paused")

        # Meanwhile the peer takes the service down to one pod, and says so in status.
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, "ha", {"spec": {"replicas": {"min": 1, "max": 3}}}
        )
        kept, *gone = sorted(_pods(api), key=lambda p: p["metadata"]["name"])
        for pod in gone:
            api.delete("v1", "Pod", NAMESPACE, pod["metadata"]["name"])
        decision = {"time": "2030-01-01T00:00:00Z", "desired": 1, "reason": "scale down 3 -> 1 (the peer)"}
        custom.patch_namespaced_custom_object_status(
            GROUP,
            VERSION,
            NAMESPACE,
            PLURAL,
            "ha",
            {
                "status": {
                    "replicas": 1,
                    "readyReplicas": 1,
                    "desiredReplicas": 1,
                    "autoscaler": {"decisions": [decision]},
                }
            },
        )
        generation = _service(api)["metadata"]["generation"]

        # The peer goes: this replica resumes, and its first pass is written with the new generation.
        _peer(api, None)
        wait_for(lambda: kopf_log.said("Resuming operations"), what="the replica resumed")
        wait_for(
            lambda: (_service(api).get("status") or {}).get("observedGeneration") == generation,
            what="a pass of the resumed replica",
        )
        status = _service(api)["status"]
        assert (status["replicas"], status["readyReplicas"], status["desiredReplicas"]) == (1, 1, 1), status
        assert status["autoscaler"]["decisions"][0]["reason"] == decision["reason"], status["autoscaler"]
        assert [p["metadata"]["name"] for p in _pods(api)] == [kept["metadata"]["name"]]
        assert (kept["metadata"]["labels"] or {}).get(ROLE_LABEL) == "active"
        wait_for(lambda: _published("ha") == {"ready": 1.0, "Ready": 1.0}, what="the gauges back, as now")


def test_a_replica_stands_by_by_the_rule_kopf_pauses_on() -> None:
    now = datetime(2026, 1, 1, 12, tzinfo=UTC)
    ago = lambda s: (now - timedelta(seconds=s)).isoformat()  # noqa: E731

    def entry(priority: int, seen: str | None, lifetime: int | None = 60) -> dict[str, Any]:
        return {"priority": priority, "lastseen": seen, "lifetime": lifetime}

    me = entry(5, ago(1))
    assert not outranked({"me": me}, 5, now)
    assert not outranked({"me": me, "low": entry(4, ago(1))}, 5, now)
    assert outranked({"me": me, "high": entry(6, ago(1))}, 5, now)
    assert not outranked({"me": me, "high": entry(6, ago(61))}, 5, now), "a dead peer pauses no one"
    assert outranked({"me": me, "high": entry(6, ago(61), 120)}, 5, now), "its own lifetime counts"
    assert not outranked({"me": me, "high": entry(6, ago(61), None)}, 5, now), "60 s unless it says"
    assert outranked({"me": me, "twin": entry(5, ago(1))}, 5, now), "the same priority pauses both"
    assert outranked({"high": entry(6, None)}, 5, now), "no time: seen now, as kopf takes it"
    assert outranked({"high": {"priority": 6, "lastseen": "2026-01-01T11:59:59"}}, 5, now), "no zone: UTC"
    assert not outranked({"me": me, "gone": None}, 5, now)
