"""Multi-node replicas through the real kopf loop: `resources.nodes > 1` makes LeaderWorkerSet groups, the
local LeaderWorkerSet controller makes their pods, and the warm pool, failover and rolls work on groups.
Pods are tended by `PodRunner` (Running, Ready, /metrics); the engines themselves run in test_e2e_groups."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from operator_harness import NAMESPACE, PodRunner, operator_cluster, wait_for

from ember_localcluster.apiserver import APIError, APIServer
from ember_localcluster.leaderworkerset import NAME, WORKER_INDEX
from ember_localcluster.leaderworkerset import crd_manifest as lws_crd
from ember_localcluster.leaderworkerset_controller import LeaderWorkerSetController
from ember_operator.desired import HASH_LABEL, ROLE_LABEL
from ember_operator.groups import LWS_KIND
from ember_operator.spec import GROUP, PLURAL, VERSION

API_VERSION = f"{GROUP}/{VERSION}"
LWS_API = "leaderworkerset.x-k8s.io/v1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[APIServer, PodRunner, Any]]:
    with operator_cluster(tmp_path_factory.mktemp("groups")) as running:
        yield running


def service(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": {"name": name, "source": f"/models/{name}"},
        "resources": {"gpus": 2, "nodes": 2},
    }
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def condition(api: APIServer, name: str, kind: str) -> dict[str, Any]:
    obj = api.get(API_VERSION, "InferenceService", NAMESPACE, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def groups(api: APIServer, name: str) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name}"
    return [
        g
        for g in api.list(LWS_API, LWS_KIND, NAMESPACE, label_selector=selector)
        if not g["metadata"].get("deletionTimestamp")
    ]


def group_pods(api: APIServer, group: str) -> list[dict[str, Any]]:
    return api.list("v1", "Pod", NAMESPACE, label_selector=f"{NAME}={group}")


def ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def serving(api: APIServer, name: str) -> list[str]:
    """Names of the Ready pods the Service selects."""
    selector = f"app.kubernetes.io/instance={name},{ROLE_LABEL}=active"
    return sorted(
        p["metadata"]["name"] for p in api.list("v1", "Pod", NAMESPACE, label_selector=selector) if ready(p)
    )


def roles(api: APIServer, name: str) -> dict[str, str]:
    """Each group's role, for groups whose pods are all there and Ready."""
    out = {}
    for g in groups(api, name):
        pods = group_pods(api, g["metadata"]["name"])
        if len(pods) == 2 and all(ready(p) for p in pods):
            out[g["metadata"]["name"]] = g["metadata"]["labels"][ROLE_LABEL]
    return out


