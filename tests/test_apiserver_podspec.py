"""Pod tolerations and nodeSelector as kube-apiserver validates them on create (ValidateTolerations,
ValidateLabels of pkg/apis/core/validation), with its 422 messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ember_localcluster.apiserver import APIError, APIServer
from ember_operator.labels import LABEL_VALUE_MESSAGE, QUALIFIED_NAME_MESSAGE


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        yield api


def _pod(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [{"name": "c", "image": "x"}], **spec},
    }


def _refused(server: APIServer, pod: dict[str, Any]) -> str:
    with pytest.raises(APIError) as caught:
        server.create(pod)
    assert caught.value.code == 422 and caught.value.reason == "Invalid", caught.value
    return caught.value.message


@pytest.mark.parametrize(
    ("toleration", "expected"),
    [
        (
            {"key": "bad key!", "operator": "Exists"},
            f'spec.tolerations[0].key: Invalid value: "bad key!": name part {QUALIFIED_NAME_MESSAGE}',
        ),
        (
            {"operator": "Equal", "value": "x"},
            'spec.tolerations[0].operator: Invalid value: "Equal": operator must be Exists when `key` is empty, '
            'which means "match all values and all keys"',
        ),
        (
            {"key": "a", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30},
            "spec.tolerations[0].effect: Invalid value: \"NoSchedule\": effect must be 'NoExecute' when "
            "`tolerationSeconds` is set",
        ),
        (
            {"key": "a", "operator": "Exists", "value": "v"},
            'spec.tolerations[0].operator: Invalid value: core.Toleration{Key:"a", Operator:"Exists", Value:"v", '
            "Effect:\"\", TolerationSeconds:(*int64)(nil)}: value must be empty when `operator` is 'Exists'",
        ),
        (
            {"key": "a", "operator": "Equal", "value": "v v"},
            f'spec.tolerations[0].operator: Invalid value: "v v": {LABEL_VALUE_MESSAGE}',
        ),
        (
            {"key": "a", "operator": "Within"},
            'spec.tolerations[0].operator: Unsupported value: "Within": supported values: "Equal", "Exists"',
        ),
        (
            {"key": "a", "operator": "Exists", "effect": "Sometimes"},
            'spec.tolerations[0].effect: Unsupported value: "Sometimes": supported values: "NoSchedule", '
            '"PreferNoSchedule", "NoExecute"',
        ),
    ],
)
def test_a_pod_with_a_toleration_kube_apiserver_refuses_is_refused(
    server: APIServer, toleration: dict[str, Any], expected: str
) -> None:
    message = _refused(server, _pod("tol", tolerations=[toleration]))
    assert message == f'Pod "tol" is invalid: {expected}', message


def test_a_pod_with_a_node_selector_kube_apiserver_refuses_is_refused(server: APIServer) -> None:
    message = _refused(server, _pod("sel", nodeSelector={"bad key!": "v v"}))
    assert message == (
        f'Pod "sel" is invalid: [spec.nodeSelector: Invalid value: "bad key!": name part {QUALIFIED_NAME_MESSAGE}, '
        f'spec.nodeSelector: Invalid value: "v v": {LABEL_VALUE_MESSAGE}]'
    ), message


def test_a_pod_with_valid_tolerations_and_selector_is_created(server: APIServer) -> None:
    tolerations = [
        {"operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "inference", "effect": "NoExecute", "tolerationSeconds": 60},
    ]
    pod = _pod("fine", tolerations=tolerations, nodeSelector={"example.com/disk": "ssd", "zone": ""})
    assert server.create(pod)["spec"]["tolerations"] == tolerations


SPREAD = {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
TSC = "spec.topologySpreadConstraints[0]"


@pytest.mark.parametrize(
    ("placement", "expected"),
    [
        (
            {"topologySpreadConstraints": [{**SPREAD, "maxSkew": 0}]},
            f"{TSC}.maxSkew: Invalid value: 0: must be greater than zero",
        ),
        (
            {"topologySpreadConstraints": [{**SPREAD, "topologyKey": ""}]},
            f"{TSC}.topologyKey: Required value: can not be empty",
        ),
        (
            {"topologySpreadConstraints": [{**SPREAD, "whenUnsatisfiable": "Sometimes"}]},
            f'{TSC}.whenUnsatisfiable: Unsupported value: "Sometimes": supported values: "DoNotSchedule", "ScheduleAnyway"',
        ),
        (
            {"topologySpreadConstraints": [SPREAD, SPREAD]},
            f'{TSC}.{{topologyKey, whenUnsatisfiable}}: Duplicate value: "{{kubernetes.io/hostname, ScheduleAnyway}}"',
        ),
        (
            {"topologySpreadConstraints": [{**SPREAD, "minDomains": 2}]},
            f"{TSC}.minDomains: Invalid value: 2: can only use minDomains if whenUnsatisfiable=DoNotSchedule, "
            "not ScheduleAnyway",
        ),
        (
            {"topologySpreadConstraints": [{**SPREAD, "nodeTaintsPolicy": "Maybe"}]},
            f'{TSC}.nodeTaintsPolicy: Unsupported value: "Maybe": supported values: "Honor", "Ignore"',
        ),
        (
            {
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [{"topologyKey": ""}]
                    }
                }
            },
            "spec.affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0].topologyKey: "
            "Required value: can not be empty",
        ),
        (
            {
                "affinity": {
                    "podAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 0, "podAffinityTerm": {"topologyKey": "zone"}}
                        ]
                    }
                }
            },
            "spec.affinity.podAffinity.preferredDuringSchedulingIgnoredDuringExecution[0].weight: Invalid value: 0: "
            "must be in the range 1-100",
        ),
    ],
)
def test_a_pod_with_spreading_or_pod_affinity_kube_apiserver_refuses_is_refused(
    server: APIServer, placement: dict[str, Any], expected: str
) -> None:
    message = _refused(server, _pod("placed", **placement))
    assert message == f'Pod "placed" is invalid: {expected}', message


def test_a_pod_with_valid_spreading_and_pod_affinity_is_created(server: APIServer) -> None:
    anti = {"labelSelector": {"matchLabels": {"app": "a"}}, "topologyKey": "kubernetes.io/hostname"}
    placement = {
        "topologySpreadConstraints": [
            SPREAD,
            {**SPREAD, "whenUnsatisfiable": "DoNotSchedule", "minDomains": 2},
        ],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": anti}]
            }
        },
    }
    assert (
        server.create(_pod("spread-fine", **placement))["spec"]["topologySpreadConstraints"][1]["minDomains"]
        == 2
    )


def test_a_containers_limits_are_its_requests_where_it_names_none(server: APIServer) -> None:
    """core/v1 SetDefaults_Pod: each container's and init container's limits are copied into its requests
    for the resources the requests do not name."""
    pod = _pod("limits-only")
    pod["spec"]["containers"] = [
        {"name": "gpu", "image": "x", "resources": {"limits": {"nvidia.com/gpu": "1"}}},
        {
            "name": "both",
            "image": "x",
            "resources": {"limits": {"cpu": "1", "memory": "1Gi"}, "requests": {"cpu": "0.5"}},
        },
        {"name": "none", "image": "x"},
    ]
    pod["spec"]["initContainers"] = [
        {"name": "init", "image": "x", "resources": {"limits": {"memory": "512Mi"}}}
    ]
    stored = server.create(pod)["spec"]
    assert [c.get("resources", {}).get("requests") for c in stored["containers"]] == [
        {"nvidia.com/gpu": "1"},
        {"cpu": "500m", "memory": "1Gi"},
        None,
    ]
    assert stored["initContainers"][0]["resources"]["requests"] == {"memory": "512Mi"}
    assert server.get("v1", "Pod", "default", "limits-only")["spec"] == stored
