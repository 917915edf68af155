"""`x-kubernetes-validations`: CRD validation rules in CEL, evaluated with cel-python.

Each rule sees the schema node it sits on as `self` (so `has(self.x)`, `self.a <= self.b` and the
list macros `all`, `exists`, `exists_one` work), and a transition rule (one that mentions `oldSelf`)
also sees the previous value; as in Kubernetes, transition rules are skipped on create, unless the rule
sets `optionalOldSelf` (Kubernetes 1.30+): then it runs on create too, with `oldSelf` an optional
(`oldSelf.hasValue()`, `oldSelf.value()`, `oldSelf.orValue(v)`), empty when there is no old value.
`message`, `messageExpression`, `fieldPath` and `reason` shape the error the way the real server does.

Compile errors and the static cost limits are checked when the CRD is written (`celcost.py`): a rule
that does not compile, or whose estimated cost is over kube-apiserver's budget, refuses the CRD.

Left out: the Kubernetes CEL library extensions (`quantity()`, `url()`, `isSorted()`, regex helpers
beyond `matches`), and the cost limits at evaluation (the per-call limit and the per-object runtime
budget): a rule runs here whatever it costs.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from typing import Any

import celpy
from celpy import celtypes

from .errors import Cause

_ENVIRONMENT = celpy.Environment()


class _Optional:
    """CEL's optional type, as far as `optionalOldSelf` needs it."""

    def __init__(self, value: Any) -> None:
        self.present = value is not None
        self.held = value

    def has_value(self) -> celtypes.BoolType:
        return celtypes.BoolType(self.present)

    def value(self) -> Any:
        if not self.present:
            raise ValueError("optional.none() dereference")
        return self.held

    def or_value(self, default: Any) -> Any:
        return self.held if self.present else default


_OPTIONAL_FUNCTIONS: dict[str, Any] = {
    "hasValue": _Optional.has_value,
    "value": _Optional.value,
    "orValue": _Optional.or_value,
}

_REASON_PREFIX = {
    "FieldValueInvalid": "Invalid value: {value}: ",
    "FieldValueForbidden": "Forbidden: ",
    "FieldValueRequired": "Required value: ",
    "FieldValueDuplicate": "Duplicate value: {value}: ",
}


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> celpy.Runner:
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(expression), functions=_OPTIONAL_FUNCTIONS)


_MISSING_KEY = re.compile(r"no such member in mapping: \\?'([^'\\]*)\\?'")


def _failure(error: Exception) -> str:
    """cel-go's wording for an evaluation error: a missing field is `no such key: <name>`, also when it
    reached the top through `||` or `&&` (cel-go returns the left error of two)."""
    text = str(error.args[0]) if error.args else str(error)
    missing = _MISSING_KEY.search(text) or _MISSING_KEY.search(str(error.args))
    return f"no such key: {missing.group(1)}" if missing else text


def _evaluate(expression: str, activation: dict[str, Any], shown: str) -> tuple[Any, str | None]:
    """(the expression's value, None), or (None, why) when it cannot be compiled or evaluated; `shown`
    names the rule in the error, as kube-apiserver's `ruleErrorString` does (its message, else the rule)."""
    try:
        result = _program(expression).evaluate(activation)
    except celpy.CELParseError as error:
        return None, f"compilation failed: {error}"
    except celpy.CELEvalError as error:
        return None, f"{_failure(error)} evaluating rule: {shown}"
    except Exception as error:  # cel-python raises plain Python errors for some type mismatches
        return None, f"{error} evaluating rule: {shown}"
    if isinstance(result, celpy.CELEvalError):
        return None, f"{_failure(result)} evaluating rule: {shown}"
    return result, None


# Rules are pure functions of `self` and `oldSelf`: their causes for a node's rules, values and path are kept
# for the next write that brings the same (a status update re-validates an unchanged spec). By the rules
# list's identity (held in the entry, so the id is not reused), and the values as JSON.
_RESULTS: OrderedDict[tuple[int, str, str, str, str], tuple[list[dict[str, Any]], list[Cause]]] = (
    OrderedDict()
)
_RESULTS_KEPT = 4096
_RESULTS_LOCK = threading.Lock()


def check_rules(rules: list[dict[str, Any]], value: Any, old: Any, path: str, type_name: str) -> list[Cause]:
    """Causes for the rules of one schema node that `value` breaks."""
    try:
        key = (id(rules), path, type_name, json.dumps(value), json.dumps(old))
    except (TypeError, ValueError):  # not JSON: evaluated every time
        return _check_rules(rules, value, old, path, type_name)
    with _RESULTS_LOCK:  # API servers in one process run on threads of their own
        kept = _RESULTS.get(key)
        if kept is not None and kept[0] is rules:
            _RESULTS.move_to_end(key)
            return list(kept[1])
    causes = _check_rules(rules, value, old, path, type_name)
    with _RESULTS_LOCK:
        _RESULTS[key] = (rules, causes)
        if len(_RESULTS) > _RESULTS_KEPT:
            _RESULTS.popitem(last=False)
    return list(causes)


def _check_rules(rules: list[dict[str, Any]], value: Any, old: Any, path: str, type_name: str) -> list[Cause]:
    causes = []
    current = celpy.json_to_cel(value)
    old_self = celpy.json_to_cel(old) if old is not None else None
    shown = json.dumps(type_name)
    for rule in rules:
        expression = rule.get("rule", "")
        activation: dict[str, Any] = {"self": current}
        if rule.get("optionalOldSelf") is True and "oldSelf" in expression:
            activation["oldSelf"] = _Optional(old_self)
        elif old_self is not None:
            activation["oldSelf"] = old_self
        elif "oldSelf" in expression:
            continue
        shown_rule = str(rule.get("message") or expression).strip()
        result, failure = _evaluate(expression, activation, shown_rule)
        if failure is not None:
            causes.append(Cause(path or "<nil>", "FieldValueInvalid", f"Invalid value: {shown}: {failure}"))
            continue
        if isinstance(result, celtypes.BoolType) and bool(result):
            continue
        message = rule.get("message") or f"failed rule: {expression}"
        if rule.get("messageExpression"):
            rendered, _ = _evaluate(rule["messageExpression"], activation, rule["messageExpression"])
            if isinstance(rendered, celtypes.StringType) and rendered:
                message = str(rendered)
        reason = rule.get("reason") or "FieldValueInvalid"
        prefix = _REASON_PREFIX.get(reason, _REASON_PREFIX["FieldValueInvalid"]).format(value=shown)
        field = path + rule.get("fieldPath", "") if rule.get("fieldPath") else path
        causes.append(Cause(field.lstrip(".") or "<nil>", reason, prefix + message))
    return causes