def test_groups_wait_for_the_leaderworkerset_api_then_serve_warm_and_active(
    cluster: Any, tmp_path: Path
) -> None:
    api, _, custom = cluster
    custom.create_namespaced_custom_object(
        GROUP, VERSION, NAMESPACE, PLURAL, service("big", replicas={"min": 1, "max": 1}, warmPool={"size": 1})
    )
    stalled = wait_for(
        lambda: condition(api, "big", "Stalled").get("status") == "True" and condition(api, "big", "Stalled")
    )
    assert stalled["reason"] == "LeaderWorkerSetMissing"
    assert (
        "resources.nodes is 2" in stalled["message"] and "leaderworkerset.x-k8s.io/v1" in stalled["message"]
    )
    assert api.list("v1", "Pod", NAMESPACE, label_selector="app.kubernetes.io/instance=big") == []

    api.install_crd(lws_crd())
    with LeaderWorkerSetController(api.write_kubeconfig(tmp_path / "kubeconfig")):
        wait_for(
            lambda: sorted(roles(api, "big").values()) == ["active", "warm"],
            timeout=30,
            what="an active and a warm group",
        )
        assert condition(api, "big", "Stalled")["status"] == "False"
        active = next(g for g, r in roles(api, "big").items() if r == "active")
        # The Service reaches the active group's leader only: no worker, no warm pod.
        assert serving(api, "big") == [f"{active}-0"]
        (lws,) = [g for g in groups(api, "big") if g["metadata"]["name"] == active]
        assert lws["spec"]["replicas"] == 1 and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
        worker = next(p for p in group_pods(api, active) if p["metadata"]["labels"][WORKER_INDEX] == "1")
        assert ROLE_LABEL not in worker["metadata"]["labels"]
        env = {e["name"]: e["value"] for e in worker["spec"]["containers"][0]["env"]}
        assert (
            env["LWS_LEADER_ADDRESS"] == f"{active}-0.{active}.{NAMESPACE}" and env["LWS_WORKER_INDEX"] == "1"
        )
        assert worker["spec"]["hostname"] == f"{active}-0-1" and worker["spec"]["subdomain"] == active
        status = wait_for(
            lambda: (
                (api.get(LWS_API, LWS_KIND, NAMESPACE, active) or {}).get("status", {}).get("readyReplicas")
                == 1
                and api.get(LWS_API, LWS_KIND, NAMESPACE, active)["status"]
            )
        )
        conditions = {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}
        assert conditions["Available"] == ("True", "AllGroupsReady")
        assert conditions.get("Progressing", ("False",))[0] == "False"  # it was True while the group started

        # A worker's engine dies: the group is recreated whole, and the warm group takes over at once.
        (warm,) = [g for g, r in roles(api, "big").items() if r == "warm"]
        old_leader_uid = next(
            p for p in group_pods(api, active) if p["metadata"]["labels"][WORKER_INDEX] == "0"
        )["metadata"]["uid"]
        cluster[1].fail(f"{active}-0-1")
        wait_for(lambda: serving(api, "big") == [f"{warm}-0"], timeout=30, what="the warm group serving")
        wait_for(
            lambda: (
                any(
                    p["metadata"]["uid"] != old_leader_uid
                    for p in group_pods(api, active)
                    if p["metadata"]["labels"][WORKER_INDEX] == "0"
                )
                or active not in [g["metadata"]["name"] for g in groups(api, "big")]
            ),
            what="the failed group recreated or replaced",
        )
        wait_for(
            lambda: sorted(roles(api, "big").values()) == ["active", "warm"],
            timeout=30,
            what="the pool refilled",
        )

        # An engine change rolls group by group.
        before = {g["metadata"]["labels"][HASH_LABEL] for g in groups(api, "big")}
        custom.patch_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, "big", {"spec": {"engine": {"maxNumSeqs": 8}}}
        )
        wait_for(
            lambda: (
                len(roles(api, "big")) == 2
                and not before & {g["metadata"]["labels"][HASH_LABEL] for g in groups(api, "big")}
                and len(serving(api, "big")) == 1
            ),
            timeout=45,
            what="the roll to new groups",
        )
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "big")
        wait_for(
            lambda: (
                not groups(api, "big")
                and not api.list("v1", "Pod", NAMESPACE, label_selector="app.kubernetes.io/instance=big")
            ),
            what="garbage collection",
        )


def test_a_group_that_keeps_crashing_stalls_with_the_leaders_error(cluster: Any, tmp_path: Path) -> None:
    api, _, custom = cluster
    with contextlib.suppress(APIError):  # the first scenario installed it
        api.install_crd(lws_crd())
    broken = service("crashy", replicas={"min": 1, "max": 1})
    broken["spec"]["resources"]["image"] = "broken:1"
    with LeaderWorkerSetController(api.write_kubeconfig(tmp_path / "kubeconfig")):
        custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, broken)
        stalled = wait_for(
            lambda: (
                condition(api, "crashy", "Stalled").get("status") == "True"
                and condition(api, "crashy", "Stalled")
            ),
            what="Stalled",
        )
        assert stalled["reason"] == "PodsCrashLooping"
        # Seen through the group's recreations, or through the leader's own restarts when the kubelet
        # restarts it before the LeaderWorkerSet's Foreground deletion of the group has finished (the
        # owner waits for its workers to go): either way the leader's error.
        message = stalled["message"]
        assert "held back" in message or "CrashLoopBackOff" in message, message
        assert message.endswith("FileNotFoundError: /models/missing/config.json")
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "crashy")
        wait_for(lambda: not groups(api, "crashy"), what="garbage collection")


def lws(api: APIServer, name: str) -> dict[str, Any]:
    return api.get(LWS_API, LWS_KIND, NAMESPACE, name) or {}


