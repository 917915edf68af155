"""`ember dev up` / `down` end to end: kubectl applies the local example, the operator starts real engine
processes through the process kubelet, and a chat request is served through the Service's local address;
and `DevCluster` with two one-GPU nodes, where a third GPU pod waits Unschedulable."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import plainhttp
from kubernetes import client, config
from tiny_service import pooled, tiny_conditions, tiny_engines, tiny_manifest
from waiting import free_port, wait_for

from ember_engine.tools.testmodel import make_test_model
from ember_localcluster.devcluster import DevCluster
from ember_localcluster.kubelet.kubelet import ENGINE_IMAGE
from ember_localcluster.kubelet.node import NodeConfig

REPO = Path(__file__).resolve().parents[1]
EMBER = str(Path(sys.executable).parent / "ember")
WEB_SERVER = ["python", "-m", "http.server", "--bind", "0.0.0.0", "8080"]


def test_dev_up_apply_serve_delete_down(tmp_path: Path) -> None:
    kubectl_bin = shutil.which("kubectl") or "/usr/bin/kubectl"
    assert Path(kubectl_bin).exists(), "kubectl is required (Debian: kubernetes-client)"
    state = tmp_path / "dev"
    port, prometheus_port = free_port(), free_port()
    prometheus = f"http://127.0.0.1:{prometheus_port}"
    up = subprocess.run(
        [
            EMBER,
            "dev",
            "up",
            "--dir",
            str(state),
            "--port",
            str(port),
            "--nodes",
            "2",
            "--prometheus",
            "--prometheus-port",
            str(prometheus_port),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert up.returncode == 0, up.stdout + up.stderr + (state / "dev.log").read_text()
    assert f"export KUBECONFIG={state / 'kubeconfig'}" in up.stdout
    assert f"Prometheus {prometheus}" in up.stdout

    def kubectl(*args: str) -> str:
        out = subprocess.run(
            [
                kubectl_bin,
                "--kubeconfig",
                str(state / "kubeconfig"),
                "--cache-dir",
                str(tmp_path / "kc"),
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout

    def eis() -> dict[str, Any]:
        return dict(json.loads(kubectl("get", "eis", "tiny", "-o", "json")))

    def ready() -> bool:
        conditions = {c["type"]: c["status"] for c in eis().get("status", {}).get("conditions", [])}
        return conditions.get("Ready") == "True" and conditions.get("WarmPoolReady") == "True"

    try:
        kubectl("apply", "-f", str(REPO / "examples" / "local.yaml"))
        wait_for(ready, timeout=180, what="the tiny InferenceService Ready with its warm pod")
        table = kubectl("get", "inferenceservices")
        assert "tiny" in table and "READY" in table and "WARM" in table
        nodes = [row.split()[:2] for row in kubectl("get", "nodes").splitlines()[1:]]
        assert nodes == [["ember-local", "Ready"], ["ember-local-2", "Ready"]]
        engine = json.loads(kubectl("get", "pods", "-l", "ember.dev/role=active", "-o", "json"))["items"][0]
        assert engine["spec"]["nodeName"] in ("ember-local", "ember-local-2")
        # kubectl logs: the engine's output, which names the pod's own address.
        assert f"http://{engine['status']['podIP']}:8000" in kubectl("logs", engine["metadata"]["name"])

        svc = json.loads(kubectl("get", "service", "tiny", "-o", "json"))
        (ingress,) = svc["status"]["loadBalancer"]["ingress"]
        base = f"http://{ingress['ip']}:{ingress['ports'][0]['port']}"
        assert eis()["status"]["endpoint"] == base
        reply = plainhttp.post(
            f"{base}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"] is not None

        # --prometheus: the engines and the operator are scraped (tests/test_prometheus.py goes further).
        def scraped() -> set[tuple[str, str]]:
            query = plainhttp.get(
                f"{prometheus}/api/v1/query", params={"query": "up == 1"}, timeout=10
            ).json()
            return {
                (r["metric"]["job"], r["metric"].get("inferenceservice", "")) for r in query["data"]["result"]
            }

        wait_for(
            lambda: {("ember-engines", "tiny"), ("ember-operator", "")} <= scraped(),
            timeout=30,
            what="Prometheus scraping the engines and the operator",
        )

        kubectl("delete", "-f", str(REPO / "examples" / "local.yaml"))
        wait_for(
            lambda: not json.loads(kubectl("get", "pods", "-o", "json"))["items"],
            timeout=120,
            what="engine pods gone",
        )
        # A pod still running when the cluster goes down: `ember dev down` returns after it has stopped.
        kubectl("run", "web", f"--image={ENGINE_IMAGE}:0.1.0", "--command", "--", *WEB_SERVER)
        wait_for(
            lambda: (
                json.loads(kubectl("get", "pod", "web", "-o", "json"))["status"].get("phase") == "Running"
            ),
            timeout=60,
            what="the web pod Running",
        )
        web = json.loads(kubectl("get", "pod", "web", "-o", "json"))
        web_pid = int(web["status"]["containerStatuses"][0]["containerID"].rsplit("/", 1)[1])
        dev_pid = int((state / "dev.pid").read_text())
    finally:
        down = subprocess.run(
            [EMBER, "dev", "down", "--dir", str(state)], capture_output=True, text=True, timeout=120
        )
    assert down.returncode == 0, down.stdout + down.stderr
    assert not (state / "dev.pid").exists()
    # Returned only once everything has stopped: the control plane, the pods' processes, the API port.
    assert not _alive(dev_pid), "the control plane process still runs after `ember dev down`"
    assert not _alive(web_pid), "a pod's process still runs after `ember dev down`"
    for taken in (port, prometheus_port):
        with socket.socket() as s:
            # Free to listen on again (SO_REUSEADDR, as servers bind: closed connections linger).
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", taken))


def test_dev_up_on_a_busy_port_says_so(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        up = subprocess.run(
            [EMBER, "dev", "up", "--dir", str(tmp_path / "dev"), "--port", str(port), "--timeout", "60"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert up.returncode == 1
    assert f"port {port}" in up.stderr and "already in use" in up.stderr, up.stderr
    assert not (tmp_path / "dev" / "dev.pid").exists()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has exited; only its parent has not collected it yet.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    return False


def test_two_one_gpu_nodes_run_two_gpu_pods_and_the_third_waits(tmp_path: Path) -> None:
    """Three pods of the engine image that each want a GPU (plain `python -m http.server`, which starts
    faster than an engine) on two nodes with one GPU each."""

    def gpu_pod(name: str) -> dict[str, Any]:
        command = ["python", "-m", "http.server", "--bind", "0.0.0.0", "8080"]
        container = {
            "name": "engine",
            "image": f"{ENGINE_IMAGE}:0.1.0",
            "command": command,
            "resources": {"limits": {"nvidia.com/gpu": "1"}},
        }
        spec = {"containers": [container], "terminationGracePeriodSeconds": 1}
        return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}

    with DevCluster(tmp_path / "dev", nodes=2, gpus_per_node=1) as cluster:
        api = cluster.api
        core = client.CoreV1Api(config.new_client_from_config(str(cluster.kubeconfig)))
        assert sorted(n.metadata.name for n in core.list_node().items) == ["ember-local", "ember-local-2"]
        for name in ("gpu-1", "gpu-2", "gpu-3"):
            api.create(gpu_pod(name))

        def phases() -> dict[str, str]:
            return {
                p["metadata"]["name"]: p["status"].get("phase", "") for p in api.list("v1", "Pod", "default")
            }

        wait_for(lambda: sorted(phases().values()) == ["Pending", "Running", "Running"], what="two running")
        pods = {p["metadata"]["name"]: p for p in api.list("v1", "Pod", "default")}
        running = [p for p in pods.values() if p["status"]["phase"] == "Running"]
        assert {p["spec"]["nodeName"] for p in running} == {"ember-local", "ember-local-2"}
        (pending,) = [p for p in pods.values() if p["status"]["phase"] == "Pending"]
        assert not pending["spec"].get("nodeName")

        def scheduled() -> dict[str, Any]:
            now = api.get("v1", "Pod", "default", pending["metadata"]["name"]) or {}
            return next(c for c in now["status"].get("conditions", []) if c["type"] == "PodScheduled")

        condition = wait_for(scheduled, what="PodScheduled on the third pod")
        assert (condition["status"], condition["reason"]) == ("False", "Unschedulable")
        assert condition["message"] == (
            "0/2 nodes are available: 2 Insufficient nvidia.com/gpu. no new claims to deallocate, "
            "preemption: 0/2 nodes are available: 2 No preemption victims found for incoming pod."
        )
        # pods/log is wired to the kubelet's files: http.server logs each request to stderr.
        first = running[0]

        def served_and_logged() -> bool:
            plainhttp.get(f"http://{first['status']['podIP']}:8080/", timeout=5)  # refused until it listens
            return '"GET / HTTP/1.1" 200' in core.read_namespaced_pod_log(
                first["metadata"]["name"], "default"
            )

        wait_for(lambda: _quietly(served_and_logged), what="a request in the pod's log")


def _quietly(check: Any) -> Any:
    try:
        return check()
    except httpx.HTTPError:
        return None


def _dev(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([EMBER, "dev", *args], capture_output=True, text=True, timeout=timeout)


def _run_web_pod(state: Path) -> int:
    """Run a pod of `python -m http.server` through the cluster in `state`; its process id."""
    api = client.CoreV1Api(config.new_client_from_config(str(state / "kubeconfig")))
    container = {"name": "web", "image": f"{ENGINE_IMAGE}:0.1.0", "command": WEB_SERVER}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web"},
        "spec": {"containers": [container]},
    }
    api.create_namespaced_pod("default", pod)

    def pid() -> int:
        status = api.read_namespaced_pod("web", "default").status
        assert status.phase == "Running"
        return int(status.container_statuses[0].container_id.rsplit("/", 1)[1])

    return wait_for(pid, timeout=60, what="the web pod Running")


def test_dev_down_and_up_reap_the_pods_of_a_control_plane_that_was_killed(tmp_path: Path) -> None:
    """A kubelet that dies leaves its containers running (as a real node's would); the process ids and
    start times it recorded let `ember dev down` and `ember dev up` end them."""
    state, port = tmp_path / "dev", free_port()
    up = _dev("up", "--dir", str(state), "--port", str(port))
    assert up.returncode == 0, up.stdout + up.stderr
    try:
        web = _run_web_pod(state)
        os.kill(int((state / "dev.pid").read_text()), signal.SIGKILL)
        down = _dev("down", "--dir", str(state))
        assert down.returncode == 0, down.stdout + down.stderr
        assert not _alive(web), "a pod's process outlived `ember dev down` after the control plane was killed"

        up = _dev("up", "--dir", str(state), "--port", str(port))
        assert up.returncode == 0, up.stdout + up.stderr
        web = _run_web_pod(state)
        os.kill(int((state / "dev.pid").read_text()), signal.SIGKILL)
        up = _dev("up", "--dir", str(state), "--port", str(port))
        assert up.returncode == 0, up.stdout + up.stderr
        assert not _alive(web), "a pod's process outlived `ember dev up` after the control plane was killed"
    finally:
        _dev("down", "--dir", str(state))


def test_two_dev_up_at_once_start_one_control_plane(tmp_path: Path) -> None:
    state, ports = tmp_path / "dev", (free_port(), free_port())
    ups = [
        subprocess.Popen(
            [EMBER, "dev", "up", "--dir", str(state), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for port in ports
    ]
    try:
        outs = [p.communicate(timeout=180) for p in ups]
        assert [p.returncode for p in ups] == [0, 0], outs
        url = (state / "ready").read_text()
        assert f"server: {url}" in (state / "kubeconfig").read_text()
        started = [out for out, _ in outs if out.startswith("ember dev: up")]
        assert len(started) == 1, outs
        (second,) = [out for out, _ in outs if not out.startswith("ember dev: up")]
        assert second.startswith(f"ember dev: already running (API server {url})"), second
        assert len(_dev_runs(state)) == 1, "two control planes run on one directory"
    finally:
        down = _dev("down", "--dir", str(state))
    assert down.stdout == "ember dev: down\n", down.stdout + down.stderr
    assert not _dev_runs(state), "a control plane outlived `ember dev down`"


def _dev_runs(state: Path) -> list[int]:
    """The `ember dev run` processes of the directory `state`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().split(b"\0")
            if b"run" in args and str(state).encode() in args and _alive(int(cmdline.parent.name)):
                found.append(int(cmdline.parent.name))
    return found


def test_evicting_the_active_pod_promotes_the_warm_one_and_refills_the_pool_elsewhere(tmp_path: Path) -> None:
    """What `kubectl drain` does to the node of `examples/local.yaml`'s active pod, step by step through the
    API: cordon the node, then evict the pod through `pods/eviction`. The operator's PodDisruptionBudget
    (over the active and warm pods, minAvailable = the active target, 1, with 2 Ready), as the disruption
    controller keeps its status, lets the eviction through; the warm pod takes over without the service ever leaving Ready, and the new
    warm pod goes to the other node."""
    make_test_model(tmp_path / "dev" / "models" / "tiny", size="tiny", force=True)
    with DevCluster(tmp_path / "dev", nodes=2) as cluster:
        api_client = config.new_client_from_config(str(cluster.kubeconfig))
        core, policy = client.CoreV1Api(api_client), client.PolicyV1Api(api_client)
        cluster.api.create(tiny_manifest())

        conditions = functools.partial(tiny_conditions, cluster)
        engines = functools.partial(tiny_engines, cluster)

        def pdb() -> dict[str, Any]:
            return policy.read_namespaced_pod_disruption_budget("tiny", "default").to_dict()["status"] or {}

        active, warm = pooled(cluster, 120)
        wait_for(lambda: pdb().get("disruptions_allowed") == 1, 20, pdb)
        node = active["spec"]["nodeName"]
        other = next(n for n in ("ember-local", "ember-local-2") if n != node)
        core.patch_node(node, {"spec": {"unschedulable": True}})
        name = active["metadata"]["name"]
        eviction = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": "default"},
        }
        core.create_namespaced_pod_eviction(name, "default", eviction)
        seen_not_ready = []

        def settled() -> bool:
            state = conditions()
            if state.get("Ready") != "True":
                seen_not_ready.append(state)
            actives, warms = engines("active"), engines("warm")
            return bool(
                [p["metadata"]["name"] for p in actives] == [warm["metadata"]["name"]]
                and len(warms) == 1
                and warms[0]["spec"].get("nodeName") == other
                and state.get("WarmPoolReady") == "True"
                and cluster.api.get("v1", "Pod", "default", name) is None
            )

        wait_for(settled, 120, lambda: (conditions(), engines("active"), engines("warm")))
        assert not seen_not_ready
        wait_for(lambda: pdb().get("disruptions_allowed") == 1 and not pdb().get("disrupted_pods"), 20, pdb)


