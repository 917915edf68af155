"""Dry-run DELETEs, single and collection, through kubectl, the official client and raw HTTP: the server
answers as the real delete would and changes nothing (no garbage collection, no namespace termination).
DeleteOptions come from the body when there is one, else from the query, and are validated as
kube-apiserver validates them (ValidateDeleteOptions, a 422)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from apiserver_http import http
from kubectl_run import kubectl
from kubernetes.client import ApiClient, CoreV1Api

from ember_localcluster.apiserver import APIServer
from ember_operator.crd import crd_manifest

NS = "t1"
CMS = f"/api/v1/namespaces/{NS}/configmaps"
PODS = f"/api/v1/namespaces/{NS}/pods"
EIS = f"/apis/ember.dev/v1alpha1/namespaces/{NS}/inferenceservices"


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=True, pod_kill_margin=None) as api:
        api.install_crd(crd_manifest())
        http(api, "POST", "/api/v1/namespaces", {"metadata": {"name": NS}})
        yield api


@pytest.fixture
def core(server: APIServer, tmp_path: Path) -> Iterator[CoreV1Api]:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(server.write_kubeconfig(tmp_path / "client-kubeconfig")),
        client_configuration=configuration,
    )
    with ApiClient(configuration) as client:
        yield CoreV1Api(client)


def _kubectl(server: APIServer, tmp_path: Path, *args: str) -> str:
    return kubectl(server, tmp_path, *args).stdout


def _exists(server: APIServer, path: str) -> bool:
    return http(server, "GET", path)[0] == 200


def _eis_with_pods(server: APIServer) -> dict[str, Any]:
    body = {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "chat"},
        "spec": {"model": {"name": "llama", "source": "/models/llama"}},
    }
    code, owner = http(server, "POST", EIS, body)
    assert code == 201, owner
    ref = {
        "apiVersion": "ember.dev/v1alpha1",
        "kind": "InferenceService",
        "name": "chat",
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }
    for name in ("chat-0", "chat-1"):
        pod = {
            "metadata": {"name": name, "ownerReferences": [ref]},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
        assert http(server, "POST", PODS, pod)[0] == 201
    return owner


def _bound_pod(server: APIServer, name: str) -> None:
    pod = {
        "metadata": {"name": name},
        "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "x"}]},
    }
    assert http(server, "POST", PODS, pod)[0] == 201


# -- kubectl ------------------------------------------------------------------------------------------


def test_kubectl_dry_run_delete_of_a_configmap_keeps_it(server: APIServer, tmp_path: Path) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    out = _kubectl(server, tmp_path, "-n", NS, "delete", "cm", "a", "--dry-run=server")
    assert out.strip() == 'configmap "a" deleted (server dry run)'
    assert _exists(server, f"{CMS}/a")


def test_kubectl_dry_run_delete_of_an_inference_service_keeps_it_and_its_pods(
    server: APIServer, tmp_path: Path
) -> None:
    _eis_with_pods(server)
    out = _kubectl(server, tmp_path, "-n", NS, "delete", "eis", "chat", "--dry-run=server")
    assert out.strip() == 'inferenceservice.ember.dev "chat" deleted (server dry run)'
    assert _exists(server, f"{EIS}/chat")
    code, pods = http(server, "GET", PODS)
    assert code == 200 and sorted(p["metadata"]["name"] for p in pods["items"]) == ["chat-0", "chat-1"]
    assert not any(p["metadata"].get("deletionTimestamp") for p in pods["items"])


def test_kubectl_dry_run_delete_of_a_namespace_leaves_it_active(server: APIServer, tmp_path: Path) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    out = _kubectl(server, tmp_path, "delete", "namespace", NS, "--dry-run=server")
    assert out.strip() == f'namespace "{NS}" deleted (server dry run)'
    code, namespace = http(server, "GET", f"/api/v1/namespaces/{NS}")
    assert code == 200 and namespace["status"]["phase"] == "Active"
    assert "deletionTimestamp" not in namespace["metadata"]
    assert _exists(server, f"{CMS}/a")


def test_kubectl_dry_run_delete_all_keeps_everything(server: APIServer, tmp_path: Path) -> None:
    for name in ("a", "b"):
        http(server, "POST", CMS, {"metadata": {"name": name, "labels": {"app": "x"}}})
    out = _kubectl(server, tmp_path, "-n", NS, "delete", "cm", "-l", "app=x", "--dry-run=server")
    assert out.splitlines() == [
        'configmap "a" deleted (server dry run)',
        'configmap "b" deleted (server dry run)',
    ]
    assert _exists(server, f"{CMS}/a") and _exists(server, f"{CMS}/b")


# -- the official client ------------------------------------------------------------------------------


def test_client_dry_run_delete_of_a_configmap_answers_success_and_keeps_it(
    server: APIServer, core: CoreV1Api
) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    status = core.delete_namespaced_config_map("a", NS, dry_run="All")  # the client answers a dict
    assert status["status"] == "Success" and status["details"]["name"] == "a"
    assert _exists(server, f"{CMS}/a")


def test_client_dry_run_delete_collection_keeps_every_item(server: APIServer, core: CoreV1Api) -> None:
    for name in ("a", "b"):
        http(server, "POST", CMS, {"metadata": {"name": name}})
    answer = core.delete_collection_namespaced_config_map(NS, dry_run="All")
    assert answer.status is None or answer.status == "Success"
    code, listed = http(server, "GET", CMS)
    assert code == 200 and [c["metadata"]["name"] for c in listed["items"]] == ["a", "b"]


def test_client_dry_run_delete_of_a_bound_pod_answers_it_marked_and_stores_nothing(
    server: APIServer, core: CoreV1Api
) -> None:
    _bound_pod(server, "p")
    before = http(server, "GET", f"{PODS}/p")[1]
    answered = core.delete_namespaced_pod("p", NS, dry_run="All", grace_period_seconds=20)
    assert answered.metadata.deletion_timestamp is not None
    assert answered.metadata.deletion_grace_period_seconds == 20
    assert http(server, "GET", f"{PODS}/p")[1] == before


def test_client_dry_run_delete_of_a_pod_in_its_grace_period_changes_nothing(
    server: APIServer, core: CoreV1Api
) -> None:
    _bound_pod(server, "p")
    marked = http(server, "DELETE", f"{PODS}/p")[1]
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 30
    answered = core.delete_namespaced_pod("p", NS, dry_run="All", grace_period_seconds=1)
    assert answered.metadata.deletion_grace_period_seconds == 1
    assert http(server, "GET", f"{PODS}/p")[1] == marked


# -- raw HTTP -----------------------------------------------------------------------------------------


def test_dry_run_in_the_body_of_a_delete(server: APIServer) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    body = {"propagationPolicy": "Background", "dryRun": ["All"]}
    code, status = http(server, "DELETE", f"{CMS}/a", body)
    assert code == 200 and status["status"] == "Success", status
    assert _exists(server, f"{CMS}/a")


def test_dry_run_collection_delete_answers_the_list_and_keeps_it(server: APIServer) -> None:
    for name in ("a", "b"):
        http(server, "POST", CMS, {"metadata": {"name": name}})
    code, answered = http(server, "DELETE", f"{CMS}?dryRun=All")
    assert code == 200 and [c["metadata"]["name"] for c in answered["items"]] == ["a", "b"]
    code, answered = http(server, "DELETE", CMS, {"dryRun": ["All"]})
    assert code == 200 and [c["metadata"]["name"] for c in answered["items"]] == ["a", "b"]
    assert _exists(server, f"{CMS}/a") and _exists(server, f"{CMS}/b")


def test_dry_run_foreground_delete_answers_the_owner_marked(server: APIServer) -> None:
    _eis_with_pods(server)
    code, answered = http(server, "DELETE", f"{EIS}/chat?dryRun=All&propagationPolicy=Foreground")
    assert code == 200 and answered["kind"] == "InferenceService"
    assert answered["metadata"]["finalizers"] == ["foregroundDeletion"]
    assert answered["metadata"]["deletionTimestamp"]
    stored = http(server, "GET", f"{EIS}/chat")[1]
    assert "deletionTimestamp" not in stored["metadata"] and "finalizers" not in stored["metadata"]
    assert len(http(server, "GET", PODS)[1]["items"]) == 2


def test_dry_run_delete_of_an_object_with_finalizers_answers_it_marked(server: APIServer) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "held", "finalizers": ["x.io/hold"]}})
    code, answered = http(server, "DELETE", f"{CMS}/held?dryRun=All")
    assert code == 200 and answered["kind"] == "ConfigMap" and answered["metadata"]["deletionTimestamp"]
    assert "deletionTimestamp" not in http(server, "GET", f"{CMS}/held")[1]["metadata"]


def test_dry_run_delete_of_a_namespace_answers_it_terminating(server: APIServer) -> None:
    code, answered = http(server, "DELETE", f"/api/v1/namespaces/{NS}?dryRun=All")
    assert code == 200 and answered["status"]["phase"] == "Terminating"
    assert http(server, "GET", f"/api/v1/namespaces/{NS}")[1]["status"]["phase"] == "Active"


UNSUPPORTED = (
    'DeleteOptions.meta.k8s.io "" is invalid: dryRun: Unsupported value: []string{"Bogus"}: '
    'supported values: "All"'
)


@pytest.mark.parametrize("collection", [False, True])
@pytest.mark.parametrize("in_body", [False, True])
def test_an_unsupported_dry_run_value_is_refused(server: APIServer, collection: bool, in_body: bool) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    path = CMS if collection else f"{CMS}/a"
    if in_body:
        code, status = http(server, "DELETE", path, {"dryRun": ["Bogus"]})
    else:
        code, status = http(server, "DELETE", f"{path}?dryRun=Bogus")
    assert code == 422 and status["reason"] == "Invalid", status
    assert status["message"] == UNSUPPORTED
    assert status["details"]["causes"] == [
        {
            "reason": "FieldValueNotSupported",
            "message": 'Unsupported value: []string{"Bogus"}: supported values: "All"',
            "field": "dryRun",
        }
    ]
    assert _exists(server, f"{CMS}/a")


def test_an_unsupported_propagation_policy_is_refused(server: APIServer) -> None:
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    code, status = http(server, "DELETE", f"{CMS}/a", {"propagationPolicy": "Bogus"})
    assert code == 422, status
    assert status["message"] == (
        'DeleteOptions.meta.k8s.io "" is invalid: propagationPolicy: Unsupported value: "Bogus": '
        'supported values: "Foreground", "Background", "Orphan", "nil"'
    )
    assert _exists(server, f"{CMS}/a")


def test_a_body_replaces_the_query(server: APIServer) -> None:
    """As kube-apiserver's delete handler: options are decoded from the body when there is one, and
    the query is then not read."""
    http(server, "POST", CMS, {"metadata": {"name": "a"}})
    code, _ = http(server, "DELETE", f"{CMS}/a?dryRun=All", {"propagationPolicy": "Background"})
    assert code == 200 and not _exists(server, f"{CMS}/a")
