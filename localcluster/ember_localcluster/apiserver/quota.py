"""ResourceQuota admission for Pods: a namespace's quotas refuse a pod that would take its usage past a
`spec.hard` limit, as the built-in ResourceQuota admission plugin does: 403 Forbidden, `pods "NAME" is
forbidden: exceeded quota: QUOTA, requested: R=N, used: R=N, limited: R=N`, naming only the exceeded
resources (sorted, comma-joined).

Counted: `pods` and `count/pods`, and `requests.*` for cpu, memory and extended resources such as
`requests.nvidia.com/gpu` (an extended resource's request defaults to its limit), over the namespace's
pods that have not ended (phase Succeeded or Failed), so usage is always exact (the real quota
controller's `status.used` lags behind by a resync). Left out: limits.*, scopes and scope selectors, and
quotas on objects other than pods.
"""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal
from typing import Any

from .errors import APIError

_SUFFIXES: dict[str, Decimal | int] = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "64Gi", "2") as a number."""
    text = str(value).strip()
    for suffix in sorted(_SUFFIXES, key=len, reverse=True):
        if text.endswith(suffix) and text[: -len(suffix)]:
            return Decimal(text[: -len(suffix)]) * Decimal(_SUFFIXES[suffix])
    return Decimal(text)


def _render(value: Decimal, original: Any) -> str:
    if original is not None:
        return str(original)
    return str(int(value)) if value == value.to_integral_value() else str(value)


def _show(keys: list[str], values: dict[str, Decimal], originals: dict[str, Any] | None = None) -> str:
    """`k=v,k=v` for the exceeded resources, as the plugin prints a resource list."""
    return ",".join(f"{k}={_render(values.get(k, Decimal(0)), (originals or {}).get(k))}" for k in keys)


def _pod_requests(pod: dict[str, Any]) -> dict[str, Decimal]:
    """What one pod counts against a quota, by quota resource name."""
    usage: dict[str, Decimal] = {"pods": Decimal(1), "count/pods": Decimal(1)}
    for c in (pod.get("spec") or {}).get("containers") or []:
        resources = c.get("resources") or {}
        requests, limits = resources.get("requests") or {}, resources.get("limits") or {}
        for name in {*requests, *limits}:
            standard = name in ("cpu", "memory", "ephemeral-storage")
            if name in requests:
                amount = requests[name]
            elif not standard:  # extended resources: the request is the limit
                amount = limits[name]
            else:
                continue
            key = f"requests.{name}"
            usage[key] = usage.get(key, Decimal(0)) + quantity(amount)
            if standard:
                usage[name] = usage.get(name, Decimal(0)) + quantity(amount)
    return usage


def admit_pod(quotas: Iterable[dict[str, Any]], pods: Iterable[dict[str, Any]], pod: dict[str, Any]) -> None:
    """Raise the plugin's 403 when `pod` would exceed one of the namespace's `quotas`."""
    quotas = list(quotas)
    if not quotas:
        return
    used: dict[str, Decimal] = {}
    for other in pods:
        if (other.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for key, amount in _pod_requests(other).items():
            used[key] = used.get(key, Decimal(0)) + amount
    requested = _pod_requests(pod)
    for q in sorted(quotas, key=lambda q: q["metadata"]["name"]):
        hard = (q.get("spec") or {}).get("hard") or {}
        exceeded = sorted(
            key
            for key, limit in hard.items()
            if key in requested and used.get(key, Decimal(0)) + requested[key] > quantity(limit)
        )
        if exceeded:
            name = pod["metadata"]["name"]
            message = (
                f'pods "{name}" is forbidden: exceeded quota: {q["metadata"]["name"]}, '
                f"requested: {_show(exceeded, requested)}, used: {_show(exceeded, used)}, "
                f"limited: {_show(exceeded, {}, hard)}"
            )
            raise APIError(403, "Forbidden", message, {"name": name, "kind": "pods"})
