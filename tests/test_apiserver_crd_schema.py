"""What kube-apiserver checks in a CRD's schema beyond its CEL costs (tests/test_apiserver_celcost.py).

A rule's `fieldPath` must name a field its schema declares (apiextensions-apiserver's
`ValidateCustomResourceDefinitionOpenAPISchema`, through `pathValid` and `cel.ValidFieldPath`: a step into
a node with neither properties nor additionalProperties "does not refer to a valid field"), and the
root's `metadata` may declare `name` and `generateName` and nothing else (`validateStructuralMetadataInvariants`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from ember_localcluster.apiserver import APIError, APIServer

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "spec.versions[0].schema.openAPIV3Schema"


def _crd(root: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Namespaced",
            "versions": [
                {"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": root}}
            ],
        },
    }


def _root(metadata: dict[str, Any], field_path: str) -> dict[str, Any]:
    return {
        "type": "object",
        "x-kubernetes-validations": [
            {"rule": "size(self.metadata.name) <= 20", "message": "short", "fieldPath": field_path}
        ],
        "properties": {
            "metadata": metadata,
            "spec": {
                "type": "object",
                "properties": {
                    "size": {"type": "integer"},
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            },
        },
    }


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


@pytest.mark.parametrize(
    "path", [".metadata.name", ".spec.count", ".spec.size.value", ".spec['count']", "spec.size"]
)
def test_a_field_path_that_names_no_declared_field_is_refused(server: APIServer, path: str) -> None:
    causes = _causes(server, _crd(_root({"type": "object"}, path)))
    assert causes == [
        {
            "reason": "FieldValueInvalid",
            "message": f'Invalid value: "{path}": fieldPath must be a valid path',
            "field": f"{SCHEMA}.x-kubernetes-validations[0].fieldPath",
        }
    ]


@pytest.mark.parametrize(
    "path", [".metadata.name", ".spec.size", ".spec['size']", ".spec.labels.team", ".spec.labels['a.b/c']"]
)
def test_a_field_path_through_declared_fields_and_map_keys_is_taken(server: APIServer, path: str) -> None:
    server.install_crd(_crd(_root({"type": "object", "properties": {"name": {"type": "string"}}}, path)))


@pytest.mark.parametrize(
    ("path", "detail"),
    [
        (" ", "fieldPath must be non-empty if specified"),
        (".spec\n.size", "fieldPath must not contain line breaks"),
    ],
)
def test_a_blank_or_broken_field_path_is_refused(server: APIServer, path: str, detail: str) -> None:
    causes = _causes(
        server, _crd(_root({"type": "object", "properties": {"name": {"type": "string"}}}, path))
    )
    assert {
        "reason": "FieldValueInvalid",
        "message": f"Invalid value: {path!r}: {detail}".replace("'", '"'),
        "field": f"{SCHEMA}.x-kubernetes-validations[0].fieldPath",
    } in causes


def test_the_roots_metadata_may_declare_only_name_and_generate_name(server: APIServer) -> None:
    metadata = {"type": "object", "properties": {"name": {"type": "string"}, "labels": {"type": "object"}}}
    causes = _causes(server, _crd(_root(metadata, ".spec.size")))
    assert {
        "reason": "FieldValueForbidden",
        "message": "Forbidden: must not specify anything other than name and generateName, but metadata is "
        "implicitly specified",
        "field": f"{SCHEMA}.properties[metadata]",
    } in causes


def test_the_shipped_crd_is_accepted(server: APIServer) -> None:
    server.install_crd(yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text()))
