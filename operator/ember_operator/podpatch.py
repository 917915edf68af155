"""Strategic-merge patches: applying one as the API server does (`strategic_merge`), and `spec.podTemplate`,
checked against the Kubernetes API's own type definitions before it is applied to an engine pod.

Lists merge by the key the Kubernetes types declare for them (`patchMergeKey`: containers by name,
volumeMounts by mountPath, ...); other lists are replaced whole. The directives `$patch: replace|delete`,
`$retainKeys`, `$deleteFromPrimitiveList/<field>` are honoured and `$setElementOrder/<field>` is accepted
(order is not kept). The local API server applies strategic-merge patches with the same function.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from kubernetes.client import models

from ember_operator.podsettings import PROTECTED_LABEL_KEYS, PROTECTED_LABEL_PREFIX

# patchMergeKey of the list fields of core/v1 and meta/v1 types, by field name (no two types disagree).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "env": "name",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
    "schedulingGates": "name",
    "conditions": "type",
    "ownerReferences": "uid",
}
# Lists of scalars with `patchStrategy: merge`: a patch adds its values to the existing ones.
PRIMITIVE_MERGE = {"finalizers"}


def strategic_merge(target: Any, patch: dict[str, Any]) -> Any:
    """`target` with `patch` merged in (neither is changed); None means "delete this map" (`$patch: delete`)."""
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return _strip_directives({k: v for k, v in patch.items() if k != "$patch"})
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            result[name] = [item for item in result.get(name) or () if item not in value]
        elif key.startswith("$"):
            continue
        elif value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            merged = strategic_merge(result.get(key), value)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list):
            result[key] = _merge_list(key, result.get(key), value)
        else:
            result[key] = value
    if isinstance(patch.get("$retainKeys"), list):
        result = {k: v for k, v in result.items() if k in patch["$retainKeys"]}
    return result


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":
        # Container ports merge by containerPort, Service ports by port.
        return "containerPort" if any("containerPort" in item for item in items) else "port"
    return MERGE_KEYS.get(field)


def _merge_list(field: str, current: Any, patch: list[Any]) -> list[Any]:
    current = copy.deepcopy(current) if isinstance(current, list) else []
    if field in PRIMITIVE_MERGE:
        return current + [item for item in patch if item not in current]
    key = _merge_key(field, [item for item in patch + current if isinstance(item, dict)])
    if key is None or not all(isinstance(item, dict) for item in patch):
        return _strip_directives(patch)
    if any(item.get("$patch") == "replace" for item in patch):
        return _strip_directives([item for item in patch if item.get("$patch") != "replace"])
    for item in patch:
        index = next((i for i, old in enumerate(current) if old.get(key) == item.get(key)), None)
        if item.get("$patch") == "delete":
            if index is not None:
                del current[index]
        elif index is None:
            current.append(_strip_directives(item))
        else:
            current[index] = strategic_merge(current[index], item)
    return current


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(item) for item in value]
    return value


# -- spec.podTemplate ------------------------------------------------------------------------------------


class PodTemplateError(ValueError):
    """spec.podTemplate cannot be applied: a field the Kubernetes API does not have, a value of the wrong
    type, or a change to what the operator relies on."""


_SCALARS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "datetime": (str,),
    "date": (str,),
}
_DIRECTIVE = re.compile(r"^\$(patch|retainKeys|setElementOrder/.+|deleteFromPrimitiveList/.+)$")


def type_problems(value: Any, type_name: str, path: str) -> list[str]:
    """Where `value`, a strategic-merge patch of a `type_name` (as the official client names its types:
    "V1PodSpec", "List[V1Container]", "Dict[str, str]", "int"), does not fit the Kubernetes API."""
    if value is None or type_name == "object":  # null deletes; "object" is IntOrString or free-form
        return []
    if type_name.lower().startswith("list["):
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {type(value).__name__}"]
        inner = type_name[5:-1]
        problems = []
        for i, item in enumerate(value):
            label = item.get(MERGE_KEYS.get(path.rsplit(".", 1)[-1], ""), i) if isinstance(item, dict) else i
            if isinstance(item, dict) and set(item) <= {"$patch"}:
                continue  # {"$patch": "replace"}
            problems += type_problems(item, inner, f"{path}[{label}]")
        return problems
    if type_name.lower().startswith(("dict[", "dict(")):
        if not isinstance(value, dict):
            return [f"{path}: expected a map, got {type(value).__name__}"]
        inner = type_name.split(",", 1)[1].strip()[:-1]
        return [
            p
            for k, v in value.items()
            if not k.startswith("$")
            for p in type_problems(v, inner, f"{path}.{k}")
        ]
    if type_name in _SCALARS:
        kinds = _SCALARS[type_name]
        if isinstance(value, bool) and bool not in kinds:
            return [f"{path}: expected {type_name}, got a boolean"]
        return (
            [] if isinstance(value, kinds) else [f"{path}: expected {type_name}, got {type(value).__name__}"]
        )
    model = getattr(models, type_name, None)
    if model is None:
        return []  # a type this client version does not know: the API server judges it
    if not isinstance(value, dict):
        return [f"{path}: expected an object ({type_name}), got {type(value).__name__}"]
    fields = {json: model.openapi_types[attr] for attr, json in model.attribute_map.items()}
    problems = []
    for key, item in value.items():
        if key.startswith("$"):
            if not _DIRECTIVE.match(key):
                problems.append(f"{path}.{key}: not a strategic-merge directive")
        elif key not in fields:
            problems.append(f"{path}.{key}: no such field in {type_name.removeprefix('V1')}")
        else:
            problems += type_problems(item, fields[key], f"{path}.{key}")
    return problems


def _contract(pod: dict[str, Any]) -> dict[str, Any]:
    """What of a pod the operator relies on: its labels, the engine container's command, args and ports,
    the init containers' command and args, and the volumes it made."""
    spec = pod["spec"]
    engine: dict[str, Any] = next((c for c in spec.get("containers") or [] if c.get("name") == "engine"), {})
    labels = pod["metadata"].get("labels") or {}
    return {
        "the operator's labels": {
            k: v
            for k, v in labels.items()
            if k in PROTECTED_LABEL_KEYS or k.startswith(PROTECTED_LABEL_PREFIX)
        },
        "the engine container": engine.get("name"),
        "the engine's command": engine.get("command"),
        "the engine's args (use engine.extraArgs)": engine.get("args"),
        "the engine's ports": engine.get("ports"),
        "the init containers' commands": [
            (c.get("name"), c.get("command"), c.get("args")) for c in spec.get("initContainers") or []
        ],
        "the operator's volumes": {
            v["name"]: v for v in spec.get("volumes") or [] if str(v.get("name")).startswith(OPERATOR_VOLUMES)
        },
    }


