"""The `pods/eviction` subresource (kube-apiserver's pkg/registry/core/pod/storage/eviction.go) and the
disruption controller (kube-controller-manager's pkg/controller/disruption/disruption.go), through the
official client against the in-process API server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from kubernetes.client import ApiClient, ApiException, CoreV1Api, PolicyV1Api
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.deployment_controller import DeploymentController
from ember_localcluster.disruption_controller import DisruptionController

NS = "default"
PDB_API = "policy/v1"


def _client(server: APIServer, path: Path) -> ApiClient:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(server.write_kubeconfig(path)), client_configuration=configuration
    )
    return ApiClient(configuration)


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False) as running:
        yield running


@pytest.fixture(scope="module")
def core(server: APIServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoreV1Api]:
    with _client(server, tmp_path_factory.mktemp("evict") / "kubeconfig") as api:
        yield CoreV1Api(api)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _pod(server: APIServer, name: str, app: str, *, phase: str = "Running", ready: bool = True) -> None:
    server.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": app}},
            "spec": {"containers": [{"name": "c", "image": "img"}], "nodeName": "n1"},
        }
    )
    ready_condition = {"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": _now()}
    server.patch(
        "v1",
        "Pod",
        NS,
        name,
        {"status": {"phase": phase, "conditions": [ready_condition]}},
        subresource="status",
    )


def _pdb(server: APIServer, name: str, app: str, status: dict[str, Any] | None, **spec: Any) -> None:
    """A PDB whose status is as a disruption controller would have written it (observedGeneration current)."""
    server.create(
        {
            "apiVersion": PDB_API,
            "kind": "PodDisruptionBudget",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": app}}, **spec},
        }
    )
    if status is not None:
        full = {"observedGeneration": 1, "disruptionsAllowed": 0, "expectedPods": 1, **status}
        server.patch(PDB_API, "PodDisruptionBudget", NS, name, {"status": full}, subresource="status")


def _evict(core: CoreV1Api, name: str, **body: Any) -> tuple[int, dict[str, Any]]:
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": NS}}
    try:
        response = core.create_namespaced_pod_eviction(name, NS, {**eviction, **body}, _preload_content=False)
    except ApiException as error:
        return error.status, json.loads(error.body)
    return response.status, json.loads(response.data)


def _exists(server: APIServer, name: str) -> bool:
    return server.get("v1", "Pod", NS, name) is not None


def test_eviction_without_a_budget_deletes_the_pod(server: APIServer, core: CoreV1Api) -> None:
    _pod(server, "free", "free")
    code, body = _evict(core, "free")
    assert (code, body["kind"], body["status"]) == (201, "Status", "Success")
    assert not _exists(server, "free")
    code, body = _evict(core, "free")
    assert (code, body["reason"], body["message"]) == (404, "NotFound", 'pods "free" not found')
    _pod(server, "named", "named")
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "other"}}
    try:
        core.create_namespaced_pod_eviction("named", NS, eviction)
        raise AssertionError("evicted under another name")
    except ApiException as error:
        assert error.status == 400
        assert json.loads(error.body)["message"] == "name in URL does not match name in Eviction object"
    assert _exists(server, "named")


def test_a_budget_with_no_disruptions_allowed_refuses_with_429(server: APIServer, core: CoreV1Api) -> None:
    _pod(server, "tight-0", "tight")
    _pdb(server, "tight", "tight", {"currentHealthy": 1, "desiredHealthy": 1}, minAvailable=1)
    code, body = _evict(core, "tight-0")
    assert code == 429
    assert body["reason"] == "TooManyRequests"
    assert body["message"] == "Cannot evict pod as it would violate the pod's disruption budget."
    assert body["details"]["causes"] == [
        {
            "reason": "DisruptionBudget",
            "message": "The disruption budget tight needs 1 healthy pods and has 1 currently",
        }
    ]
    assert _exists(server, "tight-0")


def test_a_budget_not_yet_observed_refuses_until_its_status_catches_up(
    server: APIServer, core: CoreV1Api
) -> None:
    _pod(server, "fresh-0", "fresh")
    _pdb(server, "fresh", "fresh", None, maxUnavailable=1)
    code, body = _evict(core, "fresh-0")
    assert (code, body["reason"]) == (429, "TooManyRequests")
    assert body["details"]["causes"] == [
        {
            "reason": "DisruptionBudget",
            "message": "The disruption budget fresh is still being processed by the server.",
        }
    ]
    assert body["details"]["retryAfterSeconds"] == 10
    assert _exists(server, "fresh-0")


def test_an_allowed_eviction_spends_the_budget_and_records_the_pod(
    server: APIServer, core: CoreV1Api
) -> None:
    _pod(server, "web-0", "web")
    _pod(server, "web-1", "web")
    _pdb(
        server,
        "web",
        "web",
        {"currentHealthy": 2, "desiredHealthy": 1, "disruptionsAllowed": 1, "expectedPods": 2},
        minAvailable=1,
    )
    code, body = _evict(core, "web-0")
    assert (code, body["status"]) == (201, "Success")
    assert not _exists(server, "web-0")
    status = server.get(PDB_API, "PodDisruptionBudget", NS, "web")["status"]  # type: ignore[index]
    assert status["disruptionsAllowed"] == 0
    assert list(status["disruptedPods"]) == ["web-0"]
    (condition,) = status["conditions"]
    assert (condition["type"], condition["status"], condition["reason"]) == (
        "DisruptionAllowed",
        "False",
        "InsufficientPods",
    )
    # The budget is spent: the next eviction waits for the controller to recount.
    code, body = _evict(core, "web-1")
    assert code == 429 and _exists(server, "web-1")


def test_more_than_one_budget_is_a_500(server: APIServer, core: CoreV1Api) -> None:
    _pod(server, "twice-0", "twice")
    for name in ("twice-a", "twice-b"):
        _pdb(server, name, "twice", {"currentHealthy": 1, "disruptionsAllowed": 1}, maxUnavailable=1)
    code, body = _evict(core, "twice-0")
    assert code == 500
    assert (
        body["message"]
        == "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support."
    )
    assert _exists(server, "twice-0")


def test_pods_not_running_or_not_ready_follow_upstreams_rules(server: APIServer, core: CoreV1Api) -> None:
    # A Pending pod goes without looking at the budget.
    _pod(server, "pend-0", "pend", phase="Pending", ready=False)
    _pdb(server, "pend", "pend", {"currentHealthy": 0, "desiredHealthy": 5}, minAvailable=5)
    assert _evict(core, "pend-0")[0] == 201 and not _exists(server, "pend-0")
    # A Running pod that is not Ready, while the budget's healthy count is met: deleted, budget untouched.
    _pod(server, "unready-0", "unready", ready=False)
    _pod(server, "unready-1", "unready")
    _pdb(server, "unready", "unready", {"currentHealthy": 1, "desiredHealthy": 1}, minAvailable=1)
    assert _evict(core, "unready-0")[0] == 201 and not _exists(server, "unready-0")
    status = server.get(PDB_API, "PodDisruptionBudget", NS, "unready")["status"]  # type: ignore[index]
    assert status["disruptionsAllowed"] == 0 and not status.get("disruptedPods")
    # ... but not while the application is short of healthy pods (IfHealthyBudget, the default) ...
    _pod(server, "short-0", "short", ready=False)
    _pdb(server, "short", "short", {"currentHealthy": 0, "desiredHealthy": 1}, minAvailable=1)
    assert _evict(core, "short-0")[0] == 429 and _exists(server, "short-0")
    # ... unless the budget says AlwaysAllow.
    _pod(server, "always-0", "always", ready=False)
    _pdb(
        server,
        "always",
        "always",
        {"currentHealthy": 0, "desiredHealthy": 1},
        minAvailable=1,
        unhealthyPodEvictionPolicy="AlwaysAllow",
    )
    assert _evict(core, "always-0")[0] == 201 and not _exists(server, "always-0")


def test_dry_run_checks_without_spending_or_deleting(server: APIServer, core: CoreV1Api) -> None:
    _pod(server, "dry-0", "dry")
    _pdb(server, "dry", "dry", {"currentHealthy": 1, "disruptionsAllowed": 1}, maxUnavailable=1)
    code, _ = _evict(core, "dry-0", deleteOptions={"dryRun": ["All"]})
    assert code == 201 and _exists(server, "dry-0")
    status = server.get(PDB_API, "PodDisruptionBudget", NS, "dry")["status"]  # type: ignore[index]
    assert status["disruptionsAllowed"] == 1 and not status.get("disruptedPods")


# -- the disruption controller ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def controlled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[APIServer, ApiClient]]:
    with APIServer(pod_graceful_deletion=False) as api:
        kubeconfig = api.write_kubeconfig(Path(tmp_path_factory.mktemp("pdb")) / "kubeconfig")
        with (
            DeploymentController(kubeconfig),
            DisruptionController(kubeconfig),
            _client(api, kubeconfig) as c,
        ):
            yield api, c


def _ready_all(api: APIServer, app: str) -> None:
    for pod in api.list("v1", "Pod", NS, label_selector=f"app={app}"):
        if (pod.get("status") or {}).get("phase") != "Running":
            ready = {"type": "Ready", "status": "True", "lastTransitionTime": _now()}
            api.patch(
                "v1",
                "Pod",
                NS,
                pod["metadata"]["name"],
                {"status": {"phase": "Running", "conditions": [ready]}},
                subresource="status",
            )


def _status(api: APIServer, name: str) -> dict[str, Any]:
    pdb = api.get(PDB_API, "PodDisruptionBudget", NS, name) or {}
    return dict(pdb.get("status") or {})


def _deployment(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }


def test_the_controller_counts_a_deployments_pods_and_an_eviction_is_then_allowed(
    controlled: tuple[APIServer, ApiClient],
) -> None:
    api, c = controlled
    api.create(_deployment("dep", 3))
    wait_for(lambda: len(api.list("v1", "Pod", NS, label_selector="app=dep")) == 3, 10, "three pods")
    api.create(
        {
            "apiVersion": PDB_API,
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "dep", "namespace": NS},
            "spec": {"selector": {"matchLabels": {"app": "dep"}}, "maxUnavailable": "34%"},
        }
    )
    # Not Ready yet: expected 3 (the Deployment's scale), 34 % of 3 rounds up to 2 unavailable.
    keys = ("expectedPods", "desiredHealthy", "currentHealthy", "disruptionsAllowed", "observedGeneration")
    wait_for(
        lambda: tuple(_status(api, "dep").get(k) for k in keys) == (3, 1, 0, 0, 1),
        10,
        lambda: _status(api, "dep"),
    )
    status = _status(api, "dep")
    assert [(x["type"], x["status"], x["reason"]) for x in status["conditions"]] == [
        ("DisruptionAllowed", "False", "InsufficientPods")
    ]
    assert status["conditions"][0]["lastTransitionTime"].endswith("Z")
    _ready_all(api, "dep")
    wait_for(lambda: _status(api, "dep").get("disruptionsAllowed") == 2, 10, lambda: _status(api, "dep"))
    assert _status(api, "dep")["conditions"][0]["reason"] == "SufficientPods"
    victim = api.list("v1", "Pod", NS, label_selector="app=dep")[0]["metadata"]["name"]
    CoreV1Api(c).create_namespaced_pod_eviction(
        victim, NS, {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": victim}}
    )
    # The replacement is not Ready: two healthy of one desired, one more disruption allowed.
    wait_for(
        lambda: (
            _status(api, "dep").get("currentHealthy") == 2 and not _status(api, "dep").get("disruptedPods")
        ),
        10,
        lambda: _status(api, "dep"),
    )
    assert _status(api, "dep")["disruptionsAllowed"] == 1
    # An integer minAvailable counts the selected pods without asking their controllers.
    PolicyV1Api(c).patch_namespaced_pod_disruption_budget(
        "dep", NS, {"spec": {"maxUnavailable": None, "minAvailable": 2}}
    )
    wait_for(lambda: _status(api, "dep").get("observedGeneration") == 2, 10, lambda: _status(api, "dep"))
    status = _status(api, "dep")
    assert (status["expectedPods"], status["desiredHealthy"], status["disruptionsAllowed"]) == (3, 2, 0)


def test_pods_of_a_custom_resource_are_counted_through_its_scale_subresource(
    controlled: tuple[APIServer, ApiClient],
) -> None:
    api, _ = controlled
    for kind, scale in (("Scaled", True), ("Plain", False)):
        plural = kind.lower() + "s"
        version: dict[str, Any] = {
            "name": "v1",
            "served": True,
            "storage": True,
            "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
        }
        if scale:
            version["subresources"] = {
                "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"}
            }
        api.install_crd(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.example.com"},
                "spec": {
                    "group": "example.com",
                    "scope": "Namespaced",
                    "names": {"plural": plural, "singular": kind.lower(), "kind": kind},
                    "versions": [version],
                },
            }
        )
        owner = api.create(
            {
                "apiVersion": "example.com/v1",
                "kind": kind,
                "metadata": {"name": "own", "namespace": NS},
                "spec": {"replicas": 1},
            }
        )
        ref = {
            "apiVersion": "example.com/v1",
            "kind": kind,
            "name": "own",
            "uid": owner["metadata"]["uid"],
            "controller": True,
        }
        app = plural
        for i in range(2):  # two pods of a resource whose scale says 1 (an active pod and a spare)
            api.create(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {
                        "name": f"{app}-{i}",
                        "namespace": NS,
                        "labels": {"app": app},
                        "ownerReferences": [ref],
                    },
                    "spec": {"containers": [{"name": "c", "image": "i"}]},
                }
            )
        _ready_all(api, app)
        api.create(
            {
                "apiVersion": PDB_API,
                "kind": "PodDisruptionBudget",
                "metadata": {"name": app, "namespace": NS},
                "spec": {"selector": {"matchLabels": {"app": app}}, "maxUnavailable": 0},
            }
        )

    def counts(name: str) -> tuple[Any, ...]:
        status = _status(api, name)
        keys = ("expectedPods", "desiredHealthy", "currentHealthy", "disruptionsAllowed")
        return tuple(status.get(k) for k in keys)

    # expectedPods is the scale (1), not the pods found (2): both Ready make one disruption allowed.
    wait_for(lambda: counts("scaleds") == (1, 1, 2, 1), 10, lambda: _status(api, "scaleds"))
    assert _status(api, "scaleds")["observedGeneration"] == 1
    # Without /scale the sync fails and the budget fails safe: nothing may be evicted.
    wait_for(lambda: _status(api, "plains").get("conditions"), 10, lambda: _status(api, "plains"))
    status = _status(api, "plains")
    assert status["disruptionsAllowed"] == 0
    (condition,) = status["conditions"]
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "SyncFailed",
        "plains.example.com does not implement the scale subresource",
    )


def test_an_empty_selector_covers_every_pod_of_its_namespace(server: APIServer, core: CoreV1Api) -> None:
    server.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "every"}})
    server.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "any", "namespace": "every", "labels": {"x": "y"}},
            "spec": {"containers": [{"name": "c", "image": "img"}], "nodeName": "n1"},
        }
    )
    server.patch("v1", "Pod", "every", "any", {"status": {"phase": "Running"}}, subresource="status")
    server.create(
        {
            "apiVersion": PDB_API,
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "all", "namespace": "every"},
            "spec": {"selector": {}, "maxUnavailable": 0},
        }
    )
    status = {"observedGeneration": 1, "disruptionsAllowed": 0}
    server.patch(PDB_API, "PodDisruptionBudget", "every", "all", {"status": status}, subresource="status")
    eviction = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": "any"}}
    try:
        core.create_namespaced_pod_eviction("any", "every", eviction)
        raise AssertionError("evicted against the budget")
    except ApiException as error:
        assert error.status == 429
        assert json.loads(error.body)["details"]["causes"][0]["message"] == (
            "The disruption budget all needs 0 healthy pods and has 0 currently"
        )
    assert server.get("v1", "Pod", "every", "any") is not None
