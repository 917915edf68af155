"""Probes and lifecycle hooks: the handlers the process kubelet runs against a container.

startup, readiness and liveness probes with `httpGet` (port by name or number, path, headers, HTTP or
HTTPS without verification), `tcpSocket` or `exec`, with initialDelaySeconds, periodSeconds,
timeoutSeconds, successThreshold and failureThreshold, run as the kubelet's prober
(pkg/kubelet/prober/worker.go): each probe of a pod's container (init containers are not probed) has one
worker from the pod's first sync to its end, across the container's restarts, probing on a ticker of
periodSeconds (started up to a period late, at random, while the kubelet itself has run for less than a
period). The tick as a worker starts finds no container yet, so a new pod's container is first probed
about a period after it started. A probe is skipped while the whole seconds since the container's start
are fewer than initialDelaySeconds, counted from the start also while a startup probe still runs. A
startup probe gates the other two; once a container has started, and at each sync of the pod while it is
not ready, its readiness probe runs at once (prober_manager.go UpdatePodStatus). Readiness drives the
container's `ready` and the pod's ContainersReady and Ready conditions; successes and failures in a row
count across the container's runs. Liveness or startup failure past the threshold kills the container
(`podworker`) and stops that worker's probes until the container's next run. gRPC probes are not
modelled and always fail. preStop hooks run the same handlers (exec, httpGet or sleep).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp

from ember_localcluster.kubelet.node import _signal_group
from ember_localcluster.kubelet.podenv import _ConfigError, _environment, expand
from ember_localcluster.kubelet.podstatus import _event, _phase
from ember_localcluster.kubelet.podvolumes import _rewriter

if TYPE_CHECKING:
    from ember_localcluster.kubelet.containers import _Container
    from ember_localcluster.kubelet.podworker import _PodWorker


def _port(c: _Container, port: Any) -> int:
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for declared in c.spec.get("ports") or []:
        if declared.get("name") == port:
            return int(declared["containerPort"])
    raise ValueError(f"port {port!r} is not a port of container {c.name}")


async def _run_handler(
    worker: _PodWorker, c: _Container, handler: dict[str, Any], timeout: float
) -> tuple[bool, str]:
    """Run one probe or hook handler: (success, what went wrong)."""
    try:
        if "exec" in handler:
            return await _exec(worker, c, handler["exec"].get("command") or [], timeout)
        if "httpGet" in handler:
            get = handler["httpGet"]
            scheme = str(get.get("scheme", "HTTP")).lower()
            path = str(get.get("path", "/"))
            url = f"{scheme}://{get.get('host') or worker.ip}:{_port(c, get.get('port'))}"
            url += path if path.startswith("/") else "/" + path
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            session = worker.kubelet.session
            assert session is not None
            try:
                async with session.get(
                    url,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                    allow_redirects=False,
                    ssl=False,
                ) as response:
                    if 200 <= response.status < 400:
                        return True, ""
                    return False, f"HTTP probe failed with statuscode: {response.status}"
            except (aiohttp.ClientError, TimeoutError) as error:
                return False, f'Get "{url}": {error or type(error).__name__}'
        if "tcpSocket" in handler:
            sock = handler["tcpSocket"]
            host, port = sock.get("host") or worker.ip, _port(c, sock.get("port"))
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            except (OSError, TimeoutError) as error:
                return False, f"dial tcp {host}:{port}: {error or type(error).__name__}"
            writer.close()
            return True, ""
        if "sleep" in handler:
            await asyncio.sleep(min(float(handler["sleep"].get("seconds", 0)), timeout))
            return True, ""
    except ValueError as error:
        return False, str(error)
    return False, f"{sorted(handler)} handlers are not supported by the process kubelet"


async def _exec(worker: _PodWorker, c: _Container, command: list[str], timeout: float) -> tuple[bool, str]:
    if worker.volumes is None or not command:
        return False, "nothing to run"
    rewrite = _rewriter(worker, c)
    try:
        env = {**os.environ, "HOSTNAME": worker.name, **_environment(worker, c, rewrite)}
        argv = [rewrite(expand(str(word), env)) for word in command]
        argv[0] = worker.kubelet.resolve(argv[0])
        process = await asyncio.create_subprocess_exec(
            *argv,
            cwd=worker.dir,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
        )
    except (OSError, _ConfigError) as error:
        return False, f"exec {command[0]!r}: {error}"
    worker.kubelet.track(process.pid)
    try:
        code = await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        _signal_group(process.pid, signal.SIGKILL)
        await process.wait()
        return False, f"command {command} timed out after {timeout:g}s"
    except asyncio.CancelledError:
        _signal_group(process.pid, signal.SIGKILL)
        raise
    finally:
        worker.kubelet.untrack(process.pid)
    return code == 0, f"command {command} exited with {code}" if code else ""


PROBE_KINDS = ("startup", "readiness", "liveness")


def _start_probe_workers(worker: _PodWorker) -> None:
    """One worker per probe of each of the pod's containers, for the pod's life (the prober manager's
    AddPod: init containers are not probed)."""
    for c in worker.containers.values():
        for kind in PROBE_KINDS:
            probe = c.spec.get(f"{kind}Probe")
            if probe:
                c.probe_triggers[kind] = asyncio.Event()
                c.probes.append(asyncio.create_task(_probe_worker(worker, c, kind, probe)))


def _trigger_readiness(worker: _PodWorker) -> None:
    """As the prober manager's UpdatePodStatus on each sync: a started, running container that is not
    ready and has a readiness probe gets that probe run at once."""
    for c in worker.containers.values():
        trigger = c.probe_triggers.get("readiness")
        if trigger is not None and c.started and not c.ready and "running" in c.state:
            trigger.set()


async def _probe_worker(worker: _PodWorker, c: _Container, kind: str, probe: dict[str, Any]) -> None:
    """One probe of one container, on a ticker of periodSeconds from the pod's first sync (worker.go)."""
    loop = asyncio.get_running_loop()
    period = float(probe.get("periodSeconds", 10))
    trigger = c.probe_triggers[kind]
    # Probes of a kubelet that just started would come all at once: the worker waits a random part of a
    # period first, only while the kubelet has run for less than one period.
    if period > loop.time() - worker.kubelet.started_clock:
        await asyncio.sleep(random.random() * period)
    next_tick = loop.time() + period
    state = _ProbeState()
    while await _do_probe(worker, c, kind, probe, state):
        now = loop.time()
        if trigger.is_set():
            trigger.clear()
        elif now >= next_tick:  # a tick came while probing: taken now, the ones after it are dropped
            next_tick += period * ((now - next_tick) // period + 1)
        else:
            try:
                await asyncio.wait_for(trigger.wait(), next_tick - now)
                trigger.clear()
            except TimeoutError:
                next_tick += period


@dataclass(slots=True)
class _ProbeState:
    container_id: str = ""  # the container run the worker last saw
    on_hold: bool = False  # the run failed liveness or startup and is being killed: no more probes of it
    last_ok: bool | None = None  # the last result, and how many times in a row (across runs, as worker.go)
    run: int = 0


async def _do_probe(
    worker: _PodWorker, c: _Container, kind: str, probe: dict[str, Any], s: _ProbeState
) -> bool:
    """Probe once, as worker.go doProbe; False when the worker is done."""
    if _phase(worker) in ("Succeeded", "Failed"):
        return False
    if not c.container_id:
        return True  # not created yet
    if c.container_id != s.container_id:  # a new run: its results start afresh (set by `_start`)
        s.container_id, s.on_hold = c.container_id, False
    if s.on_hold:
        return True
    if "running" not in c.state:
        if kind == "readiness":
            c.ready = False
        # Done for good only when the container will not be restarted.
        return not ("terminated" in c.state and worker.spec.get("restartPolicy") == "Never")
    if worker.terminating and kind != "readiness":
        return False  # a pod being stopped is not restarted for failing liveness
    loop = asyncio.get_running_loop()
    if int(loop.time() - c.started_clock) < int(probe.get("initialDelaySeconds", 0)):
        return True  # counted from the container's start, in whole seconds
    if c.started:
        if kind == "startup":
            return True  # done with this run (the worker stays for the next one)
    elif kind != "startup":
        return True  # the other probes wait until the container has started
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        ok, why = await _run_handler(worker, c, probe, timeout)
    except TimeoutError:
        ok, why = False, f"timed out after {timeout:g}s"
    if c.container_id != s.container_id or "running" not in c.state:
        return True  # the run ended while it was probed
    if not ok:
        _event(worker, "Unhealthy", f"{kind.capitalize()} probe failed: {why}", "Warning")
    s.run = s.run + 1 if s.last_ok == ok else 1
    s.last_ok = ok
    if s.run < int(probe.get("successThreshold" if ok else "failureThreshold", 1 if ok else 3)):
        return True
    if kind == "readiness":
        if c.ready != ok:
            c.ready = ok
            worker.wake()
    elif ok:
        if kind == "startup" and not c.started:
            c.started = True
            c.ready = not c.spec.get("readinessProbe")
            worker.wake()
    else:  # liveness or startup failed: the container is killed, no more probes until its next run
        worker._kill_unhealthy(c, kind, probe)
        s.on_hold, s.run = True, 0
    return True
