"""Probes and lifecycle hooks: the handlers the process kubelet runs against a container.

startup, readiness and liveness probes with `httpGet` (port by name or number, path, headers, HTTP or
HTTPS without verification), `tcpSocket` or `exec`, with initialDelaySeconds, periodSeconds,
timeoutSeconds, successThreshold and failureThreshold. A startup probe gates the other two; readiness
drives the container's `ready` and the pod's ContainersReady and Ready conditions; liveness or startup
failure past the threshold kills the container (preStop hook, SIGTERM, grace period, SIGKILL) and the
restart policy takes over. gRPC probes are not modelled and always fail. preStop hooks run the same
handlers (exec, httpGet or sleep).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING, Any

import aiohttp

from ember_localcluster.kubelet.node import _signal_group
from ember_localcluster.kubelet.podenv import _ConfigError, _environment, expand
from ember_localcluster.kubelet.podstatus import _event
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


async def _probe_loop(worker: _PodWorker, c: _Container, kind: str, probe: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    period = float(probe.get("periodSeconds", 10))
    timeout = float(probe.get("timeoutSeconds", 1))
    success_threshold = int(probe.get("successThreshold", 1))
    failure_threshold = int(probe.get("failureThreshold", 3))
    if kind != "startup":
        await c.started_event.wait()
    await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)))
    successes = failures = 0
    next_at = loop.time()
    while True:
        if worker.terminating and kind != "readiness":
            return  # a pod being stopped is not restarted for failing liveness
        try:
            ok, why = await _run_handler(worker, c, probe, timeout)
        except TimeoutError:
            ok, why = False, f"timed out after {timeout:g}s"
        successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
        if not ok:
            _event(worker, "Unhealthy", f"{kind.capitalize()} probe failed: {why}", "Warning")
        if kind == "readiness":
            if c.ready != ok and (successes >= success_threshold or failures >= failure_threshold):
                c.ready = ok
                worker.wake()
        elif ok and kind == "startup":
            c.started = True
            c.started_event.set()
            c.ready = not c.spec.get("readinessProbe")
            worker.wake()
            return
        elif failures >= failure_threshold and kind in ("startup", "liveness"):
            worker._kill_unhealthy(c, kind, probe)
            return
        next_at += period
        await asyncio.sleep(max(0.0, next_at - loop.time()))