def test_a_drain_of_the_node_holding_both_pods_waits_for_a_warm_pod_elsewhere(tmp_path: Path) -> None:
    """`examples/local.yaml`'s active and warm pods on one node, and that node drained: kubectl evicts both at
    once. With a warm pool the budget covers active and warm pods and keeps `replicas` of them Ready, so
    one eviction goes through and the other is refused (429) until a new warm pod is Ready on the other
    node; the service never leaves Ready. (With the budget over active pods only, minAvailable 1 - 1 = 0,
    both went at once and nothing served until new pods had loaded.)"""
    make_test_model(tmp_path / "dev" / "models" / "tiny", size="tiny", force=True)
    with DevCluster(tmp_path / "dev", nodes=2) as cluster:
        api_client = config.new_client_from_config(str(cluster.kubeconfig))
        core = client.CoreV1Api(api_client)
        core.patch_node("ember-local-2", {"spec": {"unschedulable": True}})  # both pods on ember-local
        cluster.api.create(tiny_manifest())

        conditions = functools.partial(tiny_conditions, cluster)
        engines = functools.partial(tiny_engines, cluster)

        active, warm = pooled(cluster, 120)
        assert active["spec"]["nodeName"] == warm["spec"]["nodeName"] == "ember-local"
        core.patch_node("ember-local-2", {"spec": {"unschedulable": False}})
        core.patch_node("ember-local", {"spec": {"unschedulable": True}})

        def evict(pod: dict[str, Any]) -> int:
            name = pod["metadata"]["name"]
            body = {
                "apiVersion": "policy/v1",
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": "default"},
            }
            try:
                core.create_namespaced_pod_eviction(name, "default", body)
            except client.ApiException as exc:
                return int(exc.status)
            return 201

        wait_for(
            lambda: (policy_status(cluster) or {}).get("disruptionsAllowed") == 1,
            20,
            lambda: policy_status(cluster),
        )
        assert [evict(warm), evict(active)] == [201, 429]
        seen_not_ready = []

        def drained() -> bool:
            state = conditions()
            if state.get("Ready") != "True":
                seen_not_ready.append(state)
            return cluster.api.get("v1", "Pod", "default", active["metadata"]["name"]) is None or (
                bool(engines("warm")) and evict(active) == 201
            )

        wait_for(drained, 120, lambda: (conditions(), policy_status(cluster)))
        wait_for(
            lambda: (
                conditions().get("WarmPoolReady") == "True"
                and all(
                    p["spec"].get("nodeName") == "ember-local-2" for p in engines("active") + engines("warm")
                )
            ),
            120,
            lambda: (conditions(), engines("active"), engines("warm")),
        )
        assert not seen_not_ready


