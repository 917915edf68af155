"""The local control plane's node lifecycle controller: nodes whose kubelet stopped are marked so.

As kube-controller-manager's node lifecycle controller (pkg/controller/nodelifecycle) with taint-based
eviction on, its defaults and its wording. Every `monitor_period` (`--node-monitor-period`, 5 s) it
lists the nodes, their Leases in `kube-node-lease` and the pods, and for each node (`monitorNodeHealth`):

* its last probe is when this controller last saw the node's Lease `renewTime` or its Ready condition's
  `lastHeartbeatTime` change (the controller's own clock, as upstream's `probeTimestamp`; a node first
  seen counts as probed then);
* once that is older than `grace_period` (`--node-monitor-grace-period`, 40 s), `tryUpdateNodeHealth`:
  the conditions Ready, MemoryPressure, DiskPressure and PIDPressure become `Unknown` with reason
  `NodeStatusUnknown` and message `Kubelet stopped posting node status.` (a missing one is added with
  `NodeStatusNeverUpdated`, `Kubelet never posted node status.`), their heartbeat kept;
* when Ready leaves True, a Normal Event `NodeNotReady` (`Node NAME status is now: NodeNotReady`) about
  the node, and `MarkPodsNotReady`: each pod on it gets its Ready condition `False` (reason and message
  kept, `lastTransitionTime` now) and a Warning Event `NodeNotReady`, `Node is not ready`; pods later
  found on a node that is not Ready are marked the same way;
* the taints (`doNoScheduleTaintingPass`, `doNoExecuteTaintingPass`): Ready `Unknown` puts
  `node.kubernetes.io/unreachable` on the node as NoSchedule and as NoExecute (with `timeAdded`, written
  only for NoExecute taints), Ready `False` puts `node.kubernetes.io/not-ready` the same way, and Ready
  `True` removes both. The taint eviction controller acts on the NoExecute ones
  (`tainteviction_controller.py`).

A node comes back when its kubelet posts Ready again (`ProcessKubelet.start_node`); the taints then go.
Not modelled: the pressure and `unschedulable` NoSchedule taints (the scheduler reads cordons itself),
zones and their disruption states (eviction rate limits, `--unhealthy-zone-threshold`).
Polling stands in for informers: the controller acts within `monitor_period`, as upstream's does.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Self

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ember_localcluster.events import pod_event

__all__ = ["NodeLifecycleController", "PollingController"]

log = logging.getLogger("ember.nodelifecycle")

LEASE_NAMESPACE = "kube-node-lease"
MONITOR_PERIOD = 5.0  # --node-monitor-period
GRACE_PERIOD = 40.0  # --node-monitor-grace-period
UNREACHABLE = "node.kubernetes.io/unreachable"
NOT_READY = "node.kubernetes.io/not-ready"
CONDITIONS = ("Ready", "MemoryPressure", "DiskPressure", "PIDPressure")
MERGE_PATCH = "application/merge-patch+json"
STAMP = "%Y-%m-%dT%H:%M:%SZ"


def stamp() -> str:
    return datetime.now(UTC).strftime(STAMP)


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return dict(c)
    return None


class PollingController:
    """A controller that runs `_pass()` every `period` seconds on a thread of its own (`ember-<name>`),
    with the official client; a pass that fails is logged and the next one tries again."""

    def __init__(self, kubeconfig: str | Path, name: str, period: float) -> None:
        self.kubeconfig, self.name, self.period = Path(kubeconfig), name, period
        self.core: Any = None
        self._api_client: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Self:
        self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        self.core = client.CoreV1Api(self._api_client)
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name=f"ember-{self.name}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._api_client is not None:
            self._api_client.close()
        self._thread = self._api_client = None

    def call(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The decoded JSON of a call through the official client (dicts sent as they are)."""
        response = method(*args, _preload_content=False, _request_timeout=10, **kwargs)
        return json.loads(response.data or b"null")

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._pass()
            except Exception:
                log.warning("%s: pass failed", self.name, exc_info=True)
            self._stop.wait(self.period)

    def _pass(self) -> None:
        raise NotImplementedError

    def event(self, body: dict[str, Any]) -> None:
        try:
            self.call(self.core.create_namespaced_event, body["metadata"]["namespace"], body)
        except ApiException as error:
            log.debug("%s: event not recorded: %s", self.name, error)


