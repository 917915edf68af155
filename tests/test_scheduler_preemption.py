"""Priority preemption by the local scheduler (kube-scheduler's DefaultPreemption PostFilter), against the
in-process API server with nodes but no kubelet: victims are chosen as upstream chooses them (lower priority
only, as few and as unimportant as possible, PodDisruptionBudgets spared when another node will do), get
the `DisruptionTarget` condition, a `Preempted` event and a graceful delete; the preemptor waits Pending with
`status.nominatedNodeName`, and the room nominated to it is not given to a pod of lower priority."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_scheduler import GPU, NO_VICTIMS, Bare, events, get, node, pod, scheduled, unschedulable
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.disruption_controller import DisruptionController
from ember_localcluster.scheduler import Scheduler

LONG_GRACE = 600  # victims linger, as pods a kubelet is still stopping do, until the test deletes them
PREEMPTING = "default-scheduler: preempting to accommodate a higher priority pod"


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[Bare]:
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with Scheduler(kubeconfig) as scheduler:
            yield Bare(api, kubeconfig, scheduler)


def priority_class(bare: Bare, name: str, value: int, **more: Any) -> None:
    manifest = {"metadata": {"name": name}, "value": value, **more}
    bare.api.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", **manifest})


def running_on(
    bare: Bare, name: str, where: str, gpus: int, priority: str | None, labels: dict[str, str] | None = None
) -> None:
    """A pod already bound to `where` (as one the scheduler placed earlier)."""
    extra = {"priorityClassName": priority} if priority else {}
    manifest = pod(name, gpus=gpus, nodeName=where, **extra)
    manifest["spec"]["terminationGracePeriodSeconds"] = LONG_GRACE
    manifest["metadata"]["labels"] = labels or {}
    bare.api.create(manifest)
    wait_for(lambda: ("default", name) in bare.scheduler._pods, what=f"the scheduler seeing {name}")


def nominated(bare: Bare, name: str) -> str:
    return str(
        wait_for(lambda: get(bare.api, name)["status"].get("nominatedNodeName"), what=f"{name} nominated")
    )


def terminating(bare: Bare, name: str) -> dict[str, Any]:
    found = wait_for(
        lambda: (p := get(bare.api, name))["metadata"].get("deletionTimestamp") and p,
        what=f"{name} being deleted",
    )
    return dict(found)


def untouched(bare: Bare, name: str) -> bool:
    p = get(bare.api, name)
    conditions = {c["type"] for c in p["status"].get("conditions") or []}
    return not p["metadata"].get("deletionTimestamp") and "DisruptionTarget" not in conditions


def finish(bare: Bare, name: str) -> None:
    """What the kubelet does once the victim's containers stopped: the delete with no grace left."""
    bare.api.delete("v1", "Pod", "default", name, grace_period_seconds=0)
    wait_for(lambda: bare.api.get("v1", "Pod", "default", name) is None, what=f"{name} gone")


def test_the_lowest_priority_fewest_victims_are_preempted(bare: Bare) -> None:
    priority_class(bare, "low", 10)
    priority_class(bare, "mid", 20)
    priority_class(bare, "high", 1000)
    bare.add_node(node("a", gpus=2))
    bare.add_node(node("b", gpus=2))
    running_on(bare, "a-low", "a", 1, "low")
    running_on(bare, "a-mid", "a", 1, "mid")
    running_on(bare, "b-mid", "b", 2, "mid")
    bare.api.create(pod("urgent", gpus=1, priorityClassName="high"))
    # On a only a-low has to go (a-mid, tried back first, still leaves room); on b, b-mid would. The node
    # whose most important victim is least important wins.
    assert nominated(bare, "urgent") == "a"
    victim = terminating(bare, "a-low")
    assert untouched(bare, "a-mid") and untouched(bare, "b-mid")
    target = next(c for c in victim["status"]["conditions"] if c["type"] == "DisruptionTarget")
    assert (target["status"], target["reason"], target["message"]) == (
        "True",
        "PreemptionByScheduler",
        PREEMPTING,
    )
    uid = get(bare.api, "urgent")["metadata"]["uid"]
    (event,) = wait_for(lambda: events(bare.api, "a-low", "Preempted"), what="the Preempted event")
    assert (event["type"], event["message"], event["reportingComponent"]) == (
        "Normal",
        f"Preempted by pod {uid} on node a",
        "default-scheduler",
    )
    assert event["related"]["name"] == "urgent" and event["related"]["uid"] == uid
    # While the victim terminates the preemptor waits with the FitError, no preemption part after it.
    condition = scheduled(get(bare.api, "urgent"))
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "Unschedulable",
        f"0/2 nodes are available: 2 Insufficient {GPU}.",
    )
    assert not get(bare.api, "urgent")["spec"].get("nodeName")
    finish(bare, "a-low")
    assert bare.placed("urgent") == "a"
    assert untouched(bare, "a-mid") and untouched(bare, "b-mid")

    # Two nodes with victims of one priority: the smaller sum of priorities (here, fewer victims) wins.
    bare.add_node(node("c", gpus=2))
    bare.add_node(node("d", gpus=2))
    running_on(bare, "c-1", "c", 1, "low")
    running_on(bare, "c-2", "c", 1, "low")
    running_on(bare, "d-1", "d", 2, "low")
    # a and b hold pods of priority 20 and more, which cost more than c's or d's.
    bare.api.create(pod("wide", gpus=2, priorityClassName="high"))
    assert nominated(bare, "wide") == "d"
    terminating(bare, "d-1")
    assert all(untouched(bare, name) for name in ("c-1", "c-2", "a-mid", "b-mid"))


