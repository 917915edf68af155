"""The local control plane's kubelet: it runs the containers of the Pods bound to its nodes as processes
on this machine.

`ProcessKubelet` talks to the API server only through the official `kubernetes` client, as a real kubelet
talks through client-go: it registers its Node objects (`node`), lists and watches ConfigMaps and, for
each of its nodes, the Pods bound to it (`spec.nodeName`, a field selector per node, as a kubelet
watches; `informer`), writes `pods/status`, records Events (`podstatus`) and confirms graceful deletions.
Each pod is run by a worker of its own (`podworker`). One kubelet serves one or more nodes (`nodes`, one
`NodeConfig` each): pods on any of them run the same way, on this machine. What it models, and how:

* **Nodes.** Registration with capacity, allocatable, labels, taints and conditions (`node`). A pod not
  bound to one of its nodes is not run: binding is the scheduler's business (`scheduler.py`).
* **Admission.** A pod bound to a node whose allocatable resources its requests do not fit beside the
  pods already admitted there (those not ended) is rejected as the kubelet's predicate admission does:
  phase `Failed`, reason `OutOfcpu`, `OutOfmemory`, `OutOfpods` or `OutOf<resource>` (e.g.
  `OutOfnvidia.com/gpu`), message `Pod was rejected: Node didn't have enough resource: <resource>,
  requested: N, used: N, capacity: N`, and a Warning Event. As the kubelet does, extended resources the
  node does not list are left out of that check. Only resources are checked (not node affinity, taints
  or host ports), so this only matters for pods created with `spec.nodeName` set, which skip the
  scheduler.

* **Pod network.** Each pod gets a loopback address of its own, locked host-wide; an argument or env
  value that binds all interfaces is rewritten to it (`node`). In place of cluster DNS, an argument or
  env value that is the DNS name of a pod with `hostname` and `subdomain` (a headless Service's pod, as
  LeaderWorkerSets and StatefulSets make them: `<hostname>.<subdomain>.<namespace>[.svc[.cluster.local]]`,
  alone, after `--flag=` or before `:port`) is rewritten to that pod's address when the container starts;
  a name whose pod has no address yet is left as it is.
* **Images.** Nothing is pulled. An image whose name starts with one of the known prefixes runs
  `command + args` locally; the command's first word is looked up in the virtualenv's `bin/` first (so
  `ember` is this project's `ember`), then on PATH. A container without `command` runs the prefix's
  entrypoint (for the engine image, `ember serve`, as in Dockerfile.engine). Any other image leaves the
  container waiting with reason `ErrImagePull`, so the pod stays `Pending`.
* **Volumes.** `configMap` (updated atomically), `emptyDir`, `persistentVolumeClaim` (through `claims`)
  and `hostPath`, with mount paths rewritten to host directories (`podvolumes`).
* **Environment.** `env`, `envFrom` (ConfigMaps and Secrets), `$(VAR)` expansion, fieldRef,
  configMapKeyRef and secretKeyRef (`podenv`), with the kubelet's errors for what is missing.
* **Init containers.** Run one at a time, each to completion, before the containers start; a failed one
  is restarted with the same back-off (`Init:CrashLoopBackOff` in `kubectl get pods`), or fails the pod
  under `restartPolicy: Never`.
* **Probes.** startup, readiness and liveness probes with httpGet, tcpSocket or exec, on the kubelet's
  prober's schedule (`probes`); a container failing liveness or startup is killed and restarted
  (`podworker`).
* **Restarts.** `restartPolicy` with exponential back-off and `CrashLoopBackOff` (`containers`);
  container statuses and phases as the kubelet reports them (`podstatus`).
* **Deletion.** preStop hook, SIGTERM, grace period, SIGKILL, then the pod is deleted (`podworker`).
* **Logs.** stdout and stderr of each container go to `<pod dir>/<container>.log`, appended across
  restarts (`log_path()`); each run appends `<offset> <containerID>` to `<container>.log.runs`, so that
  the API server's `pods/log` (`kubectl logs`, `--previous`) can serve one run
  (`apiserver/podlogs.py`; `DevCluster` wires it up).
* **Processes.** Each process it starts (a container's run, an exec probe) runs in a session of its own
  and is recorded as `<state_dir>/processes/<pid>`, holding the process's start time (field 22 of
  `/proc/<pid>/stat`), until it has exited. As a real node's containers outlive a kubelet that dies, these
  processes outlive a kubelet that is killed; `kill_recorded_processes(state_dir)` then ends them (the
  process group of each recorded process that still runs with the recorded start time, so a reused process
  id is left alone). `ember dev down` and `ember dev up` call it for a control plane that died.

Not modelled: isolation of any kind (processes share the host's filesystem, users, PID space and ports;
127.0.0.1 inside a pod is the host's), cgroups and resource limits (requests count only at admission),
image pulls, DNS (Service names do not resolve; only pods' names are rewritten as above), Service
environment variables, node status heartbeats (the node's Lease is its heartbeat: `nodelease`), sidecar init containers (`restartPolicy: Always` on an
init container) and ephemeral containers, secret, projected and downwardAPI volumes, read-only mounts,
in-place updates of a running pod's spec, the
terminationMessagePath file, readiness gates, exec/attach/port-forward. Linux only.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes.client.exceptions import ApiException

from ember_localcluster import fit
from ember_localcluster.apiserver.discovery import SERVER_VERSION
from ember_localcluster.informer import API_TIMEOUT, MERGE_PATCH, Informer, _key
from ember_localcluster.kubelet.containers import BACKOFF_INITIAL, BACKOFF_MAX
from ember_localcluster.kubelet.node import (
    ADDRESS_LOCKS,
    NodeConfig,
    _Addresses,
    _signal_group,
    node_labels,
    node_manifest,
    node_status,
)
from ember_localcluster.kubelet.nodelease import LEASE_DURATION_SECONDS, come_back, lose, renew_leases
from ember_localcluster.kubelet.podstatus import _post_event
from ember_localcluster.kubelet.podvolumes import write_atomically
from ember_localcluster.kubelet.podworker import _PodWorker
from ember_localcluster.runtime import BackgroundRuntime

__all__ = [
    "DEFAULT_IMAGES",
    "ENGINE_IMAGE",
    "Informer",
    "NodeConfig",
    "ProcessKubelet",
    "kill_recorded_processes",
    "write_atomically",
]

log = logging.getLogger("ember.kubelet")

ENGINE_IMAGE = "ghcr.io/ember-dev/ember-engine"
# Image name prefix → what the image runs when a container names no command (its ENTRYPOINT).
DEFAULT_IMAGES: Mapping[str, Sequence[str]] = {ENGINE_IMAGE: ("ember", "serve")}


class ProcessKubelet:
    """Runs the Pods of the API server at `kubeconfig` as local processes (see the module docstring).

    `state_dir` holds one directory per pod (`pods/<namespace>_<name>`: volumes and logs).
    `claims` maps PersistentVolumeClaim names to host directories. `images` maps image name prefixes to
    the command the image runs when a container names none (a plain sequence of prefixes is accepted:
    containers of those images must then name their command); only these images run. `ip_prefix` is the
    loopback /16 pod addresses come from. `bin_dir` is searched first for a command's first word (default:
    the directory of this Python, i.e. the virtualenv's `bin/`). `backoff_initial`/`backoff_max` shape the
    restart back-off (by default the kubelet's: 10 s doubling to 300 s).

    `nodes` are the Nodes it registers and runs pods for (default: one, `ember-local`, see `NodeConfig`).
    Each node's Lease is renewed every quarter of `lease_seconds` (`nodelease`); `stop_node(name)` loses a
    node as a power cut would, `start_node(name)` brings it back.

    `start()` returns once the kubelet has registered its nodes and listed their Pods; `stop()` kills
    every process it started (SIGKILL, no grace) and leaves the pods' and nodes' objects as they are, like
    a node that went away.
    """

    def __init__(
        self,
        kubeconfig: str | Path,
        state_dir: str | Path,
        *,
        claims: Mapping[str, str | Path] | None = None,
        images: Mapping[str, Sequence[str]] | Sequence[str] = DEFAULT_IMAGES,
        ip_prefix: str = "127.1.",
        bin_dir: str | Path | None = None,
        backoff_initial: float = BACKOFF_INITIAL,
        backoff_max: float = BACKOFF_MAX,
        nodes: Sequence[NodeConfig] | None = None,
        lease_seconds: int = LEASE_DURATION_SECONDS,
    ) -> None:
        self.nodes: dict[str, NodeConfig] = {
            n.name: n for n in (nodes if nodes is not None else [NodeConfig()])
        }
        if not self.nodes:
            raise ValueError("a kubelet needs at least one node")
        self.kubeconfig = Path(kubeconfig)
        self.state_dir = Path(state_dir).resolve()
        self.claims = {name: Path(path).resolve() for name, path in (claims or {}).items()}
        if isinstance(images, Mapping):
            self.images: dict[str, tuple[str, ...]] = {p: tuple(e) for p, e in images.items()}
        else:
            self.images = {prefix: () for prefix in images}
        self.addresses = _Addresses(ip_prefix, ADDRESS_LOCKS)
        self.bin_dir = Path(bin_dir) if bin_dir is not None else Path(sys.executable).parent
        self.backoff_initial, self.backoff_max = backoff_initial, backoff_max
        self.configmaps: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.session: aiohttp.ClientSession | None = None
        self._workers: dict[str, _PodWorker] = {}  # by uid
        self._latest: dict[tuple[str, str], _PodWorker] = {}  # by (namespace, name)
        self._finished: set[str] = set()  # uids whose deletion this kubelet confirmed
        self._rejected: set[str] = set()  # uids refused at admission
        self._node_status: dict[str, dict[str, Any]] = {}  # what each node reported at registration
        self.lease_seconds = lease_seconds
        self.started_clock = 0.0  # time.monotonic() (the loop's clock) when `start()` began
        self.lost: set[str] = set()  # nodes stopped by `stop_node`
        # One renewal of a node's Lease at a time, as its one lease controller makes them (`nodelease`).
        self.lease_locks: dict[str, asyncio.Lock] = {name: asyncio.Lock() for name in self.nodes}
        self._background: set[asyncio.Task[Any]] = set()
        self._groups: set[int] = set()
        self._groups_lock = threading.Lock()
        self._runtime = BackgroundRuntime("kubelet", api_workers=4)
        self._heartbeats: ThreadPoolExecutor | None = None

    # -- public ----------------------------------------------------------------------------------------

    def __enter__(self) -> ProcessKubelet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def node_names(self) -> list[str]:
        return list(self.nodes)

    @property
    def pods_dir(self) -> Path:
        """Where the pods' directories are (what the API server's `pods/log` reads)."""
        return self.state_dir / "pods"

    def pod_dir(self, namespace: str, name: str) -> Path:
        return self.pods_dir / f"{namespace}_{name}"

    def pod_dns_names(self) -> dict[str, str]:
        """The DNS names cluster DNS gives pods with `hostname` and `subdomain` (CoreDNS's
        `<hostname>.<subdomain>.<namespace>.svc.<domain>`, and the short forms a pod's search path
        resolves), for this kubelet's pods that have an address."""
        names = {}
        for worker in self._latest.values():
            host, sub = worker.spec.get("hostname"), worker.spec.get("subdomain")
            if worker.ip and host and sub:
                base = f"{host}.{sub}.{worker.namespace}"
                for name in (base, f"{base}.svc", f"{base}.svc.cluster.local"):
                    names[name] = worker.ip
        return names

    def log_path(self, namespace: str, name: str, container: str) -> Path:
        return self.pod_dir(namespace, name) / f"{container}.log"

    @property
    def core(self) -> Any:
        """The official client's CoreV1Api while the kubelet runs, else None."""
        return self._runtime.core

    def start(self) -> ProcessKubelet:
        runtime = self._runtime
        if runtime.running:
            raise RuntimeError("the kubelet is already running")
        self.started_clock = time.monotonic()
        (self.state_dir / "pods").mkdir(parents=True, exist_ok=True)
        runtime.start(self.kubeconfig)
        self._heartbeats = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kubelet-heartbeat")
        runtime.run(self._open_session(), timeout=10)
        runtime.run(self._register_nodes(), timeout=30)
        configmaps = runtime.informer(
            runtime.core.list_config_map_for_all_namespaces, self._on_configmap, name="configmaps"
        )
        secrets = runtime.informer(
            runtime.core.list_secret_for_all_namespaces, self._on_secret, name="secrets"
        )
        # A kubelet watches the pods bound to its node: one field-selected informer per node.
        pods = [
            runtime.informer(
                functools.partial(
                    runtime.core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={name}"
                ),
                self._on_pod,
                name=f"pods-{name}",
            )
            for name in self.nodes
        ]
        # ConfigMaps and Secrets first, so that the first pods find theirs.
        runtime.sync(configmaps, secrets)
        runtime.sync(*pods)
        runtime.run(self._start_leases(), timeout=10)
        return self

    def stop_node(self, name: str) -> None:
        """Lose node `name` as a power cut would (see `nodelease`): its lease is no longer renewed and its
        pods' processes are killed at once, with nothing written to the API server about them."""
        if name not in self.nodes:
            raise KeyError(f"no node {name!r} here (nodes: {', '.join(self.nodes)})")
        self._runtime.run(lose(self, name), timeout=30)

    def start_node(self, name: str) -> None:
        """Bring node `name` back after `stop_node`: status posted, lease renewed, its pods taken up again."""
        if name not in self.nodes:
            raise KeyError(f"no node {name!r} here (nodes: {', '.join(self.nodes)})")
        self._runtime.run(come_back(self, name), timeout=30)

    async def post_node_status(self, name: str) -> None:
        """Post the node's status afresh (Ready, with this moment's heartbeat)."""
        status = node_status(self.nodes[name], self.state_dir, str(SERVER_VERSION["gitVersion"]))
        self._node_status[name] = status
        await self.heartbeat(self._runtime.core.patch_node_status, name, {"status": status})

    async def _start_leases(self) -> None:
        self.spawn(renew_leases(self))

    def stop(self) -> None:
        runtime = self._runtime
        if not runtime.running:
            return
        runtime.stop_informers()
        self._kill_all()
        runtime.stop_loop(self._shutdown)
        self._kill_all()  # anything started while shutting down
        self.addresses.release_all()
        runtime.close()
        if self._heartbeats is not None:
            self._heartbeats.shutdown(wait=False, cancel_futures=True)
            self._heartbeats = None

    # -- for the pod workers ---------------------------------------------------------------------------

    def entrypoint(self, image: str) -> tuple[str, ...] | None:
        """What `image` runs without a command, or None when it cannot run here."""
        for prefix, entrypoint in self.images.items():
            rest = image[len(prefix) :]
            if image.startswith(prefix) and (
                not rest or not prefix or prefix[-1] in "/:@" or rest[0] in "/:@"
            ):
                return entrypoint
        return None

    def resolve(self, word: str) -> str:
        if "/" in word:
            return word
        local = self.bin_dir / word
        if local.is_file() and os.access(local, os.X_OK):
            return str(local)
        return shutil.which(word) or word

    async def api(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the official client off the loop; returns the decoded JSON body."""
        return await self._call(self._runtime.executor, method, *args, **kwargs)

    async def heartbeat(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """As `api`, on a thread of its own: the node's status and Lease updates, which the kubelet sends
        through a client of their own (its HeartbeatClient), so they never wait behind the pods' calls."""
        assert self._heartbeats is not None, "the kubelet is not running"
        return await self._call(self._heartbeats, method, *args, **kwargs)

    async def _call(self, executor: Any, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("_request_timeout", API_TIMEOUT)
        call = functools.partial(method, *args, _preload_content=False, **kwargs)
        response = await asyncio.get_running_loop().run_in_executor(executor, call)
        return json.loads(response.data or b"null")

    def spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("background API call failed: %s", task.exception())

    def track(self, pgid: int) -> None:
        with self._groups_lock:
            self._groups.add(pgid)
        started = _start_time(pgid)
        if started is not None:
            with contextlib.suppress(OSError):
                records = self.state_dir / PROCESSES
                records.mkdir(parents=True, exist_ok=True)
                (records / f".{pgid}").write_text(started)
                (records / f".{pgid}").rename(records / str(pgid))  # never a record without its time

    def untrack(self, pgid: int) -> None:
        with self._groups_lock:
            self._groups.discard(pgid)
        (self.state_dir / PROCESSES / str(pgid)).unlink(missing_ok=True)

    # -- internals -------------------------------------------------------------------------------------

    async def _register_nodes(self) -> None:
        """Create each node with its status; one that exists gets its labels and status refreshed."""
        core = self._runtime.core
        version = str(SERVER_VERSION["gitVersion"])
        for config in self.nodes.values():
            status = node_status(config, self.state_dir, version)
            self._node_status[config.name] = status
            try:
                await self.api(core.create_node, {**node_manifest(config), "status": status})
            except ApiException as error:
                if error.status != 409:
                    raise
                await self.api(core.patch_node, config.name, {"metadata": {"labels": node_labels(config)}})
                await self.api(core.patch_node_status, config.name, {"status": status})

    async def _open_session(self) -> None:
        # A fresh connection per probe, as the kubelet's prober does.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    def _kill_all(self) -> None:
        with self._groups_lock:
            groups = list(self._groups)
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)
            (self.state_dir / PROCESSES / str(pgid)).unlink(missing_ok=True)

    async def _shutdown(self) -> None:
        tasks = [w.task for w in self._workers.values() if w.task is not None]
        for task in [*tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*tasks, *self._background, return_exceptions=True)
        if self.session is not None:
            await self.session.close()

    def _on_configmap(self, kind: str, obj: dict[str, Any]) -> None:
        key = _key(obj)
        if kind == "DELETED":
            self.configmaps.pop(key, None)
        else:
            self.configmaps[key] = obj
        for worker in self._workers.values():
            if worker.namespace == key[0]:
                worker.configmap_changed(*key)

    def _on_secret(self, kind: str, obj: dict[str, Any]) -> None:
        key = _key(obj)
        if kind == "DELETED":
            self.secrets.pop(key, None)
        else:
            self.secrets[key] = obj
        for worker in self._workers.values():
            if worker.namespace == key[0]:
                worker.wake()  # a container's env may be waiting for this Secret

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self._workers.get(uid)
        if kind == "DELETED":
            self._finished.discard(uid)
            self._rejected.discard(uid)
            if worker is not None:
                worker.removed()
            return
        if worker is not None:
            worker.update(pod)
            return
        if uid in self._finished or uid in self._rejected or fit.is_terminal(pod):
            return
        node = (pod.get("spec") or {}).get("nodeName")
        if node not in self.nodes or node in self.lost:
            return  # not bound here (the informers select by node; this guards the rest), or lost
        if self._reject_if_unfit(pod, node):
            return
        key = _key(pod)
        previous = self._latest.get(key)
        worker = _PodWorker(self, pod, previous if previous is not None and previous.task else None)
        self._workers[uid] = worker
        self._latest[key] = worker
        worker.task = asyncio.get_running_loop().create_task(worker.run())
        worker.task.add_done_callback(functools.partial(self._worker_done, worker))

    def _admitted(self, node: str) -> list[dict[str, Any]]:
        """The pods this kubelet admitted on `node` that still hold its resources."""
        return [
            w.pod
            for w in self._workers.values()
            if w.node_name == node and not w.confirmed and not w.gone and not w.ended()
        ]

    def _reject_if_unfit(self, pod: dict[str, Any], node: str) -> bool:
        """The predicate admission handler's resource check (see the module docstring)."""
        info = fit.NodeInfo(
            {"metadata": {"name": node}, "status": self._node_status[node]}, self._admitted(node)
        )
        allocatable = info.allocatable()
        # As the kubelet does, leave out extended resources this node does not know of.
        known = {
            **pod,
            "spec": {
                **(pod.get("spec") or {}),
                "containers": [
                    _without_unknown_extended(c, allocatable)
                    for c in (pod.get("spec") or {}).get("containers") or []
                ],
            },
        }
        short = fit.insufficient(known, info)
        if not short:
            return False
        resource, requested, used, capacity = short[0]
        reason = f"OutOf{resource}"
        message = (
            f"Node didn't have enough resource: {resource}, requested: {requested}, used: {used}, "
            f"capacity: {capacity}"
        )
        meta = pod["metadata"]
        self._rejected.add(meta["uid"])
        status = {"status": {"phase": "Failed", "reason": reason, "message": f"Pod was rejected: {message}"}}
        core = self._runtime.core
        namespace = meta.get("namespace") or "default"
        self.spawn(
            self.api(
                core.patch_namespaced_pod_status, meta["name"], namespace, status, _content_type=MERGE_PATCH
            )
        )
        self.spawn(_post_event(self, pod, node, reason, message, "Warning"))
        log.info("pod %s/%s rejected on %s: %s", namespace, meta["name"], node, message)
        return True

    def _worker_done(self, worker: _PodWorker, task: asyncio.Task[None]) -> None:
        self._workers.pop(worker.uid, None)
        if self._latest.get((worker.namespace, worker.name)) is worker:
            del self._latest[(worker.namespace, worker.name)]
        worker.task = None
        if worker.confirmed:
            self._finished.add(worker.uid)
        if not task.cancelled() and task.exception() is not None:
            log.error("pod %s/%s: worker failed", worker.namespace, worker.name, exc_info=task.exception())


def _without_unknown_extended(container: dict[str, Any], allocatable: Mapping[str, int]) -> dict[str, Any]:
    resources = container.get("resources") or {}

    def keep(amounts: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in amounts.items() if "/" not in k or "kubernetes.io/" in k or k in allocatable}

    return {
        **container,
        "resources": {
            "requests": keep(resources.get("requests") or {}),
            "limits": keep(resources.get("limits") or {}),
        },
    }


PROCESSES = "processes"


def _start_time(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/<pid>/stat, clock ticks since boot); None when it
    has exited or is a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else fields[19]


def kill_recorded_processes(state_dir: str | Path) -> list[int]:
    """Kill (SIGKILL) the process group of each process a kubelet with `state_dir` recorded that still
    runs with its recorded start time, wait until those leaders have exited, and drop the records: what
    a kubelet that died left running. Returns the process ids it killed."""
    killed = []
    for record in sorted(Path(state_dir, PROCESSES).glob("[0-9]*")):
        with contextlib.suppress(OSError, ValueError):
            pid = int(record.name)
            if _start_time(pid) == record.read_text().strip():
                _signal_group(pid, signal.SIGKILL)
                killed.append(pid)
        record.unlink(missing_ok=True)
    deadline = time.monotonic() + 10
    while any(_start_time(pid) is not None for pid in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed
