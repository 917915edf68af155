"""The local control plane's Deployments and ReplicaSets: the rollout arithmetic as pure functions, then the
controller against the in-process API server (pods marked Ready by the test, as a kubelet would)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from waiting import wait_for

from ember_localcluster import deployment as d
from ember_localcluster.apiserver import APIServer
from ember_localcluster.deployment_controller import DeploymentController
from ember_localcluster.expectations import Expectations

NS = "default"


def deployment(replicas: int = 4, image: str = "img:1", **strategy: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": replicas,
        "selector": {"matchLabels": {"app": "web"}},
        "template": {
            "metadata": {"labels": {"app": "web"}},
            "spec": {"containers": [{"name": "c", "image": image}]},
        },
    }
    if strategy:
        spec["strategy"] = strategy
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web", "namespace": NS, "uid": "u-1", "generation": 1},
        "spec": spec,
    }


def test_template_hash_is_upstreams_alphabet_and_changes_with_the_template_and_collisions() -> None:
    t = deployment()["spec"]["template"]
    h = d.template_hash(t)
    assert h and set(h) <= set("bcdfghjklmnpqrstvwxz2456789")
    assert d.template_hash(t) == h
    assert d.template_hash(deployment(image="img:2")["spec"]["template"]) != h
    assert d.template_hash(t, 1) != h


def test_new_replicaset_carries_the_hash_label_selector_annotations_and_owner() -> None:
    rs = d.new_replicaset(deployment(replicas=4), revision=3)
    h = rs["spec"]["template"]["metadata"]["labels"][d.HASH_LABEL]
    assert rs["metadata"]["name"] == f"web-{h}"
    assert rs["spec"]["selector"]["matchLabels"] == {"app": "web", d.HASH_LABEL: h}
    assert rs["metadata"]["annotations"] == {d.REVISION: "3", d.DESIRED: "4", d.MAX: "5"}
    owner = rs["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["uid"], owner["controller"]) == ("Deployment", "u-1", True)
    assert rs["spec"]["replicas"] == 0
    assert d.matches_template(rs, deployment())
    assert not d.matches_template(rs, deployment(image="img:2"))


@pytest.mark.parametrize(
    ("replicas", "surge", "unavailable", "expected"),
    [(4, "25%", "25%", (1, 1)), (10, "25%", "25%", (3, 2)), (1, "25%", "25%", (1, 0)), (3, 0, 0, (0, 1))],
)
def test_fenceposts_round_surge_up_and_unavailability_down(
    replicas: int, surge: Any, unavailable: Any, expected: tuple[int, int]
) -> None:
    deploy = deployment(
        replicas, type="RollingUpdate", rollingUpdate={"maxSurge": surge, "maxUnavailable": unavailable}
    )
    assert d.surge_and_unavailable(deploy) == expected


def _rs(name: str, replicas: int, available: int, created: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"replicas": replicas},
        "status": {"replicas": replicas, "availableReplicas": available},
    }


@given(
    replicas=st.integers(1, 12),
    progress=st.lists(st.integers(0, 12), min_size=1, max_size=30),
)
def test_a_rolling_update_never_exceeds_surge_nor_drops_below_availability(
    replicas: int, progress: list[int]
) -> None:
    deploy = deployment(replicas)
    surge, unavailable = d.surge_and_unavailable(deploy)
    new, old = _rs("new", 0, 0, "2"), _rs("old", replicas, replicas, "1")
    # Pods become available at whatever pace (never less available than before); the old set's all are.
    for step, ready in enumerate([*sorted(progress), *([replicas] * (2 * replicas + 4))]):
        changes = d.rollout(deploy, new, [old])
        new["spec"]["replicas"] = changes.get("new", new["spec"]["replicas"])
        old["spec"]["replicas"] = changes.get("old", old["spec"]["replicas"])
        total = new["spec"]["replicas"] + old["spec"]["replicas"]
        assert total <= replicas + surge, step
        new["status"]["availableReplicas"] = min(ready, new["spec"]["replicas"])
        old["status"]["availableReplicas"] = old["spec"]["replicas"]
        available = new["status"]["availableReplicas"] + old["status"]["availableReplicas"]
        assert available >= replicas - unavailable, step
    assert (new["spec"]["replicas"], old["spec"]["replicas"]) == (replicas, 0)


def test_recreate_waits_for_the_old_pods_before_growing_the_new_set() -> None:
    deploy = deployment(3, type="Recreate")
    new, old = _rs("new", 0, 0, "2"), _rs("old", 3, 3, "1")
    assert d.rollout(deploy, new, [old]) == {"old": 0}
    old["spec"]["replicas"] = 0
    assert d.rollout(deploy, new, [old]) == {}  # status.replicas still 3: pods going
    old["status"]["replicas"] = 0
    assert d.rollout(deploy, new, [old]) == {"new": 3}


def test_replicaset_deletes_unscheduled_then_not_ready_then_newest_pods_first() -> None:
    def pod(name: str, node: bool, ready: bool, created: str) -> dict[str, Any]:
        conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
        return {
            "metadata": {"name": name, "creationTimestamp": created},
            "spec": {"nodeName": "n"} if node else {},
            "status": {"phase": "Running" if node else "Pending", "conditions": conditions},
        }

    pods = [
        pod("old-ready", True, True, "2026-01-01T00:00:01Z"),
        pod("new-ready", True, True, "2026-01-01T00:00:09Z"),
        pod("not-ready", True, False, "2026-01-01T00:00:00Z"),
        pod("unscheduled", False, False, "2026-01-01T00:00:00Z"),
    ]
    rs = {"spec": {"replicas": 1}}
    assert d.replicaset_actions(rs, pods) == (0, ["unscheduled", "not-ready", "new-ready"])
    assert d.replicaset_actions({"spec": {"replicas": 6}}, pods) == (2, [])


def test_deployment_status_conditions_use_upstreams_reasons() -> None:
    deploy = deployment(2)
    new = _rs("web-abc", 2, 2, "1")
    new["status"].update(readyReplicas=2)
    status = d.deployment_status(deploy, new, [], "2026-01-01T00:00:00Z")
    assert status["availableReplicas"] == 2 and status["updatedReplicas"] == 2
    available, progressing = status["conditions"]
    assert (available["reason"], available["message"]) == (
        "MinimumReplicasAvailable",
        "Deployment has minimum availability.",
    )
    assert progressing["reason"] == "NewReplicaSetAvailable"
    assert progressing["message"] == 'ReplicaSet "web-abc" has successfully progressed.'


# -- the controller against the API server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False) as api:
        kubeconfig = api.write_kubeconfig(Path(tmp_path_factory.mktemp("deploy")) / "kubeconfig")
        with DeploymentController(kubeconfig):
            yield api


def _pods(api: APIServer) -> list[dict[str, Any]]:
    return [
        p
        for p in api.list("v1", "Pod", NS, label_selector="app=web")
        if not p["metadata"].get("deletionTimestamp")
    ]


def _make_ready(api: APIServer) -> int:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    n = 0
    for pod in _pods(api):
        if (pod.get("status") or {}).get("phase") != "Running":
            ready = {"type": "Ready", "status": "True", "lastTransitionTime": now}
            api.patch(
                "v1",
                "Pod",
                NS,
                pod["metadata"]["name"],
                {"status": {"phase": "Running", "conditions": [ready]}},
                subresource="status",
            )
            n += 1
    return n


def test_the_controller_creates_rolls_and_reports_a_deployment(cluster: APIServer) -> None:
    api = cluster
    created = api.create(
        {k: v for k, v in deployment(3).items()} | {"metadata": {"name": "web", "namespace": NS}}
    )
    wait_for(lambda: len(_pods(api)) == 3, 10, "three pods")
    pod = _pods(api)[0]
    owner = pod["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and pod["metadata"]["generateName"] == owner["name"] + "-"
    first_hash = pod["metadata"]["labels"][d.HASH_LABEL]
    _make_ready(api)

    def status() -> dict[str, Any]:
        return api.get("apps/v1", "Deployment", NS, "web").get("status") or {}  # type: ignore[union-attr]

    wait_for(
        lambda: status().get("availableReplicas") == 3 and status().get("observedGeneration") == 1, 10, status
    )
    # A new template rolls: pods of the new hash replace the old ones, within surge and unavailability.
    api.patch(
        "apps/v1",
        "Deployment",
        NS,
        "web",
        {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "img:2"}]}}}},
    )
    most = 0

    def rolled() -> bool:
        nonlocal most
        _make_ready(api)
        pods = _pods(api)
        most = max(most, len(pods))
        s = status()
        return bool(
            s.get("updatedReplicas") == 3
            and s.get("availableReplicas") == 3
            and s.get("replicas") == 3
            and all(p["metadata"]["labels"][d.HASH_LABEL] != first_hash for p in pods)
        )

    wait_for(rolled, 20, status)
    assert most <= 4  # 3 + maxSurge (25 % of 3, rounded up)
    sets = api.list("apps/v1", "ReplicaSet", NS)
    assert sorted((rs["metadata"]["annotations"][d.REVISION], rs["spec"]["replicas"]) for rs in sets) == [
        ("1", 0),
        ("2", 3),
    ]
    assert status()["conditions"][0]["reason"] == "MinimumReplicasAvailable"
    # Deleting the Deployment takes its ReplicaSets and their pods with it (garbage collection).
    api.delete("apps/v1", "Deployment", NS, "web")
    wait_for(lambda: not api.list("apps/v1", "ReplicaSet", NS) and not _pods(api), 10, "garbage collection")
    assert created["metadata"]["uid"]


# -- expectations: a ReplicaSet acts again only once it has seen its own creates and deletes ---------------


def test_expectations_wait_for_each_create_and_delete_and_expire_after_five_minutes() -> None:
    now = [0.0]
    exp = Expectations(clock=lambda: now[0])
    key = ("ReplicaSet", NS, "web-1")
    assert exp.satisfied(key)  # nothing recorded
    exp.expect(key, adds=2)
    assert not exp.satisfied(key)
    exp.created(key)
    assert not exp.satisfied(key)
    exp.created(key)
    assert exp.satisfied(key)
    exp.expect(key, deletes=["a", "b"])
    exp.deleted(key, "a")
    exp.deleted(key, "a")  # seen twice (its deletionTimestamp, then its removal): counted once
    assert not exp.satisfied(key)
    exp.deleted(key, "b")
    assert exp.satisfied(key)
    exp.expect(key, adds=1)
    now[0] = 299.0
    assert not exp.satisfied(key)
    now[0] = 300.5  # upstream's ExpectationsTimeout: five minutes
    assert exp.satisfied(key)
    exp.expect(key, adds=1)
    exp.forget(key)
    assert exp.satisfied(key)


class _LaggingInformers(DeploymentController):
    """The controller with informers that have not delivered anything yet: what it knows is what the test
    hands it, as when the pods' events are still on their way."""

    def _informers(self) -> list[Any]:
        return []


