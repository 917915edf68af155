"""End to end, a replica spanning two nodes: the real operator makes a LeaderWorkerSet, the local
LeaderWorkerSet controller its leader and worker pods, the process kubelet runs them as two `ember serve`
processes on two nodes that form one tensor-parallel group (gloo), and a request through the Service is
answered by the split model. A killed worker takes its group down and the group comes back whole; a split
the model cannot take stalls the service with the engine's own message."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from e2e_harness import NAMESPACE, ControlPlane, container_pid, control_plane, ready
from waiting import wait_for

from ember_localcluster.kubelet.node import local_nodes
from ember_localcluster.leaderworkerset import NAME, WORKER_INDEX


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ControlPlane]:
    nodes = local_nodes(2, gpus_per_node=3)
    with control_plane(
        tmp_path_factory.mktemp("e2e-groups"), tiny_model, nodes, leaderworkersets=True
    ) as plane:
        yield plane


def group_pods(cp: ControlPlane, name: str) -> dict[str, dict[str, Any]]:
    """The current group's pods of an InferenceService by worker index ("0": the leader)."""
    out = {}
    for p in cp.api.list("v1", "Pod", NAMESPACE, label_selector=f"app.kubernetes.io/instance={name},{NAME}"):
        if not p["metadata"].get("deletionTimestamp"):
            out[p["metadata"]["labels"][WORKER_INDEX]] = p
    return out


def group_serving(cp: ControlPlane, name: str) -> dict[str, dict[str, Any]] | None:
    pods = group_pods(cp, name)
    if sorted(pods) == ["0", "1"] and all(ready(p) for p in pods.values()) and cp.is_true(name, "Ready"):
        return pods
    return None


def complete(cp: ControlPlane, name: str) -> str:
    client = openai.OpenAI(base_url=f"{cp.url(name)}/v1", api_key="unused", timeout=60, max_retries=3)
    reply = client.completions.create(model="tiny", prompt="def fibonacci(n):", max_tokens=8, temperature=0)
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    return reply.choices[0].text


def test_a_two_node_group_serves_and_comes_back_whole_after_a_worker_dies(cp: ControlPlane) -> None:
    cp.create("duo", resources={"gpus": 1, "nodes": 2}, replicas={"min": 1, "max": 1})
    pods = wait_for(
        lambda: group_serving(cp, "duo"),
        timeout=180,
        what=lambda: f"duo's group serving: {cp.describe('duo')}; {cp.describe_pods('duo')}",
    )
    leader, worker = pods["0"], pods["1"]
    # One pod per node, one rank per pod, one group.
    assert leader["spec"]["nodeName"] != worker["spec"]["nodeName"]
    assert "rank 1 of 2 joined the tensor-parallel group (gloo on cpu)" in cp.engine_log(
        worker["metadata"]["name"]
    )
    text = complete(cp, "duo")

    pid = container_pid(worker)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(
        lambda: (
            (now := group_serving(cp, "duo")) is not None
            and now["0"]["metadata"]["uid"] != leader["metadata"]["uid"]
            and now["1"]["metadata"]["uid"] != worker["metadata"]["uid"]
        ),
        timeout=180,
        what=lambda: f"duo's group recreated and serving again: {cp.describe('duo')}",
    )
    assert complete(cp, "duo") == text  # the same model, split the same way: the same greedy tokens
    cp.remove("duo")


def test_a_split_the_model_cannot_take_stalls_with_the_engines_message(cp: ControlPlane) -> None:
    # Two nodes of three GPUs: six ranks, for a model of 4 attention heads.
    cp.create("sextet", resources={"gpus": 3, "nodes": 2}, replicas={"min": 1, "max": 1})
    wait_for(
        lambda: cp.is_true("sextet", "Stalled"), timeout=180, what=lambda: f"Stalled: {cp.describe('sextet')}"
    )
    # Held back between tries (the set at 0 groups), as the kubelet backs off a crash-looping container.
    stalled = wait_for(
        lambda: "held back" in (c := cp.condition("sextet", "Stalled"))["message"] and c,
        timeout=60,
        what=lambda: f"the group held back: {cp.describe('sextet')}",
    )
    assert stalled["reason"] == "PodsCrashLooping"
    assert stalled["message"].endswith(
        "ember serve: fatal: cannot load the model: TensorParallelError: "
        "tensor_parallel_size 6 does not divide the model's 4 attention heads"
    )
    cp.remove("sextet")
