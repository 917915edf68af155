"""The local control plane's scheduler: kube-scheduler's part, binding each pending pod to a node.

`Scheduler` talks to the API server only through the official `kubernetes` client, as kube-scheduler
talks through client-go: it lists and watches Nodes and the Pods that have not ended (the field selector
`status.phase!=Succeeded,status.phase!=Failed`, kube-scheduler's own), and for every pod without
`spec.nodeName` (with `schedulerName` unset or `default-scheduler`, not being deleted, without
scheduling gates) it runs the default profile's filters over every node (`fit.py`: cordoned nodes,
taints and tolerations, `nodeSelector` and required node affinity, resource requests against what the
pods already bound there request), then PodTopologySpread and InterPodAffinity over the pods already
placed (`interpod.py`: required pod affinity and anti-affinity, existing pods' anti-affinity, `DoNotSchedule`
spread constraints). Then, as kube-scheduler does:

* **A node fits:** the best one (`interpod.select`: the default profile's scores, taints, preferred node
  affinity, least allocated, preferred pod affinity and soft spreading, with its weights; ties to the
  name, deterministic) gets the
  pod through `POST pods/NAME/binding` (the `pods/binding` subresource, with the pod's uid as
  precondition, so the API server sets `spec.nodeName` and `PodScheduled=True`), and a Normal Event
  `Scheduled` says `Successfully assigned NS/NAME to NODE`. The pod counts on that node at once (an
  "assumed" pod), before its watch event arrives.
* **None fits:** the pod stays Pending with `PodScheduled` False, reason `Unschedulable` and
  kube-scheduler's message (`0/2 nodes are available: 2 Insufficient nvidia.com/gpu. no new claims to
  deallocate, preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod.`;
  with no nodes at all, `no nodes available to schedule pods`), written through `pods/status` as a
  strategic merge patch of that one condition, with a Warning Event `FailedScheduling` carrying the same
  message (once per distinct message).

Pods are taken highest `spec.priority` first, then oldest, as the scheduling queue's PrioritySort does.
A pod that found no node waits, as in the scheduling queue's unschedulable pool, until a change that could
make room: a pod going away (or ending), a bound pod changing, a node added or changed (relabelled,
uncordoned, untainted), and for a pod that inter-pod affinity or spreading refused, a pod bound or
relabelled; a new pending pod or a pending pod's own update is not one. It is then retried once
its back-off has passed: 1 s after its first failed attempt, doubling with each further one up to 10 s
(`podInitialBackoffDuration`, `podMaxBackoffDuration`). A pod no change has moved is retried after 5 min
(`podMaxInUnschedulablePodsDuration`). A pod retried too early would bind sooner than on a real cluster, and
a controller judging from a stale `Unschedulable` condition would go untested.

Not modelled (besides what `fit.py` lists): preemption, nominated nodes, multiple profiles, extenders,
binding cycles that wait (permit, volume binding), pod groups.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ember_localcluster import fit, interpod
from ember_localcluster.events import pod_event
from ember_localcluster.informer import API_TIMEOUT
from ember_localcluster.runtime import BackgroundRuntime
from ember_localcluster.schedqueue import Backoff, placement

__all__ = ["SCHEDULER_NAME", "Scheduler"]

log = logging.getLogger("ember.scheduler")

SCHEDULER_NAME = "default-scheduler"
RETRY_SECONDS = 1.0  # after an API call failed


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    meta = obj["metadata"]
    return (meta.get("namespace") or "", meta["name"])


def _labels(obj: dict[str, Any]) -> dict[str, Any]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _scheduled_condition(pod: dict[str, Any]) -> dict[str, Any] | None:
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled":
            return dict(condition)
    return None


class Scheduler:
    """Binds the pending Pods of the API server at `kubeconfig` to its Nodes (see the module docstring).

    `start()` returns once Nodes and Pods have been listed; `stop()` stops it, leaving every pod as it is.
    """

    def __init__(self, kubeconfig: str | Path) -> None:
        self.kubeconfig = Path(kubeconfig)
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._assumed: dict[str, str] = {}  # pod uid -> node, bound here and not yet seen bound
        self._reported: dict[str, str] = {}  # pod uid -> the last FailedScheduling message sent
        self._backoff: dict[str, Backoff] = {}  # pod uid -> its wait after failed attempts
        self._waits_on_pods: set[str] = set()  # pod uids refused by inter-pod affinity or spreading
        self._timer: asyncio.TimerHandle | None = None
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._runtime = BackgroundRuntime("scheduler", api_workers=2)

    def __enter__(self) -> Scheduler:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> Scheduler:
        runtime = self._runtime
        if runtime.running:
            raise RuntimeError("the scheduler is already running")
        runtime.start(self.kubeconfig)
        runtime.run(self._begin(), timeout=10)
        nodes = runtime.informer(runtime.core.list_node, self._on_node, name="scheduler-nodes")
        pods = runtime.informer(
            functools.partial(
                runtime.core.list_pod_for_all_namespaces,
                field_selector="status.phase!=Succeeded,status.phase!=Failed",
            ),
            self._on_pod,
            name="scheduler-pods",
        )
        runtime.sync(nodes, pods)
        return self

    def stop(self) -> None:
        self._runtime.stop(self._shutdown)

    # -- on the scheduler's loop -----------------------------------------------------------------------

    async def _begin(self) -> None:
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _shutdown(self) -> None:
        tasks = [t for t in (self._task, *self._background) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()

    def _on_node(self, kind: str, node: dict[str, Any]) -> None:
        name = node["metadata"]["name"]
        if kind == "DELETED":
            self._nodes.pop(name, None)
        else:
            before = self._nodes.get(name)
            self._nodes[name] = node
            if before is None or placement(before) != placement(node):  # not a heartbeat
                self._move()
        self._wake()

    def _move(self) -> None:
        """A change that may make room: every waiting pod becomes due once its back-off has passed."""
        for waiting in self._backoff.values():
            waiting.moved = True

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        if kind == "DELETED":
            self._pods.pop(_key(pod), None)
            if (pod.get("spec") or {}).get("nodeName") or self._assumed.pop(uid, None):
                self._move()  # its node has room again
            self._reported.pop(uid, None)
            self._backoff.pop(uid, None)
            self._waits_on_pods.discard(uid)
        else:
            before = self._pods.get(_key(pod))
            self._pods[_key(pod)] = pod
            if (pod.get("spec") or {}).get("nodeName"):
                self._assumed.pop(uid, None)
                self._backoff.pop(uid, None)
                self._waits_on_pods.discard(uid)
                if (
                    before is None
                    or not (before.get("spec") or {}).get("nodeName")
                    or _labels(before) != _labels(pod)
                ):
                    self._move_pod_waiters()  # a pod bound or relabelled: affinity and spreading see it
        self._wake()

    def _move_pod_waiters(self) -> None:
        """As InterPodAffinity's and PodTopologySpread's queueing hints: a pod they refused is retried when
        a bound pod is added or relabelled; pods that waited only on resources or nodes stay put."""
        for uid in self._waits_on_pods:
            waiting = self._backoff.get(uid)
            if waiting is not None:
                waiting.moved = True

    async def _loop(self) -> None:
        assert self._wakeup is not None
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            try:
                await self._schedule_pending()
            except Exception:
                log.exception("a scheduling pass failed; trying again in %.0f s", RETRY_SECONDS)
                self._retry_later()

    def _retry_later(self) -> None:
        asyncio.get_running_loop().call_later(RETRY_SECONDS, self._wake)

    def _pending(self) -> list[dict[str, Any]]:
        def wanted(pod: dict[str, Any]) -> bool:
            spec, meta = pod.get("spec") or {}, pod["metadata"]
            return (
                not spec.get("nodeName")
                and meta["uid"] not in self._assumed
                and not meta.get("deletionTimestamp")
                and not fit.is_terminal(pod)
                and spec.get("schedulerName", SCHEDULER_NAME) in ("", SCHEDULER_NAME)
                and not spec.get("schedulingGates")
            )

        def order(pod: dict[str, Any]) -> tuple[int, str, str, str]:
            priority = (pod.get("spec") or {}).get("priority")
            meta = pod["metadata"]
            return (
                -(priority if isinstance(priority, int) else 0),
                meta.get("creationTimestamp", ""),
                meta.get("namespace", ""),
                meta["name"],
            )

        return sorted((p for p in self._pods.values() if wanted(p)), key=order)

    def _node_infos(self) -> dict[str, fit.NodeInfo]:
        infos = {name: fit.NodeInfo(node) for name, node in sorted(self._nodes.items())}
        for pod in self._pods.values():
            node = (pod.get("spec") or {}).get("nodeName") or self._assumed.get(pod["metadata"]["uid"])
            if node in infos and not fit.is_terminal(pod):
                infos[node].pods.append(pod)
        return infos

    def _due(self, pending: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The pending pods not waiting out a back-off; a wake-up is set for the first that is."""
        now = time.monotonic()
        due, soonest = [], None
        for pod in pending:
            waiting = self._backoff.get(pod["metadata"]["uid"])
            if waiting is None or waiting.retry_at() <= now:
                due.append(pod)
            else:
                soonest = waiting.retry_at() if soonest is None else min(soonest, waiting.retry_at())
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if soonest is not None:
            self._timer = asyncio.get_running_loop().call_later(soonest - now, self._wake)
        return due

    async def _schedule_pending(self) -> None:
        pending = self._due(self._pending())
        if not pending:
            return
        infos = self._node_infos()
        for pod in pending:
            if self._pods.get(_key(pod)) is not pod:
                continue  # changed or gone while this pass awaited: the next pass has it
            results = interpod.filter_nodes(pod, infos)
            feasible = [infos[name] for name, result in results.items() if result.fits]
            if feasible:
                best = interpod.select(pod, feasible, infos.values())
                if await self._bind(pod, best.name):
                    best.pods.append(pod)
            else:
                uid = pod["metadata"]["uid"]
                previous = self._backoff.get(uid)
                attempts = 1 if previous is None else previous.attempts + 1
                self._backoff[uid] = Backoff(attempts, time.monotonic())
                if any(r in interpod.POD_REASONS for result in results.values() for r in result.reasons):
                    self._waits_on_pods.add(uid)
                await self._unschedulable(pod, fit.failure_message(pod, results))

    async def _api(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", API_TIMEOUT)
        call = functools.partial(method, *args, _preload_content=False, **kwargs)
        response = await asyncio.get_running_loop().run_in_executor(self._runtime.executor, call)
        return json.loads(response.data or b"null")

    async def _bind(self, pod: dict[str, Any], node: str) -> bool:
        meta = pod["metadata"]
        namespace, name, uid = meta.get("namespace") or "default", meta["name"], meta["uid"]
        binding = client.V1Binding(
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=uid),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        try:
            await self._api(self._runtime.core.create_namespaced_pod_binding, name, namespace, binding)
        except ApiException as error:
            if error.status in (404, 409):  # gone, bound by someone else, or being deleted
                log.debug("pod %s/%s: binding to %s refused: %s", namespace, name, node, error.reason)
                return False
            log.warning("pod %s/%s: binding to %s failed: %s", namespace, name, node, error)
            self._retry_later()
            return False
        except (OSError, urllib3.exceptions.HTTPError) as error:
            log.warning("pod %s/%s: binding to %s failed: %s", namespace, name, node, error)
            self._retry_later()
            return False
        self._assumed[uid] = node
        self._reported.pop(uid, None)
        log.info("pod %s/%s bound to %s", namespace, name, node)
        self._event(
            pod, "Normal", "Scheduled", "Binding", f"Successfully assigned {namespace}/{name} to {node}"
        )
        return True

    async def _unschedulable(self, pod: dict[str, Any], message: str) -> None:
        meta = pod["metadata"]
        namespace, name, uid = meta.get("namespace") or "default", meta["name"], meta["uid"]
        previous = _scheduled_condition(pod)
        condition = {
            "type": "PodScheduled",
            "status": "False",
            "reason": "Unschedulable",
            "message": message,
            "lastProbeTime": None,
            "lastTransitionTime": _now(),
        }
        if previous is not None and previous.get("status") == "False":
            if previous.get("reason") == "Unschedulable" and previous.get("message") == message:
                return  # `UpdatePodCondition` finds nothing to change
            condition["lastTransitionTime"] = (
                previous.get("lastTransitionTime") or condition["lastTransitionTime"]
            )
        try:
            await self._api(
                self._runtime.core.patch_namespaced_pod_status,
                name,
                namespace,
                {"status": {"conditions": [condition]}},
            )
        except ApiException as error:
            if error.status != 404:
                log.warning("pod %s/%s: status update failed: %s", namespace, name, error)
                self._retry_later()
            return
        except (OSError, urllib3.exceptions.HTTPError) as error:
            log.warning("pod %s/%s: status update failed: %s", namespace, name, error)
            self._retry_later()
            return
        if self._reported.get(uid) != message:
            self._reported[uid] = message
            log.info("pod %s/%s is unschedulable: %s", namespace, name, message)
            self._event(pod, "Warning", "FailedScheduling", "Scheduling", message)

    def _event(self, pod: dict[str, Any], kind: str, reason: str, action: str, message: str) -> None:
        event = pod_event(pod, kind, reason, message, SCHEDULER_NAME, SCHEDULER_NAME, action=action)
        namespace = pod["metadata"].get("namespace") or "default"
        task = asyncio.ensure_future(self._api(self._runtime.core.create_namespaced_event, namespace, event))
        self._background.add(task)
        task.add_done_callback(self._event_sent)

    def _event_sent(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("recording an event failed: %s", task.exception())
