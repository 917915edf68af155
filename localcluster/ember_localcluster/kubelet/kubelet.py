"""The local control plane's kubelet: it runs every Pod's containers as processes on this machine.

`ProcessKubelet` talks to the API server only through the official `kubernetes` client, as a real kubelet
talks through client-go: it lists and watches Pods and ConfigMaps in all namespaces (`informer`), writes
`pods/status`, records Events (`podstatus`) and confirms graceful deletions. Each pod is run by a worker
of its own (`podworker`). What it models, and how:

* **Pod network.** Each pod gets a loopback address of its own, locked host-wide; an argument or env
  value that binds all interfaces is rewritten to it (`node`).
* **Images.** Nothing is pulled. An image whose name starts with one of the known prefixes runs
  `command + args` locally; the command's first word is looked up in the virtualenv's `bin/` first (so
  `ember` is this project's `ember`), then on PATH. A container without `command` runs the prefix's
  entrypoint (for the engine image, `ember serve`, as in Dockerfile.engine). Any other image leaves the
  container waiting with reason `ErrImagePull`, so the pod stays `Pending`.
* **Volumes.** `configMap` (updated atomically), `emptyDir`, `persistentVolumeClaim` (through `claims`)
  and `hostPath`, with mount paths rewritten to host directories (`podvolumes`).
* **Environment.** `env`, `envFrom`, `$(VAR)` expansion, fieldRef and configMapKeyRef (`podenv`).
* **Probes.** startup, readiness and liveness probes with httpGet, tcpSocket or exec (`probes`).
* **Restarts.** `restartPolicy` with exponential back-off and `CrashLoopBackOff` (`containers`);
  container statuses and phases as the kubelet reports them (`podstatus`).
* **Deletion.** preStop hook, SIGTERM, grace period, SIGKILL, then the pod is deleted (`podworker`).
* **Logs.** stdout and stderr of each container go to `<pod dir>/<container>.log`, appended across
  restarts. There is no `kubectl logs`: read the file (`log_path()`).

Not modelled: isolation of any kind (processes share the host's filesystem, users, PID space and ports;
127.0.0.1 inside a pod is the host's), cgroups and resource requests/limits, image pulls, DNS (Service
names do not resolve), Service environment variables, nodes and scheduling (every pod is run, whatever
its nodeName), init, sidecar and ephemeral containers (a pod with initContainers stays Pending), secret,
projected and downwardAPI volumes, read-only mounts, in-place updates of a running pod's spec, the
terminationMessagePath file, readiness gates, exec/attach/port-forward. Linux only.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from ember_localcluster.informer import API_TIMEOUT, Informer, _key
from ember_localcluster.kubelet.node import ADDRESS_LOCKS, _Addresses, _signal_group
from ember_localcluster.kubelet.podvolumes import write_atomically
from ember_localcluster.kubelet.podworker import _PodWorker
from ember_localcluster.runtime import BackgroundRuntime

__all__ = ["DEFAULT_IMAGES", "ENGINE_IMAGE", "Informer", "ProcessKubelet", "write_atomically"]

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
    restart back-off.

    `start()` returns once the kubelet has listed the API server's Pods; `stop()` kills every process it
    started (SIGKILL, no grace) and leaves the pods' objects as they are, like a node that went away.
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
        backoff_initial: float = 1.0,
        backoff_max: float = 10.0,
    ) -> None:
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
        self.session: aiohttp.ClientSession | None = None
        self._workers: dict[str, _PodWorker] = {}  # by uid
        self._latest: dict[tuple[str, str], _PodWorker] = {}  # by (namespace, name)
        self._finished: set[str] = set()  # uids whose deletion this kubelet confirmed
        self._background: set[asyncio.Task[Any]] = set()
        self._groups: set[int] = set()
        self._groups_lock = threading.Lock()
        self._runtime = BackgroundRuntime("kubelet", api_workers=4)

    # -- public ----------------------------------------------------------------------------------------

    def __enter__(self) -> ProcessKubelet:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def pod_dir(self, namespace: str, name: str) -> Path:
        return self.state_dir / "pods" / f"{namespace}_{name}"

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
        (self.state_dir / "pods").mkdir(parents=True, exist_ok=True)
        runtime.start(self.kubeconfig)
        runtime.run(self._open_session(), timeout=10)
        configmaps = runtime.informer(
            runtime.core.list_config_map_for_all_namespaces, self._on_configmap, name="configmaps"
        )
        pods = runtime.informer(runtime.core.list_pod_for_all_namespaces, self._on_pod, name="pods")
        # ConfigMaps first, so that the first pods find theirs.
        runtime.sync(configmaps)
        runtime.sync(pods)
        return self

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
        kwargs.setdefault("_request_timeout", API_TIMEOUT)
        call = functools.partial(method, *args, _preload_content=False, **kwargs)
        response = await asyncio.get_running_loop().run_in_executor(self._runtime.executor, call)
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

    def untrack(self, pgid: int) -> None:
        with self._groups_lock:
            self._groups.discard(pgid)

    # -- internals -------------------------------------------------------------------------------------

    async def _open_session(self) -> None:
        # A fresh connection per probe, as the kubelet's prober does.
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    def _kill_all(self) -> None:
        with self._groups_lock:
            groups = list(self._groups)
        for pgid in groups:
            _signal_group(pgid, signal.SIGKILL)

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

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self._workers.get(uid)
        if kind == "DELETED":
            self._finished.discard(uid)
            if worker is not None:
                worker.removed()
            return
        if worker is not None:
            worker.update(pod)
            return
        if uid in self._finished or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            return
        key = _key(pod)
        previous = self._latest.get(key)
        worker = _PodWorker(self, pod, previous if previous is not None and previous.task else None)
        self._workers[uid] = worker
        self._latest[key] = worker
        worker.task = asyncio.get_running_loop().create_task(worker.run())
        worker.task.add_done_callback(functools.partial(self._worker_done, worker))

    def _worker_done(self, worker: _PodWorker, task: asyncio.Task[None]) -> None:
        self._workers.pop(worker.uid, None)
        if self._latest.get((worker.namespace, worker.name)) is worker:
            del self._latest[(worker.namespace, worker.name)]
        worker.task = None
        if worker.confirmed:
            self._finished.add(worker.uid)
        if not task.cancelled() and task.exception() is not None:
            log.error("pod %s/%s: worker failed", worker.namespace, worker.name, exc_info=task.exception())
