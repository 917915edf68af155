"""`x-kubernetes-validations`: CRD validation rules in CEL, evaluated with cel-python.

Each rule sees the schema node it sits on as `self` (so `has(self.x)`, `self.a <= self.b` and the
list macros `all`, `exists`, `exists_one` work), and a transition rule (one that mentions `oldSelf`)
also sees the previous value; as in Kubernetes, transition rules are skipped on create.
`message`, `messageExpression`, `fieldPath` and `reason` shape the error the way the real server does.

Left out: the Kubernetes CEL library extensions (`quantity()`, `url()`, `isSorted()`, regex helpers
beyond `matches`), cost limits, and compile-time checks when the CRD is created (a rule that fails to
compile is reported on every write instead).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import celpy
from celpy import celtypes

from .errors import Cause

_ENVIRONMENT = celpy.Environment()

_REASON_PREFIX = {
    "FieldValueInvalid": "Invalid value: {value}: ",
    "FieldValueForbidden": "Forbidden: ",
    "FieldValueRequired": "Required value: ",
    "FieldValueDuplicate": "Duplicate value: {value}: ",
}


@functools.lru_cache(maxsize=512)
def _program(expression: str) -> celpy.Runner:
    return _ENVIRONMENT.program(_ENVIRONMENT.compile(expression))


def _evaluate(expression: str, activation: dict[str, Any]) -> tuple[Any, str | None]:
    """(the expression's value, None), or (None, why) when it cannot be compiled or evaluated."""
    try:
        result = _program(expression).evaluate(activation)
    except celpy.CELParseError as error:
        return None, f"compilation failed: {error}"
    except celpy.CELEvalError as error:
        return None, f"{error.args[0] if error.args else error} evaluating rule: {expression}"
    except Exception as error:  # cel-python raises plain Python errors for some type mismatches
        return None, f"{error} evaluating rule: {expression}"
    if isinstance(result, celpy.CELEvalError):
        return None, f"{result.args[0] if result.args else result} evaluating rule: {expression}"
    return result, None


def check_rules(rules: list[dict[str, Any]], value: Any, old: Any, path: str, type_name: str) -> list[Cause]:
    """Causes for the rules of one schema node that `value` breaks."""
    causes = []
    activation = {"self": celpy.json_to_cel(value)}
    if old is not None:
        activation["oldSelf"] = celpy.json_to_cel(old)
    shown = json.dumps(type_name)
    for rule in rules:
        expression = rule.get("rule", "")
        if "oldSelf" in expression and old is None:
            continue
        result, failure = _evaluate(expression, activation)
        if failure is not None:
            causes.append(Cause(path or "<nil>", "FieldValueInvalid", f"Invalid value: {shown}: {failure}"))
            continue
        if isinstance(result, celtypes.BoolType) and bool(result):
            continue
        message = rule.get("message") or f"failed rule: {expression}"
        if rule.get("messageExpression"):
            rendered, _ = _evaluate(rule["messageExpression"], activation)
            if isinstance(rendered, celtypes.StringType) and rendered:
                message = str(rendered)
        reason = rule.get("reason") or "FieldValueInvalid"
        prefix = _REASON_PREFIX.get(reason, _REASON_PREFIX["FieldValueInvalid"]).format(value=shown)
        field = path + rule.get("fieldPath", "") if rule.get("fieldPath") else path
        causes.append(Cause(field.lstrip(".") or "<nil>", reason, prefix + message))
    return causes
