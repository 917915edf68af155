"""Nodes, the scheduler, the `pods/binding` and `pods/log` subresources and kubelet admission, against the
in-process API server: GPU pods spread over two nodes and the third waits Unschedulable with
kube-scheduler's message until one ends; nodeSelector, taints and tolerations, cordoned nodes; binding
conflicts; `kubectl get nodes` and `kubectl logs` through the real kubectl and the official client."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.kubelet.kubelet import ProcessKubelet
from ember_localcluster.kubelet.node import NodeConfig, local_nodes, parse_taint
from ember_localcluster.scheduler import Scheduler

PYTHON_IMAGE = "docker.io/library/python:3.11-slim"
IMAGES = {"docker.io/library/python": ("python3",)}
PREFIX = "127.5."  # pod addresses of this module's kubelet (other modules use 127.1-4)
GPU = "nvidia.com/gpu"
NO_VICTIMS = "No preemption victims found for incoming pod"
NOT_HELPFUL = "Preemption is not helpful for scheduling"


def unschedulable(nodes: int, reasons: str, preemption: str) -> str:
    """kube-scheduler's FitError message (default profile, v1.34+)."""
    return (
        f"0/{nodes} nodes are available: {reasons}. no new claims to deallocate, "
        f"preemption: 0/{nodes} nodes are available: {preemption}."
    )


def pod(
    name: str, *, gpus: int = 0, cpu: str | None = None, command: list[str] | None = None, **spec: Any
) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "main",
        "image": PYTHON_IMAGE,
        "command": command
        or ["python", "-c", f"import time; print('hello from {name}', flush=True); time.sleep(600)"],
    }
    limits = {GPU: str(gpus)} if gpus else {}
    requests = {"cpu": cpu} if cpu else {}
    if limits or requests:
        container["resources"] = {k: v for k, v in (("limits", limits), ("requests", requests)) if v}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container], **spec},
    }


def get(api: APIServer, name: str) -> dict[str, Any]:
    found = api.get("v1", "Pod", "default", name)
    assert found is not None, f"pod {name} is gone"
    return found


def scheduled(p: dict[str, Any]) -> dict[str, Any]:
    return next(
        (c for c in (p.get("status") or {}).get("conditions") or [] if c["type"] == "PodScheduled"), {}
    )


def running(p: dict[str, Any]) -> bool:
    return (p.get("status") or {}).get("phase") == "Running"


def events(api: APIServer, name: str, reason: str) -> list[dict[str, Any]]:
    return [
        e
        for e in api.list("v1", "Event", "default")
        if e["involvedObject"].get("name") == name and e["reason"] == reason
    ]


def delete_all_pods(api: APIServer) -> None:
    for p in api.list("v1", "Pod", "default"):
        api.delete("v1", "Pod", "default", p["metadata"]["name"], grace_period_seconds=0)
    wait_for(lambda: not api.list("v1", "Pod", "default"), what="every pod gone", timeout=30)


# -- two nodes, one GPU each, with a kubelet -------------------------------------------------------------


@dataclass
class Cluster:
    api: APIServer
    kubelet: ProcessKubelet
    kubeconfig: Path
    core: client.CoreV1Api
    root: Path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("scheduler")
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1) as api:
        kubeconfig = api.write_kubeconfig(root / "kubeconfig")
        nodes = [NodeConfig(name, gpus=1, cpu="4", memory="8Gi") for name in ("ember-local", "ember-local-2")]
        kubelet = ProcessKubelet(
            kubeconfig, root / "state", images=IMAGES, ip_prefix=PREFIX, nodes=nodes, backoff_initial=0.5
        )
        with Scheduler(kubeconfig), kubelet:
            api.attach_kubelet(kubelet.node_names, kubelet.pods_dir)
            core = client.CoreV1Api(config.new_client_from_config(str(kubeconfig)))
            yield Cluster(api, kubelet, kubeconfig, core, root)


@pytest.fixture
def clean(cluster: Cluster) -> Iterator[Cluster]:
    yield cluster
    delete_all_pods(cluster.api)


def test_the_kubelet_registers_its_nodes(cluster: Cluster) -> None:
    nodes = {n.metadata.name: n for n in cluster.core.list_node().items}
    assert sorted(nodes) == ["ember-local", "ember-local-2"]
    for name, node in nodes.items():
        assert node.metadata.labels["kubernetes.io/hostname"] == name
        assert node.metadata.labels[f"{GPU}.present"] == "true"
        for amounts in (node.status.capacity, node.status.allocatable):
            assert (amounts["cpu"], amounts["memory"], amounts["pods"], amounts[GPU]) == (
                "4",
                "8Gi",
                "110",
                "1",
            )
        ready = next(c for c in node.status.conditions if c.type == "Ready")
        assert (ready.status, ready.reason, ready.message) == (
            "True",
            "KubeletReady",
            "kubelet is posting ready status",
        )
        assert node.status.node_info.kubelet_version.startswith("v1.")


