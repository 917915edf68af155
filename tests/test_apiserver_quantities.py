"""Resource quantities as kube-apiserver stores them (resource.Quantity's canonical form), and the
operator's writes against that form: a router Deployment it reads back in canonical form is not put again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest

from ember_localcluster.apiserver import APIError, APIServer
from ember_operator import desired, router
from ember_operator.kube import Kube, covers
from ember_operator.quantity import canonical
from ember_operator.spec import InferenceServiceSpec


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        yield api


@pytest.mark.parametrize(
    ("given", "stored"),
    [
        ("1000m", "1"),
        ("1024Mi", "1Gi"),
        ("0.5", "500m"),
        (0.5, "500m"),
        (2, "2"),
        ("2000", "2k"),
        ("1536Mi", "1536Mi"),
        ("1.5Gi", "1536Mi"),
        ("1500m", "1500m"),
        ("512", "512"),
        ("0", "0"),
        ("0Gi", "0"),
        ("1e3", "1e3"),
        ("100Ki", "100Ki"),
        ("0.5Ki", "512"),
    ],
)
def test_quantity_canonical_form(given: Any, stored: str) -> None:
    assert canonical(given) == stored


def _pod(name: str, resources: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "c", "image": "x", "resources": resources}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"containers": [container]},
    }


def test_pod_quantities_are_stored_canonical(server: APIServer) -> None:
    created = server.create(
        _pod("q1", {"requests": {"cpu": "1000m", "memory": "1024Mi"}, "limits": {"cpu": 2, "memory": 0.5}})
    )
    resources = created["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "500m"}}


def test_a_malformed_quantity_is_refused_as_undecodable(server: APIServer) -> None:
    with pytest.raises(APIError) as caught:
        server.create(_pod("q2", {"requests": {"cpu": "lots"}}))
    assert caught.value.code == 400 and caught.value.reason == "BadRequest"
    assert caught.value.message == (
        'Pod in version "v1" cannot be handled as a Pod: quantities must match the regular expression '
        "'^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'"
    )


def test_router_deployment_with_non_canonical_quantities_is_not_rewritten(
    server: APIServer, tmp_path: Path
) -> None:
    spec = InferenceServiceSpec.model_validate(
        {
            "model": {"name": "m", "source": "/m"},
            "router": {"enabled": True, "cpu": "0.5", "memory": "1024Mi"},
        }
    )
    deployment = router.desired_router_deployment(desired.Owner("q", "default", "uid-q"), spec)
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")), client_configuration=configuration
    )
    with kubernetes.client.ApiClient(configuration) as api:
        kube = Kube(api)
        first = kube.ensure(deployment, router.ENSURED_FIELDS["Deployment"])
        resources = first["spec"]["template"]["spec"]["containers"][0]["resources"]
        assert resources["requests"]["cpu"] == "500m" and resources["requests"]["memory"] == "1Gi"
        assert covers(deployment["spec"], first["spec"])
        for _ in range(3):  # resyncs
            kube.ensure(deployment, router.ENSURED_FIELDS["Deployment"])
    assert server.request_counts().get(("PUT", "deployments", ""), 0) == 0


def test_covers_compares_resource_quantities_by_value() -> None:
    want = {"resources": {"requests": {"cpu": "0.5", "memory": "1024Mi"}, "limits": {"memory": "1024Mi"}}}
    real = {"resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "1Gi"}}}
    assert covers(want, real)
    assert not covers(want, {"resources": {"requests": {"cpu": "600m", "memory": "1Gi"}, "limits": {}}})
    # Outside requests and limits strings stay strings.
    assert not covers({"labels": {"a": "1000m"}}, {"labels": {"a": "1"}})