def test_a_leaderworkerset_scaled_by_hand_is_put_back_and_its_extra_group_serves_nothing(
    cluster: Any, tmp_path: Path
) -> None:
    api, _, custom = cluster
    with contextlib.suppress(APIError):  # an earlier scenario installed it
        api.install_crd(lws_crd())
    with LeaderWorkerSetController(api.write_kubeconfig(tmp_path / "kubeconfig")):
        custom.create_namespaced_custom_object(
            GROUP, VERSION, NAMESPACE, PLURAL, service("scaled", replicas={"min": 1, "max": 1})
        )
        wait_for(
            lambda: (
                list(roles(api, "scaled").values()) == ["active"]
                and condition(api, "scaled", "Ready").get("status") == "True"
            ),
            timeout=30,
            what="the active group serving",
        )
        (active,) = roles(api, "scaled")
        # `kubectl scale lws <active> --replicas=2`: the set's /scale.
        api.patch(LWS_API, LWS_KIND, NAMESPACE, active, {"spec": {"replicas": 2}}, subresource="scale")
        # Put back, as a Deployment controller resets its ReplicaSet: group 1 goes, group 0 serves on.
        wait_for(
            lambda: (
                lws(api, active)["spec"]["replicas"] == 1
                and {p["metadata"]["name"] for p in group_pods(api, active)}
                == {f"{active}-0", f"{active}-0-1"}
            ),
            timeout=30,
            what=lambda: f"the set back at 1 group: {lws(api, active).get('spec', {}).get('replicas')}",
        )
        assert serving(api, "scaled") == [f"{active}-0"]
        ready = wait_for(
            lambda: (
                (c := condition(api, "scaled", "Ready")).get("status") == "True"
                and condition(api, "scaled", "Reconciling").get("status") == "False"
                and c
            ),
            what="Ready and converged",
        )
        assert ready["message"] == "1/1 active Ready, 0 warm Ready"
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "scaled")
        wait_for(lambda: not groups(api, "scaled"), what="garbage collection")


def test_a_crash_looping_group_is_held_back_with_a_doubling_delay(cluster: Any, tmp_path: Path) -> None:
    api, _, custom = cluster
    with contextlib.suppress(APIError):  # an earlier scenario installed it
        api.install_crd(lws_crd())
    broken = service("loopy", replicas={"min": 1, "max": 1})
    broken["spec"]["resources"]["image"] = "broken:1"
    with LeaderWorkerSetController(api.write_kubeconfig(tmp_path / "kubeconfig")):
        custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, broken)
        wait_for(lambda: condition(api, "loopy", "Stalled").get("status") == "True", what="Stalled")
        (group,) = [g["metadata"]["name"] for g in groups(api, "loopy")]
        # Held back as the kubelet holds back a crash-looping container: the set at 0 groups for 10 s.
        wait_for(
            lambda: lws(api, group)["spec"]["replicas"] == 0 and not group_pods(api, group),
            timeout=10,
            what=lambda: f"the group held at 0: {condition(api, 'loopy', 'Stalled')}",
        )
        held = time.monotonic()
        stalled = condition(api, "loopy", "Stalled")
        assert stalled["reason"] == "PodsCrashLooping"
        assert f"group {group}: " in stalled["message"] and "held back 10 s" in stalled["message"]
        assert stalled["message"].endswith("FileNotFoundError: /models/missing/config.json")
        # A group that was never Ready is not counted warm (the routers, of the same broken image, follow).
        assert condition(api, "loopy", "Ready")["message"].startswith("0/1 active Ready, 0 warm Ready")
        while time.monotonic() - held < 7:
            assert not group_pods(api, group), "the held group was started again before its back-off ended"
            time.sleep(0.2)
        # Then tried again; it crashes again and is held back twice as long. (The try is not waited for as
        # such: here its pods crash as soon as they are made, so the set may be at 1 for a single pass.)
        wait_for(
            lambda: "held back 20 s" in condition(api, "loopy", "Stalled")["message"],
            timeout=25,
            what=lambda: f"held back 20 s: {condition(api, 'loopy', 'Stalled')}",
        )
        assert lws(api, group)["spec"]["replicas"] == 0
        custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "loopy")
        wait_for(lambda: not groups(api, "loopy"), what="garbage collection")
