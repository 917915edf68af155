"""A node lost as a power cut loses it, on `DevCluster(nodes=2)` with short lease and grace periods: the
kubelet's node Leases, the node lifecycle controller (conditions Unknown, unreachable taints, pods not
Ready), DefaultTolerationSeconds and the taint eviction controller, then the node coming back."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kubernetes import client, config
from waiting import wait_for

from ember_localcluster.devcluster import DevCluster
from ember_localcluster.kubelet.kubelet import ENGINE_IMAGE

WEB_SERVER = ["python", "-m", "http.server", "--bind", "0.0.0.0", "8080"]
FAST = {"node_lease_seconds": 2, "node_monitor_period": 0.5, "node_monitor_grace_period": 3.0}


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
