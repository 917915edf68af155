"""kube-apiserver's default admission plugins that resolve what a new Pod names, with their 403s: the
ServiceAccount plugin (and the ServiceAccount controller's `default` account in each namespace), the
Priority plugin (with the two built-in PriorityClasses) and the RuntimeClass plugin."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ember_localcluster.apiserver import APIError, APIServer


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        yield api


def _pod(name: str, namespace: str = "default", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"containers": [{"name": "c", "image": "x"}], **spec},
    }


def _forbidden(server: APIServer, pod: dict[str, Any]) -> str:
    with pytest.raises(APIError) as caught:
        server.create(pod)
    assert (caught.value.code, caught.value.reason) == (403, "Forbidden"), caught.value
    assert server.get("v1", "Pod", pod["metadata"]["namespace"], pod["metadata"]["name"]) is None
    return caught.value.message


def test_every_namespace_has_a_default_service_account_that_pods_get(server: APIServer) -> None:
    server.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "fresh"}})
    for namespace in ("default", "kube-system", "fresh"):
        assert server.get("v1", "ServiceAccount", namespace, "default") is not None, namespace
    spec = server.create(_pod("plain", "fresh"))["spec"]
    assert (spec["serviceAccountName"], spec["serviceAccount"]) == ("default", "default")


def test_a_pod_naming_a_missing_service_account_is_forbidden(server: APIServer) -> None:
    message = _forbidden(server, _pod("no-sa", serviceAccountName="does-not-exist"))
    assert message == (
        'pods "no-sa" is forbidden: error looking up service account default/does-not-exist: '
        'serviceaccount "does-not-exist" not found'
    )
    server.create(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "runner", "namespace": "default"}}
    )
    assert (
        server.create(_pod("with-sa", serviceAccountName="runner"))["spec"]["serviceAccountName"] == "runner"
    )


def test_a_pod_naming_a_missing_priority_class_is_forbidden(server: APIServer) -> None:
    message = _forbidden(server, _pod("no-pc", priorityClassName="nope-pc"))
    assert message == 'pods "no-pc" is forbidden: no PriorityClass with name nope-pc was found'


def test_the_priority_comes_from_the_pods_priority_class(server: APIServer) -> None:
    spec = server.create(_pod("no-class"))["spec"]
    assert (spec["priority"], spec["preemptionPolicy"]) == (0, "PreemptLowerPriority")
    assert "priorityClassName" not in spec
    critical = server.create(_pod("critical", "kube-system", priorityClassName="system-node-critical"))[
        "spec"
    ]
    assert critical["priority"] == 2000001000
    server.create(
        {
            "apiVersion": "scheduling.k8s.io/v1",
            "kind": "PriorityClass",
            "metadata": {"name": "batch"},
            "value": 100,
            "preemptionPolicy": "Never",
        }
    )
    spec = server.create(_pod("batch", priorityClassName="batch"))["spec"]
    assert (spec["priority"], spec["preemptionPolicy"]) == (100, "Never")
    message = _forbidden(server, _pod("wrong-priority", priorityClassName="batch", priority=5))
    assert message == (
        'pods "wrong-priority" is forbidden: the integer value of priority (5) must not be provided in pod '
        "spec; priority admission controller computed 100 from the given PriorityClass name"
    )


def test_a_pod_naming_a_missing_runtime_class_is_forbidden(server: APIServer) -> None:
    message = _forbidden(server, _pod("no-rc", runtimeClassName="nope-rc"))
    assert message == 'pods "no-rc" is forbidden: pod rejected: RuntimeClass "nope-rc" not found'
    server.create(
        {
            "apiVersion": "node.k8s.io/v1",
            "kind": "RuntimeClass",
            "metadata": {"name": "runc"},
            "handler": "runc",
        }
    )
    assert server.create(_pod("with-rc", runtimeClassName="runc"))["spec"]["runtimeClassName"] == "runc"


def test_new_pods_get_the_default_toleration_seconds_for_not_ready_and_unreachable_nodes(
    server: APIServer,
) -> None:
    """The DefaultTolerationSeconds plugin: 300 s for `node.kubernetes.io/not-ready` and `unreachable`
    NoExecute taints, unless the pod already tolerates one (a toleration with that key or no key, and
    effect NoExecute or none)."""
    defaults = [
        {
            "key": "node.kubernetes.io/not-ready",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        },
        {
            "key": "node.kubernetes.io/unreachable",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": 300,
        },
    ]
    assert server.create(_pod("tolerations-default"))["spec"]["tolerations"] == defaults
    own = {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute"}
    own_seconds = {**own, "tolerationSeconds": 5}
    spec = server.create(_pod("tolerations-own", tolerations=[own_seconds]))["spec"]
    assert spec["tolerations"] == [own_seconds, defaults[0]]
    everything = {"operator": "Exists"}
    assert server.create(_pod("tolerations-all", tolerations=[everything]))["spec"]["tolerations"] == [
        everything
    ]
    other = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}
    spec = server.create(_pod("tolerations-other", tolerations=[other]))["spec"]
    assert spec["tolerations"] == [other, *defaults]


def test_the_node_lease_namespace_exists_from_the_start(server: APIServer) -> None:
    assert server.get("v1", "Namespace", "", "kube-node-lease") is not None
