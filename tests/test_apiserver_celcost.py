"""CEL rule costs at CRD writes: the static estimate kube-apiserver makes before it accepts a CRD, and
the CRD this project ships staying inside its limits."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember_localcluster.apiserver import APIError, APIServer
from ember_localcluster.apiserver.celcost import (
    STATIC_ESTIMATED_COST_LIMIT,
    STATIC_ESTIMATED_CRD_COST_LIMIT,
    estimate,
    rule_costs,
)

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "spec.versions[0].schema.openAPIV3Schema"


def _array(item: str, max_items: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "array", "items": {"type": item}}
    if max_items is not None:
        schema["maxItems"] = max_items
    return schema


def _map(value: str, max_properties: int | None = None, max_length: int | None = None) -> dict[str, Any]:
    values: dict[str, Any] = {"type": value}
    if max_length is not None:
        values["maxLength"] = max_length
    schema: dict[str, Any] = {"type": "object", "additionalProperties": values}
    if max_properties is not None:
        schema["maxProperties"] = max_properties
    return schema


def _string(max_length: int | None = None) -> dict[str, Any]:
    return {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}


# Expected costs from TestCostEstimation in kubernetes'
# staging/src/k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel/compilation_test.go
# (each case there is run once without bounds and once with the bound shown).
@pytest.mark.parametrize(
    ("schema", "rule", "cost"),
    [
        (_array("number"), "self.all(x, true)", 4718591),
        (_array("number", 10), "self.all(x, true)", 32),
        (_array("string"), "self.all(x, true)", 3145727),
        (_array("boolean", 5), "self.all(x, true)", 17),
        (_map("number"), "self.all(x, true)", 1348169),
        (_map("string", 3), "self.all(x, true)", 11),
        (_string(), "self.contains('test')", 314574),
        (_string(10), "self.contains('test')", 5),
        (_string(), "self.startsWith('test')", 2),
        (_string(), 'size(self + "hello") > size("hello")', 314578),
        (_string(4), 'size(self + "hello") > size("hello")', 7),
        (_array("string", 8), "self[1] == self[1]", 314577),
        (_array("number", 10), "self.all(x, self.all(y, self.all(z, true)))", 3552),
        (_string(), 'self.matches("x")', 314574),
        (_string(50), 'self.matches("x")', 22),
        (_string(), '"".matches("(((((((((())))))))))[0-9]")', 7),
        (_map("string"), "self.all(x, x.contains(self[x]))", 2752507),
        (_map("string", 10, 10), "self.all(x, x.contains(self[x]))", 72),
        (_string(0), 'self == "x"', 1),
        (_array("number", 3 * 1024 * 2048), "self.all(x, x == 0.0)", 25165826),
        ({"type": "array", "items": _array("number")}, "self[0][0] == -1.0", 3),
        (_map("integer"), "oldSelf.size() == self.size()", 5),
    ],
)
def test_estimates_match_kubernetes(schema: dict[str, Any], rule: str, cost: int) -> None:
    assert estimate(rule, schema) == cost


def _crd(name: str, spec_schema: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{name}s.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"plural": f"{name}s", "singular": name, "kind": name.capitalize()},
            "scope": "Namespaced",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec_schema}}},
                }
            ],
        },
    }


def _names_rule(bounded: bool) -> dict[str, Any]:
    names: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
    if bounded:
        names["maxItems"] = 16
        names["items"]["maxLength"] = 63
    names["x-kubernetes-validations"] = [{"rule": "self.all(x, x.matches('^[a-z]+$'))"}]
    return {"type": "object", "properties": {"names": names}}


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        yield api


def _refusal(server: APIServer, crd: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        server.install_crd(crd)
    assert caught.value.code == 422 and caught.value.reason == "Invalid", caught.value
    return caught.value


def test_a_rule_over_an_unbounded_list_of_unbounded_strings_is_refused(server: APIServer) -> None:
    error = _refusal(server, _crd("widget", _names_rule(bounded=False)))
    rule = f"{SCHEMA}.properties[spec].properties[names].x-kubernetes-validations[0].rule"
    advice = (
        "(try simplifying the rule, or adding maxItems, maxProperties, and maxLength where arrays, maps, "
        "and strings are declared)"
    )
    assert error.details["causes"] == [
        {
            "reason": "FieldValueForbidden",
            "message": f"Forbidden: estimated rule cost exceeds budget by factor of more than 100x {advice}",
            "field": rule,
        },
        {
            "reason": "FieldValueForbidden",
            "message": "Forbidden: contributed to estimated rule & messageExpression cost total exceeding cost "
            "limit for entire OpenAPIv3 schema",
            "field": rule,
        },
        {
            "reason": "FieldValueForbidden",
            "message": "Forbidden: x-kubernetes-validations estimated rule & messageExpression cost total for "
            f"entire OpenAPIv3 schema exceeds budget by factor of more than 100x {advice}",
            "field": SCHEMA,
        },
    ]
    assert error.message.startswith(
        f'CustomResourceDefinition.apiextensions.k8s.io "widgets.example.com" is invalid: [{rule}: Forbidden: '
    )
    assert (
        server.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, "widgets.example.com") is None
    )


def test_the_same_rule_with_bounds_is_accepted(server: APIServer) -> None:
    server.install_crd(_crd("widget", _names_rule(bounded=True)))
    server.create(
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "w", "namespace": "default"},
            "spec": {"names": ["a", "b"]},
        }
    )


def test_rules_each_under_the_limit_can_sum_over_the_schema_limit(server: APIServer) -> None:
    # Each rule: (ceil(0.1 x (3 MiB - 1)) x ceil(0.25 x 8) + 2) x 15 items = 9,437,220; eleven: 103,809,420.
    item = {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "x-kubernetes-validations": [{"rule": "self.text.matches('^[a-z]+$')"}],
    }
    lists = {f"f{i:02}": {"type": "array", "maxItems": 15, "items": item} for i in range(11)}
    error = _refusal(server, _crd("widget", {"type": "object", "properties": lists}))
    causes = error.details["causes"]
    assert [c["field"] for c in causes] == [
        *(
            f"{SCHEMA}.properties[spec].properties[f{i:02}].items.x-kubernetes-validations[0].rule"
            for i in range(4)
        ),
        SCHEMA,
    ]
    assert causes[-1]["message"].startswith(
        "Forbidden: x-kubernetes-validations estimated rule & messageExpression cost total for entire "
        "OpenAPIv3 schema exceeds budget by factor of 1.038094x "
    )


def test_a_rule_that_does_not_compile_is_refused_at_creation(server: APIServer) -> None:
    spec = {
        "type": "object",
        "properties": {"replicas": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.replica > 0"}],
    }
    error = _refusal(server, _crd("widget", spec))
    (cause,) = error.details["causes"]
    assert cause["field"] == f"{SCHEMA}.properties[spec].x-kubernetes-validations[0].rule"
    assert cause["reason"] == "FieldValueInvalid"
    assert cause["message"] == (
        'Invalid value: apiextensions.ValidationRule{Rule:"self.replica > 0", Message:"", MessageExpression:"", '
        'Reason:(*apiextensions.FieldValueErrorReason)(nil), FieldPath:"", OptionalOldSelf:(*bool)(nil)}: '
        "compilation failed: ERROR: <input>:1:5: undefined field 'replica'\n | self.replica > 0\n | ....^"
    )


def test_a_rule_must_be_a_bool(server: APIServer) -> None:
    spec = {
        "type": "object",
        "properties": {"replicas": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.replicas + 1"}],
    }
    (cause,) = _refusal(server, _crd("widget", spec)).details["causes"]
    assert cause["message"].endswith(": cel expression must evaluate to a bool")


def test_the_shipped_crd_is_within_every_cost_limit() -> None:
    crd = yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    costs = rule_costs(version["schema"]["openAPIV3Schema"], SCHEMA)
    assert len(costs) >= 40
    for rule in costs:
        assert rule.error is None and rule.unsupported is None, rule
        assert rule.total <= STATIC_ESTIMATED_COST_LIMIT, rule
    assert sum(rule.total for rule in costs) <= STATIC_ESTIMATED_CRD_COST_LIMIT


def test_a_rule_that_does_not_parse_is_refused_and_one_not_modelled_is_taken(server: APIServer) -> None:
    spec: dict[str, Any] = {
        "type": "object",
        "properties": {"size": {"type": "string"}},
        "x-kubernetes-validations": [{"rule": "self.size =="}],
    }
    (cause,) = _refusal(server, _crd("widget", spec)).details["causes"]
    assert "compilation failed: ERROR: <input>: Syntax error:" in cause["message"]
    # The Kubernetes CEL library is not modelled: such a rule is left out of the estimate, not refused.
    spec["x-kubernetes-validations"] = [{"rule": "isQuantity(self.size)"}]
    server.install_crd(_crd("widget", spec))
