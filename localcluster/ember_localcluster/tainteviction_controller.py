"""The local control plane's taint eviction controller: pods go from nodes with NoExecute taints.

As kube-controller-manager's taint-eviction-controller (pkg/controller/tainteviction), polling every
`period` (0.5 s) in place of its informers. For each pod bound to a node (and not yet being deleted):

* the node's NoExecute taints the pod does not tolerate (`v1helper.TolerationsTolerateTaint`: key and
  effect match, or the toleration has no key and `Exists`, or no effect; `Equal` compares values) get it
  deleted at once;
* otherwise, when it tolerates them, it is deleted once the shortest `tolerationSeconds` among the
  tolerations it uses has passed since this controller first saw the taints on its node
  (`getMinTolerationTime`: 0 or less is at once, none at all is forever); a node whose NoExecute taints
  go before then cancels the deletion, with a Normal Event `TaintManagerEviction`, `Cancelling deletion
  of Pod NS/NAME`.

A deletion (`addConditionAndDeletePod`) first records a Normal Event `TaintManagerEviction`, `Marking for
deletion Pod NS/NAME`, sets the pod's `DisruptionTarget` condition True with reason
`DeletionByTaintManager` and message `Taint manager: deleting due to NoExecute taint`, then deletes the
pod with its own grace period. On a node that was lost the pod then stays Terminating, as it does on a
real cluster: no kubelet confirms the deletion until the node comes back, or the pod garbage collector
force-deletes it (`podgc_controller.py`: the Node object deleted, or the node tainted out of service).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from kubernetes.client.exceptions import ApiException

from ember_localcluster.events import pod_event
from ember_localcluster.nodelifecycle_controller import MERGE_PATCH, PollingController, stamp

__all__ = ["TaintEvictionController"]

log = logging.getLogger("ember.tainteviction")

Key = tuple[str, str]


def tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    """`Toleration.ToleratesTaint`."""
    if toleration.get("effect") and toleration.get("effect") != taint.get("effect"):
        return False
    if toleration.get("key") and toleration.get("key") != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    return operator == "Equal" and (toleration.get("value") or "") == (taint.get("value") or "")


def min_toleration_seconds(taints: list[dict[str, Any]], tolerations: list[dict[str, Any]]) -> float | None:
    """How long the pod may stay: 0 when a taint is not tolerated, None when forever."""
    used = []
    for taint in taints:
        match = next((t for t in tolerations if tolerates(t, taint)), None)
        if match is None:
            return 0.0
        used.append(match)
    seconds = [t["tolerationSeconds"] for t in used if t.get("tolerationSeconds") is not None]
    if not used:
        return 0.0
    if not seconds:
        return None
    return max(0.0, float(min(seconds)))


class TaintEvictionController(PollingController):
    def __init__(self, kubeconfig: str | Path, *, period: float = 0.5) -> None:
        super().__init__(kubeconfig, "tainteviction", period)
        self._since: dict[Key, float] = {}  # pod → when its node's NoExecute taints were first seen

    def _pass(self) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.call(self.core.list_node)["items"]}
        now, scheduled = time.monotonic(), {}
        for pod in self.call(self.core.list_pod_for_all_namespaces)["items"]:
            meta, node = pod["metadata"], nodes.get((pod.get("spec") or {}).get("nodeName") or "")
            if node is None or meta.get("deletionTimestamp"):
                continue
            key = (meta["namespace"], meta["name"])
            taints = [
                t for t in (node.get("spec") or {}).get("taints") or [] if t.get("effect") == "NoExecute"
            ]
            if not taints:
                if key in self._since:
                    self._event(pod, "Cancelling deletion of Pod")
                continue
            seconds = min_toleration_seconds(taints, (pod.get("spec") or {}).get("tolerations") or [])
            if seconds is None:
                continue
            scheduled[key] = since = self._since.get(key, now)
            if now - since >= seconds:
                self._delete(pod)
        self._since = scheduled

    def _event(self, pod: dict[str, Any], what: str) -> None:
        meta = pod["metadata"]
        message = f"{what} {meta['namespace']}/{meta['name']}"
        event = pod_event(pod, "Normal", "TaintManagerEviction", message, "taint-eviction-controller", "")
        self.event(self._api_client.sanitize_for_serialization(event))

    def _delete(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        name, namespace = meta["name"], meta["namespace"]
        self._event(pod, "Marking for deletion Pod")
        conditions = [
            c
            for c in (pod.get("status") or {}).get("conditions") or []
            if c.get("type") != "DisruptionTarget"
        ]
        target = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": "DeletionByTaintManager",
            "message": "Taint manager: deleting due to NoExecute taint",
            "lastTransitionTime": stamp(),
        }
        try:
            patch = {"status": {"conditions": [*conditions, target]}}
            self.call(
                self.core.patch_namespaced_pod_status, name, namespace, patch, _content_type=MERGE_PATCH
            )
            self.call(self.core.delete_namespaced_pod, name, namespace)
        except ApiException as error:
            if error.status != 404:
                raise
        log.info("pod %s/%s deleted: NoExecute taint on its node", namespace, name)
