"""When a pod that found no node is tried again: kube-scheduler's back-off and unschedulable-pool rules."""

from __future__ import annotations

import copy

from ember_localcluster.schedqueue import Backoff, placement


def test_a_waiting_pod_is_retried_after_a_doubling_back_off_once_a_change_moved_it() -> None:
    waits = []
    for attempts in range(1, 7):
        b = Backoff(attempts, failed_at=100.0, moved=True)
        waits.append(b.retry_at() - 100.0)
    assert waits == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_waiting_pod_no_change_moved_is_retried_after_five_minutes() -> None:
    assert Backoff(1, failed_at=100.0).retry_at() == 400.0
    assert Backoff(6, failed_at=100.0).retry_at() == 400.0


def test_a_node_heartbeat_is_not_a_placement_change() -> None:
    node = {
        "metadata": {"name": "n", "labels": {"zone": "a"}},
        "spec": {},
        "status": {
            "allocatable": {"nvidia.com/gpu": "2"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    beat = copy.deepcopy(node)
    beat["status"]["conditions"][0]["lastHeartbeatTime"] = "2026-01-01T00:00:01Z"
    assert placement(beat) == placement(node)
    for change in (
        lambda n: n["metadata"]["labels"].update(zone="b"),
        lambda n: n["spec"].update(unschedulable=True),
        lambda n: n["spec"].update(taints=[{"key": "k", "effect": "NoSchedule"}]),
        lambda n: n["status"]["allocatable"].update({"nvidia.com/gpu": "1"}),
    ):
        changed = copy.deepcopy(node)
        change(changed)
        assert placement(changed) != placement(node)
