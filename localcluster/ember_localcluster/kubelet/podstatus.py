"""What the process kubelet reports about a pod: its `pods/status` and core/v1 Events.

`containerStatuses` and `initContainerStatuses` carry state, lastState, restartCount, ready, started, image,
imageID and containerID (`process://<pid>`). Phases follow the kubelet's rules, Succeeded and Failed
included: Pending while init containers run (Failed when one fails under restartPolicy Never); the
Initialized condition lists the init containers not yet done ("containers with incomplete status: [...]");
readiness drives the pod's ContainersReady and Ready conditions. Each distinct Event is recorded once per pod.
"""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import urllib3
from kubernetes.client.exceptions import ApiException

from ember_localcluster.events import pod_event
from ember_localcluster.informer import MERGE_PATCH
from ember_localcluster.kubelet.node import HOST_IP

if TYPE_CHECKING:
    from ember_localcluster.kubelet.containers import _Container
    from ember_localcluster.kubelet.kubelet import ProcessKubelet
    from ember_localcluster.kubelet.podworker import _PodWorker

log = logging.getLogger("ember.kubelet")


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _phase(worker: _PodWorker) -> str:
    pending = worker.pending_init()
    if pending is not None:
        # An init container that failed for good (restartPolicy Never) fails the pod; else it waits.
        return "Failed" if pending.done else "Pending"
    containers = list(worker.containers.values())
    if worker.terminating and all(c.process is None for c in containers):
        exits = [c.state.get("terminated", {}).get("exitCode") for c in containers]
        return "Succeeded" if all(code == 0 for code in exits) else "Failed"
    running = waiting = stopped = succeeded = 0
    for c in containers:
        if "running" in c.state:
            running += 1
        elif "terminated" in c.state:
            stopped += 1
            succeeded += c.state["terminated"].get("exitCode") == 0
        elif "terminated" in c.last_state:  # waiting to restart: stopped, never succeeded (getPhase)
            stopped += 1
        else:
            waiting += 1
    if waiting:
        return "Pending"
    if running:
        return "Running"
    if stopped:
        restart_policy = worker.spec.get("restartPolicy", "Always")
        if restart_policy == "Always":
            return "Running"
        if stopped == succeeded:
            return "Succeeded"
        return "Failed" if restart_policy == "Never" else "Running"
    return "Pending"


def _condition(
    worker: _PodWorker, kind: str, ok: bool, reason: str = "", message: str = ""
) -> dict[str, Any]:
    status = "True" if ok else "False"
    previous = worker.conditions.get(kind)
    changed_at = previous["lastTransitionTime"] if previous and previous["status"] == status else _now()
    condition: dict[str, Any] = {
        "type": kind,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": changed_at,
    }
    if not ok and reason:
        condition.update(reason=reason, message=message)
    worker.conditions[kind] = condition
    return condition


def _status(worker: _PodWorker) -> dict[str, Any]:
    phase = _phase(worker)
    unready = [c.name for c in worker.containers.values() if not c.ready]
    if phase in ("Succeeded", "Failed"):
        reason, message = "PodCompleted", ""
    else:
        reason, message = "ContainersNotReady", f"containers with unready status: [{' '.join(unready)}]"
    incomplete = [
        c.name for c in worker.init_containers.values() if c.state.get("terminated", {}).get("exitCode") != 0
    ]
    conditions = [
        _condition(
            worker,
            "Initialized",
            not incomplete,
            "ContainersNotInitialized",
            f"containers with incomplete status: [{' '.join(incomplete)}]",
        ),
        _condition(worker, "Ready", not unready, reason, message),
        _condition(worker, "ContainersReady", not unready, reason, message),
        _condition(worker, "PodScheduled", True),
    ]
    out: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions,
        "hostIP": HOST_IP,
        "hostIPs": [{"ip": HOST_IP}],
        "podIP": worker.ip,
        "podIPs": [{"ip": worker.ip}],
        "startTime": worker.start_time,
        "containerStatuses": [_container_status(c) for c in worker.containers.values()],
    }
    if worker.init_containers:
        out["initContainerStatuses"] = [_container_status(c) for c in worker.init_containers.values()]
    return out


def _container_status(c: _Container) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": c.name,
        "image": c.spec.get("image", ""),
        "imageID": f"local://{c.spec.get('image', '')}",
        "ready": c.ready,
        "started": c.started,
        "restartCount": c.restart_count,
        "state": c.state,
        "lastState": c.last_state,
    }
    if c.container_id:
        status["containerID"] = c.container_id
    return status


async def _publish(worker: _PodWorker) -> bool:
    """Write the status when it changed; False when that failed and should be tried again."""
    status = _status(worker)
    if status == worker.published or worker.lost:
        return True
    try:
        await worker.kubelet.api(
            worker.kubelet.core.patch_namespaced_pod_status,
            worker.name,
            worker.namespace,
            {"status": status},
            _content_type=MERGE_PATCH,
        )
    except ApiException as error:
        if error.status == 404:  # the pod is gone; its DELETED event ends this worker
            return True
        log.warning("%s/%s: status update failed: %s", worker.namespace, worker.name, error)
        return False
    except (OSError, urllib3.exceptions.HTTPError) as error:  # the API server is unreachable
        log.warning("%s/%s: status update failed: %s", worker.namespace, worker.name, error)
        return False
    worker.published = status
    return True


def _event(worker: _PodWorker, reason: str, message: str, kind: str = "Normal") -> None:
    """Record a core/v1 Event about this pod, once per distinct reason and message."""
    if (reason, message) in worker.events_sent or worker.lost:
        return
    worker.events_sent.add((reason, message))
    worker.kubelet.spawn(_post_event(worker.kubelet, worker.pod, worker.node_name, reason, message, kind))


async def _post_event(
    kubelet: ProcessKubelet, pod: dict[str, Any], node: str, reason: str, message: str, kind: str
) -> None:
    """Create an Event about `pod` from the kubelet of `node`."""
    event = pod_event(pod, kind, reason, message, "kubelet", node, host=node)
    namespace = pod["metadata"].get("namespace") or "default"
    await kubelet.api(kubelet.core.create_namespaced_event, namespace, event)
