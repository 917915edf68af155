"""One container's runs: starting its process, its exit, and the restart policy with its back-off.

`restartPolicy` Always, OnFailure or Never (an init container is done once it exits 0, and is restarted
after a failure unless the policy is Never, as the kubelet does; a container killed for failing its
liveness or startup probe is restarted unless the policy is Never, whatever its exit code, as
computePodActions does); restarts wait out an exponential back-off as the kubelet's (pkg/kubelet:
`backOffPeriod` 10 s doubling to `MaxContainerBackOff` 300 s by default; the first exit restarts at once,
the second waits 10 s, the third 20 s; reset after a run of twice the cap) during which the container
waits with reason `CrashLoopBackOff`. With `FallbackToLogsOnError` a failed run's terminated message is the
tail of its log (the last 80 lines or 2 KiB, whichever is less). An image the kubelet cannot run leaves the
container waiting with reason `ErrImagePull`; a container it cannot configure, with
`CreateContainerConfigError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ember_localcluster.kubelet.node import _signal_group
from ember_localcluster.kubelet.podenv import _command, _ConfigError
from ember_localcluster.kubelet.podstatus import _event, _now

if TYPE_CHECKING:
    from ember_localcluster.kubelet.podworker import _PodWorker

LOG_TAIL_LINES, LOG_TAIL_BYTES = 80, 2048
# The kubelet's crash-loop back-off (pkg/kubelet/kubelet.go: backOffPeriod, MaxContainerBackOff).
BACKOFF_INITIAL, BACKOFF_MAX = 10.0, 300.0


@dataclass(slots=True, eq=False)
class _Container:
    spec: dict[str, Any]
    init: bool = False  # an init container: runs to completion before the next one and the containers
    runs: int = 0
    restart_count: int = 0
    process: asyncio.subprocess.Process | None = None
    exit_task: asyncio.Task[None] | None = None
    killing: asyncio.Task[None] | None = None
    probes: list[asyncio.Task[None]] = field(default_factory=list)  # its probe workers, one per probe
    probe_triggers: dict[str, asyncio.Event] = field(default_factory=dict)  # a run now, by probe kind
    restart_after_kill: bool = False  # killed for failing a probe: restarted whatever its exit code
    container_id: str = ""
    started_at: str = ""
    started_clock: float = 0.0
    log_offset: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "ContainerCreating"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    ready: bool = False
    started: bool = False
    restart_at: float | None = None
    backoff: float = 0.0
    done: bool = False  # terminated for good: the restart policy says no

    @property
    def name(self) -> str:
        return str(self.spec["name"])


def _log_tail(path: Path, offset: int) -> str:
    """The end of one run's log: the last 80 lines or 2 KiB of what it wrote, whichever is less."""
    with contextlib.suppress(OSError), path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        f.seek(max(offset, size - LOG_TAIL_BYTES))
        lines = f.read().decode("utf-8", errors="replace").splitlines()
        return "\n".join(lines[-LOG_TAIL_LINES:])
    return ""