def test_gpu_pods_fill_two_nodes_and_the_third_waits_until_one_ends(clean: Cluster) -> None:
    api = clean.api
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        api.create(pod(name, gpus=1))
    wait_for(lambda: sum(running(get(api, n)) for n in ("gpu-a", "gpu-b", "gpu-c")) == 2, what="two running")
    pods = {n: get(api, n) for n in ("gpu-a", "gpu-b", "gpu-c")}
    placed = {p["spec"].get("nodeName") for p in pods.values() if running(p)}
    assert placed == {"ember-local", "ember-local-2"}, "one GPU pod per node"
    (waiting,) = [n for n, p in pods.items() if not running(p)]
    message = unschedulable(2, f"2 Insufficient {GPU}", f"2 {NO_VICTIMS}")
    condition = wait_for(lambda: scheduled(get(api, waiting)), what="PodScheduled on the waiting pod")
    assert (condition["status"], condition["reason"], condition["message"]) == (
        "False",
        "Unschedulable",
        message,
    )
    assert get(api, waiting)["status"]["phase"] == "Pending" and not get(api, waiting)["spec"].get("nodeName")
    (failed,) = wait_for(lambda: events(api, waiting, "FailedScheduling"), what="a FailedScheduling event")
    assert (failed["type"], failed["message"], failed["source"]["component"]) == (
        "Warning",
        message,
        "default-scheduler",
    )

    # One GPU pod ends: the waiting one is bound to the node it leaves, and runs there.
    first = next(n for n, p in pods.items() if running(p))
    freed = pods[first]["spec"]["nodeName"]
    api.delete("v1", "Pod", "default", first)
    wait_for(lambda: running(get(api, waiting)), what=f"{waiting} running", timeout=30)
    bound = get(api, waiting)
    assert bound["spec"]["nodeName"] == freed
    assert scheduled(bound)["status"] == "True"
    (assigned,) = wait_for(lambda: events(api, waiting, "Scheduled"), what="a Scheduled event")
    assert assigned["message"] == f"Successfully assigned default/{waiting} to {freed}"


def test_a_pod_placed_by_hand_on_a_full_node_is_rejected_by_the_kubelet(clean: Cluster) -> None:
    api = clean.api
    api.create(pod("first", gpus=1, nodeName="ember-local"))
    wait_for(lambda: running(get(api, "first")), what="first running")
    api.create(pod("second", gpus=1, nodeName="ember-local"))
    status = wait_for(
        lambda: (s := get(api, "second")["status"]).get("phase") == "Failed" and s, what="second rejected"
    )
    assert status["reason"] == f"OutOf{GPU}"
    assert status["message"] == (
        f"Pod was rejected: Node didn't have enough resource: {GPU}, requested: 1, used: 1, capacity: 1"
    )


