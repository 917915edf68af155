"""The `pods/log` subresource (`kubectl logs`): `GET /api/v1/namespaces/NS/pods/NAME/log`, plain text,
read from the process kubelet's log files.

kube-apiserver finds the container (`LogLocation` in pkg/registry/core/pod/strategy.go) and streams what
the pod's node's kubelet answers (`GetKubeletContainerLogs`); here the server reads the kubelet's files
itself. Each node's kubelet registers where its pods' directories are (`APIServer.attach_kubelet`):
`<pods dir>/<namespace>_<pod>/<container>.log`, with one `<offset> <containerID>` line per run in
`<container>.log.runs`, so one run of a container can be cut out of the file the runs share. What is
reproduced:

* `container` must name one of the pod's containers (400 "container X is not valid for pod P"); without
  it a pod with one container uses that one and one with several is a 400 "a container name must be
  specified for pod P, choose one of: [a b]" (init containers first, as `VisitContainers` lists them).
  kubectl always names one (the default-container annotation, else the first).
* A pod not bound to a node answers 200 with an empty body, as upstream's empty location does.
* For a bound pod, the container's status picks the run, as the kubelet's `validateContainerLogStatus`:
  the running run (or, with `previous=true`, the last terminated one: 400 `previous terminated container
  "C" in pod "P" not found` without one), the terminated run, else a 400 `container "C" in pod "P" is
  waiting to start: <reason>` ("image can't be pulled" for ErrImagePull). A container with no status yet
  (no kubelet has reported on the pod, e.g. when none runs for its node) counts as waiting with reason
  `ContainerCreating`, what the kubelet reports for a container it has not started.
* `tailLines` (the last N lines), `limitBytes` (the first N bytes of what would be sent), and
  `follow=true` (the run's output as it grows, until the run ends, the pod goes or the client leaves);
  negative `tailLines` or `limitBytes` below 1 are the 422 `PodLogOptions "P" is invalid`.

Not served: `timestamps`, `sinceSeconds` and `sinceTime` (the kubelet here records no time per line): a
400 says so rather than answering something else. `stream` (stdout/stderr split) is ignored: both go to
one file.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from .errors import Cause, bad_request, int_param, invalid

if TYPE_CHECKING:
    from .store import Store

FOLLOW_POLL_SECONDS = 0.2
_TRUE = ("1", "t", "true")


def _flag(query: Mapping[str, str], key: str) -> bool:
    return query.get(key, "").lower() in _TRUE


def _container_names(spec: Mapping[str, Any]) -> list[str]:
    return [
        c.get("name", "")
        for kind in ("initContainers", "containers", "ephemeralContainers")
        for c in spec.get(kind) or []
    ]


def _container(pod: Mapping[str, Any], wanted: str) -> str:
    """`validateContainer`: the container the request is about."""
    spec, name = pod.get("spec") or {}, pod["metadata"]["name"]
    if wanted:
        if wanted not in _container_names(spec):
            raise bad_request(f"container {wanted} is not valid for pod {name}")
        return wanted
    containers = spec.get("containers") or []
    if len(containers) == 1:
        return str(containers[0].get("name", ""))
    if not containers:
        raise bad_request(f"a container name must be specified for pod {name}")
    names = " ".join(_container_names(spec))
    raise bad_request(f"a container name must be specified for pod {name}, choose one of: [{names}]")


def _status_of(pod: Mapping[str, Any], container: str) -> dict[str, Any] | None:
    status = pod.get("status") or {}
    for kind in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        for entry in status.get(kind) or []:
            if entry.get("name") == container:
                return dict(entry)
    return None


def container_run(pod: Mapping[str, Any], container: str, previous: bool) -> str:
    """`validateContainerLogStatus`: the containerID of the run to read, or the kubelet's 400."""
    name = pod["metadata"]["name"]
    status = _status_of(pod, container) or {"state": {"waiting": {"reason": "ContainerCreating"}}}
    state, last = status.get("state") or {}, (status.get("lastState") or {}).get("terminated")
    running, terminated, waiting = state.get("running"), state.get("terminated"), state.get("waiting")
    if previous:
        if not last or not last.get("containerID"):
            raise bad_request(f'previous terminated container "{container}" in pod "{name}" not found')
        return str(last["containerID"])
    if running is not None:
        return str(status.get("containerID") or "")
    if terminated is not None:
        if terminated.get("containerID"):
            return str(terminated["containerID"])
        if last and last.get("containerID"):
            return str(last["containerID"])
        raise bad_request(f'container "{container}" in pod "{name}" is terminated')
    if last is not None:
        if not last.get("containerID"):
            raise bad_request(f'container "{container}" in pod "{name}" is terminated')
        return str(last["containerID"])
    if waiting is not None:
        reason = waiting.get("reason", "")
        detail = {
            "ErrImagePull": "image can't be pulled",
            "ImagePullBackOff": "trying and failing to pull image",
        }.get(reason, reason)
        raise bad_request(f'container "{container}" in pod "{name}" is waiting to start: {detail}')
    raise bad_request(f'container "{container}" in pod "{name}" is waiting to start - no logs yet')


