"""The hold of a crash-looping multi-node group, kept on its LeaderWorkerSet so that an operator that
starts again (a restart, another replica) takes it up where it was instead of starting the set at once."""

from __future__ import annotations

from typing import Any

from ember_operator.groups import GROUP_INDEX_LABEL, SET_NAME_LABEL, WORKER_INDEX_LABEL
from ember_operator.units import CRASH_HOLD_ANNOTATION, CrashLog, collect_units

OWNER = "uid-1"
GROUP = "svc-abcde"


def _group(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "metadata": {
            "name": GROUP,
            "namespace": "ns",
            "labels": {"app.kubernetes.io/instance": "svc"},
            "annotations": annotations or {},
            "ownerReferences": [{"uid": OWNER}],
            "creationTimestamp": "2030-01-01T00:00:00Z",
        },
        "spec": {"replicas": 1, "leaderWorkerTemplate": {"size": 2}},
    }


def _crashed(n: int, worker: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": f"{GROUP}-{n}-{worker}",
            "namespace": "ns",
            "uid": f"pod-{n}-{worker}",
            "labels": {
                "app.kubernetes.io/instance": "svc",
                SET_NAME_LABEL: GROUP,
                GROUP_INDEX_LABEL: "0",
                WORKER_INDEX_LABEL: worker,
            },
        },
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"lastState": {"terminated": {"exitCode": 1, "message": "FileNotFoundError: config.json"}}}
            ],
        },
    }


def test_a_groups_hold_outlives_the_operator_on_its_leaderworkerset() -> None:
    log = CrashLog()
    group = _group()
    for n in range(3):
        log.record(_crashed(n, "0"))
    units = collect_units(OWNER, [], [group])
    (trouble,) = log.troubles("ns", "svc", units, now=100.0)
    assert "held back 10 s" in trouble.message and log.held("ns", GROUP)
    kept = log.annotation("ns", GROUP, now=100.0, wall=5000.0)
    assert kept is not None

    # An operator starting 4 s later: the hold has 6 s to run, counted from the annotation.
    again = CrashLog()
    again.restore(_group({CRASH_HOLD_ANNOTATION: kept}), now=7.0, wall=5004.0)
    (trouble,) = again.troubles("ns", "svc", units, now=7.0)
    assert again.held("ns", GROUP), "the set would be started again at once"
    assert "crashed 3 times" in trouble.message and "held back 10 s" in trouble.message
    again.troubles("ns", "svc", units, now=12.9)
    assert again.held("ns", GROUP)
    again.troubles("ns", "svc", units, now=13.0)
    assert not again.held("ns", GROUP)
    # The next crash after the release holds it twice as long, as without the restart.
    again.record(_crashed(3, "0"))
    (trouble,) = again.troubles("ns", "svc", units, now=14.0)
    assert again.held("ns", GROUP) and "held back 20 s" in trouble.message
    # Restoring is for a log that lost the group: one that has it keeps its own.
    again.restore(_group({CRASH_HOLD_ANNOTATION: kept}), now=14.0, wall=6000.0)
    assert "held back 20 s" in again.troubles("ns", "svc", units, now=14.5)[0].message


def test_a_restart_counts_the_crashed_pods_it_sees_again_once() -> None:
    log = CrashLog()
    pods = [_crashed(0, "0"), _crashed(1, "0")]
    for p in pods:
        log.record(p)
    units = collect_units(OWNER, pods, [_group()])
    assert log.troubles("ns", "svc", units, now=100.0) == []
    kept = log.annotation("ns", GROUP, now=100.0, wall=5000.0)

    # The operator after a restart lists the same two crashed pods: still two crashes, nothing held.
    again = CrashLog()
    again.restore(_group({CRASH_HOLD_ANNOTATION: kept}), now=7.0, wall=5004.0)
    for p in pods:
        again.record(p)
    assert again.troubles("ns", "svc", units, now=7.0) == []
    assert not again.held("ns", GROUP)
    # A third crash is the third.
    again.record(_crashed(2, "0"))
    (trouble,) = again.troubles("ns", "svc", units, now=8.0)
    assert "crashed 3 times" in trouble.message and again.held("ns", GROUP)


def test_a_hold_is_taken_up_when_a_pod_event_came_first() -> None:
    log = CrashLog()
    for n in range(3):
        log.record(_crashed(n, "0"))
    units = collect_units(OWNER, [], [_group()])
    log.troubles("ns", "svc", units, now=100.0)
    kept = log.annotation("ns", GROUP, now=100.0, wall=5000.0)

    # The pod watch's first listing reaches the new operator before its first pass restores the hold.
    again = CrashLog()
    again.record(_crashed(2, "0"))
    again.restore(_group({CRASH_HOLD_ANNOTATION: kept}), now=7.0, wall=5004.0)
    assert again.held("ns", GROUP), "the saved hold was dropped"
    (trouble,) = again.troubles("ns", "svc", units, now=7.0)
    assert "crashed 3 times" in trouble.message and "held back 10 s" in trouble.message
    # Taken up once: later passes read the annotation again, but the log's own state stands.
    again.troubles("ns", "svc", units, now=13.0)
    assert not again.held("ns", GROUP)
    again.restore(_group({CRASH_HOLD_ANNOTATION: kept}), now=13.5, wall=5010.5)
    assert not again.held("ns", GROUP)


def test_the_kept_hold_names_a_bounded_number_of_pods() -> None:
    log = CrashLog()
    for n in range(100):
        log.record(_crashed(n, "0"))
    kept = log.annotation("ns", GROUP, now=100.0, wall=5000.0)
    assert kept is not None and len(kept) < 2000
    again = CrashLog()
    again.restore(_group({CRASH_HOLD_ANNOTATION: kept}), now=7.0, wall=5004.0)
    again.record(_crashed(99, "0"))
    (trouble,) = again.troubles("ns", "svc", collect_units(OWNER, [], [_group()]), now=7.0)
    assert "crashed 100 times" in trouble.message
