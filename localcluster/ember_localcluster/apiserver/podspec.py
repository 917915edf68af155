"""A Pod's tolerations and nodeSelector as kube-apiserver validates them (pkg/apis/core/validation:
ValidateTolerations, and ValidateLabels for the selector), with its messages.

Left out: the rest of ValidatePodSpec. A toleration refused for a value with `operator: Exists` is shown as
Go's %#v shows it; where tolerationSeconds is set, Go prints a pointer's address, shown here as `0x...`.
"""

from __future__ import annotations

import json
from typing import Any

from ember_operator.labels import label_key_errors, label_value_errors

from .errors import Cause, invalid_value, not_supported

_OPERATORS = ("Equal", "Exists")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def _go_toleration(t: dict[str, Any]) -> str:
    seconds = "(*int64)(nil)" if t.get("tolerationSeconds") is None else "(*int64)(0x...)"
    fields = ", ".join(
        f"{k[0].upper()}{k[1:]}:{json.dumps(t.get(k) or '')}" for k in ("key", "operator", "value", "effect")
    )
    return f"core.Toleration{{{fields}, TolerationSeconds:{seconds}}}"


def toleration_causes(tolerations: list[Any]) -> list[Cause]:
    causes = []
    for i, t in enumerate(tolerations):
        if not isinstance(t, dict):
            continue
        path = f"spec.tolerations[{i}]"
        key, operator, value = t.get("key") or "", t.get("operator") or "", t.get("value") or ""
        effect = t.get("effect") or ""
        if key:
            causes += [invalid_value(f"{path}.key", json.dumps(key), m) for m in label_key_errors(key)]
        if not key and operator != "Exists":
            causes.append(
                invalid_value(
                    f"{path}.operator",
                    json.dumps(operator),
                    'operator must be Exists when `key` is empty, which means "match all values and all keys"',
                )
            )
        if t.get("tolerationSeconds") is not None and effect != "NoExecute":
            causes.append(
                invalid_value(
                    f"{path}.effect",
                    json.dumps(effect),
                    "effect must be 'NoExecute' when `tolerationSeconds` is set",
                )
            )
        if operator in ("Equal", ""):
            errors = label_value_errors(value)
            if errors:
                causes.append(invalid_value(f"{path}.operator", json.dumps(value), ";".join(errors)))
        elif operator == "Exists":
            if value:
                message = "value must be empty when `operator` is 'Exists'"
                causes.append(invalid_value(f"{path}.operator", _go_toleration(t), message))
        else:
            causes.append(not_supported(f"{path}.operator", json.dumps(operator), _OPERATORS))
        if effect and effect not in _EFFECTS:
            causes.append(not_supported(f"{path}.effect", json.dumps(effect), _EFFECTS))
    return causes


def label_causes(labels: dict[str, Any], path: str) -> list[Cause]:
    """ValidateLabels of k8s.io/apimachinery: each key a qualified name, each value a label value."""
    causes = []
    for key, value in labels.items():
        causes += [invalid_value(path, json.dumps(key), m) for m in label_key_errors(key)]
        if isinstance(value, str):
            causes += [invalid_value(path, json.dumps(value), m) for m in label_value_errors(value)]
    return causes


def node_selector_causes(selector: dict[str, Any]) -> list[Cause]:
    return label_causes(selector, "spec.nodeSelector")


def pod_spec_causes(spec: Any) -> list[Cause]:
    """The causes of a 422 for the Pod spec's tolerations and nodeSelector (none: they are valid)."""
    if not isinstance(spec, dict):
        return []
    tolerations, selector = spec.get("tolerations"), spec.get("nodeSelector")
    causes = toleration_causes(tolerations) if isinstance(tolerations, list) else []
    return causes + (node_selector_causes(selector) if isinstance(selector, dict) else [])