def _run_bounds(log: Path, container_id: str) -> tuple[int, int | None]:
    """Where the run `container_id` starts in `log` and where the next run starts (None: the end)."""
    runs: list[tuple[int, str]] = []
    with contextlib.suppress(OSError):
        for line in Path(f"{log}.runs").read_text().splitlines():
            offset, _, run = line.partition(" ")
            if offset.isdigit():
                runs.append((int(offset), run))
    for i in range(len(runs) - 1, -1, -1):
        if runs[i][1] == container_id:
            return runs[i][0], runs[i + 1][0] if i + 1 < len(runs) else None
    return 0, None  # no index (or not this run in it): the whole file


def _read(log: Path, start: int, end: int | None) -> bytes:
    with contextlib.suppress(OSError), log.open("rb") as f:
        f.seek(start)
        return f.read() if end is None else f.read(max(0, end - start))
    return b""


def _tail(data: bytes, lines: int) -> bytes:
    if lines == 0:
        return b""
    return b"".join(data.splitlines(keepends=True)[-lines:])


async def serve_pod_log(
    request: web.Request, store: Store, pods_dirs: Mapping[str, Path], namespace: str, name: str
) -> web.StreamResponse:
    query = request.query
    for unsupported in ("timestamps", "sinceSeconds", "sinceTime"):
        if query.get(unsupported) and (unsupported != "timestamps" or _flag(query, unsupported)):
            raise bad_request(
                f"{unsupported} is not supported by this API server: its kubelet records no time per log line"
            )
    tail, limit = int_param(query, "tailLines"), int_param(query, "limitBytes")
    causes = []
    if tail is not None and tail < 0:
        causes.append(
            Cause(
                "tailLines", "FieldValueInvalid", f"Invalid value: {tail}: must be greater than or equal to 0"
            )
        )
    if limit is not None and limit < 1:
        causes.append(
            Cause("limitBytes", "FieldValueInvalid", f"Invalid value: {limit}: must be greater than 0")
        )
    if causes:
        raise invalid("PodLogOptions", "", name, causes)
    pods = store.registry.lookup("", "v1", "pods")
    assert pods is not None
    pod = store.get(pods, namespace, name)
    container = _container(pod, query.get("container", ""))
    node = (pod.get("spec") or {}).get("nodeName")
    text = {"Content-Type": "text/plain"}
    if not node:
        return web.Response(body=b"", headers=text)
    previous = _flag(query, "previous")
    run = container_run(pod, container, previous)
    pods_dir = pods_dirs.get(node)
    log = pods_dir / f"{namespace}_{name}" / f"{container}.log" if pods_dir is not None else None
    start, end = _run_bounds(log, run) if log is not None else (0, 0)
    everything = _read(log, start, end) if log is not None else b""
    data = everything if tail is None else _tail(everything, tail)
    if limit is not None:
        data = data[:limit]
    if not _flag(query, "follow") or previous or log is None or end is not None:
        return web.Response(body=data, headers=text)
    response = web.StreamResponse(headers=text)
    await response.prepare(request)
    sent, position = len(data), start + len(everything)
    uid = pod["metadata"]["uid"]
    with contextlib.suppress(ConnectionResetError):
        await response.write(data)
        while limit is None or sent < limit:
            await asyncio.sleep(FOLLOW_POLL_SECONDS)
            now = store.objects[pods.storage].get((namespace, name))
            running = (
                now is not None and now["metadata"]["uid"] == uid and _still_running(now, container, run)
            )
            _, end = _run_bounds(log, run)
            more = _read(log, position, end)
            position += len(more)
            if limit is not None:
                more = more[: limit - sent]
            if more:
                await response.write(more)
                sent += len(more)
            if not running or end is not None:
                break
        await response.write_eof()
    return response


def _still_running(pod: Mapping[str, Any], container: str, run: str) -> bool:
    status = _status_of(pod, container) or {}
    return "running" in (status.get("state") or {}) and status.get("containerID") == run
