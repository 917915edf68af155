"""`kubectl get` columns of the built-in kinds, as kube-apiserver's table printers (pkg/printers/internalversion)
give them: the server generates every column, `-o wide` ones at priority 1, and kubectl shows what it asks for."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import plainhttp
import pytest

from ember_localcluster.apiserver import APIServer

TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}


@pytest.fixture
def api() -> Iterator[APIServer]:
    with APIServer() as server:
        yield server


def _table(api: APIServer, path: str) -> tuple[list[tuple[str, int]], list[list[Any]]]:
    table = plainhttp.get(f"{api.url}{path}", headers=TABLE, timeout=10).json()
    columns = [(c["name"], c.get("priority", 0)) for c in table["columnDefinitions"]]
    return columns, [row["cells"] for row in table["rows"]]


def _without_age(columns: list[tuple[str, int]], cells: list[Any]) -> list[Any]:
    return [cell for (name, _), cell in zip(columns, cells, strict=True) if name != "Age"]


def test_services_show_external_ip_ports_and_selector(api: APIServer) -> None:
    for name, kind, extra in [
        ("plain", "ClusterIP", {}),
        ("balanced", "LoadBalancer", {}),
        ("node", "NodePort", {}),
    ]:
        api.create(
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {
                    "type": kind,
                    "selector": {"b": "2", "a": "1"},
                    "ports": [
                        {"port": 80, "protocol": "TCP", **({"nodePort": 30080} if kind == "NodePort" else {})}
                    ],
                    **extra,
                },
            }
        )
    # No service proxy runs here, so no load balancer address is published: `<pending>`.
    columns, rows = _table(api, "/api/v1/namespaces/default/services")
    assert columns == [
        ("Name", 0),
        ("Type", 0),
        ("Cluster-IP", 0),
        ("External-IP", 0),
        ("Port(s)", 0),
        ("Age", 0),
        ("Selector", 1),
    ]
    by_name = {row[0]: _without_age(columns, row) for row in rows}
    assert by_name["plain"] == ["plain", "ClusterIP", "<none>", "<none>", "80/TCP", "a=1,b=2"]
    assert by_name["balanced"] == ["balanced", "LoadBalancer", "<none>", "<pending>", "80/TCP", "a=1,b=2"]
    assert by_name["node"] == ["node", "NodePort", "<none>", "<none>", "80:30080/TCP", "a=1,b=2"]


def test_a_load_balancers_address_is_its_external_ip(api: APIServer) -> None:
    svc = api.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "lb", "namespace": "default"},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 8000}]},
        }
    )
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "127.0.0.9"}, {"hostname": "lb.example"}]}}
    plainhttp.put(
        f"{api.url}/api/v1/namespaces/default/services/lb/status", json=svc, timeout=10
    ).raise_for_status()
    columns, (row,) = _table(api, "/api/v1/namespaces/default/services/lb")
    assert _without_age(columns, row) == [
        "lb",
        "LoadBalancer",
        "<none>",
        "127.0.0.9,lb.example",
        "8000/TCP",
        "<none>",
    ]


def _template(image: str) -> dict[str, Any]:
    return {
        "metadata": {"labels": {"app": "x"}},
        "spec": {"containers": [{"name": "main", "image": image}, {"name": "side", "image": "busybox"}]},
    }


def test_replicasets_show_desired_current_ready(api: APIServer) -> None:
    api.create(
        {
            "apiVersion": "apps/v1",
            "kind": "ReplicaSet",
            "metadata": {"name": "rs", "namespace": "default"},
            "spec": {
                "replicas": 3,
                "selector": {"matchLabels": {"app": "x"}},
                "template": _template("engine:1"),
            },
        }
    )
    columns, (row,) = _table(api, "/apis/apps/v1/namespaces/default/replicasets")
    assert columns == [
        ("Name", 0),
        ("Desired", 0),
        ("Current", 0),
        ("Ready", 0),
        ("Age", 0),
        ("Containers", 1),
        ("Images", 1),
        ("Selector", 1),
    ]
    assert _without_age(columns, row) == ["rs", 3, 0, 0, "main,side", "engine:1,busybox", "app=x"]


def test_deployments_show_containers_images_and_selector_wide(api: APIServer) -> None:
    api.create(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "d", "namespace": "default"},
            "spec": {
                "replicas": 2,
                "selector": {
                    "matchLabels": {"app": "x"},
                    "matchExpressions": [{"key": "tier", "operator": "In", "values": ["a", "b"]}],
                },
                "template": {**_template("router:1"), "metadata": {"labels": {"app": "x", "tier": "a"}}},
            },
        }
    )
    columns, (row,) = _table(api, "/apis/apps/v1/namespaces/default/deployments")
    assert columns == [
        ("Name", 0),
        ("Ready", 0),
        ("Up-to-date", 0),
        ("Available", 0),
        ("Age", 0),
        ("Containers", 1),
        ("Images", 1),
        ("Selector", 1),
    ]
    assert _without_age(columns, row) == [
        "d",
        "0/2",
        0,
        0,
        "main,side",
        "router:1,busybox",
        "app=x,tier in (a,b)",
    ]


def test_pod_disruption_budgets_show_their_bounds(api: APIServer) -> None:
    for name, bound in [("min", {"minAvailable": 1}), ("max", {"maxUnavailable": "25%"})]:
        api.create(
            {
                "apiVersion": "policy/v1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": name, "namespace": "default"},
                "spec": {"selector": {"matchLabels": {"app": "x"}}, **bound},
            }
        )
    columns, rows = _table(api, "/apis/policy/v1/namespaces/default/poddisruptionbudgets")
    assert columns == [
        ("Name", 0),
        ("Min Available", 0),
        ("Max Unavailable", 0),
        ("Allowed Disruptions", 0),
        ("Age", 0),
    ]
    assert sorted(_without_age(columns, row) for row in rows) == [
        ["max", "N/A", "25%", 0],
        ["min", "1", "N/A", 0],
    ]
