"""Built-in kinds' update and workload rules as kube-apiserver validates them: ValidatePodUpdate (a pod's
spec is immutable but for a few fields) and apps/v1 Deployment selectors (ValidateDeploymentSpec,
ValidateDeploymentUpdate), with their 422 messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ember_localcluster.apiserver import APIError, APIServer

POD_FORBIDDEN = (
    'Pod "p" is invalid: spec: Forbidden: pod updates may not change fields other than '
    "`spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,"
    "`spec.tolerations` (only additions to existing tolerations),"
    "`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)"
)


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False) as api:
        yield api


def _pod() -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x"}]},
    }


def _refused(call: Any) -> APIError:
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.code == 422 and caught.value.reason == "Invalid", caught.value
    return caught.value


@pytest.mark.parametrize(
    "patch",
    [
        {"spec": {"containers": [{"name": "c", "image": "x", "env": [{"name": "A", "value": "1"}]}]}},
        {"spec": {"nodeName": "n9"}},
        {"spec": {"restartPolicy": "Never"}},
    ],
)
def test_pod_spec_changes_are_forbidden(server: APIServer, patch: dict[str, Any]) -> None:
    server.create(_pod())
    error = _refused(lambda: server.patch("v1", "Pod", "default", "p", patch))
    assert error.message.startswith(POD_FORBIDDEN + "\n"), error.message


def test_pod_image_deadline_and_new_tolerations_may_change(server: APIServer) -> None:
    created = server.create(_pod())
    # Additions only: the list sent keeps the tolerations admission gave it (DefaultTolerationSeconds).
    kept = created["spec"]["tolerations"]
    patched = server.patch(
        "v1",
        "Pod",
        "default",
        "p",
        {
            "metadata": {"labels": {"a": "b"}},
            "spec": {
                "containers": [{"name": "c", "image": "y"}],
                "activeDeadlineSeconds": 30,
                "tolerations": [*kept, {"key": "k", "operator": "Exists"}],
            },
        },
    )
    assert patched["spec"]["containers"][0]["image"] == "y" and patched["spec"]["activeDeadlineSeconds"] == 30
    assert patched["spec"]["tolerations"][-1] == {"key": "k", "operator": "Exists"}


def _deployment(selector: dict[str, str], labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "d", "namespace": "default"},
        "spec": {
            "selector": {"matchLabels": selector},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "x"}]},
            },
        },
    }


def test_deployment_selector_must_match_the_template(server: APIServer) -> None:
    error = _refused(lambda: server.create(_deployment({"a": "b"}, {"a": "c"})))
    assert error.message == (
        'Deployment.apps "d" is invalid: spec.template.metadata.labels: Invalid value: '
        'map[string]string{"a":"c"}: `selector` does not match template `labels`'
    )


def test_deployment_needs_a_selector(server: APIServer) -> None:
    body = _deployment({}, {"a": "c"})
    del body["spec"]["selector"]
    error = _refused(lambda: server.create(body))
    assert error.message == 'Deployment.apps "d" is invalid: spec.selector: Required value'


def test_deployment_selector_is_immutable(server: APIServer) -> None:
    server.create(_deployment({"a": "b"}, {"a": "b", "x": "y"}))
    patch = {"spec": {"selector": {"matchLabels": {"x": "y"}}}}
    error = _refused(lambda: server.patch("apps/v1", "Deployment", "default", "d", patch))
    assert error.message == (
        'Deployment.apps "d" is invalid: spec.selector: Invalid value: v1.LabelSelector{MatchLabels:'
        'map[string]string{"a":"b", "x":"y"}, MatchExpressions:[]v1.LabelSelectorRequirement(nil)}: '
        "field is immutable"
    )
