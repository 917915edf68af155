"""Reading engine pods as the API server reports them: role, readiness, start-up time and trouble."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ember_operator.desired import ENGINE_PORT, HASH_LABEL, ROLE_LABEL, WARM
from ember_operator.modelsource import is_fetch_container
from ember_operator.rollout import PodView

# A container waiting for one of these reasons (a crash loop: after this many restarts) will not come up on
# its own.
CRASH_RESTARTS = 3
# How long past the end of its grace period a pod being deleted is taken for stranded (`_stranded`).
STRANDED_AFTER_SECONDS = 30.0
# The least a pod nominated for a preemption waits for its victims to end, whatever capacityWaitSeconds:
# the victims take their grace period to go (30 s by default, more for a batch job that finishes its work).
PREEMPTION_WAIT_MIN = 120.0
_STUCK_WAITING = {
    "CrashLoopBackOff": "PodsCrashLooping",
    "ErrImagePull": "ImageUnavailable",
    "ImagePullBackOff": "ImageUnavailable",
    "InvalidImageName": "ImageUnavailable",
    "CreateContainerConfigError": "PodsFailing",
    "CreateContainerError": "PodsFailing",
}


_SECOND = timedelta(seconds=1)


@dataclass(frozen=True, slots=True)
class Trouble:
    """A problem that needs a change to the spec: a CamelCase reason and a message for people."""

    reason: str
    message: str


def parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any] | None:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == kind:
            return c
    return None


def is_ready(pod: dict[str, Any]) -> bool:
    c = _condition(pod, "Ready")
    return c is not None and c.get("status") == "True"


def _engine_down(pod: dict[str, Any], unready_since: datetime | None) -> bool:
    """Whether the engine container is not running, or has restarted since the pod stopped being Ready
    (a restarted engine loads its model again: it will not serve for a while)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if not statuses:
        return False
    for s in statuses:
        state = s.get("state") or {}
        if "running" not in state:
            return True
        finished = parse_time(((s.get("lastState") or {}).get("terminated") or {}).get("finishedAt"))
        # Timestamps have one-second resolution: an exit in the second the pod went unready counts.
        if finished is not None and unready_since is not None and finished >= unready_since - _SECOND:
            return True
    return False


def _refused(pod: dict[str, Any]) -> bool:
    c = _condition(pod, "PodScheduled")
    return c is not None and c.get("status") == "False" and c.get("reason") == "Unschedulable"


def _unschedulable(pod: dict[str, Any], now: datetime | None = None, grace: float = 0.0) -> bool:
    """No node can take it now, and the scheduler made none free for it (or it has waited for that too
    long: see `preempting`)."""
    return _refused(pod) and preempting(pod, now, grace) is None


def preempting(pod: dict[str, Any], now: datetime | None = None, grace: float = 0.0) -> str | None:
    """The node a pod the scheduler refused is nominated to (`status.nominatedNodeName`): it preempted pods
    of lower priority there and waits for them to end, so it is on its way, not stuck; None otherwise, and
    None once it has waited (from its PodScheduled condition's last transition) `grace` seconds, or
    PREEMPTION_WAIT_MIN where that is longer, at `now` (a victim on a lost node is Terminating for good,
    and the scheduler keeps the nomination): then it is as unschedulable as any refused pod. With no
    `now`, the wait has no end."""
    node = (pod.get("status") or {}).get("nominatedNodeName")
    if not node or not _refused(pod) or pod["metadata"].get("deletionTimestamp"):
        return None
    if now is not None:
        scheduled = _condition(pod, "PodScheduled") or {}
        waited = parse_time(scheduled.get("lastTransitionTime")) or now
        if (now - waited).total_seconds() >= max(grace, PREEMPTION_WAIT_MIN):
            return None
    return (
        f"pod {pod['metadata']['name']}: nominated to node {node}, where it preempted pods of lower priority"
    )


def _stranded(meta: dict[str, Any], now: datetime) -> bool:
    """Being deleted and `STRANDED_AFTER_SECONDS` past the end of its grace period (`deletionTimestamp`):
    its kubelet, which kills the containers at that deadline and then confirms, is not there (its node
    lost), and the pod stays Terminating until the node comes back or the pod is force-deleted."""
    deadline = parse_time(meta.get("deletionTimestamp"))
    return deadline is not None and (now - deadline).total_seconds() > STRANDED_AFTER_SECONDS


