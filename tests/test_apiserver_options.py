"""Query options as kube-apiserver validates them (ValidateCreateOptions and the other write options,
ValidateListOptions of meta/internalversion), and field selectors on custom resources (only
metadata.name and metadata.namespace are field labels), with upstream's status codes and messages."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from apiserver_http import http

from ember_localcluster.apiserver import APIServer
from ember_operator.crd import crd_manifest

CMS = "/api/v1/namespaces/default/configmaps"
EIS = "/apis/ember.dev/v1alpha1/namespaces/default/inferenceservices"


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        api.install_crd(crd_manifest())
        yield api


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (
            "fieldValidation=Bogus",
            'CreateOptions.meta.k8s.io "" is invalid: fieldValidation: Unsupported value: "Bogus": supported '
            'values: "", "Ignore", "Strict", "Warn"',
        ),
        (
            "dryRun=Bogus",
            'CreateOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: []string{"Bogus"}: supported '
            'values: "All"',
        ),
    ],
)
def test_create_options_are_validated(server: APIServer, query: str, message: str) -> None:
    code, status = http(server, "POST", f"{CMS}?{query}", {"metadata": {"name": "opt"}})
    assert code == 422 and status["reason"] == "Invalid" and status["message"] == message
    assert http(server, "GET", f"{CMS}/opt")[0] == 404


def test_dry_run_all_stores_nothing(server: APIServer) -> None:
    code, _ = http(server, "POST", f"{CMS}?dryRun=All", {"metadata": {"name": "dry"}})
    assert code == 201 and http(server, "GET", f"{CMS}/dry")[0] == 404


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (
            "resourceVersionMatch=Exact",
            "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden unless resourceVersion is provided",
        ),
        (
            "resourceVersion=1&resourceVersionMatch=Bogus",
            'resourceVersionMatch: Unsupported value: "Bogus": supported values: "Exact", "NotOlderThan", ""',
        ),
        ("sendInitialEvents=true", "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for list"),
        (
            "watch=true&sendInitialEvents=true",
            "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to "
            "NotOlderThan",
        ),
    ],
)
def test_list_options_are_validated(server: APIServer, query: str, message: str) -> None:
    code, status = http(server, "GET", f"{CMS}?{query}")
    assert code == 422 and status["message"] == f'ListOptions.meta.k8s.io "" is invalid: {message}'


def test_custom_resources_select_only_by_name_and_namespace(server: APIServer) -> None:
    code, status = http(server, "GET", f"{EIS}?fieldSelector=spec.foo%3Dbar")
    assert code == 400 and status["reason"] == "BadRequest"
    assert status["message"] == "field label not supported: spec.foo"
    assert http(server, "GET", f"{EIS}?fieldSelector=metadata.name%3Dx")[0] == 200


APPLY = "application/apply-patch+yaml"
DOC = '{"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ssa"}, "data": {"x": "1"}}'


@pytest.mark.parametrize(
    ("query", "content_type", "message"),
    [
        (
            "force=true",
            "application/merge-patch+json",
            "force: Forbidden: may not be specified for non-apply patch",
        ),
        ("fieldManager=" + "m" * 129, APPLY, "fieldManager: Too long: may not be more than 128 bytes"),
        ("", APPLY, "fieldManager: Required value: is required for apply patch"),
    ],
)
def test_patch_options_are_validated(server: APIServer, query: str, content_type: str, message: str) -> None:
    body = '{"data": {"q": "1"}}' if "merge" in content_type else DOC
    code, status = http(server, "PATCH", f"{CMS}/ssa?{query}", body.encode(), content_type)
    assert code == 422 and status["message"] == f'PatchOptions.meta.k8s.io "" is invalid: {message}'


def test_an_apply_without_api_version_is_a_bad_request(server: APIServer) -> None:
    code, status = http(
        server, "PATCH", f"{CMS}/ssa2?fieldManager=m", b"metadata: {name: ssa2}\ndata: {a: b}", APPLY
    )
    assert code == 400 and status["message"] == (
        "Incorrect version specified in apply patch. Specified patch version: , expected: v1"
    )