def test_a_replicaset_synced_again_before_its_pods_events_arrive_creates_nothing_more(
    tmp_path: Path,
) -> None:
    """kube-controller-manager's ReplicaSet controller records the pods it asked for
    (`ControllerExpectations`) and does not create or delete again until its informer has seen them. The
    local controller acted on its stale cache: a second sync before the pods' ADDED events created a
    second set (6 pods for 3 replicas)."""
    with APIServer(pod_graceful_deletion=False) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        rs = api.create(
            {
                "apiVersion": "apps/v1",
                "kind": "ReplicaSet",
                "metadata": {"name": "lag", "namespace": NS},
                "spec": {
                    "replicas": 3,
                    "selector": {"matchLabels": {"app": "lag"}},
                    "template": {
                        "metadata": {"labels": {"app": "lag"}},
                        "spec": {"containers": [{"name": "c", "image": "img:1"}]},
                    },
                },
            }
        )
        key = ("ReplicaSet", NS, "lag")
        with _LaggingInformers(kubeconfig) as controller:
            controller._objects[key] = rs
            for _ in range(2):
                controller._runtime.run(controller._sync_replicaset(key), timeout=10)
            pods = api.list("v1", "Pod", NS, label_selector="app=lag")
            assert len(pods) == 3
            for pod in pods:  # the events arrive: the next sync acts on what it sees
                controller._runtime.run(_deliver(controller, "ADDED", pod), timeout=10)
            controller._objects[key] = rs | {"spec": rs["spec"] | {"replicas": 4}}
            controller._runtime.run(controller._sync_replicaset(key), timeout=10)
            assert len(api.list("v1", "Pod", NS, label_selector="app=lag")) == 4


async def _deliver(controller: DeploymentController, event: str, obj: dict[str, Any]) -> None:
    controller._on_event("Pod", event, obj)