def view(pod: dict[str, Any], now: datetime | None = None, capacity_wait: float = 0.0) -> PodView:
    """The pod as the roll planner sees it; `now` and `capacity_wait` end a wait for preemption (else
    endless), as `preempting` says."""
    meta = pod["metadata"]
    labels = meta.get("labels") or {}
    ready_condition = _condition(pod, "Ready")
    ready = ready_condition is not None and ready_condition.get("status") == "True"
    unready_since = (
        None if ready or ready_condition is None else parse_time(ready_condition.get("lastTransitionTime"))
    )
    return PodView(
        name=meta["name"],
        role=labels.get(ROLE_LABEL, WARM),
        template_hash=labels.get(HASH_LABEL, ""),
        ready=ready,
        created=parse_time(meta.get("creationTimestamp")) or datetime.now(UTC),
        phase=(pod.get("status") or {}).get("phase") or "Pending",
        deleting=meta.get("deletionTimestamp") is not None,
        unready_since=unready_since,
        container_down=not ready and _engine_down(pod, unready_since),
        unschedulable=_unschedulable(pod, now, capacity_wait),
        stranded=_stranded(meta, datetime.now(UTC)),
        node_lost=_node_lost(ready_condition, _status_of(pod, "ContainersReady")),
    )


def _node_lost(ready: dict[str, Any] | None, containers_ready: str | None) -> bool:
    """Marked not Ready by the node lifecycle controller: MarkPodsNotReady sets only the Ready condition, so
    ContainersReady still says True. The kubelet itself leaves them apart only for readiness gates."""
    return (
        ready is not None
        and ready.get("status") == "False"
        and ready.get("reason") != "ReadinessGatesNotReady"
        and containers_ready == "True"
    )


def _status_of(pod: dict[str, Any], kind: str) -> str | None:
    c = _condition(pod, kind)
    return None if c is None else c.get("status")


def metrics_url(pod: dict[str, Any]) -> str | None:
    ip = (pod.get("status") or {}).get("podIP")
    return f"http://{ip}:{ENGINE_PORT}/metrics" if ip else None


def cold_start_seconds(pod: dict[str, Any]) -> float | None:
    """Creation to first Ready, for a pod whose container never restarted (a restart resets the clock)."""
    c = _condition(pod, "Ready")
    if c is None or c.get("status") != "True":
        return None
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    if any(s.get("restartCount", 0) for s in statuses):
        return None
    created = parse_time(pod["metadata"].get("creationTimestamp"))
    ready_at = parse_time(c.get("lastTransitionTime"))
    if created is None or ready_at is None:
        return None
    return max(0.0, (ready_at - created).total_seconds())


# What a Python server prints on its way out after the error: never the cause.
_SHUTDOWN_NOISE = (
    "Finished server process",
    "Waiting for application shutdown",
    "Application shutdown complete",
    "Shutting down",
)


def error_line(log_tail: str) -> str:
    """The line of a failed container's log tail that says what failed: the engine's own fatal line, else
    the exception line of the last Python traceback, else the last line that is not shutdown noise."""
    lines = [line.rstrip() for line in log_tail.strip().splitlines() if line.strip()]
    for line in reversed(lines):
        if "fatal:" in line:
            return line[-300:]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")]
    if starts:
        # The traceback's frames are indented; its first unindented line is the exception.
        for line in lines[starts[-1] + 1 :]:
            if not line[:1].isspace():
                return line[:300]
    for line in reversed(lines):
        if not any(noise in line for noise in _SHUTDOWN_NOISE):
            return line[:300]
    return lines[-1][:300] if lines else ""


# A crash-looping pod is trouble until it has been Ready this long.
RECOVERED_AFTER_SECONDS = 30.0
HELD_REASONS = ("PodsCrashLooping", "PodsFailing", "ModelFetchFailed")


def ready_for(pod: dict[str, Any], now: datetime) -> float | None:
    """Seconds since the pod became Ready, or None when it is not Ready."""
    c = _condition(pod, "Ready")
    if c is None or c.get("status") != "True":
        return None
    since = parse_time(c.get("lastTransitionTime"))
    return None if since is None else (now - since).total_seconds()


def held_troubles(
    held: dict[str, Trouble], pods: list[dict[str, Any]], found: dict[str, Trouble], now: datetime
) -> list[Trouble]:
    """Crash troubles with hysteresis: one seen on a pod stays (in `held`, updated in place) until that pod
    has been Ready for RECOVERED_AFTER_SECONDS or is gone, or, for a failed fetch, until the fetch has
    completed (an init container never runs again in its pod); other troubles are reported as found."""
    by_name = {p["metadata"]["name"]: p for p in pods}
    for name, t in found.items():
        if t.reason in HELD_REASONS:
            held[name] = t
    for name in list(held):
        pod = by_name.get(name)
        seconds = ready_for(pod, now) if pod is not None else None
        if name not in found and (
            pod is None
            or (seconds is not None and seconds >= RECOVERED_AFTER_SECONDS)
            or (held[name].reason == "ModelFetchFailed" and _fetched(pod))
        ):
            del held[name]
    return [*held.values(), *(t for name, t in found.items() if name not in held)]