# Volumes the operator mounts into its containers, by name or prefix (desired.py and modelsource.py).
OPERATOR_VOLUMES = ("policy", "models", "model-cache", "model-source-", "dshm")


def apply_pod_template(
    pod: dict[str, Any], metadata: dict[str, Any], spec_patch: dict[str, Any]
) -> dict[str, Any]:
    """`pod` with spec.podTemplate applied (its `metadata` labels and annotations, and `spec_patch` over the
    pod's spec), or PodTemplateError saying what is wrong with it."""
    problems = type_problems(spec_patch, "V1PodSpec", "podTemplate.spec")
    if problems:
        raise PodTemplateError("; ".join(problems))
    patched = copy.deepcopy(pod)
    meta = patched["metadata"]
    for kind in ("labels", "annotations"):
        if metadata.get(kind):
            meta[kind] = {**(meta.get(kind) or {}), **metadata[kind]}
    merged = strategic_merge(patched["spec"], spec_patch)
    if merged is None:
        raise PodTemplateError("podTemplate.spec: $patch: delete would remove the whole pod spec")
    patched["spec"] = merged
    before, after = _contract(pod), _contract(patched)
    changed = [what for what in before if before[what] != after[what]]
    if changed:
        raise PodTemplateError(
            f"podTemplate may not change {', '.join(changed)}: the operator relies on them"
        )
    return patched
