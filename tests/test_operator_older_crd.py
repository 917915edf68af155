"""The operator under a CRD older than itself (a cluster whose CRD was not upgraded with the operator, as
`helm upgrade` leaves CRDs): the API server stores a spec the operator's own model refuses. The operator
says so (Stalled, InvalidSpec, the model's message) and keeps running the service on the last spec it
took: a failed active pod is still replaced by the warm pod, and the pool refilled."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from operator_harness import PodRunner, crd_manifest, operator_cluster, wait_for
from test_operator_kopf import condition, converged, create, patch_spec, pods, service, status

from ember_localcluster.apiserver import APIServer


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
