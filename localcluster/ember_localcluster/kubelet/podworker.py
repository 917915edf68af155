"""The per-pod worker: it runs one pod (one uid) from first sight to its deletion, on the kubelet's loop.

A pod with a `deletionTimestamp` runs each running container's preStop hook (exec, httpGet or sleep),
then SIGTERMs its process group, SIGKILLs what is left when the grace period
(`deletionGracePeriodSeconds`, less the whole seconds the hook took, but never less than 2 s after SIGTERM,
as the kubelet's killContainer gives) ends, reports the terminal phase and deletes the pod with
`gracePeriodSeconds=0`, which the API server (run with `pod_graceful_deletion=True`) waits for. A pod
that disappears at once has its processes killed at once.

A container failing its liveness or startup probe is killed the same way (the probe's
terminationGracePeriodSeconds, else the pod's), with a `Killing` event "Container <name> failed liveness
probe, will be restarted", and restarted unless the restart policy is Never. Under Never, with no other
container left running, the pod is stopped instead, as computePodActions' KillPod: "Stopping container
<name>", with the pod's grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ember_localcluster.kubelet.containers import _Container, _start
from ember_localcluster.kubelet.node import NODE_NAME, _signal_group
from ember_localcluster.kubelet.podstatus import _event, _now, _phase, _publish
from ember_localcluster.kubelet.podvolumes import MOUNT_RETRY_SECONDS, _mount, _MountError, _write_configmap
from ember_localcluster.kubelet.probes import _run_handler, _start_probe_workers, _trigger_readiness

if TYPE_CHECKING:
    from ember_localcluster.kubelet.kubelet import ProcessKubelet

log = logging.getLogger("ember.kubelet")

# The kubelet's minimumGracePeriodInSeconds: a container always has this long after SIGTERM.
MINIMUM_GRACE_SECONDS = 2.0


class _PodWorker:
    """Runs one pod (one uid) from first sight to its deletion, on the kubelet's event loop."""

    def __init__(self, kubelet: ProcessKubelet, pod: dict[str, Any], previous: _PodWorker | None) -> None:
        self.kubelet = kubelet
        self.pod = pod
        self.previous = previous
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta.get("namespace") or "default", meta["name"], meta["uid"]
        self.node_name = str((pod.get("spec") or {}).get("nodeName") or NODE_NAME)
        self.dir = kubelet.pod_dir(self.namespace, self.name)
        spec = pod.get("spec") or {}
        self.init_containers = {c["name"]: _Container(c, init=True) for c in spec.get("initContainers") or []}
        self.containers = {c["name"]: _Container(c) for c in spec.get("containers") or []}
        if self.init_containers:  # what the kubelet reports for containers that wait for the init ones
            for c in (*self.init_containers.values(), *self.containers.values()):
                c.state = {"waiting": {"reason": "PodInitializing"}}
        self.ip = ""
        self.start_time = ""
        self.volumes: dict[str, Path] | None = None
        self.mount_error = ""
        self.configmap_volumes: dict[tuple[str, str], list[dict[str, Any]]] = {}
        self.terminating = False
        self.confirmed = False  # this kubelet deleted the pod after stopping it
        self.gone = False  # deleted from the API server without this kubelet's confirmation
        self.lost = False  # its node was lost (`nodelease.lose`): nothing more is written about it
        # Seeded from the pod's status, so the conditions the kubelet does not change (PodScheduled, set by
        # the binding) keep their lastTransitionTime, as the kubelet's status manager keeps it.
        self.conditions: dict[str, dict[str, Any]] = {
            c["type"]: dict(c)
            for c in (pod.get("status") or {}).get("conditions") or []
            if isinstance(c, dict) and "type" in c and "lastTransitionTime" in c
        }
        self.published: dict[str, Any] | None = None
        self.events_sent: set[tuple[str, str]] = set()
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    @property
    def spec(self) -> dict[str, Any]:
        return self.pod.get("spec") or {}

    @property
    def every_container(self) -> list[_Container]:
        return [*self.init_containers.values(), *self.containers.values()]

    def pending_init(self) -> _Container | None:
        """The first init container that has not succeeded yet (None: the pod is initialized)."""
        for c in self.init_containers.values():
            if not (c.done and c.state.get("terminated", {}).get("exitCode") == 0):
                return c
        return None

    def update(self, pod: dict[str, Any]) -> None:
        self.pod = pod
        self.wakeup.set()

    def wake(self) -> None:
        self.wakeup.set()

    async def run(self) -> None:
        try:
            if self.previous is not None and self.previous.task is not None:
                # The same name's previous pod may still be tearing down in the same directory.
                await asyncio.wait({self.previous.task})
            self.previous = None
            await self._live()
        finally:
            await self._teardown()

    async def _live(self) -> None:
        self.ip = self.kubelet.addresses.allocate()
        self.start_time = _now()
        shutil.rmtree(self.dir / "volumes", ignore_errors=True)
        self.dir.mkdir(parents=True, exist_ok=True)
        _start_probe_workers(self)
        loop = asyncio.get_running_loop()
        while True:
            self.wakeup.clear()
            if self.pod["metadata"].get("deletionTimestamp"):
                await self._terminate()
                return
            deadlines = [c.restart_at for c in self.every_container if c.restart_at is not None]
            if _phase(self) not in ("Succeeded", "Failed"):
                if self.volumes is None:
                    _mount(self)
                if self.volumes is None:
                    deadlines.append(loop.time() + MOUNT_RETRY_SECONDS)
                else:
                    # Init containers one at a time, each to completion, then the containers together.
                    pending = self.pending_init()
                    for c in [pending] if pending is not None else self.containers.values():
                        idle = c.process is None and c.killing is None and not c.done
                        if idle and (c.restart_at is None or c.restart_at <= loop.time()):
                            await _start(self, c)
            _trigger_readiness(self)
            if not await _publish(self):
                deadlines.append(loop.time() + 1.0)
            timeout = max(0.0, min(deadlines) - loop.time()) if deadlines else None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wakeup.wait(), timeout)

    def ended(self) -> bool:
        """Whether every container has ended for good (the pod's phase is Succeeded or Failed)."""
        return _phase(self) in ("Succeeded", "Failed")

    def removed(self) -> None:
        """The pod is gone from the API server: kill what still runs, at once."""
        self.gone = True
        if self.task is not None and not self.confirmed:
            self.task.cancel()

    async def _teardown(self) -> None:
        self.terminating = True  # no more restarts
        tasks = [t for c in self.every_container for t in (*c.probes, c.killing) if t is not None]
        for task in tasks:
            task.cancel()
        for c in self.every_container:
            if c.process is not None:
                _signal_group(c.process.pid, signal.SIGKILL)
        waits = [c.exit_task for c in self.every_container if c.exit_task is not None]
        try:
            await asyncio.gather(*tasks, *waits, return_exceptions=True)
        finally:
            if self.ip:
                self.kubelet.addresses.release(self.ip)
            # What the pod wrote to configMap and emptyDir volumes goes with it; logs stay for reading.
            shutil.rmtree(self.dir / "volumes", ignore_errors=True)

    def configmap_changed(self, namespace: str, name: str) -> None:
        self.wake()  # a mount or a container's env may be waiting for this ConfigMap
        if self.volumes is None:
            return
        for volume in self.configmap_volumes.get((namespace, name), []):
            try:
                _write_configmap(self, volume)
            except (
                _MountError
            ) as error:  # a deleted ConfigMap: the pod keeps the last content, like Kubernetes
                log.debug(
                    "%s/%s: configMap volume %s not updated: %s", self.namespace, self.name, name, error
                )

    # -- stopping --------------------------------------------------------------------------------------

    async def _stop_container(self, c: _Container, grace: float) -> None:
        """As the kubelet's killContainer: the preStop hook (given the grace period), SIGTERM, what is left
        of the period in whole seconds but never less than 2 s, SIGKILL; returns once the process is gone."""
        process, exit_task = c.process, c.exit_task
        if process is None or exit_task is None:
            return
        loop = asyncio.get_running_loop()
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if hook and grace > 0:
            began = loop.time()
            await _run_handler(self, c, hook, grace)
            grace -= int(loop.time() - began)
        if process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(exit_task), max(grace, MINIMUM_GRACE_SECONDS))
        except TimeoutError:
            _signal_group(process.pid, signal.SIGKILL)
            await asyncio.shield(exit_task)

    def _kill_unhealthy(self, c: _Container, kind: str, probe: dict[str, Any]) -> None:
        """Kill a container that failed its liveness or startup probe, as computePodActions and SyncPod do:
        restarted afterwards unless the restart policy is Never; under Never, with no other container left
        running, the pod is stopped instead (`KillPod`)."""
        if self.terminating or c.killing is not None:
            return
        restart = self.spec.get("restartPolicy", "Always") != "Never"
        others = [o for o in self.containers.values() if o is not c and o.process and o.killing is None]
        # setTerminationGracePeriod: the pod's deletion grace period, else the probe's (only for this kill,
        # not for the pod's), else the pod's.
        grace = self.pod["metadata"].get("deletionGracePeriodSeconds")
        pod_grace = self.spec.get("terminationGracePeriodSeconds", 30)
        if restart or others:
            message = f"Container {c.name} failed {kind} probe" + (", will be restarted" if restart else "")
            if grace is None:
                grace = probe.get("terminationGracePeriodSeconds", pod_grace)
        else:
            message = f"Stopping container {c.name}"
        if grace is None:
            grace = pod_grace
        _event(self, "Killing", message)
        c.restart_after_kill = restart

        async def kill() -> None:
            try:
                await self._stop_container(c, float(grace))
            finally:
                c.killing = None
                self.wake()

        c.killing = asyncio.create_task(kill())

    async def _terminate(self) -> None:
        self.terminating = True
        meta = self.pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = self.spec.get("terminationGracePeriodSeconds", 30)
        for c in self.every_container:
            c.restart_at = None
            if c.process is not None:
                _event(self, "Killing", f"Stopping container {c.name}")
        containers = self.every_container
        await asyncio.gather(
            *(self._stop_container(c, float(grace)) for c in containers if c.process and not c.killing),
            *(asyncio.shield(c.killing) for c in containers if c.killing),
        )
        for c in self.every_container:
            c.ready = c.ready and c.init  # a succeeded init container stays ready
            c.started = False
            if "terminated" in c.last_state and "waiting" in c.state:
                c.state = {"terminated": c.last_state["terminated"]}
        await _publish(self)
        self.confirmed = True
        try:
            await self.kubelet.api(
                self.kubelet.core.delete_namespaced_pod,
                self.name,
                self.namespace,
                grace_period_seconds=0,
                body=client.V1DeleteOptions(
                    grace_period_seconds=0, preconditions=client.V1Preconditions(uid=self.uid)
                ),
            )
        except ApiException as error:
            if error.status not in (404, 409):  # gone already, or a new pod of that name
                log.warning("%s/%s: deleting the pod failed: %s", self.namespace, self.name, error)
        except (OSError, urllib3.exceptions.HTTPError) as error:
            log.warning("%s/%s: deleting the pod failed: %s", self.namespace, self.name, error)
