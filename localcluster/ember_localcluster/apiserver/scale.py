"""The `/scale` subresource: an object seen as an `autoscaling/v1 Scale`, and written back through it.

The CRD's `specReplicasPath`, `statusReplicasPath` and `labelSelectorPath` (Deployments: `.spec.replicas`,
`.status.replicas`, `.spec.selector`) say where the numbers live. As apiextensions-apiserver's ScaleREST
does, reading the Scale of an object that has no value at the spec path is a 500 InternalError ("the spec
replicas field ".spec.replicas" does not exist"); a write through `/scale` that sets the replicas still
works there, and one that leaves them unset is a 400 ("... cannot be empty"). A missing status path reads
as 0. Writing a Scale sets the spec path, so it is an ordinary spec change: generation bumps and a stale
resourceVersion is a 409.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

from . import patching
from .errors import APIError, Cause, bad_request, conflict, invalid
from .resources import ResourceType, ScalePaths
from .selectors import render_label_selector

if TYPE_CHECKING:
    from .store import Store


def _steps(path: str) -> list[str]:
    return [step for step in path.strip(".").split(".") if step]


def read_path(obj: dict[str, Any], path: str) -> Any:
    node: Any = obj
    for step in _steps(path):
        if not isinstance(node, dict):
            return None
        node = node.get(step)
    return node


# apiextensions marks "no replicas before" with the smallest int32 while a write is applied.
_UNSET = -2147483648


def _missing(paths: ScalePaths) -> str:
    return f'the spec replicas field "{paths.spec_replicas}" does not exist'


def to_scale(paths: ScalePaths, obj: dict[str, Any], *, unset: int | None = None) -> dict[str, Any]:
    """The Scale of `obj`; a missing spec value is an internal error unless `unset` stands in for it."""
    replicas = read_path(obj, paths.spec_replicas)
    if replicas is None:
        if unset is None:
            message = _missing(paths)
            raise APIError(
                500,
                "InternalError",
                f"Internal error occurred: {message}",
                {"causes": [{"message": message}]},
            )
        replicas = unset
    meta = obj["metadata"]
    status: dict[str, Any] = {"replicas": read_path(obj, paths.status_replicas) or 0}
    if paths.label_selector:
        selector = read_path(obj, paths.label_selector)
        if isinstance(selector, dict):
            selector = render_label_selector(selector)
        if selector:
            status["selector"] = selector
    return {
        "kind": "Scale",
        "apiVersion": "autoscaling/v1",
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in meta
        },
        "spec": {"replicas": replicas},
        "status": status,
    }


def with_replicas(paths: ScalePaths, obj: dict[str, Any], scale: Any) -> dict[str, Any]:
    """A copy of `obj` with the replicas a client wrote through `/scale`."""
    spec = scale.get("spec") if isinstance(scale, dict) else None
    replicas = spec.get("replicas") if isinstance(spec, dict) else None
    if replicas == _UNSET:
        raise bad_request(f'the spec replicas field "{paths.spec_replicas}" cannot be empty')
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        name = obj["metadata"]["name"]
        cause = Cause(
            "spec.replicas",
            "FieldValueInvalid",
            f"Invalid value: {replicas!r}: must be greater than or equal to 0",
        )
        raise invalid("Scale", "autoscaling", name, [cause])
    result = copy.deepcopy(obj)
    *parents, last = _steps(paths.spec_replicas)
    node = result
    for step in parents:
        node = node.setdefault(step, {})
    node[last] = replicas
    return result


def get_scale(store: Store, rtype: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
    assert rtype.scale is not None
    return to_scale(rtype.scale, store.get(rtype, namespace, name))


def write_scale(
    store: Store,
    rtype: ResourceType,
    namespace: str | None,
    name: str,
    patch_type: str | None,
    document: Any,
    *,
    dry_run: bool = False,
) -> dict[str, Any]:
    """PUT (`patch_type` None) or PATCH a Scale; the Scale after the write."""
    assert rtype.scale is not None
    current = store.get(rtype, namespace, name)
    before = to_scale(rtype.scale, current, unset=_UNSET)
    # A Scale is a built-in type, so even a custom resource's /scale takes a strategic merge patch.
    wanted = (
        document if patch_type is None else patching.apply_patch(patch_type, before, document, custom=False)
    )
    sent_rv = (wanted.get("metadata") or {}).get("resourceVersion") if isinstance(wanted, dict) else None
    if sent_rv not in (None, "", current["metadata"]["resourceVersion"]):
        raise conflict(rtype.plural, rtype.group, name)
    new = with_replicas(rtype.scale, current, wanted)
    return to_scale(rtype.scale, store.write(rtype, current, new, dry_run=dry_run))
