"""Writes as kube-apiserver's generic registry decides them (k8s.io/apiserver's endpoints handlers and
registry/generic/registry.Store): identity and concurrency checks on update, what DELETE answers, the
order of validation and the AlreadyExists check, and which kinds carry `metadata.generation`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from apiserver_http import http

from ember_localcluster.apiserver import APIServer
from ember_operator.crd import crd_manifest

CMS = "/api/v1/namespaces/default/configmaps"
EIS = "/apis/ember.dev/v1alpha1/namespaces/default/inferenceservices"


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False) as api:
        api.install_crd(crd_manifest())
        yield api


def _eis(name: str) -> dict[str, Any]:
    spec = {"model": {"name": "m", "source": "/models/m"}}
    return {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }


def _created(server: APIServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    code, obj = http(server, "POST", path, body)
    assert code == 201, obj
    return obj


# -- identity and concurrency on update --------------------------------------------------------------


def test_put_of_a_custom_resource_needs_a_resource_version(server: APIServer) -> None:
    obj = _created(server, EIS, _eis("norv"))
    del obj["metadata"]["resourceVersion"]
    obj["spec"]["model"]["name"] = "m2"
    code, status = http(server, "PUT", f"{EIS}/norv", obj)
    assert code == 422 and status["reason"] == "Invalid"
    assert status["message"] == (
        'inferenceservices.ember.dev "norv" is invalid: metadata.resourceVersion: Invalid value: 0: '
        "must be specified for an update"
    )
    assert status["details"]["kind"] == "inferenceservices" and status["details"]["group"] == "ember.dev"


def test_put_of_a_configmap_without_resource_version_is_unconditional(server: APIServer) -> None:
    obj = _created(server, CMS, {"metadata": {"name": "uncond"}})
    del obj["metadata"]["resourceVersion"]
    obj["data"] = {"a": "b"}
    code, updated = http(server, "PUT", f"{CMS}/uncond", obj)
    assert code == 200 and updated["data"] == {"a": "b"}


def test_put_with_another_uid_fails_the_uid_precondition(server: APIServer) -> None:
    obj = _created(server, CMS, {"metadata": {"name": "uid"}})
    stored_uid = obj["metadata"]["uid"]
    obj["metadata"]["uid"] = "00000000-0000-0000-0000-000000000000"
    code, status = http(server, "PUT", f"{CMS}/uid", obj)
    assert code == 409 and status["reason"] == "Conflict"
    assert status["message"] == (
        'Operation cannot be fulfilled on configmaps "uid": Precondition failed: UID in precondition: '
        f"00000000-0000-0000-0000-000000000000, UID in object meta: {stored_uid}"
    )


def test_patch_changing_the_uid_is_invalid(server: APIServer) -> None:
    _created(server, CMS, {"metadata": {"name": "uidp"}})
    patch = {"metadata": {"uid": "00000000-0000-0000-0000-000000000000"}}
    code, status = http(server, "PATCH", f"{CMS}/uidp", patch, "application/merge-patch+json")
    assert code == 422
    assert status["message"] == (
        'ConfigMap "uidp" is invalid: metadata.uid: Invalid value: "00000000-0000-0000-0000-000000000000": '
        "field is immutable"
    )


def test_put_with_another_namespace_in_the_body_is_a_bad_request(server: APIServer) -> None:
    obj = _created(server, CMS, {"metadata": {"name": "ns"}})
    obj["metadata"]["namespace"] = "kube-system"
    code, status = http(server, "PUT", f"{CMS}/ns", obj)
    assert code == 400 and status["reason"] == "BadRequest"
    assert (
        status["message"]
        == "the namespace of the provided object does not match the namespace sent on the request"
    )


def test_patch_changing_the_name_is_a_bad_request(server: APIServer) -> None:
    _created(server, CMS, {"metadata": {"name": "named"}})
    code, status = http(
        server, "PATCH", f"{CMS}/named", {"metadata": {"name": "other"}}, "application/merge-patch+json"
    )
    assert code == 400
    assert status["message"] == "the name of the object (other) does not match the name on the URL (named)"


def test_create_with_a_resource_version_is_refused(server: APIServer) -> None:
    code, status = http(server, "POST", CMS, {"metadata": {"name": "withrv", "resourceVersion": "5"}})
    assert code == 500 and status["message"] == "resourceVersion should not be set on objects to be created"
    assert http(server, "GET", f"{CMS}/withrv")[0] == 404


# -- what DELETE answers; validation before AlreadyExists ---------------------------------------------


def test_immediate_delete_of_a_custom_resource_answers_a_success_status(server: APIServer) -> None:
    uid = _created(server, EIS, _eis("gone"))["metadata"]["uid"]
    code, body = http(server, "DELETE", f"{EIS}/gone")
    assert code == 200
    assert body == {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success",
        "details": {"name": "gone", "group": "ember.dev", "kind": "inferenceservices", "uid": uid},
    }


def test_immediate_delete_of_a_configmap_answers_a_success_status(server: APIServer) -> None:
    uid = _created(server, CMS, {"metadata": {"name": "gonecm"}})["metadata"]["uid"]
    code, body = http(server, "DELETE", f"{CMS}/gonecm")
    assert code == 200 and body["kind"] == "Status" and body["status"] == "Success"
    assert body["details"] == {"name": "gonecm", "group": "", "kind": "configmaps", "uid": uid}


def test_delete_held_by_a_finalizer_answers_the_object(server: APIServer) -> None:
    _created(server, CMS, {"metadata": {"name": "held", "finalizers": ["example.com/hold"]}})
    code, body = http(server, "DELETE", f"{CMS}/held")
    assert code == 200 and body["kind"] == "ConfigMap" and body["metadata"]["deletionTimestamp"]
    http(server, "PATCH", f"{CMS}/held", {"metadata": {"finalizers": None}}, "application/merge-patch+json")


def test_immediate_delete_of_a_pod_answers_the_pod(server: APIServer) -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    _created(server, "/api/v1/namespaces/default/pods", pod)
    code, body = http(server, "DELETE", "/api/v1/namespaces/default/pods/p")
    assert code == 200 and body["kind"] == "Pod"


def test_an_invalid_body_with_an_existing_name_is_invalid_not_already_exists(server: APIServer) -> None:
    _created(server, CMS, {"metadata": {"name": "exists"}})
    code, status = http(server, "POST", CMS, {"metadata": {"name": "exists", "labels": {"a": "has space"}}})
    assert code == 422 and status["reason"] == "Invalid", status


# -- metadata.generation ------------------------------------------------------------------------------


def test_configmaps_have_no_generation(server: APIServer) -> None:
    created = _created(server, CMS, {"metadata": {"name": "nogen", "generation": 7}, "data": {"a": "1"}})
    assert "generation" not in created["metadata"]
    code, patched = http(
        server, "PATCH", f"{CMS}/nogen", {"data": {"a": "2"}}, "application/merge-patch+json"
    )
    assert code == 200 and "generation" not in patched["metadata"]


def test_deployment_generation_grows_with_spec_and_annotations(server: APIServer) -> None:
    path = "/apis/apps/v1/namespaces/default/deployments"
    template = {"metadata": {"labels": {"app": "g"}}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    body = {
        "metadata": {"name": "gen"},
        "spec": {"selector": {"matchLabels": {"app": "g"}}, "template": template},
    }
    assert _created(server, path, body)["metadata"]["generation"] == 1
    merge = "application/merge-patch+json"
    code, patched = http(server, "PATCH", f"{path}/gen", {"metadata": {"labels": {"x": "y"}}}, merge)
    assert code == 200 and patched["metadata"]["generation"] == 1
    code, patched = http(server, "PATCH", f"{path}/gen", {"metadata": {"annotations": {"x": "y"}}}, merge)
    assert code == 200 and patched["metadata"]["generation"] == 2
    code, patched = http(server, "PATCH", f"{path}/gen", {"spec": {"replicas": 3}}, merge)
    assert code == 200 and patched["metadata"]["generation"] == 3


def test_custom_resource_without_status_subresource_bumps_generation_on_status(server: APIServer) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "widgets.example.com"},
        "spec": {
            "group": "example.com",
            "scope": "Namespaced",
            "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
                    },
                }
            ],
        },
    }
    server.create(crd)
    path = "/apis/example.com/v1/namespaces/default/widgets"
    created = _created(
        server, path, {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}}
    )
    assert created["metadata"]["generation"] == 1
    merge = "application/merge-patch+json"
    code, patched = http(server, "PATCH", f"{path}/w", {"status": {"ready": True}}, merge)
    assert code == 200 and patched["metadata"]["generation"] == 2
    code, patched = http(server, "PATCH", f"{path}/w", {"metadata": {"labels": {"a": "b"}}}, merge)
    assert code == 200 and patched["metadata"]["generation"] == 2


def test_unknown_metadata_fields_are_dropped_or_refused_when_strict(server: APIServer) -> None:
    body = {**_eis("mf"), "metadata": {"name": "mf", "foo": 1}}
    code, created = http(server, "POST", EIS, body)
    assert code == 201 and "foo" not in created["metadata"]
    code, status = http(
        server, "POST", f"{CMS}?fieldValidation=Strict", {"metadata": {"name": "mf", "foo": 1}}
    )
    assert code == 400 and status["message"] == (
        'ConfigMap in version "v1" cannot be handled as a ConfigMap: strict decoding error: unknown field '
        '"metadata.foo"'
    )
