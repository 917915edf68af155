"""core/v1 Events about a Pod, as the kubelet and kube-scheduler record them."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from kubernetes import client


def pod_event(
    pod: dict[str, Any],
    kind: str,
    reason: str,
    message: str,
    component: str,
    instance: str,
    host: str | None = None,
    action: str | None = None,
    related: dict[str, Any] | None = None,
) -> client.CoreV1Event:
    """An Event (`kind` Normal or Warning) about `pod`, from `component` running as `instance`;
    `related`: a second pod the event concerns (the preemptor of a preempted pod)."""
    meta = pod["metadata"]
    namespace, name = meta.get("namespace") or "default", meta["name"]
    now = datetime.now(UTC)
    return client.CoreV1Event(
        metadata=client.V1ObjectMeta(name=f"{name}.{uuid.uuid4().hex[:16]}", namespace=namespace),
        involved_object=_reference(pod),
        related=None if related is None else _reference(related),
        reason=reason,
        message=message,
        type=kind,
        action=action,
        source=client.V1EventSource(component=component, host=host),
        first_timestamp=now,
        last_timestamp=now,
        count=1,
        reporting_component=component,
        reporting_instance=instance,
    )


def _reference(pod: dict[str, Any]) -> client.V1ObjectReference:
    meta = pod["metadata"]
    namespace = meta.get("namespace") or "default"
    return client.V1ObjectReference(
        api_version="v1", kind="Pod", name=meta["name"], namespace=namespace, uid=meta["uid"]
    )