class NodeLifecycleController(PollingController):
    def __init__(
        self,
        kubeconfig: str | Path,
        *,
        monitor_period: float = MONITOR_PERIOD,
        grace_period: float = GRACE_PERIOD,
    ) -> None:
        super().__init__(kubeconfig, "nodelifecycle", monitor_period)
        self.grace_period = grace_period
        self._probed: dict[str, tuple[float, Any, Any]] = {}  # node → (when, heartbeat, renewTime)

    def _pass(self) -> None:
        leases = client.CoordinationV1Api(self._api_client)
        nodes = self.call(self.core.list_node)["items"]
        renewed = {
            lease["metadata"]["name"]: (lease.get("spec") or {}).get("renewTime")
            for lease in self.call(leases.list_namespaced_lease, LEASE_NAMESPACE)["items"]
        }
        pods = self.call(self.core.list_pod_for_all_namespaces)["items"]
        now = time.monotonic()
        names = {n["metadata"]["name"] for n in nodes}
        self._probed = {k: v for k, v in self._probed.items() if k in names}
        for node in nodes:
            name = node["metadata"]["name"]
            ready = condition(node, "Ready") or {}
            seen = (ready.get("lastHeartbeatTime"), renewed.get(name))
            last = self._probed.get(name)
            if last is None or (last[1], last[2]) != seen:
                self._probed[name] = (now, *seen)
            was = ready.get("status")
            if now - self._probed[name][0] > self.grace_period:
                node = self._unknown(node)
            status = (condition(node, "Ready") or {}).get("status")
            if was == "True" and status != "True":
                self._node_event(node, "NodeNotReady")
            if status != "True":
                for pod in pods:
                    if (pod.get("spec") or {}).get("nodeName") == name:
                        self._mark_not_ready(pod)
            self._taint(node, status)

    def _unknown(self, node: dict[str, Any]) -> dict[str, Any]:
        """`tryUpdateNodeHealth` for a node past its grace period: its conditions Unknown."""
        conditions = list((node.get("status") or {}).get("conditions") or [])
        now, changed = stamp(), False
        for kind in CONDITIONS:
            current = next((c for c in conditions if c.get("type") == kind), None)
            if current is None:
                conditions.append(
                    {
                        "type": kind,
                        "status": "Unknown",
                        "reason": "NodeStatusNeverUpdated",
                        "message": "Kubelet never posted node status.",
                        "lastHeartbeatTime": node["metadata"].get("creationTimestamp"),
                        "lastTransitionTime": now,
                    }
                )
                changed = True
            elif current.get("status") != "Unknown":
                current.update(
                    status="Unknown",
                    reason="NodeStatusUnknown",
                    message="Kubelet stopped posting node status.",
                    lastTransitionTime=now,
                )
                changed = True
        if not changed:
            return node
        patch = {"metadata": {"resourceVersion": node["metadata"]["resourceVersion"]}}
        patch["status"] = {"conditions": conditions}
        name = node["metadata"]["name"]
        log.info("node %s: kubelet stopped posting node status; conditions Unknown", name)
        return dict(self.call(self.core.patch_node_status, name, patch, _content_type=MERGE_PATCH))

    def _node_event(self, node: dict[str, Any], status: str) -> None:
        """`RecordNodeStatusChange`."""
        meta, now = node["metadata"], stamp()
        self.event(
            {
                "metadata": {"name": f"{meta['name']}.{uuid.uuid4().hex[:16]}", "namespace": "default"},
                "involvedObject": {"kind": "Node", "name": meta["name"], "uid": meta["uid"]},
                "reason": status,
                "message": f"Node {meta['name']} status is now: {status}",
                "type": "Normal",
                "source": {"component": "node-controller"},
                "reportingComponent": "node-controller",
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )

    def _mark_not_ready(self, pod: dict[str, Any]) -> None:
        """`MarkPodsNotReady` for one pod: its Ready condition False, then the Warning Event."""
        conditions = list((pod.get("status") or {}).get("conditions") or [])
        for i, c in enumerate(conditions):
            if c.get("type") != "Ready" or c.get("status") == "False":
                continue
            conditions[i] = {**c, "status": "False", "lastTransitionTime": stamp()}
            meta = pod["metadata"]
            patch = {
                "metadata": {"resourceVersion": meta["resourceVersion"]},
                "status": {"conditions": conditions},
            }
            try:
                self.call(
                    self.core.patch_namespaced_pod_status,
                    meta["name"],
                    meta["namespace"],
                    patch,
                    _content_type=MERGE_PATCH,
                )
            except ApiException as error:  # gone, or changed: the next pass sees it again
                log.debug("pod %s/%s not marked: %s", meta["namespace"], meta["name"], error)
                return
            event = pod_event(pod, "Warning", "NodeNotReady", "Node is not ready", "node-controller", "")
            with_event = self._api_client.sanitize_for_serialization(event)
            self.event(with_event)
            return

    def _taint(self, node: dict[str, Any], ready: str | None) -> None:
        want = {"Unknown": UNREACHABLE, "False": NOT_READY}.get(ready or "")
        taints = list((node.get("spec") or {}).get("taints") or [])
        kept = [t for t in taints if t.get("key") not in (UNREACHABLE, NOT_READY) or t.get("key") == want]
        if want is not None:
            for effect in ("NoSchedule", "NoExecute"):
                if not any(t.get("key") == want and t.get("effect") == effect for t in kept):
                    taint = {"key": want, "effect": effect}
                    if effect == "NoExecute":
                        taint["timeAdded"] = stamp()
                    kept.append(taint)
        if kept == taints:
            return
        meta = node["metadata"]
        patch = {"metadata": {"resourceVersion": meta["resourceVersion"]}, "spec": {"taints": kept}}
        try:
            self.call(self.core.patch_node, meta["name"], patch, _content_type=MERGE_PATCH)
        except ApiException as error:  # changed meanwhile: the next pass tries again
            log.debug("node %s: taints not updated: %s", meta["name"], error)
