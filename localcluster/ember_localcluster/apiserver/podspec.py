"""A Pod's tolerations, nodeSelector, pod (anti-)affinity terms and topology spread constraints as
kube-apiserver validates them (pkg/apis/core/validation: ValidateTolerations, ValidateLabels for the
selector, validatePodAffinityTerm's topologyKey and the preferred terms' weight, and
validateTopologySpreadConstraints), with its messages.

Left out: the rest of ValidatePodSpec (node affinity, the label selectors and namespaces of affinity terms
and spread constraints). A toleration refused for a value with `operator: Exists` is shown as
Go's %#v shows it; where tolerationSeconds is set, Go prints a pointer's address, shown here as `0x...`.
"""

from __future__ import annotations

import json
from typing import Any

from ember_operator.labels import label_key_errors, label_value_errors

from .errors import Cause, invalid_value, not_supported, required

_OPERATORS = ("Equal", "Exists")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_ACTIONS = ("DoNotSchedule", "ScheduleAnyway")
_POLICIES = ("Honor", "Ignore")
_NOT_POSITIVE = "must be greater than zero"


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


def _term_causes(term: Any, path: str) -> list[Cause]:
    """validatePodAffinityTerm: a topology key, itself a label name."""
    if not isinstance(term, dict):
        return []
    key = term.get("topologyKey") or ""
    if not key:
        return [required(f"{path}.topologyKey", "can not be empty")]
    return [invalid_value(f"{path}.topologyKey", json.dumps(key), m) for m in label_key_errors(key)]


def affinity_causes(affinity: Any) -> list[Cause]:
    causes: list[Cause] = []
    for kind in ("podAffinity", "podAntiAffinity"):
        section = affinity.get(kind) if isinstance(affinity, dict) else None
        if not isinstance(section, dict):
            continue
        path = f"spec.affinity.{kind}"
        for i, term in enumerate(section.get("requiredDuringSchedulingIgnoredDuringExecution") or []):
            causes += _term_causes(term, f"{path}.requiredDuringSchedulingIgnoredDuringExecution[{i}]")
        for i, weighted in enumerate(section.get("preferredDuringSchedulingIgnoredDuringExecution") or []):
            if not isinstance(weighted, dict):
                continue
            at = f"{path}.preferredDuringSchedulingIgnoredDuringExecution[{i}]"
            weight = weighted.get("weight")
            if not isinstance(weight, int) or not 1 <= weight <= 100:
                causes.append(invalid_value(f"{at}.weight", json.dumps(weight), "must be in the range 1-100"))
            causes += _term_causes(weighted.get("podAffinityTerm"), f"{at}.podAffinityTerm")
    return causes


def spread_causes(constraints: list[Any]) -> list[Cause]:
    """validateTopologySpreadConstraints (the label selector and matchLabelKeys left out)."""
    causes = []
    for i, c in enumerate(constraints):
        if not isinstance(c, dict):
            continue
        path = f"spec.topologySpreadConstraints[{i}]"
        skew, key, action = c.get("maxSkew"), c.get("topologyKey") or "", c.get("whenUnsatisfiable") or ""
        if not isinstance(skew, int) or skew <= 0:
            causes.append(invalid_value(f"{path}.maxSkew", json.dumps(skew or 0), _NOT_POSITIVE))
        if not key:
            causes.append(required(f"{path}.topologyKey", "can not be empty"))
        if action not in _ACTIONS:
            causes.append(not_supported(f"{path}.whenUnsatisfiable", json.dumps(action), _ACTIONS))
        rest = constraints[i + 1 :]
        if any(
            isinstance(o, dict)
            and (o.get("topologyKey") or "", o.get("whenUnsatisfiable") or "") == (key, action)
            for o in rest
        ):
            shown = json.dumps(f"{{{key}, {action}}}")
            causes.append(
                Cause(
                    f"{path}.{{topologyKey, whenUnsatisfiable}}",
                    "FieldValueDuplicate",
                    f"Duplicate value: {shown}",
                )
            )
        domains = c.get("minDomains")
        if domains is not None:
            if not isinstance(domains, int) or domains <= 0:
                causes.append(invalid_value(f"{path}.minDomains", json.dumps(domains), _NOT_POSITIVE))
            if action != "DoNotSchedule":
                message = f"can only use minDomains if whenUnsatisfiable=DoNotSchedule, not {action}"
                causes.append(invalid_value(f"{path}.minDomains", json.dumps(domains), message))
        for policy in ("nodeAffinityPolicy", "nodeTaintsPolicy"):
            value = c.get(policy)
            if value is not None and value not in _POLICIES:
                causes.append(not_supported(f"{path}.{policy}", json.dumps(value), _POLICIES))
    return causes


def pod_spec_causes(spec: Any) -> list[Cause]:
    """The causes of a 422 for the Pod spec's tolerations, nodeSelector, affinity and spread constraints (none:
    they are valid)."""
    if not isinstance(spec, dict):
        return []
    tolerations, selector = spec.get("tolerations"), spec.get("nodeSelector")
    causes = toleration_causes(tolerations) if isinstance(tolerations, list) else []
    causes += node_selector_causes(selector) if isinstance(selector, dict) else []
    causes += affinity_causes(spec.get("affinity"))
    spread = spec.get("topologySpreadConstraints")
    return causes + (spread_causes(spread) if isinstance(spread, list) else [])