def _fetched(pod: dict[str, Any]) -> bool:
    """Whether every fetch init container of the pod has completed."""
    fetches = [
        s
        for s in (pod.get("status") or {}).get("initContainerStatuses") or []
        if is_fetch_container(s.get("name"))
    ]
    return bool(fetches) and all(
        ((s.get("state") or {}).get("terminated") or {}).get("exitCode") == 0 for s in fetches
    )


def waiting_for_capacity(
    pod: dict[str, Any], now: datetime, grace: float, since: datetime | None = None
) -> str | None:
    """The scheduler's message for a pod no node can take yet, while it has waited less than `grace`
    seconds (a cluster autoscaler may be adding a node), counted from `since` where that is later (room
    last freed; now, while a roll frees it); None otherwise."""
    scheduled = _condition(pod, "PodScheduled")
    if not _unschedulable(pod, now, grace) or scheduled is None:
        return None
    waited = parse_time(scheduled.get("lastTransitionTime")) or now
    if since is not None and since > waited:
        waited = since
    if (now - waited).total_seconds() >= grace:
        return None
    return f"pod {pod['metadata']['name']}: {scheduled.get('message', 'Unschedulable')}"


def _stuck(s: dict[str, Any]) -> tuple[str, str] | None:
    """(reason, what and why) for a container status that will not come right on its own."""
    waiting = (s.get("state") or {}).get("waiting") or {}
    last = (s.get("lastState") or {}).get("terminated") or {}
    reason = waiting.get("reason")
    # A crash loop is a problem once it has gone on for a few restarts (one crash is the kubelet's to
    # handle), and only while the container is down: restarts of a running container are history.
    if reason not in _STUCK_WAITING or (
        reason == "CrashLoopBackOff" and s.get("restartCount", 0) < CRASH_RESTARTS
    ):
        return None
    detail = error_line(last.get("message") or waiting.get("message") or "")
    # The runtime's reason for the last exit where it says more than the exit code does (OOMKilled).
    why = [f"exit code {last['exitCode']}"] if "exitCode" in last else []
    why += [last["reason"]] if last.get("reason") not in (None, "", "Error", "Completed") else []
    code = f" ({', '.join(why)})" if why else ""
    return _STUCK_WAITING[reason], f"{reason}{code}" + (f": {detail}" if detail else "")


def trouble(
    pod: dict[str, Any],
    now: datetime | None = None,
    capacity_wait: float = 0.0,
    since: datetime | None = None,
) -> Trouble | None:
    """Why this pod will not become Ready without a change (to its spec, or to the cluster's capacity once
    `capacity_wait` seconds have passed, from `since` where that is later), or None if nothing says so."""
    name = pod["metadata"]["name"]
    status = pod.get("status") or {}
    scheduled = _condition(pod, "PodScheduled")
    if preempting(pod, now, capacity_wait) is not None:
        return None  # the room it needs is being freed: Reconciling says WaitingForPreemption
    if scheduled is not None and scheduled.get("status") == "False" and scheduled.get("reason"):
        if now is not None and waiting_for_capacity(pod, now, capacity_wait, since) is not None:
            return None  # still within the wait: Reconciling says WaitingForCapacity
        message = f"pod {name}: {scheduled['reason']}: {scheduled.get('message', '')}".rstrip(": ")
        return Trouble("PodsUnschedulable", message)
    # Init containers run first (a model fetch): while one is stuck, the engine has not even started.
    for s in status.get("initContainerStatuses") or []:
        stuck = _stuck(s)
        if stuck is not None:
            fetch = is_fetch_container(s.get("name")) and stuck[0] == "PodsCrashLooping"
            kind = "ModelFetchFailed" if fetch else stuck[0]
            return Trouble(kind, f"pod {name}: init container {s.get('name')}: {stuck[1]}")
    for s in status.get("containerStatuses") or []:
        stuck = _stuck(s)
        if stuck is not None:
            return Trouble(stuck[0], f"pod {name}: {stuck[1]}")
    if status.get("phase") == "Pending" and status.get("reason"):
        return Trouble(
            "PodsFailing", f"pod {name}: {status['reason']}: {status.get('message', '')}".rstrip(": ")
        )
    return None
