"""DELETE options as kube-apiserver and its garbage collector honour them: Foreground propagation (the
owner waits, with the `foregroundDeletion` finalizer, for its blocking dependents) and a second DELETE of a
Pod that shortens its grace period (rest.BeforeDelete)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from apiserver_http import http

from ember_localcluster.apiserver import APIServer

CMS = "/api/v1/namespaces/default/configmaps"
PODS = "/api/v1/namespaces/default/pods"
MERGE = "application/merge-patch+json"


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=True) as api:
        yield api


def _dependent(name: str, owner: dict[str, Any], block: bool, finalizers: list[str]) -> dict[str, Any]:
    ref = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
    }
    ref["blockOwnerDeletion"] = block
    return {"metadata": {"name": name, "finalizers": finalizers, "ownerReferences": [ref]}}


def test_foreground_deletion_waits_for_blocking_dependents(server: APIServer) -> None:
    owner = http(server, "POST", CMS, {"metadata": {"name": "owner"}})[1]
    http(server, "POST", CMS, _dependent("blocker", owner, True, ["x.io/hold"]))
    http(server, "POST", CMS, _dependent("free", owner, False, []))
    code, deleted = http(server, "DELETE", f"{CMS}/owner?propagationPolicy=Foreground")
    assert code == 200 and deleted["kind"] == "ConfigMap"
    code, held = http(server, "GET", f"{CMS}/owner")
    assert code == 200 and held["metadata"]["deletionTimestamp"]
    assert held["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert http(server, "GET", f"{CMS}/free")[0] == 404
    code, blocker = http(server, "GET", f"{CMS}/blocker")
    assert code == 200 and blocker["metadata"]["deletionTimestamp"]

    http(server, "PATCH", f"{CMS}/blocker", {"metadata": {"finalizers": None}}, MERGE)
    assert http(server, "GET", f"{CMS}/blocker")[0] == 404
    assert http(server, "GET", f"{CMS}/owner")[0] == 404


def test_foreground_deletion_without_dependents_is_immediate(server: APIServer) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "alone"}})
    code, _ = http(server, "DELETE", f"{CMS}/alone?propagationPolicy=Foreground")
    assert code == 200 and http(server, "GET", f"{CMS}/alone")[0] == 404


def _time(stamp: str) -> datetime:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ")


def test_a_second_delete_may_shorten_a_pods_grace_period(server: APIServer) -> None:
    pod = {"metadata": {"name": "g"}, "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]}}
    http(server, "POST", PODS, pod)
    first = http(server, "DELETE", f"{PODS}/g")[1]["metadata"]
    assert first["deletionGracePeriodSeconds"] == 30
    longer = http(server, "DELETE", f"{PODS}/g?gracePeriodSeconds=60")[1]["metadata"]
    assert (
        longer["deletionGracePeriodSeconds"] == 30
        and longer["deletionTimestamp"] == first["deletionTimestamp"]
    )
    code, shorter = http(server, "DELETE", f"{PODS}/g?gracePeriodSeconds=1")
    assert code == 200 and shorter["metadata"]["deletionGracePeriodSeconds"] == 1
    assert _time(shorter["metadata"]["deletionTimestamp"]) == _time(first["deletionTimestamp"]) - timedelta(
        seconds=29
    )
