"""End-to-end scenarios, the lifecycle around serving: deletion and garbage collection, kubectl on the
local example, admission (Pod Security, ResourceQuota), an HPA-style client on `/scale`, and the operator
stopped and restarted. The real operator, real `ember serve` processes run by the process kubelet, traffic
through each Service's published local address; no mocks.

One control plane serves every scenario here (test_e2e.py has its own); each scenario uses
InferenceServices of its own and deletes them at its end. The operator-restart scenario runs last: it stops
the operator and starts a new one.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
from e2e_harness import (
    NAMESPACE,
    ControlPlane,
    Load,
    alive,
    control_plane,
    fresh_client,
    ready,
    say,
)
from waiting import wait_for

from ember_operator.spec import GROUP, PLURAL, VERSION

REPO = Path(__file__).resolve().parents[1]
KUBECTL = "/usr/bin/kubectl"


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("e2e-lifecycle"), tiny_model) as plane:
        yield plane


def names(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


# -- deletion ----------------------------------------------------------------------------------------------------


def test_delete_garbage_collects_every_child_and_stops_the_engines(cp: ControlPlane) -> None:
    cp.create("gone", replicas={"min": 1, "max": 1}, warmPool={"size": 1})
    cp.wait_converged("gone", 1, 1)
    pids = cp.engine_pids("gone")
    assert len(pids) == 2 and all(alive(p) for p in pids), "two engine processes run"
    assert cp.api.get("v1", "ConfigMap", NAMESPACE, "gone-policy") is not None
    assert cp.proxy.address(NAMESPACE, "gone") is not None

    cp.delete("gone")
    wait_for(lambda: cp.eis("gone") is None, timeout=30, what="the InferenceService gone")
    wait_for(
        lambda: (
            not cp.pods("gone", deleting=True)
            and cp.api.get("v1", "Service", NAMESPACE, "gone") is None
            and cp.api.get("v1", "ConfigMap", NAMESPACE, "gone-policy") is None
        ),
        timeout=60,
        what="pods, Service and ConfigMap garbage-collected",
    )
    wait_for(lambda: not any(alive(p) for p in pids), timeout=30, what=f"engine processes {pids} gone")
    wait_for(lambda: cp.proxy.address(NAMESPACE, "gone") is None, what="the Service's listener closed")


# -- kubectl ----------------------------------------------------------------------------------------------------


def test_kubectl_apply_get_describe_delete_the_local_example(cp: ControlPlane, tmp_path: Path) -> None:
    if not (Path(KUBECTL).is_file() and os.access(KUBECTL, os.X_OK)):
        pytest.fail(
            f"kubectl is required at {KUBECTL} for this scenario (Debian: apt-get install kubernetes-client)"
        )
    example = REPO / "examples" / "local.yaml"

    def run_kubectl(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [KUBECTL, "--kubeconfig", str(cp.kubeconfig), "--cache-dir", str(tmp_path / "kc"), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    def kubectl(*args: str) -> str:
        out = run_kubectl(*args)
        assert out.returncode == 0, f"kubectl {' '.join(args)} should succeed: {out.stderr}"
        return out.stdout

    assert "created" in kubectl("apply", "-f", str(example))

    def conditions() -> dict[str, str]:
        obj = json.loads(kubectl("get", "eis", "tiny", "-o", "json"))
        return {c["type"]: c["status"] for c in obj.get("status", {}).get("conditions", [])}

    wait_for(
        lambda: conditions().get("Ready") == "True" and conditions().get("WarmPoolReady") == "True",
        timeout=90,
        what="kubectl get eis tiny: Ready=True and WarmPoolReady=True",
    )
    table = kubectl("get", "inferenceservices")
    assert "tiny" in table and "READY" in table, f"the printer columns list tiny: {table}"
    described = kubectl("describe", "eis", "tiny")
    for text in ("Name:         tiny", "Ready", "WarmPoolReady", "Endpoint:"):
        assert text in described, f"kubectl describe shows {text!r}: {described}"
    assert "unchanged" in kubectl("apply", "-f", str(example)), "a second apply changes nothing"
    # The example autoscales itself (Builtin): kubectl scale is refused, saying why, not ignored.
    scaled = run_kubectl("scale", "eis", "tiny", "--replicas=2")
    assert scaled.returncode != 0 and "followed only when autoscaling.mode is External" in scaled.stderr, (
        scaled.stdout + scaled.stderr
    )

    endpoint = json.loads(kubectl("get", "eis", "tiny", "-o", "json"))["status"]["endpoint"]
    with fresh_client(30) as client:
        reply = client.post(
            f"{endpoint}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}
        )
    assert reply.status_code == 200, reply.text

    pids = cp.engine_pids("tiny")
    assert "deleted" in kubectl("delete", "-f", str(example))
    wait_for(
        lambda: (
            not json.loads(kubectl("get", "pods", "-l", "app.kubernetes.io/instance=tiny", "-o", "json"))[
                "items"
            ]
        ),
        timeout=60,
        what="kubectl get pods: the example's pods gone",
    )
    out = run_kubectl("get", "eis", "tiny")
    assert out.returncode != 0 and "NotFound" in out.stderr, f"the InferenceService gone: {out.stderr}"
    wait_for(lambda: not any(alive(p) for p in pids), timeout=30, what="the example's engine processes gone")


def test_engine_pods_are_admitted_where_pod_security_restricted_is_enforced(cp: ControlPlane) -> None:
    label = "pod-security.kubernetes.io/enforce"
    cp.api.patch("v1", "Namespace", None, NAMESPACE, {"metadata": {"labels": {label: "restricted"}}})
    try:
        cp.create("restricted", replicas={"min": 1, "max": 1})
        cp.wait_converged("restricted", 1, 0)
    finally:
        cp.api.patch("v1", "Namespace", None, NAMESPACE, {"metadata": {"labels": {label: None}}})
    cp.remove("restricted")


def test_an_hpa_style_client_drives_scale_on_an_object_applied_without_desired(cp: ControlPlane) -> None:
    cp.create("hpa", replicas={"min": 1, "max": 2}, autoscaling={"mode": "External"})
    cp.wait_converged("hpa", 1, 0)
    custom = kubernetes.client.CustomObjectsApi(kubernetes.config.new_client_from_config(str(cp.kubeconfig)))
    # What the HPA controller does: read the Scale (its status.selector finds the pods), then write it. It
    # writes only over a non-zero spec.replicas: 0 is ScalingDisabled ("the replica count of the target is
    # zero"), so the default must be the one replica that runs.
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, PLURAL, "hpa")
    assert scale["spec"]["replicas"] == 1 and scale["status"]["selector"]
    scale["spec"]["replicas"] = 2
    custom.replace_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, PLURAL, "hpa", scale)
    cp.wait_converged("hpa", 2, 0)
    cp.remove("hpa")


def test_a_quota_refusal_stalls_and_raising_the_quota_recovers(cp: ControlPlane) -> None:
    wait_for(
        lambda: not cp.api.list("v1", "Pod", NAMESPACE), timeout=90, what="no pods left from earlier tests"
    )
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "pods", "namespace": NAMESPACE},
        "spec": {"hard": {"pods": "1"}},
    }
    cp.api.create(quota)
    try:
        cp.create("quota", replicas={"min": 1, "max": 1}, warmPool={"size": 1})
        wait_for(
            lambda: cp.condition("quota", "Stalled").get("reason") == "QuotaExceeded",
            timeout=60,
            what="QuotaExceeded",
        )
        assert (
            "exceeded quota: pods, requested: pods=1, used: pods=1, limited: pods=1"
            in cp.condition("quota", "Stalled")["message"]
        )
        cp.api.patch("v1", "ResourceQuota", NAMESPACE, "pods", {"spec": {"hard": {"pods": "2"}}})
        cp.wait_converged("quota", 1, 1)
        assert cp.condition("quota", "Stalled").get("status") == "False"
    finally:
        cp.api.delete("v1", "ResourceQuota", NAMESPACE, "pods")
    cp.remove("quota")


def test_deleting_with_the_operator_stopped_completes(cp: ControlPlane) -> None:
    cp.create("orphaned", replicas={"min": 1, "max": 1})
    cp.wait_converged("orphaned", 1, 0)
    cp.operator.stop()
    try:
        cp.delete("orphaned")
        wait_for(lambda: cp.eis("orphaned") is None, timeout=10, what="the InferenceService deleted")
        wait_for(
            lambda: not cp.pods("orphaned", deleting=True), timeout=60, what="its pods garbage-collected"
        )
    finally:
        cp.operator.start()


# -- last: it restarts the operator -------------------------------------------------------------------


def test_an_operator_restarted_mid_scale_up_converges_to_the_same_state(cp: ControlPlane) -> None:
    cp.create(
        "restart",
        engine={"maxNumSeqs": 1},
        replicas={"min": 1, "max": 2},
        autoscaling={"intervalSeconds": 1, "queueDepthPerReplica": 1, "scaleDownStabilizationSeconds": 300},
    )
    cp.wait_converged("restart", 1, 0)
    (first,) = cp.pods("restart", "active")

    most = [0]
    stop = threading.Event()

    def watch_pods() -> None:
        while not stop.wait(0.02):
            most[0] = max(most[0], len(cp.pods("restart", deleting=True)))

    watcher = threading.Thread(target=watch_pods, daemon=True)
    watcher.start()
    try:
        with Load(cp.url("restart"), clients=4, max_tokens=64):
            wait_for(
                lambda: cp.status("restart").get("desiredReplicas") == 2 and len(cp.pods("restart")) == 2,
                timeout=60,
                what="a scale-up to 2 decided and its pod created",
            )
            cp.operator.stop()
        starting = [p for p in cp.pods("restart") if p["metadata"]["name"] != first["metadata"]["name"]]
        say(
            "\nthe operator was stopped while the new pod was "
            + ("starting" if not all(ready(p) for p in starting) else "already Ready")
        )
        before = names(cp.pods("restart"))
        cp.operator.start()

        def settled() -> str:
            # The load has stopped: only the restored target (and the 300 s scale-down window it was decided
            # in) keeps 2 replicas. Stop waiting as soon as the new operator gives that up.
            if cp.status("restart").get("desiredReplicas") != 2:
                return "desiredReplicas changed"
            return "converged" if cp.converged("restart", 2, 0) else ""

        outcome = wait_for(settled, timeout=90, what="2 active pods Ready after the restart")
        assert outcome == "converged", (
            "the new operator keeps desiredReplicas 2 from status through the scale-down stabilisation "
            f"window (300 s) and finishes the scale-up; now: {cp.describe('restart')}"
        )
        assert names(cp.pods("restart")) == before, "the same pods: none replaced, none added"
        assert most[0] == 2, f"never more than 2 pods (no duplicates), saw {most[0]}"
    finally:
        stop.set()
        watcher.join()
    cp.remove("restart")
