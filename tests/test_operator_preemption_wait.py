"""A pod waiting for the victims of its preemption waits no longer than a pod waiting for capacity: the
scheduler keeps the nomination while a victim on a lost node stays Terminating for good."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from ember_operator.pods import PREEMPTION_WAIT_MIN, preempting, trouble
from ember_operator.units import collect_units

T0 = datetime(2030, 1, 1, tzinfo=UTC)
MESSAGE = "0/2 nodes are available: 1 Insufficient cpu. not eligible due to a terminating pod on the nominated node."


def _nominated() -> dict[str, Any]:
    return {
        "metadata": {
            "name": "svc-a",
            "namespace": "ns",
            "uid": "pod-a",
            "ownerReferences": [{"uid": "owner"}],
            "labels": {"app.kubernetes.io/instance": "svc"},
            "creationTimestamp": "2030-01-01T00:00:00Z",
        },
        "status": {
            "phase": "Pending",
            "nominatedNodeName": "node-2",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": MESSAGE,
                    "lastTransitionTime": "2030-01-01T00:00:00Z",
                }
            ],
        },
    }


def test_a_preemption_wait_ends_after_the_capacity_wait() -> None:
    pod = _nominated()
    soon = T0 + timedelta(seconds=200)
    assert preempting(pod, soon, 300) is not None
    assert trouble(pod, soon, 300) is None

    late = T0 + timedelta(seconds=301)
    assert preempting(pod, late, 300) is None
    found = trouble(pod, late, 300)
    assert found is not None and found.reason == "PodsUnschedulable" and MESSAGE in found.message


def test_a_preemption_past_the_wait_is_unschedulable_to_the_roll() -> None:
    pod = _nominated()
    (v,) = collect_units("owner", [pod], [], T0 + timedelta(seconds=200), 300).views
    assert not v.unschedulable
    (v,) = collect_units("owner", [pod], [], T0 + timedelta(seconds=301), 300).views
    assert v.unschedulable


def test_a_preemption_has_the_victims_grace_even_without_a_capacity_wait() -> None:
    pod = _nominated()
    assert preempting(pod, T0 + timedelta(seconds=PREEMPTION_WAIT_MIN - 1), 0) is not None
    assert preempting(pod, T0 + timedelta(seconds=PREEMPTION_WAIT_MIN + 1), 0) is None