def test_the_warm_pod_stands_by_on_another_node_than_the_active_one(tmp_path: Path) -> None:
    """`examples/local.yaml` (one active pod, a warm pool of one) on a big node and a small one. Least
    allocated alone puts both pods on the big node, where one node lost takes the service and its standby
    together; the operator's default spreading of a service's engine pods over nodes sends the warm pod to
    the other node."""
    make_test_model(tmp_path / "dev" / "models" / "tiny", size="tiny", force=True)
    nodes = [
        NodeConfig("ember-local", cpu="16", memory="64Gi"),
        NodeConfig("ember-local-2", cpu="4", memory="16Gi"),
    ]
    with DevCluster(tmp_path / "dev", nodes=nodes) as cluster:
        cluster.api.create(tiny_manifest())
        active, warm = pooled(cluster, 120)
        assert {active["spec"]["nodeName"], warm["spec"]["nodeName"]} == {"ember-local", "ember-local-2"}


def policy_status(cluster: DevCluster) -> dict[str, Any] | None:
    pdb = cluster.api.get("policy/v1", "PodDisruptionBudget", "default", "tiny")
    return None if pdb is None else pdb.get("status")


def test_dev_node_stop_and_start_lose_a_node_and_bring_it_back(tmp_path: Path) -> None:
    """`ember dev node stop NAME` asks the running control plane to lose a node as a power cut would (its
    pods' processes killed at once, its lease no longer renewed); `start` brings it back."""
    state = tmp_path / "dev"
    port = free_port()
    up = _dev("up", "--dir", str(state), "--port", str(port), "--nodes", "2")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        api = client.CoreV1Api(config.new_client_from_config(str(state / "kubeconfig")))
        container = {"name": "web", "image": f"{ENGINE_IMAGE}:0.1.0", "command": WEB_SERVER}
        spec = {"containers": [container], "nodeSelector": {"kubernetes.io/hostname": "ember-local-2"}}
        api.create_namespaced_pod(
            "default", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "web"}, "spec": spec}
        )

        def pid() -> int:
            status = api.read_namespaced_pod("web", "default").status
            assert status.phase == "Running"
            return int(status.container_statuses[0].container_id.rsplit("/", 1)[1])

        process = wait_for(pid, timeout=60, what="the web pod Running")
        stop = _dev("node", "stop", "ember-local-2", "--dir", str(state))
        assert (stop.returncode, stop.stdout) == (0, "ember dev: node ember-local-2 stopped\n"), stop.stderr
        assert not _alive(process)
        unknown = _dev("node", "stop", "nowhere", "--dir", str(state))
        assert (unknown.returncode, unknown.stderr) == (
            1,
            "ember dev: error: no node 'nowhere' here (nodes: ember-local, ember-local-2)\n",
        )
        start = _dev("node", "start", "ember-local-2", "--dir", str(state))
        assert (start.returncode, start.stdout) == (0, "ember dev: node ember-local-2 started\n"), (
            start.stderr
        )
        wait_for(lambda: pid() != process, 60, what="the pod run again")
    finally:
        _dev("down", "--dir", str(state))
