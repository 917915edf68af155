"""Resource quantities of built-in kinds in the form kube-apiserver stores them.

Fields typed `resource.Quantity` in k8s.io/api are decoded into a Quantity and encoded back in its
canonical form (`ember_operator.quantity.canonical`): a container's `cpu: 1000m` is returned as `1`,
`memory: 1024Mi` as `1Gi`, `0.5` as `500m`, a JSON number as a string. A value that is no quantity fails
decoding: a 400, `Pod in version "v1" cannot be handled as a Pod: quantities must match the regular
expression ...`. Custom resources are left as sent (their schema decides, as with apiextensions).
"""

from __future__ import annotations

from typing import Any

from ember_operator.quantity import canonical

from .errors import bad_request
from .resources import ResourceType

_WORKLOADS = (("apps", "deployments"), ("apps", "replicasets"))
_CONTAINER_LISTS = ("containers", "initContainers", "ephemeralContainers")


def canonicalize(rtype: ResourceType, obj: dict[str, Any]) -> None:
    """Rewrite, in place, the quantities of `obj` (a built-in) in canonical form."""
    try:
        _canonicalize(rtype, obj)
    except ValueError as error:
        version = rtype.api_version
        raise bad_request(
            f'{rtype.kind} in version "{version.split("/")[-1]}" cannot be handled as a {rtype.kind}: {error}'
        ) from None


def _canonicalize(rtype: ResourceType, obj: dict[str, Any]) -> None:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    if rtype.storage == ("", "pods"):
        _pod_spec(spec)
    elif rtype.storage in _WORKLOADS:
        _pod_spec(_dict(_dict(spec.get("template")).get("spec")))
    elif rtype.storage == ("", "resourcequotas"):
        for part, key in ((spec, "hard"), (status, "hard"), (status, "used")):
            _quantity_map(part, key)
    elif rtype.storage == ("", "nodes"):
        for key in ("capacity", "allocatable"):
            _quantity_map(status, key)
    elif rtype.storage == ("", "persistentvolumeclaims"):
        _resources(spec)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _quantity_map(parent: dict[str, Any], key: str) -> None:
    values = parent.get(key)
    if isinstance(values, dict):
        parent[key] = {name: canonical(value) for name, value in values.items()}


def _resources(holder: dict[str, Any]) -> None:
    resources = _dict(holder.get("resources"))
    for key in ("requests", "limits"):
        _quantity_map(resources, key)


def _pod_spec(spec: dict[str, Any]) -> None:
    for key in _CONTAINER_LISTS:
        for container in spec.get(key) or []:
            if isinstance(container, dict):
                _resources(container)
    _resources(spec)
    _quantity_map(spec, "overhead")
    for volume in spec.get("volumes") or []:
        empty_dir = _dict(_dict(volume).get("emptyDir"))
        if empty_dir.get("sizeLimit") is not None:
            empty_dir["sizeLimit"] = canonical(empty_dir["sizeLimit"])
