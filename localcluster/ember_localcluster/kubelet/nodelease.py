"""The kubelet's node Leases (pkg/kubelet/nodelease), and a node lost as a power cut loses it.

**Leases.** For each of its nodes the kubelet keeps a `coordination.k8s.io/v1` Lease in the namespace
`kube-node-lease`, named after the node and owned by it: `spec.holderIdentity` the node's name,
`leaseDurationSeconds` 40 (`--node-lease-duration-seconds`'s default, `lease_seconds` here) and
`renewTime` renewed every quarter of that (`nodeLeaseRenewIntervalFraction` 0.25: every 10 s). The node
lifecycle controller reads these as the nodes' heartbeats (`nodelifecycle_controller.py`). Lease and node
status updates go out on a thread of their own (`ProcessKubelet.heartbeat`), as the kubelet sends them
through its own HeartbeatClient: a burst of pod status patches and Events never holds a heartbeat back.

**Losing a node.** `ProcessKubelet.stop_node(name)` is the node losing power: its lease is no longer
renewed, its pods' processes are killed at once (SIGKILL, no preStop, no grace) and nothing more is
written to the API server for them (no status, no events, no confirmed deletion); pods bound to it later
are not started. `start_node(name)` is the node coming back: its status is posted again (Ready), its
lease renewed, and the pods bound to it are taken up again as a restarted kubelet takes them up (run
again, or their deletion confirmed when they were deleted meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

if TYPE_CHECKING:
    from ember_localcluster.kubelet.kubelet import ProcessKubelet

log = logging.getLogger("ember.kubelet")

LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_SECONDS = 40  # the kubelet's --node-lease-duration-seconds
RENEW_INTERVAL_FRACTION = 0.25  # nodeLeaseRenewIntervalFraction


def micro_time(now: datetime | None = None) -> str:
    """metav1.MicroTime as it is serialized."""
    return (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def lease_manifest(node: dict[str, Any], duration: int) -> dict[str, Any]:
    """The Lease the kubelet creates for `node` (its object, for the owner reference)."""
    meta = node["metadata"]
    owner = {"apiVersion": "v1", "kind": "Node", "name": meta["name"], "uid": meta["uid"]}
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": meta["name"], "namespace": LEASE_NAMESPACE, "ownerReferences": [owner]},
        "spec": {"holderIdentity": meta["name"], "leaseDurationSeconds": duration, "renewTime": micro_time()},
    }


async def renew_lease(kubelet: ProcessKubelet, name: str) -> None:
    """Create the node's Lease, or renew its `renewTime`. The renewal loop and a node coming back both
    renew; one at a time, or the later of two replaces made from one read would meet 409 Conflict."""
    async with kubelet.lease_locks[name]:
        await _renew(kubelet, name)


async def _renew(kubelet: ProcessKubelet, name: str) -> None:
    leases = client.CoordinationV1Api(kubelet.core.api_client)
    duration = kubelet.lease_seconds
    try:
        lease = await kubelet.heartbeat(leases.read_namespaced_lease, name, LEASE_NAMESPACE)
    except ApiException as error:
        if error.status != 404:
            raise
        node = await kubelet.heartbeat(kubelet.core.read_node, name)
        await kubelet.heartbeat(
            leases.create_namespaced_lease, LEASE_NAMESPACE, lease_manifest(node, duration)
        )
        return
    lease["spec"] = {**lease.get("spec", {}), "holderIdentity": name, "leaseDurationSeconds": duration}
    lease["spec"]["renewTime"] = micro_time()
    await kubelet.heartbeat(leases.replace_namespaced_lease, name, LEASE_NAMESPACE, lease)


async def renew_leases(kubelet: ProcessKubelet) -> None:
    """Renew every node's lease but the lost ones', every quarter of the lease's duration, until cancelled."""
    while True:
        for name in kubelet.nodes:
            if name in kubelet.lost:
                continue
            try:
                await renew_lease(kubelet, name)
            except Exception as error:  # the next renewal tries again, as the kubelet's does
                log.warning("node %s: lease renewal failed: %s", name, error)
        await asyncio.sleep(kubelet.lease_seconds * RENEW_INTERVAL_FRACTION)


async def lose(kubelet: ProcessKubelet, name: str) -> None:
    """The node's pods' processes killed at once, their workers gone without a word to the API server."""
    kubelet.lost.add(name)
    workers = [w for w in list(kubelet._workers.values()) if w.node_name == name]
    for worker in workers:
        worker.lost = True
        if worker.task is not None:
            worker.task.cancel()  # its teardown SIGKILLs the containers' process groups
    tasks = [w.task for w in workers if w.task is not None]
    await asyncio.gather(*tasks, return_exceptions=True)


async def come_back(kubelet: ProcessKubelet, name: str) -> None:
    """The node's status posted again, its lease renewed, and its pods taken up again."""
    kubelet.lost.discard(name)
    await kubelet.post_node_status(name)
    await renew_lease(kubelet, name)
    pods = await kubelet.api(kubelet.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={name}")
    for pod in pods.get("items") or []:
        kubelet._on_pod("MODIFIED", pod)
