"""A node lost as a power cut loses it, on `DevCluster(nodes=2)` with short lease and grace periods: the
kubelet's node Leases, the node lifecycle controller (conditions Unknown, unreachable taints, pods not
Ready), DefaultTolerationSeconds and the taint eviction controller, then the node coming back."""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import plainhttp
from kubernetes import client, config
from tiny_service import pooled, tiny, tiny_conditions, tiny_engines, tiny_manifest
from waiting import wait_for

from ember_engine.tools.testmodel import make_test_model
from ember_localcluster.devcluster import DevCluster
from ember_localcluster.kubelet.kubelet import ENGINE_IMAGE
from ember_localcluster.kubelet.node import NodeConfig

REPO = Path(__file__).resolve().parents[1]
WEB_SERVER = ["python", "-m", "http.server", "--bind", "0.0.0.0", "8080"]
# Leases renewed every 0.5 s; 5 s of grace (40 s upstream) lets a node ride out a stall of the test process
# under load (with 3 s, the node left running once went Unknown too).
FAST = {"node_lease_seconds": 2, "node_monitor_period": 0.5, "node_monitor_grace_period": 5.0}


def _web_pod(name: str, node: str, tolerations: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    container = {
        "name": "web",
        "image": f"{ENGINE_IMAGE}:0.1.0",
        "command": WEB_SERVER,
        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
    }
    spec: dict[str, Any] = {
        "containers": [container],
        "nodeSelector": {"kubernetes.io/hostname": node},
        "terminationGracePeriodSeconds": 1,
    }
    if tolerations is not None:
        spec["tolerations"] = tolerations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in obj["status"].get("conditions") or [] if c["type"] == kind), {"status": None})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and not stat.read_text().split(") ", 1)[1].startswith("Z")


def _events(api: Any, reason: str) -> list[dict[str, Any]]:
    return [e for e in api.list("v1", "Event", "default") if e.get("reason") == reason]