def test_kubectl_get_nodes_and_logs(clean: Cluster, tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is not on PATH; it is part of the machine setup (apt install kubectl)"
    api = clean.api

    def run(*args: str) -> str:
        command = [
            kubectl,
            "--kubeconfig",
            str(clean.kubeconfig),
            "--cache-dir",
            str(tmp_path / "cache"),
            *args,
        ]
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"{' '.join(args)} failed: {result.stderr}"
        return result.stdout

    header, *rows = run("get", "nodes").splitlines()
    assert header.split() == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert [row.split()[:3] for row in rows] == [
        ["ember-local", "Ready", "<none>"],
        ["ember-local-2", "Ready", "<none>"],
    ]
    wide = run("get", "nodes", "-o", "wide").splitlines()[0].split()
    assert wide[5:8] == ["INTERNAL-IP", "EXTERNAL-IP", "OS-IMAGE"]
    run("cordon", "ember-local-2")
    assert run("get", "node", "ember-local-2").splitlines()[1].split()[1] == "Ready,SchedulingDisabled"
    run("uncordon", "ember-local-2")

    # A container that fails once, then runs: `kubectl logs` shows the current run, --previous the last one.
    script = (
        "import pathlib, sys, time\n"
        "f = pathlib.Path(sys.argv[1]); n = int(f.read_text()) + 1 if f.exists() else 1; f.write_text(str(n))\n"
        "print(f'start {n}', flush=True)\n"
        "if n == 1: sys.exit(3)\n"
        "time.sleep(600)\n"
    )
    flaky = pod(
        "flaky", command=["python", "-c", script, "/data/n"], volumes=[{"name": "data", "emptyDir": {}}]
    )
    flaky["spec"]["containers"][0]["volumeMounts"] = [{"name": "data", "mountPath": "/data"}]
    api.create(flaky)

    def restarted_and_running() -> bool:
        (state,) = get(api, "flaky")["status"].get("containerStatuses") or [{}]
        return state.get("restartCount") == 1 and "running" in state.get("state", {})

    wait_for(restarted_and_running, what="flaky restarted once and running", timeout=30)
    wait_for(lambda: run("logs", "flaky") == "start 2\n", what="the current run's log")
    assert run("logs", "flaky", "--previous") == "start 1\n"
    assert clean.core.read_namespaced_pod_log("flaky", "default") == "start 2\n"
    assert clean.core.read_namespaced_pod_log("flaky", "default", previous=True, tail_lines=1) == "start 1\n"


def test_pod_log_errors_are_upstreams(clean: Cluster) -> None:
    api, core = clean.api, clean.core
    two = pod("two")
    two["spec"]["containers"].append({**two["spec"]["containers"][0], "name": "side"})
    api.create(two)
    wait_for(lambda: running(get(api, "two")), what="two running")
    with pytest.raises(ApiException) as error:
        core.read_namespaced_pod_log("two", "default")
    assert error.value.status == 400
    assert json.loads(error.value.body)["message"] == (
        "a container name must be specified for pod two, choose one of: [main side]"
    )
    wait_for(lambda: core.read_namespaced_pod_log("two", "default", container="side") == "hello from two\n")
    with pytest.raises(ApiException) as error:
        core.read_namespaced_pod_log("two", "default", container="nope")
    assert json.loads(error.value.body)["message"] == "container nope is not valid for pod two"
    with pytest.raises(ApiException) as error:
        core.read_namespaced_pod_log("two", "default", container="main", tail_lines=-1)
    assert error.value.status == 422
    assert json.loads(error.value.body)["message"] == (
        'PodLogOptions "two" is invalid: tailLines: Invalid value: -1: must be greater than or equal to 0'
    )
    with pytest.raises(ApiException) as error:
        core.read_namespaced_pod_log("two", "default", container="main", previous=True)
    assert (
        json.loads(error.value.body)["message"]
        == 'previous terminated container "main" in pod "two" not found'
    )

    # Not bound to any node (no node matches): an empty answer, as upstream gives for an unassigned pod.
    api.create(pod("nowhere", nodeSelector={"disk": "none"}))
    wait_for(
        lambda: scheduled(get(api, "nowhere")).get("reason") == "Unschedulable", what="nowhere unschedulable"
    )
    assert core.read_namespaced_pod_log("nowhere", "default") == ""

    # Follow: the run's output as it grows, until the container ends.
    script = "import time\nfor i in range(3):\n    print(f'tick {i}', flush=True); time.sleep(0.3)\n"
    api.create(pod("ticker", command=["python", "-c", script], restartPolicy="Never"))
    wait_for(lambda: running(get(api, "ticker")) or get(api, "ticker")["status"].get("phase") == "Succeeded")
    url = f"{api.url}/api/v1/namespaces/default/pods/ticker/log"
    with httpx.Client(timeout=30) as http:
        followed = http.get(url, params={"follow": "true"})
    assert followed.status_code == 200 and followed.headers["content-type"].startswith("text/plain")
    assert followed.text == "tick 0\ntick 1\ntick 2\n"


# -- nodes without a kubelet: where the scheduler binds ----------------------------------------------------


def node(
    name: str, *, gpus: int = 0, cpu: str = "4", labels: dict[str, str] | None = None, **spec: Any
) -> dict[str, Any]:
    capacity = {"cpu": cpu, "memory": "16Gi", "pods": "110", **({GPU: str(gpus)} if gpus else {})}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": spec,
        "status": {"capacity": capacity, "allocatable": capacity},
    }


@dataclass
class Bare:
    api: APIServer
    kubeconfig: Path
    scheduler: Scheduler

    def add_node(self, manifest: dict[str, Any]) -> None:
        self.api.create(manifest)  # with its status, as a kubelet registers a node
        # Nodes and pods come to the scheduler on separate watches: a pod created next could reach it before
        # the node does (so could kube-scheduler's informers); the scenarios here place pods on known nodes.
        name = manifest["metadata"]["name"]
        wait_for(lambda: name in self.scheduler._nodes, what=f"the scheduler seeing node {name}")

    def placed(self, name: str) -> str:
        return str(wait_for(lambda: get(self.api, name)["spec"].get("nodeName"), what=f"{name} bound"))

    def refused(self, name: str) -> str:
        condition = wait_for(lambda: scheduled(get(self.api, name)), what=f"{name}'s PodScheduled")
        assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
        return str(condition["message"])