async def _start(worker: _PodWorker, c: _Container) -> None:
    image = str(c.spec.get("image", ""))
    entrypoint = worker.kubelet.entrypoint(image)
    if entrypoint is None:
        known = ", ".join(worker.kubelet.images)
        message = f'image "{image}" cannot run locally: only images starting with {known} run here'
        c.state = {"waiting": {"reason": "ErrImagePull", "message": message}}
        _event(worker, "Failed", f"Failed to pull image {image!r}: {message}", "Warning")
        return
    try:
        argv, env = _command(worker, c, entrypoint)
    except _ConfigError as error:
        c.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(error)}}
        _event(worker, "Failed", f"Error: {error}", "Warning")
        return
    if c.runs:
        c.restart_count += 1
    c.runs += 1
    c.restart_at = None
    c.ready = c.started = c.restart_after_kill = False
    log_path = worker.kubelet.log_path(worker.namespace, worker.name, c.name)
    c.log_offset = log_path.stat().st_size if log_path.exists() else 0
    c.started_at, c.started_clock = _now(), asyncio.get_running_loop().time()
    try:
        with log_path.open("ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=worker.dir,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                # The process keeps the pod's address locked for as long as it lives.
                pass_fds=(worker.kubelet.addresses.held[worker.ip],),
            )
    except OSError as error:
        message = f"failed to start container process: exec {argv[0]!r}: {error.strerror or error}"
        _event(worker, "Failed", f"Error: {message}", "Warning")
        _record_exit(worker, c, 128, "StartError", message)
        return
    worker.kubelet.track(process.pid)
    c.process, c.container_id = process, f"process://{process.pid}"
    # Where this run starts in the log the runs share, for the API server's `pods/log`.
    with contextlib.suppress(OSError), Path(f"{log_path}.runs").open("a") as runs:
        runs.write(f"{c.log_offset} {c.container_id}\n")
    c.state = {"running": {"startedAt": c.started_at}}
    _event(worker, "Started", f"Started container {c.name}")
    c.exit_task = asyncio.create_task(_await_exit(worker, c, process))
    # Without a startup probe a container has started once it runs; without a readiness probe it is ready
    # then too (the prober manager's UpdatePodStatus). Init containers are never probed: ready once they
    # succeeded.
    if c.init or not c.spec.get("startupProbe"):
        c.started = True
        c.ready = not c.init and not c.spec.get("readinessProbe")


async def _await_exit(worker: _PodWorker, c: _Container, process: asyncio.subprocess.Process) -> None:
    code = await process.wait()
    # The group may outlive its leader (children of the container's process).
    _signal_group(process.pid, signal.SIGKILL)
    worker.kubelet.untrack(process.pid)
    c.process = None
    exit_code = code if code >= 0 else 128 - code  # as a container runtime reports a signal
    _record_exit(worker, c, exit_code, "Completed" if exit_code == 0 else "Error")
    worker.wake()


def _record_exit(worker: _PodWorker, c: _Container, exit_code: int, reason: str, message: str = "") -> None:
    c.ready = c.started = False
    terminated: dict[str, Any] = {"exitCode": exit_code, "reason": reason}
    policy = c.spec.get("terminationMessagePolicy", "File")
    if not message and exit_code != 0 and policy == "FallbackToLogsOnError":
        message = _log_tail(worker.kubelet.log_path(worker.namespace, worker.name, c.name), c.log_offset)
    if message:
        terminated["message"] = message
    terminated.update(startedAt=c.started_at, finishedAt=_now())
    if c.container_id:
        terminated["containerID"] = c.container_id
    restart_policy = worker.spec.get("restartPolicy", "Always")
    if c.init:  # init containers run until they succeed, unless the pod never restarts anything
        restart = exit_code != 0 and restart_policy != "Never"
        c.ready = exit_code == 0
    else:
        restart = restart_policy == "Always" or (restart_policy == "OnFailure" and exit_code != 0)
        restart = restart or c.restart_after_kill
    if worker.terminating or not restart:
        c.state, c.done = {"terminated": terminated}, True
        return
    loop = asyncio.get_running_loop()
    kubelet = worker.kubelet
    if loop.time() - c.started_clock >= 2 * kubelet.backoff_max:
        c.backoff = 0.0  # it ran well for a while: start the back-off over, as the kubelet does
    c.last_state = {"terminated": terminated}
    if not c.backoff:  # a first exit restarts at once; back-off applies from the second
        c.backoff = kubelet.backoff_initial
        c.restart_at = loop.time()
        c.state = {"waiting": {"reason": "ContainerCreating"}}
        return
    # Wait out the current back-off, then double it for the next exit.
    c.restart_at = loop.time() + c.backoff
    wait = f"back-off {c.backoff:g}s restarting failed container={c.name} pod={worker.name}_{worker.namespace}({worker.uid})"
    c.backoff = min(2 * c.backoff, kubelet.backoff_max)
    c.state = {"waiting": {"reason": "CrashLoopBackOff", "message": wait}}
    _event(
        worker, "BackOff", f"Back-off restarting failed container {c.name} in pod {worker.name}", "Warning"
    )