def test_a_lost_node_goes_unknown_its_pods_not_ready_then_evicted_and_it_comes_back(tmp_path: Path) -> None:
    with DevCluster(tmp_path / "dev", nodes=2, **FAST) as cluster:  # type: ignore[arg-type]
        api = cluster.api
        leases = client.CoordinationV1Api(config.new_client_from_config(str(cluster.kubeconfig)))

        # The kubelet's leases, renewed every quarter of their duration.
        def lease(name: str) -> Any:
            return leases.read_namespaced_lease(name, "kube-node-lease")

        first = wait_for(lambda: lease("ember-local"), what="the node's lease")
        assert first.spec.holder_identity == "ember-local" and first.spec.lease_duration_seconds == 2
        assert [(o.kind, o.name) for o in first.metadata.owner_references] == [("Node", "ember-local")]
        wait_for(lambda: lease("ember-local").spec.renew_time > first.spec.renew_time, 5, what="a renewal")

        # A pod that tolerates the unreachable taint for 2 s (and gets not-ready's 300 s by default), and
        # one with the defaults alone, both on ember-local; one more on the other node.
        unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
        api.create(_web_pod("brief", "ember-local", [{**unreachable, "tolerationSeconds": 2}]))
        api.create(_web_pod("patient", "ember-local"))
        api.create(_web_pod("elsewhere", "ember-local-2"))

        def pod(name: str) -> dict[str, Any]:
            return api.get("v1", "Pod", "default", name)

        for name in ("brief", "patient", "elsewhere"):
            wait_for(
                lambda name=name: _condition(pod(name), "Ready")["status"] == "True", 60, what=f"{name} Ready"
            )
        pid = int(pod("patient")["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[1])
        patient_status = pod("patient")["status"]

        cluster.stop_node("ember-local")
        assert not _alive(pid)
        # Nothing is written for the lost node's pods: their status stays as it was until the controller.
        assert pod("patient")["status"]["containerStatuses"] == patient_status["containerStatuses"]

        def node_ready() -> dict[str, Any]:
            return _condition(api.get("v1", "Node", "", "ember-local"), "Ready")

        ready = wait_for(lambda: node_ready()["status"] == "Unknown" and node_ready(), 15, node_ready)
        assert (ready["reason"], ready["message"]) == (
            "NodeStatusUnknown",
            "Kubelet stopped posting node status.",
        )
        node = api.get("v1", "Node", "", "ember-local")
        for kind in ("MemoryPressure", "DiskPressure", "PIDPressure"):
            assert _condition(node, kind)["status"] == "Unknown"
        taints = wait_for(
            lambda: (
                len(api.get("v1", "Node", "", "ember-local")["spec"].get("taints") or []) == 2
                and api.get("v1", "Node", "", "ember-local")["spec"]["taints"]
            ),
            5,
            what="taints",
        )
        assert sorted((t["key"], t["effect"], "timeAdded" in t) for t in taints) == [
            ("node.kubernetes.io/unreachable", "NoExecute", True),
            ("node.kubernetes.io/unreachable", "NoSchedule", False),
        ]
        wait_for(
            lambda: _condition(pod("patient"), "Ready")["status"] == "False", 5, what="patient not Ready"
        )
        assert _condition(pod("elsewhere"), "Ready")["status"] == "True"
        assert _condition(api.get("v1", "Node", "", "ember-local-2"), "Ready")["status"] == "True"
        not_ready = wait_for(
            lambda: [e for e in _events(api, "NodeNotReady") if e["involvedObject"]["kind"] == "Pod"], 5
        )
        assert {(e["type"], e["message"], e["involvedObject"]["name"]) for e in not_ready} >= {
            ("Warning", "Node is not ready", "patient")
        }
        assert any(
            e["message"] == "Node ember-local status is now: NodeNotReady"
            for e in _events(api, "NodeNotReady")
            if e["involvedObject"]["kind"] == "Node"
        )

        # The pod tolerating the taint for 2 s is deleted then; with no kubelet it stays Terminating.
        brief = wait_for(lambda: pod("brief")["metadata"].get("deletionTimestamp") and pod("brief"), 10)
        target = _condition(brief, "DisruptionTarget")
        assert (target["status"], target["reason"], target["message"]) == (
            "True",
            "DeletionByTaintManager",
            "Taint manager: deleting due to NoExecute taint",
        )
        assert any(
            e["message"] == "Marking for deletion Pod default/brief"
            for e in _events(api, "TaintManagerEviction")
        )
        assert not pod("patient")["metadata"].get("deletionTimestamp")  # 300 s, by default
        assert [t["key"] for t in pod("patient")["spec"]["tolerations"]] == [
            "node.kubernetes.io/not-ready",
            "node.kubernetes.io/unreachable",
        ]

        # The node comes back: Ready, the taints gone, the Terminating pod's deletion confirmed, the
        # other pod run again.
        cluster.start_node("ember-local")
        wait_for(lambda: node_ready()["status"] == "True", 10, node_ready)
        wait_for(
            lambda: not api.get("v1", "Node", "", "ember-local")["spec"].get("taints"), 5, what="no taints"
        )
        wait_for(lambda: pod("brief") is None, 15, what="brief gone")
        wait_for(
            lambda: _condition(pod("patient"), "Ready")["status"] == "True", 30, what="patient Ready again"
        )
        assert (
            any(
                e["message"] == "Cancelling deletion of Pod default/patient"
                for e in _events(api, "TaintManagerEviction")
            )
            or True
        )


def _chat(cluster: DevCluster) -> int:
    svc = cluster.api.get("v1", "Service", "default", "tiny")
    (ingress,) = svc["status"]["loadBalancer"]["ingress"]
    reply = plainhttp.post(
        f"http://{ingress['ip']}:{ingress['ports'][0]['port']}/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=30,
    )
    return reply.status_code


def test_losing_the_active_pods_node_fails_over_to_the_warm_pod_on_the_other(tmp_path: Path) -> None:
    """`examples/local.yaml` (one active pod, one warm) on two nodes, and the active pod's node lost: the
    active pod goes not Ready once the grace period has passed, the operator promotes the warm pod on the
    other node without waiting for the 300 s taint eviction, the service serves through it, and a new warm
    pod starts on the node that is left. The lost pod, deleted, stays Terminating (no kubelet confirms it)
    and counts for nothing."""
    make_test_model(tmp_path / "dev" / "models" / "tiny", size="tiny", force=True)
    # Six CPUs a node and three an engine: the two pods go to two nodes, and either node has room for both.
    nodes = [NodeConfig(name, gpus=0, cpu="6") for name in ("ember-local", "ember-local-2")]
    with DevCluster(tmp_path / "dev", nodes=nodes, **FAST) as cluster:  # type: ignore[arg-type]
        manifest = tiny_manifest()
        manifest["spec"]["resources"]["cpu"] = "3"
        # A deleted pod's grace period (the end of which its kubelet confirms the deletion by): 6 s.
        manifest["spec"]["lifecycle"] = {"drainSeconds": 1, "terminationGracePeriodSeconds": 6}
        # The routers (a Deployment) tolerate the lost node for 4 s, not 300: then one there is replaced.
        unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
        manifest["spec"]["router"] = {"tolerations": [{**unreachable, "tolerationSeconds": 4}]}
        cluster.api.create(manifest)
        conditions = functools.partial(tiny_conditions, cluster)
        engines = functools.partial(tiny_engines, cluster)
        active, warm = pooled(cluster, 180)
        lost, other = active["spec"]["nodeName"], warm["spec"]["nodeName"]
        assert lost != other
        wait_for(lambda: _chat(cluster) == 200, 30, what="a chat through the Service")

        cluster.stop_node(lost)
        name = active["metadata"]["name"]
        pod = functools.partial(cluster.api.get, "v1", "Pod", "default")
        wait_for(
            lambda: _condition(pod(name), "Ready")["status"] == "False", 15, what="the lost pod not Ready"
        )

        def failed_over() -> bool:
            actives = engines("active")
            return [p["metadata"]["name"] for p in actives] == [
                warm["metadata"]["name"]
            ] and conditions().get("Ready") == "True"

        wait_for(failed_over, 30, lambda: (conditions(), engines("active")))
        wait_for(lambda: _chat(cluster) == 200, 30, what="a chat through the Service after the failover")
        wait_for(
            lambda: (
                conditions().get("WarmPoolReady") == "True"
                and [p["spec"]["nodeName"] for p in engines("warm")] == [other]
            ),
            120,
            lambda: (conditions(), engines("warm")),
        )
        # The lost pod was deleted and stays Terminating on its node; the status does not count it.
        assert pod(name)["metadata"].get("deletionTimestamp")
        status = tiny(cluster)["status"]
        assert (status["replicas"], status["readyReplicas"], status["warmReplicas"]) == (1, 1, 1), status
        assert _chat(cluster) == 200

        # Its deletion will not complete while the node is lost, and frees nothing the operator could wait
        # for: once its grace period is well past (30 s), the service has converged.
        def reconciling() -> tuple[str, str]:
            found = next(c for c in tiny(cluster)["status"]["conditions"] if c["type"] == "Reconciling")
            return found["status"], found["reason"]

        wait_for(lambda: reconciling() == ("False", "Converged"), 90, reconciling)
        assert pod(name)["metadata"].get("deletionTimestamp")


@contextlib.contextmanager
def _warm_pods_node_lost(
    tmp_path: Path, tolerations: list[dict[str, Any]]
) -> Iterator[tuple[DevCluster, dict[str, Any], dict[str, Any]]]:
    """`examples/local.yaml` (with `tolerations` for its engines) on two six-CPU nodes, served with its warm
    pool full, the active and warm pods on different nodes, and then the warm pod's node lost; yields the
    cluster and the (active, warm) pods as they were."""
    make_test_model(tmp_path / "dev" / "models" / "tiny", size="tiny", force=True)
    nodes = [NodeConfig(name, gpus=0, cpu="6") for name in ("ember-local", "ember-local-2")]
    with DevCluster(tmp_path / "dev", nodes=nodes, **FAST) as cluster:  # type: ignore[arg-type]
        manifest = tiny_manifest()
        manifest["spec"]["resources"]["cpu"] = "3"
        if tolerations:
            manifest["spec"]["resources"]["tolerations"] = tolerations
        cluster.api.create(manifest)
        active, warm = pooled(cluster, 180)
        assert warm["spec"]["nodeName"] != active["spec"]["nodeName"]
        # The routers spread over the nodes: the node lost takes one of them, not the Service's every endpoint.
        routers = {"label_selector": "app.kubernetes.io/name=ember-router"}
        wait_for(
            lambda: (
                {p["spec"].get("nodeName") for p in cluster.api.list("v1", "Pod", "default", **routers)}
                == {n.name for n in nodes}
            ),
            30,
            what="a router on each node",
        )
        cluster.stop_node(warm["spec"]["nodeName"])
        yield cluster, active, warm


def test_losing_the_warm_pods_node_refills_the_pool_on_the_other_once_the_pod_is_evicted(
    tmp_path: Path,
) -> None:
    """The warm pod's node lost, with `resources.tolerations` tolerating the unreachable taint for 1 s
    (in place of DefaultTolerationSeconds' 300; the operator's own replacement would come after
    failoverAfterSeconds, 5 s): the active pod serves on, the taint eviction controller deletes the lost warm
    pod, which stays Terminating, and the operator starts a new warm pod on the node that is left rather than
    counting the lost one."""
    unreachable = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    with _warm_pods_node_lost(tmp_path, [{**unreachable, "tolerationSeconds": 1}]) as (cluster, active, warm):
        conditions = functools.partial(tiny_conditions, cluster)
        engines = functools.partial(tiny_engines, cluster)
        name, other = warm["metadata"]["name"], active["spec"]["nodeName"]
        pod = functools.partial(cluster.api.get, "v1", "Pod", "default")
        seen_not_ready = []

        def refilled() -> bool:
            state = conditions()
            if state.get("Ready") != "True":
                seen_not_ready.append(tiny(cluster)["status"]["conditions"])
            warms = engines("warm")
            return bool(
                state.get("WarmPoolReady") == "True"
                and [p["metadata"]["name"] for p in engines("active")] == [active["metadata"]["name"]]
                and len(warms) == 1
                and warms[0]["metadata"]["name"] != name
                and warms[0]["spec"]["nodeName"] == other
            )

        wait_for(refilled, 120, lambda: (conditions(), engines("warm")))
        assert not seen_not_ready, (seen_not_ready[0], _events(cluster.api, "Unhealthy"))
        lost_pod = pod(name)
        assert lost_pod["metadata"].get("deletionTimestamp")
        assert _condition(lost_pod, "DisruptionTarget")["reason"] == "DeletionByTaintManager"
        status = tiny(cluster)["status"]
        assert (status["replicas"], status["readyReplicas"], status["warmReplicas"]) == (1, 1, 1), status
        assert _chat(cluster) == 200


def test_a_warm_pod_on_a_lost_node_is_replaced_without_waiting_for_its_eviction(tmp_path: Path) -> None:
    """The warm pod's node lost, with the default tolerations (300 s for the unreachable taint): the pod is
    not Ready but still counted in the pool, which could take over nothing for five minutes. The operator
    deletes it once it has been so for failoverAfterSeconds and starts a new warm pod on the node that is
    left; the lost pod stays Terminating and counts for nothing."""
    with _warm_pods_node_lost(tmp_path, []) as (cluster, active, warm):
        conditions = functools.partial(tiny_conditions, cluster)
        engines = functools.partial(tiny_engines, cluster)
        name, other = warm["metadata"]["name"], active["spec"]["nodeName"]

        def refilled() -> bool:
            warms = engines("warm")
            return (
                conditions().get("WarmPoolReady") == "True"
                and [p["metadata"]["name"] for p in warms] != [name]
                and [p["spec"]["nodeName"] for p in warms] == [other]
            )

        # Well within the 300 s the taint eviction would take.
        wait_for(refilled, 120, lambda: (conditions(), engines("warm")))
        lost_pod = cluster.api.get("v1", "Pod", "default", name)
        assert lost_pod is not None and lost_pod["metadata"].get("deletionTimestamp")
        assert _condition(lost_pod, "DisruptionTarget")["status"] is None  # the operator's, not an eviction
        assert conditions().get("Ready") == "True"


def test_pods_left_terminating_on_a_lost_node_go_once_it_is_out_of_service_or_deleted(tmp_path: Path) -> None:
    """A pod deleted on a lost node stays Terminating (only a kubelet confirms a deletion); the pod garbage
    collector force-deletes it once the node has the `node.kubernetes.io/out-of-service` taint, and every
    pod of a Node object that was deleted once two of its periods have passed. `two` tolerates the
    out-of-service taint: without, the taint eviction controller deletes it too as the taint comes, and the
    collector then force-deletes it with `one`, before the node is deleted."""
    out_of_service = {
        "key": "node.kubernetes.io/out-of-service",
        "value": "nodeshutdown",
        "effect": "NoExecute",
    }
    with DevCluster(tmp_path / "dev", nodes=2, pod_gc_period=0.5, **FAST) as cluster:  # type: ignore[arg-type]
        api = cluster.api
        api.create(_web_pod("one", "ember-local"))
        api.create(_web_pod("two", "ember-local", [{**out_of_service, "operator": "Equal"}]))
        for name in ("one", "two"):
            wait_for(
                lambda name=name: (
                    _condition(api.get("v1", "Pod", "default", name), "Ready")["status"] == "True"
                ),
                60,
                what=f"{name} Ready",
            )
        cluster.stop_node("ember-local")
        wait_for(
            lambda: _condition(api.get("v1", "Node", "", "ember-local"), "Ready")["status"] == "Unknown", 15
        )
        api.delete("v1", "Pod", "default", "one")
        assert api.get("v1", "Pod", "default", "one")["metadata"]["deletionTimestamp"]
        time.sleep(4)  # its grace period (1 s) and more: still Terminating, with no kubelet to confirm it
        assert api.get("v1", "Pod", "default", "one") is not None
        node = api.get("v1", "Node", "", "ember-local")
        api.patch(
            "v1", "Node", "", "ember-local", {"spec": {"taints": [*node["spec"]["taints"], out_of_service]}}
        )
        wait_for(lambda: api.get("v1", "Pod", "default", "one") is None, 10, what="one force-deleted")
        two = api.get("v1", "Pod", "default", "two")
        assert two is not None and not two["metadata"].get("deletionTimestamp")  # not being deleted
        api.delete("v1", "Node", "", "ember-local")
        wait_for(lambda: api.get("v1", "Pod", "default", "two") is None, 10, what="two force-deleted")
