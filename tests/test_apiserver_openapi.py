"""The OpenAPI documents through kubectl (`explain`, `apply`) and raw HTTP: custom resources published with
their schemas in `/openapi/v3/apis/<group>/<version>` and `/openapi/v2`, appearing and going with their
CRDs; built-in kinds without schemas."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver_http import http
from kubectl_run import kubectl

from ember_localcluster.apiserver import APIServer
from ember_operator.crd import crd_manifest

EIS = "dev.ember.v1alpha1.InferenceService"
EIS_LIST = "dev.ember.v1alpha1.InferenceServiceList"
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        api.install_crd(crd_manifest())
        yield api


def _get(server: APIServer, path: str, accept: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(server.url + path)
    if accept is not None:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _keys(node: Any) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in _keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in _keys(v)}
    return set()


# -- kubectl explain ----------------------------------------------------------------------------------


def test_kubectl_explain_shows_the_inference_service(server: APIServer, tmp_path: Path) -> None:
    out = kubectl(server, tmp_path, "explain", "eis").stdout
    header = out.split("DESCRIPTION:")[0].split()
    assert header == ["GROUP:", "ember.dev", "KIND:", "InferenceService", "VERSION:", "v1alpha1"]
    fields = [
        line.split()[0]
        for line in out.split("FIELDS:")[1].splitlines()
        if line[:2] == "  " and line[2] != " "
    ]
    assert fields == ["apiVersion", "kind", "metadata", "spec", "status"]


def test_kubectl_explain_a_nested_field(server: APIServer, tmp_path: Path) -> None:
    out = kubectl(server, tmp_path, "explain", "eis.spec.engine").stdout
    assert "FIELD: engine <Object>" in out
    assert "blockSize\t<integer>" in out and "kvCacheDtype\t<string>" in out


def test_kubectl_explain_recursive_reaches_object_meta(server: APIServer, tmp_path: Path) -> None:
    out = kubectl(server, tmp_path, "explain", "eis", "--recursive").stdout
    assert "ownerReferences\t<[]OwnerReference>" in out and "blockSize\t<integer>" in out


def test_kubectl_explain_of_a_built_in_kind_fails(server: APIServer, tmp_path: Path) -> None:
    """Built-in kinds have no schema here."""
    result = kubectl(server, tmp_path, "explain", "pods", ok=False)
    assert result.returncode != 0 and "not found in OpenAPI schema" in result.stderr


def test_kubectl_apply_still_patches_built_in_kinds(server: APIServer, tmp_path: Path) -> None:
    manifest = tmp_path / "cm.yaml"
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"a": "1"}}
    manifest.write_text(yaml.safe_dump(body))
    assert "created" in kubectl(server, tmp_path, "apply", "-f", str(manifest)).stdout
    manifest.write_text(yaml.safe_dump({**body, "data": {"a": "2"}}))
    result = kubectl(server, tmp_path, "apply", "-f", str(manifest))
    assert "configured" in result.stdout and "warning" not in result.stderr.lower(), result.stderr
    assert http(server, "GET", "/api/v1/namespaces/default/configmaps/applied")[1]["data"] == {"a": "2"}


# -- the documents ------------------------------------------------------------------------------------


def test_v3_group_version_document_has_the_schemas(server: APIServer) -> None:
    code, raw = _get(server, "/openapi/v3/apis/ember.dev/v1alpha1", "application/json")
    assert code == 200
    document = json.loads(raw)
    schemas = document["components"]["schemas"]
    kind, listed = schemas[EIS], schemas[EIS_LIST]
    assert kind["x-kubernetes-group-version-kind"] == [
        {"group": "ember.dev", "kind": "InferenceService", "version": "v1alpha1"}
    ]
    assert listed["x-kubernetes-group-version-kind"][0]["kind"] == "InferenceServiceList"
    assert kind["properties"]["metadata"]["allOf"] == [{"$ref": f"#/components/schemas/{OBJECT_META}"}]
    assert listed["properties"]["items"]["items"] == {"$ref": f"#/components/schemas/{EIS}"}
    assert "blockSize" in kind["properties"]["spec"]["properties"]["engine"]["properties"]
    for ref in _refs(document):
        assert ref.removeprefix("#/components/schemas/") in schemas, ref
    operations = document["paths"]["/apis/ember.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{name}"]
    assert sorted(operations) == ["delete", "get", "patch", "put"]
    assert operations["patch"]["x-kubernetes-action"] == "patch"
    assert (
        "/apis/ember.dev/v1alpha1/namespaces/{namespace}/inferenceservices/{name}/scale" in document["paths"]
    )


def test_v2_document_has_the_definitions_without_what_v2_cannot_say(server: APIServer) -> None:
    code, raw = _get(server, "/openapi/v2", "application/json")
    assert code == 200
    document = json.loads(raw)
    assert document["swagger"] == "2.0"
    definitions = document["definitions"]
    assert definitions[EIS]["properties"]["metadata"]["$ref"] == f"#/definitions/{OBJECT_META}"
    assert definitions[EIS_LIST]["x-kubernetes-group-version-kind"][0]["kind"] == "InferenceServiceList"
    for ref in _refs(document):
        assert ref.removeprefix("#/definitions/") in definitions, ref
    assert not _keys(definitions[EIS]) & {"anyOf", "allOf", "oneOf", "not", "nullable"}
    path = "/apis/ember.dev/v1alpha1/namespaces/{namespace}/inferenceservices"
    assert document["paths"][path]["post"]["x-kubernetes-action"] == "post"


def test_v2_as_protobuf_is_not_acceptable(server: APIServer) -> None:
    assert _get(server, "/openapi/v2", PROTOBUF)[0] == 406
    assert _get(server, "/openapi/v2", f"{PROTOBUF}, application/json")[0] == 200
    assert _get(server, "/openapi/v2")[0] == 200


def test_crds_appear_and_go_at_run_time(server: APIServer) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "scope": "Cluster",
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": {
                                    "type": "object",
                                    "properties": {
                                        "size": {"x-kubernetes-int-or-string": True},
                                        "note": {"type": "string", "nullable": True},
                                    },
                                    "required": ["note"],
                                }
                            },
                        }
                    },
                }
            ],
        },
    }
    crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
    assert http(server, "POST", crds, crd)[0] == 201
    v3 = json.loads(_get(server, "/openapi/v3/apis/example.com/v1")[1])["components"]["schemas"]
    spec = v3["com.example.v1.Widget"]["properties"]["spec"]
    assert spec["properties"]["size"]["anyOf"] == [{"type": "integer"}, {"type": "string"}]
    assert "/openapi/v3/apis/example.com/v1" in json.loads(_get(server, "/openapi/v3")[1])["paths"].__repr__()
    v2 = json.loads(_get(server, "/openapi/v2")[1])["definitions"]
    spec = v2["com.example.v1.Widget"]["properties"]["spec"]
    assert "anyOf" not in spec["properties"]["size"] and spec["properties"]["note"] == {}
    assert "required" not in spec

    assert http(server, "DELETE", f"{crds}/widgets.example.com")[0] == 200
    assert _get(server, "/openapi/v3/apis/example.com/v1")[0] == 404
    assert "com.example.v1.Widget" not in json.loads(_get(server, "/openapi/v2")[1])["definitions"]
