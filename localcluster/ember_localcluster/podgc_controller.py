"""The local control plane's pod garbage collector, for the pods of nodes that are gone or out of service.

As kube-controller-manager's pod GC controller (pkg/controller/podgc), every `period` (`gcCheckPeriod`,
20 s), two of its passes:

* `gcOrphaned`: a pod bound to a node that no longer exists, still missing after a quarantine of two
  periods (`quarantineTime`, 40 s: a node just created may not be seen yet), is marked `Failed` (when it
  had not ended) with the `DisruptionTarget` condition (reason `DeletionByPodGC`, message `PodGC: node no
  longer exists`) and force-deleted (grace period 0);
* `gcTerminating`: a pod being deleted on a node that is not Ready and has the
  `node.kubernetes.io/out-of-service` taint is marked `Failed` and force-deleted.

So a pod left Terminating on a lost node goes once the Node object is deleted (`kubectl delete node`) or
tainted out of service. Not modelled: `gcTerminated` (the `--terminated-pod-gc-threshold`) and
`gcUnscheduledTerminating`.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from ember_localcluster.nodelifecycle_controller import MERGE_PATCH, PollingController, condition, stamp

__all__ = ["PodGCController"]

log = logging.getLogger("ember.podgc")

GC_CHECK_PERIOD = 20.0
OUT_OF_SERVICE = "node.kubernetes.io/out-of-service"


class PodGCController(PollingController):
    def __init__(self, kubeconfig: str | Path, *, period: float = GC_CHECK_PERIOD) -> None:
        super().__init__(kubeconfig, "podgc", period)
        self.quarantine = 2 * period
        self._missing: dict[str, float] = {}  # node name → when first found missing

    def _pass(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.call(self.core.list_node)["items"]}
        now, missing = time.monotonic(), {}
        for pod in self.call(self.core.list_pod_for_all_namespaces)["items"]:
            name = (pod.get("spec") or {}).get("nodeName")
            if not name:
                continue
            node = nodes.get(name)
            if node is None:
                missing[name] = since = self._missing.get(name, now)
                if now - since >= self.quarantine:
                    self._delete(pod, "PodGC: node no longer exists")
            elif pod["metadata"].get("deletionTimestamp") and _out_of_service(node):
                self._delete(pod, None)
        self._missing = missing

    def _delete(self, pod: dict[str, Any], reason: str | None) -> None:
        """`markFailedAndDeletePodWithCondition`."""
        meta, status = pod["metadata"], pod.get("status") or {}
        name, namespace = meta["name"], meta["namespace"]
        patch: dict[str, Any] = {}
        if status.get("phase") not in ("Succeeded", "Failed"):
            patch["phase"] = "Failed"
        if reason is not None:
            conditions = [c for c in status.get("conditions") or [] if c.get("type") != "DisruptionTarget"]
            target = {"type": "DisruptionTarget", "status": "True", "reason": "DeletionByPodGC"}
            patch["conditions"] = [*conditions, {**target, "message": reason, "lastTransitionTime": stamp()}]
        try:
            if patch:
                self.call(
                    self.core.patch_namespaced_pod_status,
                    name,
                    namespace,
                    {"status": patch},
                    _content_type=MERGE_PATCH,
                )
            self.call(self.core.delete_namespaced_pod, name, namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                raise
        log.info("pod %s/%s force-deleted: %s", namespace, name, reason or "node out of service")


def _out_of_service(node: dict[str, Any]) -> bool:
    ready = (condition(node, "Ready") or {}).get("status")
    taints = (node.get("spec") or {}).get("taints") or []
    return ready != "True" and any(t.get("key") == OUT_OF_SERVICE for t in taints)