@pytest.fixture
def bare(tmp_path: Path) -> Iterator[Bare]:
    """An API server and the scheduler, no kubelet: pods are bound but never run."""
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        with Scheduler(kubeconfig) as scheduler:
            yield Bare(api, kubeconfig, scheduler)


def test_without_nodes_nothing_is_available(bare: Bare) -> None:
    bare.api.create(pod("early"))
    assert bare.refused("early") == "no nodes available to schedule pods"
    bare.add_node(node("late"))
    assert bare.placed("early") == "late", "a new node gets the waiting pod"


def test_node_selector(bare: Bare) -> None:
    bare.add_node(node("a", labels={"disk": "ssd"}))
    bare.add_node(node("b"))
    bare.api.create(pod("wants-ssd", nodeSelector={"disk": "ssd"}))
    assert bare.placed("wants-ssd") == "a"
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "disk", "operator": "In", "values": ["nvme"]}]}
                ]
            }
        }
    }
    bare.api.create(pod("wants-nvme", affinity=affinity))
    assert bare.refused("wants-nvme") == unschedulable(
        2, "2 node(s) didn't match Pod's node affinity/selector", f"2 {NOT_HELPFUL}"
    )
    bare.api.patch("v1", "Node", None, "b", {"metadata": {"labels": {"disk": "nvme"}}})
    assert bare.placed("wants-nvme") == "b", "relabelling a node retries the pod"


