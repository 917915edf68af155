"""Annotations as kube-apiserver's ValidateAnnotations checks them: each key a qualified name (checked
lower-cased), all keys and values together at most 256 KiB; through kubectl and raw HTTP."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from apiserver_http import http
from kubectl_run import kubectl

from ember_localcluster.apiserver import APIServer

CMS = "/api/v1/namespaces/default/configmaps"
EIS = "/apis/ember.dev/v1alpha1/namespaces/default/inferenceservices"
TOO_LONG = "metadata.annotations: Too long: may not be more than 262144 bytes"
NAME_PART = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    from ember_operator.crd import crd_manifest

    with APIServer() as api:
        api.install_crd(crd_manifest())
        yield api


def test_client_side_apply_of_a_large_configmap_is_refused(server: APIServer, tmp_path: Path) -> None:
    """kubectl keeps the whole applied object in the last-applied-configuration annotation."""
    manifest = tmp_path / "big.yaml"
    body = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "big"},
        "data": {"a": "x" * 300_000},
    }
    manifest.write_text(yaml.safe_dump(body))
    result = kubectl(server, tmp_path, "apply", "-f", str(manifest), ok=False)
    assert result.returncode != 0
    assert f'The ConfigMap "big" is invalid: {TOO_LONG}' in result.stderr
    assert http(server, "GET", f"{CMS}/big")[0] == 404


def test_annotations_over_256_kib_are_refused(server: APIServer) -> None:
    half = "x" * (128 * 1024)
    body = {"metadata": {"name": "two", "annotations": {"a": half, "b": half}}}
    code, status = http(server, "POST", CMS, body)
    assert code == 422 and status["message"] == f'ConfigMap "two" is invalid: {TOO_LONG}'
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueTooLong",
            "message": "Too long: may not be more than 262144 bytes",
            "field": "metadata.annotations",
        }
    ]
    body = {"metadata": {"name": "two", "annotations": {"a": half, "b": half[:-2]}}}
    assert http(server, "POST", CMS, body)[0] == 201


def test_an_annotation_key_that_is_no_qualified_name_is_refused(server: APIServer) -> None:
    body = {"metadata": {"name": "bad", "annotations": {"bad key!": "v"}}}
    code, status = http(server, "POST", CMS, body)
    assert code == 422 and status["message"] == (
        f'ConfigMap "bad" is invalid: metadata.annotations: Invalid value: "bad key!": {NAME_PART}'
    )
    code, created = http(
        server,
        "POST",
        EIS,
        {"metadata": {"name": "chat"}, "spec": {"model": {"name": "m", "source": "/models/m"}}},
    )
    assert code == 201, created
    patch = {"metadata": {"annotations": {"bad key!": "v"}}}
    code, status = http(server, "PATCH", f"{EIS}/chat", patch, "application/merge-patch+json")
    assert code == 422 and status["message"].startswith(
        'InferenceService.ember.dev "chat" is invalid: metadata.annotations: Invalid value: "bad key!"'
    )


def test_annotation_keys_are_checked_lower_cased(server: APIServer) -> None:
    body = {"metadata": {"name": "upper", "annotations": {"Example.COM/Some-Key": "v"}}}
    assert http(server, "POST", CMS, body)[0] == 201
