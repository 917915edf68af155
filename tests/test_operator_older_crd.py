"""The operator under a CRD older than itself (a cluster whose CRD was not upgraded with the operator, as
`helm upgrade` leaves CRDs): the API server stores a spec the operator's own model refuses. The operator
says so (Stalled, InvalidSpec, the model's message) and keeps running the service on the last spec it
took: a failed active pod is still replaced by the warm pod, and the pool refilled."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from operator_harness import NAMESPACE, PodRunner, crd_manifest, operator_cluster, wait_for
from test_operator_cli import operator_process
from test_operator_kopf import condition, converged, create, get, patch_spec, pods, service, status

from ember_localcluster.apiserver import APIServer
from ember_localcluster.deployment_controller import DeploymentController
from ember_operator.handlers import SPEC_TAKEN


def older_crd() -> dict[str, Any]:
    """The CRD without extraArgs' rule (as an older one, before the rule matched option prefixes)."""
    crd = crd_manifest()
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    extra = spec["properties"]["engine"]["properties"]["extraArgs"]
    assert extra.pop("x-kubernetes-validations")
    return crd


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[APIServer, PodRunner, Any]]:
    with operator_cluster(tmp_path_factory.mktemp("operator"), older_crd()) as running:
        yield running


def test_a_spec_the_operator_refuses_stalls_and_the_last_good_one_keeps_serving(cluster: Any) -> None:
    api, runner, custom = cluster
    create(custom, service("held", warmPool={"size": 1}))
    wait_for(lambda: converged(api, "held", 1, 1), what="1 active, 1 warm")
    patch_spec(custom, "held", {"engine": {"extraArgs": ["--quant=w8a16"]}})  # stored: no rule refuses it
    wait_for(
        lambda: condition(api, "held", "Stalled").get("reason") == "InvalidSpec",
        what="Stalled with InvalidSpec",
    )
    message = condition(api, "held", "Stalled")["message"]
    assert "--quantization (got '--quant=w8a16') comes from model.quantization" in message
    (active,) = pods(api, "held", "active")
    (warm,) = pods(api, "held", "warm")
    runner.fail(active["metadata"]["name"])
    wait_for(
        lambda: [p["metadata"]["name"] for p in pods(api, "held", "active")] == [warm["metadata"]["name"]],
        what="the warm pod promoted in the failed pod's place",
    )
    wait_for(lambda: len(pods(api, "held", "warm")) == 1, what="the pool refilled")
    # The pods are the last good spec's: the refused option reached none of them.
    for pod in pods(api, "held"):
        assert not any("--quant" in a for c in pod["spec"]["containers"] for a in c.get("args") or [])
    assert condition(api, "held", "Ready")  # the other conditions are still reported
    assert status(api, "held").get("replicas") == 1

    patch_spec(custom, "held", {"engine": {"extraArgs": None}})
    wait_for(lambda: converged(api, "held", 1, 1), what="converged again once the spec is fixed")
    assert condition(api, "held", "Stalled").get("status") == "False"


def test_a_restarted_operator_keeps_serving_on_the_last_spec_taken(tmp_path: Path) -> None:
    """The spec turns invalid while the operator is away (restarted, or another replica taking over): the
    operator that comes up has taken no spec itself, and runs the service on the one the last took."""
    with APIServer(pod_graceful_deletion=False, bookmark_interval=1.0) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        api.install_crd(older_crd())
        runner = PodRunner(api).start()
        deployments = DeploymentController(kubeconfig).start()
        custom = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(kubeconfig)))
        flags = ("--namespace", NAMESPACE, "--standalone", "--health-port=0", "--metrics-port=0")
        try:
            with operator_process(kubeconfig, tmp_path / "first.log", *flags):
                create(custom, service("kept", warmPool={"size": 1}))
                wait_for(lambda: converged(api, "kept", 1, 1), timeout=60, what="1 active, 1 warm")
                taken = wait_for(
                    lambda: get(api, "kept")["metadata"]["annotations"][SPEC_TAKEN], what="the spec"
                )
                assert json.loads(taken) == get(api, "kept")["spec"]
                generation = get(api, "kept")["metadata"]["generation"]
            patch_spec(custom, "kept", {"engine": {"extraArgs": ["--quant=w8a16"]}})
            with operator_process(kubeconfig, tmp_path / "second.log", *flags):
                wait_for(
                    lambda: condition(api, "kept", "Stalled").get("reason") == "InvalidSpec",
                    timeout=60,
                    what="Stalled with InvalidSpec",
                )
                (active,) = pods(api, "kept", "active")
                (warm,) = pods(api, "kept", "warm")
                runner.fail(active["metadata"]["name"])
                wait_for(
                    lambda: (
                        [p["metadata"]["name"] for p in pods(api, "kept", "active")]
                        == [warm["metadata"]["name"]]
                    ),
                    timeout=60,
                    what="the warm pod promoted in the failed pod's place",
                )
                wait_for(lambda: len(pods(api, "kept", "warm")) == 1, timeout=60, what="the pool refilled")
                assert get(api, "kept")["metadata"]["generation"] == generation + 1  # the patch's alone
                for pod in pods(api, "kept"):
                    assert not any(
                        "--quant" in a for c in pod["spec"]["containers"] for a in c.get("args") or []
                    )
        finally:
            runner.stop()
            deployments.stop()