def test_taints_and_tolerations(bare: Bare) -> None:
    bare.add_node(node("cpu-only"))
    bare.add_node(node("gpu", gpus=2, taints=[{"key": GPU, "value": "present", "effect": "NoSchedule"}]))
    bare.api.create(pod("untolerating", gpus=1))
    assert bare.refused("untolerating") == unschedulable(
        2, f"1 Insufficient {GPU}, 1 node(s) had untolerated taint(s)", f"1 {NO_VICTIMS}, 1 {NOT_HELPFUL}"
    )
    wrong = [{"key": GPU, "operator": "Equal", "value": "absent", "effect": "NoSchedule"}]
    bare.api.create(pod("wrong-value", gpus=1, tolerations=wrong))
    assert "1 node(s) had untolerated taint(s)" in bare.refused("wrong-value")
    exists = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
    bare.api.create(pod("tolerating", gpus=1, tolerations=exists))
    assert bare.placed("tolerating") == "gpu"
    equal = [{"key": GPU, "operator": "Equal", "value": "present"}]  # no effect: every effect
    bare.api.create(pod("equal", gpus=1, tolerations=equal))
    assert bare.placed("equal") == "gpu"
    # Both GPUs taken: a third tolerating pod waits for resources, not for the taint.
    # preemptionPolicy Never comes from a PriorityClass, as kube-apiserver's Priority admission sets it.
    never = {"metadata": {"name": "never-preempts"}, "value": 0, "preemptionPolicy": "Never"}
    bare.api.create({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass", **never})
    bare.api.create(pod("third", gpus=1, tolerations=exists, priorityClassName="never-preempts"))
    assert bare.refused("third") == (
        f"0/2 nodes are available: 2 Insufficient {GPU}. no new claims to deallocate, "
        "preemption: not eligible due to preemptionPolicy=Never."
    )
    # A NoExecute taint repels too (the message follows the nodes); PreferNoSchedule only steers.
    bare.add_node(node("draining", gpus=1, taints=[{"key": "maintenance", "effect": "NoExecute"}]))
    wait_for(
        lambda: (
            bare.refused("untolerating")
            == unschedulable(
                3,
                f"1 Insufficient {GPU}, 2 node(s) had untolerated taint(s)",
                f"1 {NO_VICTIMS}, 2 {NOT_HELPFUL}",
            )
        ),
        what="the message to count the third node",
    )
    bare.add_node(node("soft", gpus=3, taints=[{"key": "spot", "effect": "PreferNoSchedule"}]))
    assert {bare.placed(name) for name in ("untolerating", "wrong-value", "third")} == {"soft"}


def test_cordoned_nodes_and_least_allocated_placement(bare: Bare) -> None:
    bare.add_node(node("n1"))
    bare.add_node(node("n2", unschedulable=True))
    bare.api.create(pod("p1", cpu="1"))
    assert bare.placed("p1") == "n1"
    bare.api.create(pod("big", cpu="4"))
    assert bare.refused("big") == unschedulable(
        2, "1 Insufficient cpu, 1 node(s) were unschedulable", f"1 {NO_VICTIMS}, 1 {NOT_HELPFUL}"
    )
    bare.api.patch("v1", "Node", None, "n2", {"spec": {"unschedulable": False}})
    assert bare.placed("big") == "n2", "uncordoning retries the pod"
    bare.add_node(node("n3"))
    # n1 holds 1 cpu, n2 all 4, n3 none: the least allocated fitting node wins, then the name.
    bare.api.create(pod("p2", cpu="1"))
    assert bare.placed("p2") == "n3"
    bare.api.create(pod("p3", cpu="1"))
    assert bare.placed("p3") == "n1"


# -- the pods/binding subresource ------------------------------------------------------------------------


def test_binding_sets_the_node_once(tmp_path: Path) -> None:
    with APIServer() as api, httpx.Client(base_url=api.url, timeout=10) as http:
        core = client.CoreV1Api(config.new_client_from_config(str(api.write_kubeconfig(tmp_path / "kc"))))
        created = api.create(pod("p"))
        url = "/api/v1/namespaces/default/pods/p/binding"

        def bind(name: str, target: dict[str, Any], **meta: Any) -> httpx.Response:
            body = {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, **meta},
                "target": target,
            }
            return http.post(url, json=body)

        mismatch = bind("other", {"kind": "Node", "name": "n1"})
        assert (mismatch.status_code, mismatch.json()["message"]) == (
            400,
            "name in URL does not match name in Binding object",
        )
        no_target = bind("p", {"kind": "Node"})
        assert (no_target.status_code, no_target.json()["message"]) == (500, "target.name: Required value")
        stale = bind("p", {"kind": "Node", "name": "n1"}, uid="not-the-uid")
        assert (
            stale.status_code == 409
            and "Precondition failed: UID in precondition: not-the-uid" in stale.json()["message"]
        )

        ok = bind("p", {"kind": "Node", "name": "n1"}, uid=created["metadata"]["uid"])
        assert ok.status_code == 201
        assert ok.json() == {
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Success",
            "code": 201,
        }
        bound = get(api, "p")
        # Pods keep no metadata.generation in Kubernetes 1.32 (the version the server reports).
        assert bound["spec"]["nodeName"] == "n1" and "generation" not in bound["metadata"]
        assert scheduled(bound)["status"] == "True"

        again = bind("p", {"kind": "Node", "name": "n2"})
        assert again.status_code == 409
        assert again.json()["reason"] == "Conflict"
        assert again.json()["message"] == (
            'Operation cannot be fulfilled on pods/binding "p": pod p is already assigned to node "n1"'
        )
        assert again.json()["details"] == {"name": "p", "group": "", "kind": "pods/binding"}

        # The official client (its Binding model cannot read the Status answer: raw response).
        api.create(pod("q"))
        body = client.V1Binding(
            metadata=client.V1ObjectMeta(name="q"), target=client.V1ObjectReference(kind="Node", name="n2")
        )
        response = core.create_namespaced_pod_binding("q", "default", body, _preload_content=False)
        assert response.status == 201 and get(api, "q")["spec"]["nodeName"] == "n2"
        with pytest.raises(ApiException) as error:
            core.create_namespaced_pod_binding("q", "default", body, _preload_content=False)
        assert error.value.status == 409

        # A bound pod no kubelet has started: its container is waiting to start.
        log = http.get("/api/v1/namespaces/default/pods/q/log")
        assert (log.status_code, log.json()["message"]) == (
            400,
            'container "main" in pod "q" is waiting to start: ContainerCreating',
        )
        discovery = http.get("/api/v1").json()["resources"]
        assert {r["name"]: r["verbs"] for r in discovery if r["name"].startswith("pods/")} == {
            "pods/status": ["get", "patch", "update"],
            "pods/binding": ["create"],
            "pods/eviction": ["create"],
            "pods/log": ["get"],
        }
        (eviction,) = [r for r in discovery if r["name"] == "pods/eviction"]
        assert (eviction["group"], eviction["version"], eviction["kind"]) == ("policy", "v1", "Eviction")


def test_node_helpers() -> None:
    assert [n.name for n in local_nodes(3, 2)] == ["ember-local", "ember-local-2", "ember-local-3"]
    assert parse_taint("nvidia.com/gpu=present:NoSchedule") == {
        "key": GPU,
        "value": "present",
        "effect": "NoSchedule",
    }
    assert parse_taint("dedicated:NoExecute") == {"key": "dedicated", "effect": "NoExecute"}
    with pytest.raises(ValueError):
        parse_taint("dedicated=x:Sometimes")
