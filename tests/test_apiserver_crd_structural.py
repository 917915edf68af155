"""What kube-apiserver refuses in a CRD schema before it serves it: a schema that is not structural, and a
`default` that is not valid for its own schema.

Structural (apiextensions-apiserver's `ValidateCustomResourceDefinitionOpenAPISchema` and the structural
schema package's `validateStructuralInvariants`): every node has a `type`, an array has `items`,
`properties` and `additionalProperties` exclude each other, JSON-Schema keywords Kubernetes does not
serve (`$ref`, `patternProperties`, ...) are refused, and a list of `x-kubernetes-list-type: map` keys its
items on scalar properties that are required or defaulted.

Defaults (`structuraldefaulting.ValidateDefaults`): each default must hold no field its schema would prune,
must pass its schema as written (the defaults of its children are not filled in first), and must pass
the CEL rules of its schema. The messages and field paths below are the real server's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ember_localcluster.apiserver import APIError, APIServer

SCHEMA = "spec.versions[0].schema.openAPIV3Schema"
SPEC = f"{SCHEMA}.properties[spec]"


def _crd(spec: dict[str, Any], **root: Any) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"spec": spec}, **root}
    return {
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [
                {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": schema}}
            ],
        },
    }


def _object(**properties: Any) -> dict[str, Any]:
    return {"type": "object", "properties": properties}


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        yield api


def _causes(server: APIServer, crd: dict[str, Any]) -> list[dict[str, Any]]:
    with pytest.raises(APIError) as caught:
        server.install_crd(crd)
    assert caught.value.code == 422 and caught.value.reason == "Invalid", caught.value
    assert (
        server.get("apiextensions.k8s.io/v1", "CustomResourceDefinition", None, "widgets.example.com") is None
    )
    return list(caught.value.details["causes"])


def _cause(reason: str, field: str, message: str) -> dict[str, str]:
    return {"reason": reason, "message": message, "field": field}


# -- structural ----------------------------------------------------------------------------------------


def test_a_field_or_item_without_a_type_is_refused(server: APIServer) -> None:
    spec = _object(size={"minimum": 1}, tags={"type": "array", "items": {"maxLength": 3}})
    assert sorted(_causes(server, _crd(spec)), key=str) == sorted(
        [
            _cause(
                "FieldValueRequired",
                f"{SPEC}.properties[size].type",
                "Required value: must not be empty for specified object fields",
            ),
            _cause(
                "FieldValueRequired",
                f"{SPEC}.properties[tags].items.type",
                "Required value: must not be empty for specified array items",
            ),
        ],
        key=str,
    )


def test_int_or_string_and_preserved_fields_need_no_type(server: APIServer) -> None:
    spec = _object(
        port={"x-kubernetes-int-or-string": True},
        extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    server.install_crd(_crd(spec))


def test_an_array_without_items_is_refused(server: APIServer) -> None:
    assert _causes(server, _crd(_object(tags={"type": "array"}))) == [
        _cause("FieldValueRequired", f"{SPEC}.properties[tags].items", "Required value: must be specified")
    ]


def test_properties_and_additional_properties_exclude_each_other(server: APIServer) -> None:
    spec = {
        "type": "object",
        "properties": {"a": {"type": "string"}},
        "additionalProperties": {"type": "string"},
    }
    assert _causes(server, _crd(spec)) == [
        _cause(
            "FieldValueForbidden",
            f"{SPEC}.additionalProperties",
            "Forbidden: additionalProperties and properties are mutual exclusive",
        )
    ]


def test_the_root_must_be_an_object(server: APIServer) -> None:
    crd = _crd(_object())
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"] = {"type": "array", "items": {"type": "string"}}
    assert _causes(server, crd) == [
        _cause("FieldValueInvalid", f"{SCHEMA}.type", 'Invalid value: "array": must be object at the root')
    ]


@pytest.mark.parametrize(
    ("keyword", "value", "reason", "message"),
    [
        ("$ref", "#/definitions/x", "FieldValueForbidden", "Forbidden: $ref is not supported"),
        ("id", "x", "FieldValueForbidden", "Forbidden: id is not supported"),
        (
            "patternProperties",
            {"^a": {"type": "string"}},
            "FieldValueForbidden",
            "Forbidden: patternProperties is not supported",
        ),
        (
            "uniqueItems",
            True,
            "FieldValueForbidden",
            "Forbidden: uniqueItems cannot be set to true since the runtime complexity becomes quadratic",
        ),
        (
            "x-kubernetes-preserve-unknown-fields",
            False,
            "FieldValueInvalid",
            "Invalid value: false: must be true or undefined",
        ),
    ],
)
def test_keywords_kubernetes_does_not_serve_are_refused(
    server: APIServer, keyword: str, value: Any, reason: str, message: str
) -> None:
    spec = _object(tags={"type": "array", "items": {"type": "string"}, keyword: value})
    assert _cause(reason, f"{SPEC}.properties[tags].{keyword}", message) in _causes(server, _crd(spec))


def test_a_type_inside_any_of_is_refused(server: APIServer) -> None:
    spec = _object(size={"type": "integer", "anyOf": [{"type": "integer", "minimum": 1}, {"maximum": -1}]})
    assert _causes(server, _crd(spec)) == [
        _cause(
            "FieldValueForbidden",
            f"{SPEC}.properties[size].anyOf[0].type",
            "Forbidden: must be empty to be structural",
        )
    ]


def test_int_or_string_may_name_its_two_types_in_any_of(server: APIServer) -> None:
    port = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    server.install_crd(_crd(_object(port=port)))


def _list_map(item: dict[str, Any], keys: list[str]) -> dict[str, Any]:
    return {
        "type": "array",
        "items": item,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": keys,
    }


def test_a_list_map_key_must_be_required_or_defaulted(server: APIServer) -> None:
    spec = _object(ports=_list_map(_object(name={"type": "string"}, port={"type": "integer"}), ["name"]))
    assert _causes(server, _crd(spec)) == [
        _cause(
            "FieldValueRequired",
            f"{SPEC}.properties[ports].items.properties[name].default",
            "Required value: this property is in x-kubernetes-list-map-keys, so it must have a default or be "
            "a required property",
        )
    ]
    defaulted = _object(name={"type": "string", "default": "http"}, port={"type": "integer"})
    server.install_crd(_crd(_object(ports=_list_map(defaulted, ["name"]))))


def test_a_list_map_key_must_be_a_scalar_item_property(server: APIServer) -> None:
    item = {**_object(name={"type": "object"}, port={"type": "integer"}), "required": ["name", "port"]}
    causes = _causes(server, _crd(_object(ports=_list_map(item, ["name", "nmae"]))))
    assert sorted(causes, key=str) == sorted(
        [
            _cause(
                "FieldValueInvalid",
                f"{SPEC}.properties[ports].items.properties[name].type",
                'Invalid value: "object": must be a scalar type if parent array\'s x-kubernetes-list-type is map',
            ),
            _cause(
                "FieldValueInvalid",
                f"{SPEC}.properties[ports].x-kubernetes-list-map-keys",
                'Invalid value: []string{"name", "nmae"}: entries must all be names of item properties',
            ),
        ],
        key=str,
    )


def test_a_list_map_key_may_not_be_nullable(server: APIServer) -> None:
    item = {**_object(name={"type": "string", "nullable": True}), "required": ["name"]}
    assert _causes(server, _crd(_object(ports=_list_map(item, ["name"])))) == [
        _cause(
            "FieldValueForbidden",
            f"{SPEC}.properties[ports].items.properties[name].nullable",
            "Forbidden: this property is in x-kubernetes-list-map-keys, so it cannot be nullable",
        )
    ]


def test_list_map_keys_need_list_type_map(server: APIServer) -> None:
    ports = {
        "type": "array",
        "items": {**_object(name={"type": "string"}), "required": ["name"]},
        "x-kubernetes-list-type": "set",
        "x-kubernetes-list-map-keys": ["name"],
    }
    assert _cause(
        "FieldValueInvalid",
        f"{SPEC}.properties[ports].x-kubernetes-list-type",
        'Invalid value: "set": must be map if x-kubernetes-list-map-keys is non-empty',
    ) in _causes(server, _crd(_object(ports=ports)))


# -- defaults ------------------------------------------------------------------------------------------


def test_a_default_of_the_wrong_type_is_refused(server: APIServer) -> None:
    spec = _object(size={"type": "integer", "default": "big"})
    assert _causes(server, _crd(spec)) == [
        _cause(
            "FieldValueTypeInvalid",
            f"{SPEC}.properties[size].default",
            'Invalid value: "string":  in body must be of type integer: "string"',
        )
    ]


@pytest.mark.parametrize(
    ("schema", "reason", "message"),
    [
        (
            {"type": "integer", "minimum": 1, "default": 0},
            "FieldValueInvalid",
            "Invalid value: 0:  in body should be greater than or equal to 1",
        ),
        (
            {"type": "string", "enum": ["a", "b"], "default": "c"},
            "FieldValueNotSupported",
            'Unsupported value: "c": supported values: "a", "b"',
        ),
        (
            {"type": "string", "pattern": "^[a-z]+$", "default": "A"},
            "FieldValueInvalid",
            "Invalid value: \"A\":  in body should match '^[a-z]+$'",
        ),
    ],
)
def test_a_default_outside_its_bounds_is_refused(
    server: APIServer, schema: dict[str, Any], reason: str, message: str
) -> None:
    assert _causes(server, _crd(_object(size=schema))) == [
        _cause(reason, f"{SPEC}.properties[size].default", message)
    ]


def test_an_object_default_is_validated_field_by_field(server: APIServer) -> None:
    limits = {
        **_object(min={"type": "integer", "minimum": 1}, max={"type": "integer"}),
        "required": ["max"],
        "default": {"min": 0},
    }
    assert sorted(_causes(server, _crd(_object(limits=limits))), key=str) == sorted(
        [
            _cause(
                "FieldValueInvalid",
                f"{SPEC}.properties[limits].default.min",
                "Invalid value: 0: min in body should be greater than or equal to 1",
            ),
            _cause("FieldValueRequired", f"{SPEC}.properties[limits].default.max", "Required value"),
        ],
        key=str,
    )


def test_a_default_is_validated_without_its_childrens_defaults(server: APIServer) -> None:
    """A required field with a default of its own does not make `{}` a valid default for its parent:
    the server checks the default as written."""
    limits = {**_object(max={"type": "integer", "default": 4}), "required": ["max"], "default": {}}
    assert _causes(server, _crd(_object(limits=limits))) == [
        _cause("FieldValueRequired", f"{SPEC}.properties[limits].default.max", "Required value")
    ]


def test_a_default_with_unknown_fields_is_refused(server: APIServer) -> None:
    limits = {**_object(max={"type": "integer"}), "default": {"max": 4, "extra": True}}
    assert _causes(server, _crd(_object(limits=limits))) == [
        _cause(
            "FieldValueInvalid",
            f"{SPEC}.properties[limits].default",
            'Invalid value: map[string]interface {}{"extra":true, "max":4}: must not have unknown fields',
        )
    ]


def test_a_default_must_pass_the_rules_of_its_schema(server: APIServer) -> None:
    limits = {
        **_object(min={"type": "integer"}, max={"type": "integer"}),
        "x-kubernetes-validations": [{"rule": "self.min <= self.max", "message": "min must not exceed max"}],
        "default": {"min": 5, "max": 1},
    }
    assert _causes(server, _crd(_object(limits=limits))) == [
        _cause(
            "FieldValueInvalid",
            f"{SPEC}.properties[limits].default",
            'Invalid value: "object": min must not exceed max',
        )
    ]


def test_a_rule_that_reads_a_field_the_default_leaves_out_fails_on_the_default(server: APIServer) -> None:
    """The rule sees the default as written: `{}` has no `min`, whatever `min`'s own default."""
    limits = {
        **_object(min={"type": "integer", "default": 1}, max={"type": "integer", "default": 2}),
        "x-kubernetes-validations": [{"rule": "self.min <= self.max", "message": "min must not exceed max"}],
        "default": {},
    }
    assert _causes(server, _crd(_object(limits=limits))) == [
        _cause(
            "FieldValueInvalid",
            f"{SPEC}.properties[limits].default",
            'Invalid value: "object": no such key: min evaluating rule: min must not exceed max',
        )
    ]
    limits["x-kubernetes-validations"] = [
        {
            "rule": "!has(self.min) || !has(self.max) || self.min <= self.max",
            "message": "min must not exceed max",
        }
    ]
    server.install_crd(_crd(_object(limits=limits)))


def test_a_default_in_the_roots_metadata_is_refused(server: APIServer) -> None:
    metadata = {"type": "object", "properties": {"name": {"type": "string", "default": "x"}}}
    crd = _crd(_object(), **{})
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"] = metadata
    assert _causes(server, crd) == [
        _cause(
            "FieldValueForbidden",
            f"{SCHEMA}.properties[metadata].properties[name].default",
            "Forbidden: must not be set in top-level metadata",
        )
    ]
