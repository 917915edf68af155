"""Inter-pod affinity and topology spreading in the local scheduler, against the in-process API server with
no kubelet (pods are bound, never run): required pod affinity and anti-affinity and existing pods'
anti-affinity with kube-scheduler's FitError reasons, `DoNotSchedule` spread constraints (maxSkew,
minDomains, a node without the key), and the scores that spread pods where least-allocated alone would pack
them (`ScheduleAnyway` constraints, preferred anti-affinity and affinity)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_scheduler import NO_VICTIMS, NOT_HELPFUL, Bare, node, pod, unschedulable
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.scheduler import Scheduler

HOST = "kubernetes.io/hostname"


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[Bare]:
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with Scheduler(kubeconfig) as scheduler:
            yield Bare(api, kubeconfig, scheduler)


def labelled(name: str, labels: dict[str, str], **spec: Any) -> dict[str, Any]:
    manifest = pod(name, **spec)
    manifest["metadata"]["labels"] = labels
    return manifest


def get_in(bare: Bare, namespace: str, name: str) -> dict[str, Any]:
    found = bare.api.get("v1", "Pod", namespace, name)
    assert found is not None
    return dict(found)


def term(app: str, key: str = HOST) -> dict[str, Any]:
    return {"labelSelector": {"matchLabels": {"app": app}}, "topologyKey": key}


def required(kind: str, app: str) -> dict[str, Any]:
    return {kind: {"requiredDuringSchedulingIgnoredDuringExecution": [term(app)]}}


def preferred(kind: str, app: str) -> dict[str, Any]:
    return {
        kind: {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": term(app)}]
        }
    }


def spread(app: str, key: str, when: str, **more: Any) -> list[dict[str, Any]]:
    constraint = {"maxSkew": 1, "topologyKey": key, "whenUnsatisfiable": when}
    return [{**constraint, "labelSelector": {"matchLabels": {"app": app}}, **more}]


def test_required_pod_anti_affinity_and_existing_pods_anti_affinity(bare: Bare) -> None:
    bare.add_node(node("a"))
    bare.add_node(node("b"))
    anti = required("podAntiAffinity", "web")
    bare.api.create(labelled("web-1", {"app": "web"}, affinity=anti))
    assert bare.placed("web-1") == "a"
    bare.api.create(labelled("web-2", {"app": "web"}, affinity=anti))
    assert bare.placed("web-2") == "b"
    bare.api.create(labelled("web-3", {"app": "web"}, affinity=anti))
    assert bare.refused("web-3") == unschedulable(
        2, "2 node(s) didn't match pod anti-affinity rules", f"2 {NO_VICTIMS}"
    )
    # A pod without rules of its own that the running pods' anti-affinity selects is kept off their nodes.
    bare.api.create(labelled("plain", {"app": "web"}))
    assert bare.refused("plain") == unschedulable(
        2, "2 node(s) didn't satisfy existing pods anti-affinity rules", f"2 {NO_VICTIMS}"
    )
    bare.api.delete("v1", "Pod", "default", "plain", grace_period_seconds=0)
    # Another namespace's pods are not the term's (its namespace is the pod's own by default).
    bare.api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}})
    elsewhere = labelled("web-other", {"app": "web"}, affinity=anti)
    elsewhere["metadata"]["namespace"] = "other"
    bare.api.create(elsewhere)
    wait_for(lambda: get_in(bare, "other", "web-other")["spec"].get("nodeName"), what="web-other bound")
    # A pod gone frees its node for the waiting one.
    bare.api.delete("v1", "Pod", "default", "web-1", grace_period_seconds=0)
    assert bare.placed("web-3") == "a"


def test_required_pod_affinity_waits_for_its_pod(bare: Bare) -> None:
    bare.add_node(node("a"))
    bare.add_node(node("b"))
    bare.api.create(labelled("follower", {"app": "follower"}, affinity=required("podAffinity", "cache")))
    assert bare.refused("follower") == unschedulable(
        2, "2 node(s) didn't match pod affinity rules", f"2 {NOT_HELPFUL}"
    )
    # The pod it wants arriving on b moves it at once (not after the 5 min a pod no change moved waits).
    bare.api.create(labelled("cache", {"app": "cache"}, nodeSelector={HOST: "b"}))
    assert bare.placed("cache") == "b"
    assert bare.placed("follower") == "b"
    # The first of a series that matches its own terms is placed though no pod matches yet.
    bare.api.create(labelled("first", {"app": "series"}, affinity=required("podAffinity", "series")))
    assert bare.placed("first") == "a"
    bare.api.create(labelled("second", {"app": "series"}, affinity=required("podAffinity", "series")))
    assert bare.placed("second") == "a"


def test_do_not_schedule_spread_constraints(bare: Bare) -> None:
    bare.add_node(node("a", labels={"zone": "1"}))
    bare.add_node(node("b", labels={"zone": "2"}))
    bare.add_node(node("c"))  # no zone: outside the domains, and refused
    constraints = spread("s", "zone", "DoNotSchedule")
    for name, where in (("s1", "a"), ("s2", "b")):
        bare.api.create(labelled(name, {"app": "s"}, topologySpreadConstraints=constraints))
        assert bare.placed(name) == where
    bare.api.patch("v1", "Node", None, "b", {"spec": {"unschedulable": True}})
    bare.api.create(labelled("s3", {"app": "s"}, topologySpreadConstraints=constraints))
    assert bare.placed("s3") == "a"  # 2 in zone 1, 1 in zone 2: a skew of 1
    bare.api.create(labelled("s4", {"app": "s"}, topologySpreadConstraints=constraints))
    assert bare.refused("s4") == unschedulable(
        3,
        "1 node(s) didn't match pod topology spread constraints, "
        "1 node(s) didn't match pod topology spread constraints (missing required label), "
        "1 node(s) were unschedulable",
        f"1 {NO_VICTIMS}, 2 {NOT_HELPFUL}",
    )
    bare.api.patch("v1", "Node", None, "b", {"spec": {"unschedulable": False}})
    assert bare.placed("s4") == "b"
    # minDomains 3 with two zones: the smallest domain counts as 0, so each zone takes maxSkew pods.
    few = spread("m", "zone", "DoNotSchedule", minDomains=3)
    for name in ("m1", "m2", "m3"):
        bare.api.create(labelled(name, {"app": "m"}, topologySpreadConstraints=few))
    assert {bare.placed("m1"), bare.placed("m2")} == {"a", "b"}
    assert "2 node(s) didn't match pod topology spread constraints" in bare.refused("m3")


def test_soft_spreading_and_preferred_affinity_outweigh_least_allocated(bare: Bare) -> None:
    bare.add_node(node("big", cpu="16"))
    bare.add_node(node("small", cpu="4"))
    # Least allocated alone puts both on big (after one 1-cpu pod it is still the emptier node).
    bare.api.create(pod("packed-1", cpu="1"))
    bare.api.create(pod("packed-2", cpu="1"))
    assert [bare.placed("packed-1"), bare.placed("packed-2")] == ["big", "big"]
    soft = spread("soft", HOST, "ScheduleAnyway")
    for name in ("soft-1", "soft-2"):
        bare.api.create(labelled(name, {"app": "soft"}, cpu="1", topologySpreadConstraints=soft))
    assert [bare.placed("soft-1"), bare.placed("soft-2")] == ["big", "small"]
    anti = preferred("podAntiAffinity", "apart")
    for name in ("apart-1", "apart-2"):
        bare.api.create(labelled(name, {"app": "apart"}, cpu="1", affinity=anti))
    assert [bare.placed("apart-1"), bare.placed("apart-2")] == ["big", "small"]
    bare.api.create(labelled("near", {"app": "near"}, cpu="1", affinity=preferred("podAffinity", "apart")))
    assert bare.placed("near") in ("big", "small")
    bare.api.create(labelled("with-soft", {"app": "x"}, cpu="1", affinity=preferred("podAffinity", "soft")))
    # Both nodes hold one `soft` pod: affinity scores them alike, and least allocated decides.
    assert bare.placed("with-soft") == "big"
    bare.api.create(labelled("lonely", {"app": "y"}, cpu="1", nodeSelector={HOST: "small"}))
    assert bare.placed("lonely") == "small"
    bare.api.create(labelled("follows", {"app": "z"}, cpu="1", affinity=preferred("podAffinity", "y")))
    assert bare.placed("follows") == "small", "preferred affinity outweighs least allocated"
