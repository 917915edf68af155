"""Priority preemption and the operator, on `DevCluster(nodes=2)` with four CPUs a node and three an engine:
an engine pod of a high `spec.pod.priorityClassName` that preempts a batch pod is waiting for the room
being freed, not stalled; and an active engine pod preempted by a pod of a still higher priority is lost as
any pod is: the warm pod is promoted, a replacement is created, and, with no room left for it, the
scheduler's verdict is what the service reports."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from tiny_service import pooled, tiny, tiny_conditions, tiny_engines, tiny_manifest
from waiting import wait_for

from ember_engine.tools.testmodel import make_test_model
from ember_localcluster.devcluster import DevCluster
from ember_localcluster.kubelet.kubelet import ENGINE_IMAGE
from ember_localcluster.kubelet.node import NodeConfig

# A batch job that finishes what it is doing before it stops: it ignores SIGTERM, so its deletion takes
# its whole grace period, as a preempted pod's often does.
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(10**6)"
BATCH_GRACE = 20


def _pod(name: str, cpu: str, priority: str | None, **spec: Any) -> dict[str, Any]:
    container = {
        "name": "main",
        "image": f"{ENGINE_IMAGE}:0.1.0",
        "command": ["python", "-c", STUBBORN],
        "resources": {"requests": {"cpu": cpu}},
    }
    extra = {"priorityClassName": priority} if priority else {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [container], "terminationGracePeriodSeconds": BATCH_GRACE, **extra, **spec},
    }


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def test_a_preempting_engine_waits_and_a_preempted_one_is_replaced(tmp_path: Path) -> None:
    make_test_model(tmp_path / "dev" / "models" / "tiny", size="tiny", force=True)
    nodes = [NodeConfig(name, gpus=0, cpu="4") for name in ("ember-local", "ember-local-2")]
    with DevCluster(tmp_path / "dev", nodes=nodes) as cluster:
        api = cluster.api
        for name, value in (("serving", 1000), ("critical", 2000)):
            api.create(
                {
                    "apiVersion": "scheduling.k8s.io/v1",
                    "kind": "PriorityClass",
                    "metadata": {"name": name},
                    "value": value,
                }
            )
        api.create(_pod("batch", "3", None))
        pod = functools.partial(api.get, "v1", "Pod", "default")
        wait_for(
            lambda: (pod("batch") or {}).get("status", {}).get("phase") == "Running", 60, what="batch running"
        )

        manifest = tiny_manifest()
        manifest["spec"]["resources"]["cpu"] = "3"
        manifest["spec"]["pod"] = {"priorityClassName": "serving"}
        # No wait for capacity: a pod no node can take is at once a problem, so only a pod judged to be on
        # its way may keep the service from Stalled.
        manifest["spec"]["capacityWaitSeconds"] = 0
        api.create(manifest)
        conditions = functools.partial(tiny_conditions, cluster)

        # One engine pod finds a free node; the other preempts the batch pod and waits for it to stop.
        def preempting() -> dict[str, Any] | None:
            for p in api.list("v1", "Pod", "default", label_selector="ember.dev/role"):
                if (p.get("status") or {}).get("nominatedNodeName"):
                    return p
            return None

        waiting = wait_for(preempting, 120, what="an engine pod nominated to the batch pod's node")
        assert waiting["status"]["nominatedNodeName"] == pod("batch")["spec"]["nodeName"]
        assert pod("batch")["metadata"].get("deletionTimestamp")

        def reported() -> dict[str, Any]:
            found = {c["type"]: c for c in (tiny(cluster).get("status") or {}).get("conditions") or []}
            return found

        # While the batch pod takes its grace period to go, the service is making progress, not stalled.
        name = waiting["metadata"]["name"]
        seen: list[tuple[str, str, str]] = []

        def bound() -> bool:
            found = reported()
            stalled, reconciling = found.get("Stalled") or {}, found.get("Reconciling") or {}
            seen.append((stalled.get("status"), stalled.get("reason"), reconciling.get("reason")))
            return bool((pod(name) or {}).get("spec", {}).get("nodeName"))

        wait_for(bound, 120, what=f"{name} bound once the batch pod is gone")
        assert ("True", "PodsUnschedulable") not in {(s, r) for s, r, _ in seen}, seen
        assert "WaitingForPreemption" in {r for _, _, r in seen}, seen

        active, warm = pooled(cluster, 240)
        assert pod("batch") is None
        assert conditions().get("Stalled") == "False"

        # A pod of a still higher priority takes the active pod's node: the active pod is its victim.
        node = active["spec"]["nodeName"]
        api.create(_pod("intruder", "3", "critical", nodeSelector={"kubernetes.io/hostname": node}))
        victim = wait_for(
            lambda: (
                (p := pod(active["metadata"]["name"])) is None
                or _condition(p, "DisruptionTarget").get("reason") == "PreemptionByScheduler"
            ),
            60,
            what="the active pod preempted",
        )
        assert victim

        def failed_over() -> bool:
            actives = tiny_engines(cluster, "active")
            return [p["metadata"]["name"] for p in actives] == [warm["metadata"]["name"]]

        wait_for(failed_over, 60, lambda: tiny_engines(cluster, "active"))
        # The replacement has no room: the intruder holds one node, the promoted pod most of the other, and
        # neither is of lower priority (the router pods there are, but evicting them frees no CPU). The
        # service says so, with the scheduler's words.
        expected = (
            "0/2 nodes are available: 2 Insufficient cpu. no new claims to deallocate, preemption: 0/2 nodes "
            "are available: 2 Insufficient cpu."
        )
        wait_for(
            lambda: reported().get("Stalled", {}).get("reason") == "PodsUnschedulable",
            90,
            reported,
        )
        found = reported()
        assert expected in found["Stalled"]["message"], found
        assert found["Ready"]["status"] == "True", found
        assert found["WarmPoolReady"]["status"] == "False", found
