"""Strict field validation's wording, as kube-apiserver's handlers give it: create and update decode the
body (transformDecodeError: `<Kind> in version "<v>" cannot be handled as a <Kind>: strict decoding
error: ...`), patch applies it (the bare `strict decoding error: ...`); every unknown field in one error,
metadata's first."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from apiserver_http import http
from kubectl_run import kubectl

from ember_localcluster.apiserver import APIServer
from ember_operator.crd import crd_manifest

EIS = "/apis/ember.dev/v1alpha1/namespaces/default/inferenceservices"
CMS = "/api/v1/namespaces/default/configmaps"
PREFIX = 'InferenceService in version "v1alpha1" cannot be handled as a InferenceService: '
TWO = 'strict decoding error: unknown field "spec.bar", unknown field "spec.foo"'


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        api.install_crd(crd_manifest())
        yield api


def _eis(name: str, **extra: Any) -> dict[str, Any]:
    spec = {"model": {"name": "m", "source": "/models/m"}, **extra}
    return {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_create_names_the_kind_and_joins_the_fields(server: APIServer) -> None:
    code, status = http(server, "POST", f"{EIS}?fieldValidation=Strict", _eis("c", foo=1, bar=2))
    assert code == 400 and status["reason"] == "BadRequest"
    assert status["message"] == PREFIX + TWO


def test_metadata_fields_come_first_in_the_same_error(server: APIServer) -> None:
    body = _eis("m", foo=1)
    body["metadata"]["zap"] = 1
    code, status = http(server, "POST", f"{EIS}?fieldValidation=Strict", body)
    assert code == 400 and status["message"] == (
        PREFIX + 'strict decoding error: unknown field "metadata.zap", unknown field "spec.foo"'
    )
    code, status = http(
        server, "POST", f"{CMS}?fieldValidation=Strict", {"metadata": {"name": "m", "zap": 1}}
    )
    assert code == 400 and status["message"] == (
        'ConfigMap in version "v1" cannot be handled as a ConfigMap: strict decoding error: unknown field '
        '"metadata.zap"'
    )


def test_update_names_the_kind(server: APIServer) -> None:
    created = http(server, "POST", EIS, _eis("u"))[1]
    body = _eis("u", foo=1, bar=2)
    body["metadata"]["resourceVersion"] = created["metadata"]["resourceVersion"]
    code, status = http(server, "PUT", f"{EIS}/u?fieldValidation=Strict", body)
    assert code == 400 and status["message"] == PREFIX + TWO


def test_patch_answers_the_bare_error(server: APIServer) -> None:
    http(server, "POST", EIS, _eis("p"))
    patch = {"spec": {"foo": 1, "bar": 2}}
    code, status = http(
        server, "PATCH", f"{EIS}/p?fieldValidation=Strict", patch, "application/merge-patch+json"
    )
    assert code == 400 and status["message"] == TWO


def test_kubectl_apply_shows_the_kind(server: APIServer, tmp_path: Path) -> None:
    manifest = tmp_path / "eis.yaml"
    manifest.write_text(yaml.safe_dump(_eis("k", foo=1)))
    result = kubectl(server, tmp_path, "apply", "-f", str(manifest), ok=False)
    assert result.returncode != 0
    assert PREFIX + 'strict decoding error: unknown field "spec.foo"' in result.stderr