def test_a_disruption_budget_steers_preemption_to_another_node(bare: Bare) -> None:
    priority_class(bare, "low", 10)
    priority_class(bare, "high", 1000)
    bare.add_node(node("a", gpus=1))
    bare.add_node(node("b", gpus=1))
    running_on(bare, "guarded", "a", 1, "low", labels={"app": "guarded"})
    running_on(bare, "plain", "b", 1, "low")
    budget = {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}}
    bare.api.create(
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": {"name": "g"}, "spec": budget}
    )
    with DisruptionController(bare.kubeconfig):

        def synced() -> dict[str, Any] | None:
            found = bare.api.get("policy/v1", "PodDisruptionBudget", "default", "g") or {}
            status = found.get("status") or {}
            return status if status.get("observedGeneration") else None

        status = wait_for(synced, what="the budget's status")
        assert status["disruptionsAllowed"] == 0  # the guarded pod is not Ready: no disruption allowed
        wait_for(
            lambda: [b for b in getattr(bare.scheduler, "_budgets", {}).values() if b.get("status")],
            what="the scheduler seeing the budget's status",
            timeout=10,
        )
        bare.api.create(pod("first", gpus=1, priorityClassName="high"))
        # a comes first by name, but preempting there would break the budget: b is taken instead.
        assert nominated(bare, "first") == "b"
        terminating(bare, "plain")
        assert untouched(bare, "guarded")
        # With b's room nominated to `first`, the budget is the only way left: preemption goes through it.
        bare.api.create(pod("second", gpus=1, priorityClassName="high"))
        assert nominated(bare, "second") == "a"
        terminating(bare, "guarded")


def test_preemption_policy_never_waits_and_a_preempting_pod_does_not(bare: Bare) -> None:
    priority_class(bare, "low", 10)
    priority_class(bare, "polite", 1000, preemptionPolicy="Never")
    priority_class(bare, "high", 1000)
    bare.add_node(node("a", gpus=1))
    running_on(bare, "low", "a", 1, "low")
    bare.api.create(pod("waits", gpus=1, priorityClassName="polite"))
    assert bare.refused("waits") == (
        f"0/1 nodes are available: 1 Insufficient {GPU}. no new claims to deallocate, "
        "preemption: not eligible due to preemptionPolicy=Never."
    )
    assert untouched(bare, "low") and not get(bare.api, "waits")["status"].get("nominatedNodeName")
    bare.api.create(pod("takes", gpus=1, priorityClassName="high"))
    assert nominated(bare, "takes") == "a"
    terminating(bare, "low")
    finish(bare, "low")
    assert bare.placed("takes") == "a"
    assert not get(bare.api, "waits")["spec"].get("nodeName")


def test_the_nominated_room_is_not_given_to_a_lower_priority_pod(bare: Bare) -> None:
    priority_class(bare, "high", 1000)
    bare.add_node(node("a", gpus=2))
    running_on(bare, "low", "a", 1, None)
    bare.api.create(pod("big", gpus=2, priorityClassName="high"))
    assert nominated(bare, "big") == "a"
    terminating(bare, "low")
    # One GPU is free on a, but it is part of what `big` was nominated for: a pod of lower priority that
    # would fit there is refused, as kube-scheduler's filters count the nominated pod on its node.
    bare.api.create(pod("small", gpus=1))
    assert bare.refused("small") == unschedulable(1, f"1 Insufficient {GPU}", f"1 {NO_VICTIMS}")
    assert not get(bare.api, "small")["spec"].get("nodeName")
    finish(bare, "low")
    assert bare.placed("big") == "a"
    assert not get(bare.api, "small")["spec"].get("nodeName")


def test_without_a_helpful_victim_the_fit_error_says_why_per_node(bare: Bare) -> None:
    priority_class(bare, "high", 1000)
    bare.add_node(node("a", gpus=1))
    bare.add_node(node("tainted", gpus=1, taints=[{"key": "k", "effect": "NoSchedule"}]))
    running_on(bare, "equal", "a", 1, "high")
    running_on(bare, "cpu-only", "a", 0, None)  # of lower priority, but holding no GPU
    bare.api.create(pod("same", gpus=1, priorityClassName="high"))
    # On a, even without the lower-priority pod the GPU is taken: the node's reason is the filter's.
    assert bare.refused("same") == unschedulable(
        2,
        f"1 Insufficient {GPU}, 1 node(s) had untolerated taint(s)",
        f"1 Insufficient {GPU}, 1 Preemption is not helpful for scheduling",
    )
    assert untouched(bare, "equal") and untouched(bare, "cpu-only")
    assert not get(bare.api, "same")["status"].get("nominatedNodeName")
