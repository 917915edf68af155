"""The local control plane's scheduler: kube-scheduler's part, binding each pending pod to a node.

`Scheduler` talks to the API server only through the official `kubernetes` client, as kube-scheduler
talks through client-go: it lists and watches Nodes and the Pods that have not ended (the field selector
`status.phase!=Succeeded,status.phase!=Failed`, kube-scheduler's own) and PodDisruptionBudgets, and for
every pod without
`spec.nodeName` (with `schedulerName` unset or `default-scheduler`, not being deleted, without
scheduling gates) it runs the default profile's filters over every node (`fit.py`: cordoned nodes,
taints and tolerations, `nodeSelector` and required node affinity, resource requests against what the
pods already bound there request), then PodTopologySpread and InterPodAffinity over the pods already
placed (`interpod.py`: required pod affinity and anti-affinity, existing pods' anti-affinity, `DoNotSchedule`
spread constraints), counting the pending pods nominated to a node (`status.nominatedNodeName`) with at
least the pod's priority as if bound there (`preemption.py`). A pod nominated to a node is tried on that
node first. Then, as kube-scheduler does:

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
* **None fits, and preemption finds room** (DefaultPreemption, `preemption.py`): each victim gets the
  `DisruptionTarget` condition (True, reason `PreemptionByScheduler`, message `default-scheduler:
  preempting to accommodate a higher priority pod`) and a graceful DELETE (its own grace period), and a
  Normal Event `Preempted` (`Preempted by pod <preemptor uid> on node <node>`, action `Preempting`, the
  preemptor as related object); the pods of lower priority nominated to that node lose their nomination;
  the preemptor stays Pending with `status.nominatedNodeName` set to the node and the FitError without
  its preemption part (`0/2 nodes are available: 2 Insufficient nvidia.com/gpu.`), and is bound once the
  victims are gone. When preemption finds nothing the nomination is cleared and the message says why per
  node; a pod with `preemptionPolicy: Never`, or whose nominated node still has a victim terminating,
  keeps its nomination as it is.

Pods are taken highest `spec.priority` first, then oldest, as the scheduling queue's PrioritySort does.
A pod that found no node waits, as in the scheduling queue's unschedulable pool, until a change that could
make room: a pod going away (or ending), a bound pod changing, a node added or changed (relabelled,
uncordoned, untainted), and for a pod that inter-pod affinity or spreading refused, a pod bound or
relabelled; a new pending pod or a pending pod's own update is not one. It is then retried once
its back-off has passed: 1 s after its first failed attempt, doubling with each further one up to 10 s
(`podInitialBackoffDuration`, `podMaxBackoffDuration`). A pod no change has moved is retried after 5 min
(`podMaxInUnschedulablePodsDuration`). A pod retried too early would bind sooner than on a real cluster, and
a controller judging from a stale `Unschedulable` condition would go untested.

Not modelled (besides what `fit.py` lists): multiple profiles, extenders, binding cycles that wait
(permit, volume binding), pod groups, and preemption of pods waiting at Permit (there are none).
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

from ember_localcluster import fit, interpod, preemption
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


def _has_condition(pod: dict[str, Any], wanted: dict[str, Any]) -> bool:
    """Whether `UpdatePodCondition` would find nothing to change: same status, reason and message."""
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == wanted["type"]:
            return all(condition.get(k) == wanted[k] for k in ("status", "reason", "message"))
    return False


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
        self._nominations: dict[str, str] = {}  # pod uid -> node ("" none) written here, ahead of its watch
        self._budgets: dict[tuple[str, str], dict[str, Any]] = {}  # PodDisruptionBudgets
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
        budgets = runtime.informer(
            runtime.policy.list_pod_disruption_budget_for_all_namespaces,
            self._on_budget,
            name="scheduler-budgets",
        )
        runtime.sync(nodes, pods, budgets)
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

    def _on_budget(self, kind: str, budget: dict[str, Any]) -> None:
        if kind == "DELETED":
            self._budgets.pop(_key(budget), None)
        else:
            self._budgets[_key(budget)] = budget

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
            self._nominations.pop(uid, None)
        else:
            before = self._pods.get(_key(pod))
            self._pods[_key(pod)] = pod
            if (pod.get("spec") or {}).get("nodeName"):
                self._assumed.pop(uid, None)
                self._backoff.pop(uid, None)
                self._waits_on_pods.discard(uid)
                self._nominations.pop(uid, None)
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

    def _nominated_node(self, pod: dict[str, Any]) -> str:
        uid = pod["metadata"]["uid"]
        if uid in self._nominations:
            return self._nominations[uid]
        return str((pod.get("status") or {}).get("nominatedNodeName") or "")

    def _nominated(self, pending: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
        """The scheduler's nominator: node -> the pending pods nominated to it."""
        out: dict[str, list[dict[str, Any]]] = {}
        for pod in pending:
            node = self._nominated_node(pod)
            if node:
                out.setdefault(node, []).append(pod)
        return out

    async def _schedule_pending(self) -> None:
        pending = self._pending()
        due = self._due(pending)
        if not due:
            return
        infos = self._node_infos()
        nominated = self._nominated(pending)
        for pod in due:
            if self._pods.get(_key(pod)) is not pod:
                continue  # changed or gone while this pass awaited: the next pass has it
            node = await self._schedule_one(pod, infos, nominated)
            for pods in nominated.values():  # bound, or nominated elsewhere: as the nominator updates
                pods[:] = [p for p in pods if p is not pod]
            if node:
                nominated.setdefault(node, []).append(pod)

    async def _schedule_one(
        self, pod: dict[str, Any], infos: dict[str, fit.NodeInfo], nominated: dict[str, list[dict[str, Any]]]
    ) -> str:
        """One scheduling cycle; returns the node the pod is nominated to afterwards ("" if bound or none)."""
        current = self._nominated_node(pod)
        if current in infos and preemption.filter_node(pod, infos, current, nominated).fits:
            if await self._bind(pod, current):  # evaluateNominatedNode: the nominated node first
                infos[current].pods.append(pod)
                return ""
            return current
        results = preemption.filter_nodes(pod, infos, nominated)
        feasible = [infos[name] for name, result in results.items() if result.fits]
        if feasible:
            best = interpod.select(pod, feasible, infos.values())
            if await self._bind(pod, best.name):
                best.pods.append(pod)
                return ""
            return current
        uid = pod["metadata"]["uid"]
        previous = self._backoff.get(uid)
        attempts = 1 if previous is None else previous.attempts + 1
        self._backoff[uid] = Backoff(attempts, time.monotonic())
        if any(r in interpod.POD_REASONS for result in results.values() for r in result.reasons):
            self._waits_on_pods.add(uid)
        if not infos:
            await self._unschedulable(pod, fit.NO_NODES, nomination="")
            return ""
        outcome = preemption.preempt(pod, infos, results, nominated, list(self._budgets.values()), current)
        nomination: str | None = "" if outcome.clear_nomination else None
        if outcome.candidate is not None:
            if not await self._prepare(pod, outcome.candidate, nominated):
                self._retry_later()
                return current
            nomination = outcome.candidate.node
        await self._unschedulable(pod, fit.failure_message(results, outcome.message), nomination=nomination)
        return current if nomination is None else nomination

    async def _prepare(
        self, pod: dict[str, Any], candidate: preemption.Candidate, nominated: dict[str, list[dict[str, Any]]]
    ) -> bool:
        """`prepareCandidate`: each victim gets the DisruptionTarget condition and a graceful delete, and a
        `Preempted` event; the pods of lower priority nominated to the node lose their nomination."""
        for victim in candidate.victims:
            if victim["metadata"].get("deletionTimestamp"):
                continue  # its graceful deletion has begun
            if not await self._preempt_victim(pod, victim, candidate.node):
                return False
        for other in preemption.lower_nominated(pod, candidate.node, nominated):
            await self._write_status(dict(other), {"nominatedNodeName": None})
            self._nominations[other["metadata"]["uid"]] = ""
            nominated[candidate.node] = [p for p in nominated[candidate.node] if p is not other]
        return True

    async def _preempt_victim(self, preemptor: dict[str, Any], victim: dict[str, Any], node: str) -> bool:
        meta = victim["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        scheduler = (preemptor.get("spec") or {}).get("schedulerName") or SCHEDULER_NAME
        condition = {
            "type": "DisruptionTarget",
            "status": "True",
            "reason": preemption.PREEMPTED_REASON,
            "message": f"{scheduler}: preempting to accommodate a higher priority pod",
            "lastProbeTime": None,
            "lastTransitionTime": _now(),
        }
        try:
            if not _has_condition(victim, condition):
                await self._api(
                    self._runtime.core.patch_namespaced_pod_status,
                    name,
                    namespace,
                    {"status": {"conditions": [condition]}},
                )
            await self._api(self._runtime.core.delete_namespaced_pod, name, namespace)
        except ApiException as error:
            if error.status == 404:
                return True  # already gone
            log.warning("pod %s/%s: preempting it failed: %s", namespace, name, error)
            return False
        except (OSError, urllib3.exceptions.HTTPError) as error:
            log.warning("pod %s/%s: preempting it failed: %s", namespace, name, error)
            return False
        preemptor_meta = preemptor["metadata"]
        log.info("pod %s/%s preempted by %s on %s", namespace, name, preemptor_meta["name"], node)
        message = f"Preempted by pod {preemptor_meta['uid']} on node {node}"
        self._event(victim, "Normal", "Preempted", "Preempting", message, related=preemptor)
        return True

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

    async def _unschedulable(self, pod: dict[str, Any], message: str, *, nomination: str | None) -> None:
        """`updatePod` after a failed cycle: the PodScheduled condition, and `nominatedNodeName` set to
        `nomination` (cleared when empty, left alone when None), in one status patch when either changed."""
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
        status: dict[str, Any] = {"conditions": [condition]}
        if previous is not None and previous.get("status") == "False":
            if previous.get("reason") == "Unschedulable" and previous.get("message") == message:
                status = {}  # `UpdatePodCondition` finds nothing to change
            condition["lastTransitionTime"] = (
                previous.get("lastTransitionTime") or condition["lastTransitionTime"]
            )
        if nomination is not None and nomination != self._nominated_node(pod):
            status["nominatedNodeName"] = nomination or None
        if status and not await self._write_status(pod, status):
            return
        if "nominatedNodeName" in status:
            self._nominations[uid] = nomination or ""
        if self._reported.get(uid) != message:
            self._reported[uid] = message
            log.info("pod %s/%s is unschedulable: %s", namespace, name, message)
            self._event(pod, "Warning", "FailedScheduling", "Scheduling", message)

    async def _write_status(self, pod: dict[str, Any], status: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        namespace, name = meta.get("namespace") or "default", meta["name"]
        try:
            await self._api(
                self._runtime.core.patch_namespaced_pod_status, name, namespace, {"status": status}
            )
        except ApiException as error:
            if error.status != 404:
                log.warning("pod %s/%s: status update failed: %s", namespace, name, error)
                self._retry_later()
            return False
        except (OSError, urllib3.exceptions.HTTPError) as error:
            log.warning("pod %s/%s: status update failed: %s", namespace, name, error)
            self._retry_later()
            return False
        return True

    def _event(
        self,
        pod: dict[str, Any],
        kind: str,
        reason: str,
        action: str,
        message: str,
        related: dict[str, Any] | None = None,
    ) -> None:
        event = pod_event(
            pod, kind, reason, message, SCHEDULER_NAME, SCHEDULER_NAME, action=action, related=related
        )
        namespace = pod["metadata"].get("namespace") or "default"
        task = asyncio.ensure_future(self._api(self._runtime.core.create_namespaced_event, namespace, event))
        self._background.add(task)
        task.add_done_callback(self._event_sent)

    def _event_sent(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("recording an event failed: %s", task.exception())
