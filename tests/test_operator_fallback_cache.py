"""A fallback service's address is kept between passes until the resync (60 s by default); what happens to
that service — deleted, or its address moved — reaches the services that name it at once, not at the
resync. Here with the resync far off (600 s), so that only the change itself can bring it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import NAMESPACE, PodRunner, operator_cluster, wait_for
from test_operator_kopf import condition, create, service, status

from ember_localcluster.apiserver import APIServer
from ember_operator.spec import GROUP, PLURAL, VERSION


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[APIServer, PodRunner, Any]]:
    with operator_cluster(tmp_path_factory.mktemp("operator"), resync=600.0) as running:
        yield running


def _policy(api: APIServer, name: str) -> str:
    cm = api.get("v1", "ConfigMap", NAMESPACE, f"{name}-policy")
    return "" if cm is None else str(cm["data"]["policy.yaml"])


def test_a_fallback_moved_or_deleted_reaches_its_users_before_the_resync(cluster: Any) -> None:
    """It stayed in the engines' policy until the resync: engines sent their overflow to an address
    that was gone, and FallbackInvalid showed only then."""
    api, _runner, custom = cluster
    create(custom, service("small"))
    wait_for(lambda: status(api, "small").get("endpoint"), what="the fallback's endpoint")
    create(custom, service("big", fallback={"service": "small"}))
    wait_for(lambda: "http://small.default.svc.cluster.local" in _policy(api, "big"), what="the fallback URL")
    api.patch(  # a load balancer publishes an address: the fallback's endpoint moves
        "v1",
        "Service",
        NAMESPACE,
        "small",
        {
            "status": {
                "loadBalancer": {
                    "ingress": [{"ip": "127.0.0.1", "ports": [{"port": 31999, "protocol": "TCP"}]}]
                }
            }
        },
        subresource="status",
    )
    wait_for(lambda: "http://127.0.0.1:31999" in _policy(api, "big"), timeout=60, what="the moved address")
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "small")
    wait_for(
        lambda: condition(api, "big", "Stalled").get("reason") == "FallbackInvalid",
        timeout=60,
        what="FallbackInvalid once the fallback is gone",
    )
    assert "31999" not in _policy(api, "big")


def test_children_deleted_or_edited_are_put_back_before_the_resync(cluster: Any) -> None:
    """The operator watches what it makes: a Service, policy ConfigMap, PodDisruptionBudget or router
    Deployment someone deletes or edits is put back within a pass or two, as a controller that owns them
    does, not left broken until the resync (here 600 s; before, they stayed gone that long)."""
    api, _runner, custom = cluster
    name = "kept"
    create(custom, service(name))
    wait_for(lambda: condition(api, name, "Ready").get("status") == "True", what="Ready")
    children = [
        ("v1", "Service", name),
        ("v1", "ConfigMap", f"{name}-policy"),
        ("policy/v1", "PodDisruptionBudget", name),
        ("apps/v1", "Deployment", f"{name}-router"),
    ]
    before = {}
    for api_version, kind, child in children:
        obj = api.get(api_version, kind, NAMESPACE, child)
        assert obj is not None, (kind, child)
        before[kind] = obj["metadata"]["uid"]
    selector = api.get("v1", "Service", NAMESPACE, name)["spec"]["selector"]  # type: ignore[index]
    api.patch("v1", "Service", NAMESPACE, name, {"spec": {"selector": {"app": "elsewhere"}}})
    wait_for(
        lambda: api.get("v1", "Service", NAMESPACE, name)["spec"]["selector"] == selector,  # type: ignore[index]
        timeout=15,
        what="the Service's selector put back",
    )
    for api_version, kind, child in children:
        api.delete(api_version, kind, NAMESPACE, child)

    def remade(api_version: str, kind: str, child: str) -> bool:
        obj = api.get(api_version, kind, NAMESPACE, child)
        return obj is not None and obj["metadata"]["uid"] != before[kind]

    wait_for(lambda: all(remade(*c) for c in children), timeout=15, what="each child made again")
    wait_for(lambda: condition(api, name, "Ready").get("status") == "True", what="Ready again")
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)
