"""Namespace deletion as Kubernetes does it: the namespace registry marks the namespace Terminating
(spec.finalizers `kubernetes`), the NamespaceLifecycle admission plugin refuses new content with a 403, the
namespace controller deletes the content, reports what remains in the namespace's conditions, and removes
the namespace once nothing is left."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from apiserver_http import http

from ember_localcluster.apiserver import APIServer

NS = "/api/v1/namespaces"
MERGE = "application/merge-patch+json"


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False) as api:
        yield api


def _conditions(namespace: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    return {c["type"]: (c["status"], c["reason"], c["message"]) for c in namespace["status"]["conditions"]}


def test_a_new_namespace_has_the_kubernetes_finalizer(server: APIServer) -> None:
    code, created = http(server, "POST", NS, {"metadata": {"name": "fin"}})
    assert code == 201 and created["spec"] == {"finalizers": ["kubernetes"]}
    assert created["status"] == {"phase": "Active"}


def test_namespace_with_held_content_stays_terminating_until_the_content_goes(server: APIServer) -> None:
    http(server, "POST", NS, {"metadata": {"name": "t1"}})
    code, _ = http(
        server, "POST", f"{NS}/t1/configmaps", {"metadata": {"name": "held", "finalizers": ["x.io/hold"]}}
    )
    assert code == 201
    http(server, "POST", f"{NS}/t1/configmaps", {"metadata": {"name": "free"}})
    code, deleted = http(server, "DELETE", f"{NS}/t1")
    assert code == 200 and deleted["kind"] == "Namespace"
    assert deleted["metadata"]["deletionTimestamp"] and deleted["status"]["phase"] == "Terminating"

    code, namespace = http(server, "GET", f"{NS}/t1")
    assert code == 200 and namespace["status"]["phase"] == "Terminating"
    conditions = _conditions(namespace)
    assert conditions["NamespaceContentRemaining"] == (
        "True",
        "SomeResourcesRemain",
        "Some resources are remaining: configmaps. has 1 resource instances",
    )
    assert conditions["NamespaceFinalizersRemaining"] == (
        "True",
        "SomeFinalizersRemain",
        "Some content in the namespace has finalizers remaining: x.io/hold in 1 resource instances",
    )
    assert http(server, "GET", f"{NS}/t1/configmaps/free")[0] == 404

    code, status = http(server, "POST", f"{NS}/t1/configmaps", {"metadata": {"name": "new"}})
    assert code == 403 and status["reason"] == "Forbidden"
    assert status["message"] == (
        'configmaps "new" is forbidden: unable to create new content in namespace t1 because it is being terminated'
    )
    assert status["details"]["causes"] == [
        {
            "reason": "NamespaceTerminating",
            "message": "namespace t1 is being terminated",
            "field": "metadata.namespace",
        }
    ]
    code, status = http(server, "DELETE", f"{NS}/t1")
    assert code == 409 and status["message"] == (
        'Operation cannot be fulfilled on namespaces "t1": The system is ensuring all content is removed from this '
        "namespace.  Upon completion, this namespace will automatically be purged by the system."
    )

    code, _ = http(server, "PATCH", f"{NS}/t1/configmaps/held", {"metadata": {"finalizers": None}}, MERGE)
    assert code == 200
    assert http(server, "GET", f"{NS}/t1")[0] == 404
    # A namespace made again under that name starts empty.
    http(server, "POST", NS, {"metadata": {"name": "t1"}})
    assert http(server, "GET", f"{NS}/t1/configmaps/held")[0] == 404


def test_an_empty_namespace_goes_at_once(server: APIServer) -> None:
    http(server, "POST", NS, {"metadata": {"name": "empty"}})
    http(server, "POST", f"{NS}/empty/configmaps", {"metadata": {"name": "a"}})
    code, deleted = http(server, "DELETE", f"{NS}/empty")
    assert code == 200 and deleted["status"]["phase"] == "Terminating"
    assert http(server, "GET", f"{NS}/empty")[0] == 404


def test_a_namespace_always_carries_its_name_label(server: APIServer) -> None:
    """SetDefaults_Namespace (Kubernetes 1.21+) labels every namespace `kubernetes.io/metadata.name: <name>`
    on create and on every write, whatever the write says, so that selectors can pick namespaces by name."""
    label = "kubernetes.io/metadata.name"
    code, created = http(server, "POST", NS, {"metadata": {"name": "t4", "labels": {"team": "a"}}})
    assert code == 201 and created["metadata"]["labels"] == {"team": "a", label: "t4"}
    patch = {"metadata": {"labels": {label: "other", "team": None}}}
    code, patched = http(server, "PATCH", f"{NS}/t4", patch, "application/merge-patch+json")
    assert code == 200 and patched["metadata"]["labels"] == {label: "t4"}
