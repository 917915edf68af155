"""The process kubelet against the in-process API server, with real processes: the engine on the tiny model,
crash loops, liveness restarts, images it cannot run, graceful deletion, and the engine behind the
service proxy."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import yaml
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.kubelet.kubelet import ENGINE_IMAGE, ProcessKubelet, write_atomically
from ember_localcluster.kubelet.nodelease import renew_lease
from ember_localcluster.proxy import ServiceProxy
from ember_localcluster.scheduler import Scheduler

T = TypeVar("T")

PYTHON_IMAGE = "docker.io/library/python:3.11-slim"
IMAGES = {ENGINE_IMAGE: ("ember", "serve"), "docker.io/library/python": ("python3",)}
POLICY_DIR = "/etc/ember/policy"
# Not the default 127.1.: a local control plane of an older checkout may be using that one.
PREFIX = "127.3."


@dataclass
class Cluster:
    api: APIServer
    kubelet: ProcessKubelet
    proxy: ServiceProxy
    http: httpx.Client
    started: float  # time.monotonic() once the kubelet had started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("cluster")
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1) as api:
        kubeconfig = api.write_kubeconfig(root / "kubeconfig")
        # Crash loops quicker than the kubelet's 10 s doubling to 300 s, so restarts are seen in seconds.
        kubelet = ProcessKubelet(
            kubeconfig,
            root / "state",
            claims={"weights": tiny_model.parent},
            images=IMAGES,
            ip_prefix=PREFIX,
            backoff_initial=1.0,
            backoff_max=10.0,
        )
        with (
            Scheduler(kubeconfig),
            kubelet,
            ServiceProxy(kubeconfig) as proxy,
            httpx.Client(trust_env=False, timeout=30) as http,
        ):
            yield Cluster(api, kubelet, proxy, http, time.monotonic())


def get_pod(api: APIServer, name: str) -> dict[str, Any]:
    pod = api.get("v1", "Pod", "default", name)
    assert pod is not None, f"pod {name} is gone"
    return pod


def wait_for_pod(
    api: APIServer, name: str, what: str, check: Callable[[dict[str, Any]], Any], timeout: float = 30.0
) -> dict[str, Any]:
    """The pod, once `check(pod)` holds."""

    def probe() -> dict[str, Any] | None:
        pod = get_pod(api, name)
        return pod if check(pod) else None

    return wait_for(probe, what=f"{name}: {what}", timeout=timeout)


def container(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or [{}]
    return dict(statuses[0])


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def python_pod(name: str, command: list[str], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"test": name}},
        "spec": {
            "terminationGracePeriodSeconds": 2,
            "containers": [{"name": "main", "image": PYTHON_IMAGE, "command": command}],
            **spec,
        },
    }


def delete_and_wait(api: APIServer, name: str) -> None:
    api.delete("v1", "Pod", "default", name)
    wait_for(lambda: api.get("v1", "Pod", "default", name) is None, what=f"pod {name} to go")


# -- the engine -----------------------------------------------------------------------------------------

POLICY = yaml.safe_dump({"loadShedding": {"maxQueueDepth": 3}})
# The same limit plus a priority class "gold" that the first policy does not know.
GOLD_POLICY = yaml.safe_dump(
    {
        "loadShedding": {
            "maxQueueDepth": 3,
            "priorityClasses": [{"name": "gold", "priority": 0}, {"name": "standard", "priority": 1}],
        }
    }
)


def engine_pod(name: str) -> dict[str, Any]:
    """The shape of the operator's engine pod (operator/desired.py), on the tiny model and the CPU."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"app": "engine"}},
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "engine",
                    "image": f"{ENGINE_IMAGE}:0.1.0",
                    "command": ["ember", "serve"],
                    "args": [
                        "--model=/models/tiny",
                        "--host=0.0.0.0",
                        "--port=8000",
                        "--device=cpu",
                        f"--policy={POLICY_DIR}/policy.yaml",
                    ],
                    "ports": [{"name": "http", "containerPort": 8000, "protocol": "TCP"}],
                    "readinessProbe": {
                        "httpGet": {"path": "/ready", "port": "http"},
                        "periodSeconds": 1,
                        "timeoutSeconds": 2,
                        "failureThreshold": 1,
                    },
                    "livenessProbe": {
                        "httpGet": {"path": "/health", "port": "http"},
                        "periodSeconds": 10,
                        "timeoutSeconds": 2,
                        "failureThreshold": 3,
                    },
                    # The operator's hook is `sleep 5`; this one also leaves a mark to see it ran first.
                    "lifecycle": {
                        "preStop": {
                            "exec": {"command": ["sh", "-c", 'touch "$1"; sleep 2', "sh", "/scratch/stop"]}
                        }
                    },
                    "volumeMounts": [
                        {"name": "policy", "mountPath": POLICY_DIR, "readOnly": True},
                        {"name": "models", "mountPath": "/models", "readOnly": True},
                        {"name": "scratch", "mountPath": "/scratch"},
                    ],
                    "terminationMessagePolicy": "FallbackToLogsOnError",
                }
            ],
            "volumes": [
                {"name": "policy", "configMap": {"name": f"{name}-policy"}},
                {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}},
                {"name": "scratch", "emptyDir": {}},
            ],
        },
    }


@pytest.fixture(scope="module")
def engine(cluster: Cluster) -> dict[str, Any]:
    """A Ready engine pod named `engine`; the last test of this module deletes it."""
    api = cluster.api
    api.create(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "engine-policy"},
            "data": {"policy.yaml": POLICY},
        }
    )
    api.create(engine_pod("engine"))
    return wait_for_pod(api, "engine", "Ready", is_ready, 90)


def completion(http: httpx.Client, url: str, priority: str | None = None) -> httpx.Response:
    headers = {"x-ember-priority": priority} if priority else {}
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
    return http.post(f"{url}/v1/completions", json=body, headers=headers)


def test_engine_pod_runs_and_serves_on_its_pod_ip(cluster: Cluster, engine: dict[str, Any]) -> None:
    status = engine["status"]
    assert status["phase"] == "Running"
    ip = status["podIP"]
    assert ip.startswith(PREFIX) and status["podIPs"] == [{"ip": ip}]
    assert status["hostIP"] == "127.0.0.1" and status["startTime"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "True",
        "Ready": "True",
    }
    engine_status = container(engine)
    assert engine_status["ready"] and engine_status["started"] and engine_status["restartCount"] == 0
    assert "running" in engine_status["state"] and engine_status["image"] == f"{ENGINE_IMAGE}:0.1.0"
    models = cluster.http.get(f"http://{ip}:8000/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    log = cluster.kubelet.log_path("default", "engine", "engine").read_text()
    assert f"http://{ip}:8000" in log  # --host=0.0.0.0 became the pod's address


def test_configmap_update_reaches_the_running_engine(cluster: Cluster, engine: dict[str, Any]) -> None:
    url = f"http://{engine['status']['podIP']}:8000"
    volume = cluster.kubelet.pod_dir("default", "engine") / "volumes" / "policy"
    assert (volume / "policy.yaml").read_text() == POLICY
    assert (volume / "..data").is_symlink()
    refused = completion(cluster.http, url, "gold")
    assert refused.status_code == 400 and "gold" in refused.json()["error"]["message"]

    cluster.api.patch("v1", "ConfigMap", "default", "engine-policy", {"data": {"policy.yaml": GOLD_POLICY}})
    wait_for(
        lambda: (volume / "policy.yaml").read_text() == GOLD_POLICY, what="the new policy file", timeout=10
    )
    # The engine re-reads the file about once a second; then the class exists.
    wait_for(
        lambda: completion(cluster.http, url, "gold").status_code == 200,
        what="the engine to accept priority gold",
        timeout=15,
    )
    assert get_pod(cluster.api, "engine")["status"]["containerStatuses"][0]["restartCount"] == 0


def test_service_proxy_forwards_chat_completions_to_the_engine(
    cluster: Cluster, engine: dict[str, Any]
) -> None:
    api = cluster.api
    api.create(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "chat"},
            "spec": {
                "selector": {"app": "engine"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
            },
        }
    )

    def published() -> int | None:
        service = api.get("v1", "Service", "default", "chat") or {}
        ingress = ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
        return ingress[0]["ports"][0]["port"] if ingress else None

    port = wait_for(published, what="the Service's published address", timeout=10)
    assert cluster.proxy.address("default", "chat") == ("127.0.0.1", port)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    reply = cluster.http.post(url, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["role"] == "assistant"

    with cluster.http.stream("POST", url, json={**body, "stream": True}) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line for line in stream.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    api.delete("v1", "Service", "default", "chat")


def test_deleting_the_engine_pod_runs_prestop_then_sigterm(cluster: Cluster, engine: dict[str, Any]) -> None:
    api, kubelet = cluster.api, cluster.kubelet
    url = f"http://{engine['status']['podIP']}:8000"
    pid = int(container(get_pod(api, "engine"))["containerID"].removeprefix("process://"))
    marker = kubelet.pod_dir("default", "engine") / "volumes" / "scratch" / "stop"
    api.delete("v1", "Pod", "default", "engine")
    assert get_pod(api, "engine")["metadata"]["deletionTimestamp"]  # graceful: the pod stays for now
    wait_for(marker.exists, what="the preStop hook", timeout=10)
    # The hook runs before SIGTERM: the engine still answers while it sleeps.
    assert cluster.http.get(f"{url}/health").status_code == 200
    wait_for(
        lambda: api.get("v1", "Pod", "default", "engine") is None, what="the pod to be deleted", timeout=30
    )

    def gone() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False

    wait_for(gone, what="the engine process to exit", timeout=5)
    log = kubelet.log_path("default", "engine", "engine").read_text()
    assert "Finished server process" in log  # a graceful shutdown, not a SIGKILL


# -- restarts, images, mounts ---------------------------------------------------------------------------


def test_crashing_container_backs_off_and_reports_its_last_log_lines(cluster: Cluster) -> None:
    api = cluster.api
    pod = engine_pod("crash")
    pod["metadata"]["labels"] = {"app": "crash"}
    engine_container = pod["spec"]["containers"][0]
    engine_container["args"] = ["--model=/nonexistent", "--host=0.0.0.0", "--port=8000", "--device=cpu"]
    for key in ("readinessProbe", "livenessProbe", "lifecycle"):
        del engine_container[key]
    engine_container["volumeMounts"] = []
    pod["spec"]["volumes"] = []
    api.create(pod)
    seen_backoff = []

    def restarted_twice() -> dict[str, Any] | None:
        status = container(get_pod(api, "crash"))
        if (status.get("state") or {}).get("waiting", {}).get("reason") == "CrashLoopBackOff":
            seen_backoff.append(status)
        return status if status.get("restartCount", 0) >= 2 else None

    status = wait_for(restarted_twice, what="two restarts", timeout=60)
    assert seen_backoff, "never saw the container waiting in CrashLoopBackOff"
    assert "back-off" in seen_backoff[-1]["state"]["waiting"]["message"]
    terminated = status["lastState"]["terminated"]
    assert terminated["exitCode"] == 1 and terminated["reason"] == "Error"
    assert "/nonexistent/config.json not found" in terminated["message"]
    assert len(terminated["message"]) <= 2048
    # As in Kubernetes, a pod whose container keeps restarting is still Running.
    assert get_pod(api, "crash")["status"]["phase"] == "Running"
    delete_and_wait(api, "crash")


def test_failing_liveness_probe_restarts_the_container(cluster: Cluster, tmp_path: Path) -> None:
    api = cluster.api
    (tmp_path / "healthz").write_text("ok")
    command = ["python", "-m", "http.server", "--bind", "0.0.0.0", "--directory", "/srv", "8081"]
    pod = python_pod("live", command, volumes=[{"name": "srv", "hostPath": {"path": str(tmp_path)}}])
    pod["spec"]["containers"][0].update(
        volumeMounts=[{"name": "srv", "mountPath": "/srv"}],
        livenessProbe={
            "httpGet": {"path": "/healthz", "port": 8081},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
    )
    api.create(pod)
    wait_for(lambda: container(get_pod(api, "live")).get("ready"), what="the server to answer")
    (tmp_path / "healthz").unlink()
    status = container(wait_for_pod(api, "live", "a restart", lambda p: container(p)["restartCount"]))
    (tmp_path / "healthz").write_text("ok")
    assert status["lastState"]["terminated"]["exitCode"] == 128 + 15  # stopped by SIGTERM
    events = api.list("v1", "Event", "default", field_selector="involvedObject.name=live")
    assert any(e["reason"] == "Killing" and "liveness" in e["message"] for e in events), events
    assert any(e["reason"] == "Unhealthy" and "404" in e["message"] for e in events), events
    delete_and_wait(api, "live")


def test_startup_probe_gates_readiness(cluster: Cluster, tmp_path: Path) -> None:
    api = cluster.api
    command = ["python", "-m", "http.server", "--bind", "0.0.0.0", "--directory", "/srv", "8082"]
    pod = python_pod("slow", command, volumes=[{"name": "srv", "hostPath": {"path": str(tmp_path)}}])
    pod["spec"]["containers"][0].update(
        volumeMounts=[{"name": "srv", "mountPath": "/srv"}],
        startupProbe={
            "httpGet": {"path": "/started", "port": 8082},
            "periodSeconds": 1,
            "failureThreshold": 60,
        },
        readinessProbe={"exec": {"command": ["test", "-f", "/srv/ready"]}, "periodSeconds": 1},
        livenessProbe={"tcpSocket": {"port": 8082}, "periodSeconds": 1},
    )
    api.create(pod)

    def startup_failed() -> bool:
        events = api.list("v1", "Event", "default", field_selector="involvedObject.name=slow")
        return any("Startup probe failed" in e["message"] for e in events)

    wait_for(startup_failed, what="a failed startup probe")
    status = container(get_pod(api, "slow"))
    assert "running" in status["state"] and not status["started"] and not status["ready"]
    (tmp_path / "started").write_text("")
    status = container(wait_for_pod(api, "slow", "started", lambda p: container(p)["started"]))
    assert not status["ready"]  # the exec readiness probe still fails
    (tmp_path / "ready").write_text("")
    pod = wait_for_pod(api, "slow", "Ready", is_ready)
    assert container(pod)["restartCount"] == 0
    delete_and_wait(api, "slow")


# Each exec probe below appends the time it ran to a file of its own, for the test to read.
RECORD = ["sh", "-c", 'date +%s.%N >> "$1"', "sh"]


def probe_times(path: Path) -> list[float]:
    return [float(line) for line in path.read_text().split()] if path.exists() else []


def srv_pod(name: str, tmp_path: Path, script: str, *args: str, **spec: Any) -> dict[str, Any]:
    """A pod whose container runs `sh -c script sh args...` with `tmp_path` mounted at /srv."""
    pod = python_pod(
        name,
        ["sh", "-c", script, "sh", *args],
        volumes=[{"name": "srv", "hostPath": {"path": str(tmp_path)}}],
        **spec,
    )
    pod["spec"]["containers"][0]["volumeMounts"] = [{"name": "srv", "mountPath": "/srv"}]
    return pod


def test_first_startup_and_liveness_probes_wait_for_the_probe_period(
    cluster: Cluster, tmp_path: Path
) -> None:
    """As the kubelet's prober (pkg/kubelet/prober/worker.go `run`/`doProbe`): each probe has a worker from
    the pod's first sync, ticking every periodSeconds; the tick as the worker starts finds no container
    yet, so a new pod's container is first probed about one period after it started, not as it starts."""
    api, period = cluster.api, 2
    # A worker started within a period of the kubelet's own start first waits a random part of a period.
    time.sleep(max(0.0, cluster.started + period - time.monotonic()))
    pod = srv_pod("ticker", tmp_path, 'date +%s.%N > "$1"; exec sleep 600', "/srv/start")
    pod["spec"]["containers"][0].update(
        startupProbe={"exec": {"command": [*RECORD, "/srv/startup"]}, "periodSeconds": period},
        livenessProbe={"exec": {"command": [*RECORD, "/srv/liveness"]}, "periodSeconds": period},
    )
    api.create(pod)
    wait_for(lambda: probe_times(tmp_path / "liveness"), what="a liveness probe", timeout=15)
    start = probe_times(tmp_path / "start")[0]
    startup, liveness = probe_times(tmp_path / "startup")[0], probe_times(tmp_path / "liveness")[0]
    assert startup - start >= period / 2, f"first startup probe {startup - start:.2f} s after the start"
    assert liveness - start >= period / 2, f"first liveness probe {liveness - start:.2f} s after the start"
    assert is_ready(get_pod(api, "ticker"))
    delete_and_wait(api, "ticker")


def test_initial_delay_counts_from_the_containers_start(cluster: Cluster, tmp_path: Path) -> None:
    """worker.go `doProbe` skips a probe while the whole seconds since the container's `startedAt` are fewer
    than initialDelaySeconds: the delay runs from the container's start, also while a startup probe still
    gates the other probes, not from the startup probe's success."""
    api, delay = cluster.api, 5
    script = 'date +%s.%N > "$1"; sleep 4; touch "$2"; exec sleep 600'
    pod = srv_pod("delayed", tmp_path, script, "/srv/start", "/srv/started")
    pod["spec"]["containers"][0].update(
        startupProbe={"exec": {"command": ["test", "-f", "/srv/started"]}, "periodSeconds": 1},
        readinessProbe={
            "exec": {"command": [*RECORD, "/srv/readiness"]},
            "periodSeconds": 1,
            "initialDelaySeconds": delay,
        },
    )
    pod["spec"]["containers"][0]["startupProbe"]["failureThreshold"] = 30
    api.create(pod)
    wait_for(lambda: probe_times(tmp_path / "readiness"), what="a readiness probe", timeout=20)
    first = probe_times(tmp_path / "readiness")[0] - probe_times(tmp_path / "start")[0]
    # Counted from the startup probe's success (about 4 s in) it would come at 9 s or later.
    assert delay <= first < delay + 3.5, f"first readiness probe {first:.2f} s after the container started"
    delete_and_wait(api, "delayed")


# Exits 0 soon after SIGTERM (the signal reaches the whole process group, so the `sleep` ends too).
EXIT_0_ON_SIGTERM = 'trap "exit 0" TERM; while :; do sleep 0.1; done'


def test_a_liveness_kill_restarts_the_container_under_on_failure_whatever_its_exit_code(
    cluster: Cluster, tmp_path: Path
) -> None:
    """kuberuntime_manager.go `computePodActions`: a container failing its liveness probe is killed and, when
    the restart policy is not Never (`shouldRestartOnFailure`), started again in the same sync, even if
    it exits 0 on SIGTERM under restartPolicy OnFailure."""
    api = cluster.api
    pod = srv_pod("onfailure", tmp_path, EXIT_0_ON_SIGTERM, restartPolicy="OnFailure")
    pod["spec"]["containers"][0]["livenessProbe"] = {
        "exec": {"command": ["false"]},
        "periodSeconds": 1,
        "failureThreshold": 1,
    }
    api.create(pod)

    def restarted_or_ended(p: dict[str, Any]) -> bool:
        status = container(p)
        return bool(status.get("restartCount")) or "terminated" in status.get("state", {})

    status = container(wait_for_pod(api, "onfailure", "a restart or an end", restarted_or_ended))
    assert status["restartCount"] >= 1, status
    assert status["lastState"]["terminated"]["exitCode"] == 0
    events = api.list("v1", "Event", "default", field_selector="involvedObject.name=onfailure")
    messages = {e["message"] for e in events if e["reason"] == "Killing"}
    assert "Container main failed liveness probe, will be restarted" in messages, messages
    delete_and_wait(api, "onfailure")


def test_a_liveness_kill_under_never_stops_the_pod_with_at_least_two_seconds_after_sigterm(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Under restartPolicy Never a single container failing liveness leaves nothing to keep, so
    `computePodActions` kills the pod (`KillPod`): the Killing event reads `Stopping container main`, and
    `killContainer` gives the container at least `minimumGracePeriodInSeconds` (2 s) after SIGTERM even
    with terminationGracePeriodSeconds 0."""
    api = cluster.api
    pod = srv_pod(
        "never", tmp_path, EXIT_0_ON_SIGTERM, restartPolicy="Never", terminationGracePeriodSeconds=0
    )
    pod["spec"]["containers"][0]["livenessProbe"] = {
        "exec": {"command": ["false"]},
        "periodSeconds": 1,
        "failureThreshold": 1,
    }
    api.create(pod)
    pod = wait_for_pod(api, "never", "the container to end", lambda p: "terminated" in container(p)["state"])
    terminated = container(pod)["state"]["terminated"]
    assert (terminated["exitCode"], terminated["reason"]) == (0, "Completed"), terminated  # not SIGKILLed
    assert container(pod)["restartCount"] == 0
    assert wait_for_pod(api, "never", "Succeeded", lambda p: p["status"]["phase"] == "Succeeded")
    events = api.list("v1", "Event", "default", field_selector="involvedObject.name=never")
    messages = {e["message"] for e in events if e["reason"] == "Killing"}
    assert messages == {"Stopping container main"}, messages
    delete_and_wait(api, "never")


def test_unknown_image_stays_pending_with_err_image_pull(cluster: Cluster) -> None:
    api = cluster.api
    # Also: the kubelet lists again after its watch expires, and still sees new pods.
    api.compact()
    api.expire_watches()
    pod = python_pod("nginx", ["nginx"])
    pod["spec"]["containers"][0]["image"] = "docker.io/library/nginx:1.27"
    api.create(pod)
    status = container(
        wait_for_pod(api, "nginx", "waiting", lambda p: "waiting" in container(p).get("state", {}))
    )
    assert status["state"]["waiting"]["reason"] == "ErrImagePull"
    message = status["state"]["waiting"]["message"]
    assert "docker.io/library/nginx:1.27" in message and ENGINE_IMAGE in message
    assert get_pod(api, "nginx")["status"]["phase"] == "Pending"
    delete_and_wait(api, "nginx")


def test_unknown_claim_fails_the_mount(cluster: Cluster) -> None:
    api = cluster.api
    pod = python_pod("noclaim", ["python", "-c", "pass"])
    pod["spec"]["volumes"] = [{"name": "models", "persistentVolumeClaim": {"claimName": "missing"}}]
    api.create(pod)

    def failed_mount() -> list[dict[str, Any]]:
        events = api.list("v1", "Event", "default", field_selector="involvedObject.name=noclaim")
        return [e for e in events if e["reason"] == "FailedMount"]

    event = wait_for(failed_mount, what="a FailedMount event")[0]
    assert 'persistentvolumeclaim "missing" not found' in event["message"]
    pod = get_pod(api, "noclaim")
    assert pod["status"]["phase"] == "Pending"
    assert container(pod)["state"]["waiting"]["reason"] == "ContainerCreating"
    delete_and_wait(api, "noclaim")


@pytest.mark.parametrize(
    ("restart_policy", "code", "phase"),
    [("Never", 0, "Succeeded"), ("Never", 3, "Failed"), ("OnFailure", 0, "Succeeded")],
)
def test_run_to_completion_phases(cluster: Cluster, restart_policy: str, code: int, phase: str) -> None:
    api = cluster.api
    name = f"exit-{restart_policy.lower()}-{code}"
    api.create(python_pod(name, ["python", "-c", f"raise SystemExit({code})"], restartPolicy=restart_policy))
    pod = wait_for_pod(api, name, phase, lambda p: p["status"].get("phase") == phase)
    terminated = container(pod)["state"]["terminated"]
    assert terminated["exitCode"] == code
    assert terminated["reason"] == ("Completed" if code == 0 else "Error")
    assert container(pod)["restartCount"] == 0
    delete_and_wait(api, name)


def test_environment_arguments_and_paths_are_rewritten(cluster: Cluster) -> None:
    api = cluster.api
    script = "import os, sys; print(sys.argv[1:]); print(os.environ['GREETING'])"
    pod = python_pod(
        "echo",
        ["python", "-c", script, "--bind=0.0.0.0", "/data/file", "$(GREETING)"],
        restartPolicy="Never",
        volumes=[{"name": "data", "emptyDir": {}}],
    )
    pod["spec"]["containers"][0].update(
        volumeMounts=[{"name": "data", "mountPath": "/data"}],
        env=[
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "GREETING", "value": "hello-$(POD_IP)"},
        ],
    )
    api.create(pod)
    done = wait_for_pod(api, "echo", "Succeeded", lambda p: p["status"].get("phase") == "Succeeded")
    ip = done["status"]["podIP"]
    data = cluster.kubelet.pod_dir("default", "echo") / "volumes" / "data"
    argv_line, greeting = cluster.kubelet.log_path("default", "echo", "main").read_text().splitlines()
    assert argv_line == str([f"--bind={ip}", f"{data}/file", f"hello-{ip}"])
    assert greeting == f"hello-{ip}"
    delete_and_wait(api, "echo")


@pytest.mark.parametrize(("name", "automount"), [("token", None), ("no-token", False)])
def test_a_pod_reaches_the_api_server_unless_it_opts_out_of_the_service_account_token(
    cluster: Cluster, name: str, automount: bool | None
) -> None:
    script = "import os; print(os.environ.get('KUBECONFIG'))"
    extra = {} if automount is None else {"automountServiceAccountToken": automount}
    cluster.api.create(python_pod(name, ["python", "-c", script], restartPolicy="Never", **extra))
    wait_for_pod(cluster.api, name, "Succeeded", lambda p: p["status"].get("phase") == "Succeeded")
    printed = cluster.kubelet.log_path("default", name, "main").read_text().strip()
    assert printed == (str(cluster.kubelet.kubeconfig) if automount is None else "None")
    delete_and_wait(cluster.api, name)


def pod_table_status(cluster: Cluster, name: str) -> str:
    """The STATUS column of `kubectl get pod NAME`, as the API server prints it."""
    table = cluster.http.get(
        f"{cluster.api.url}/api/v1/namespaces/default/pods/{name}",
        headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
    ).json()
    columns = [c["name"] for c in table["columnDefinitions"]]
    return str(table["rows"][0]["cells"][columns.index("Status")])


def test_init_containers_run_in_order_to_completion_before_the_containers(cluster: Cluster) -> None:
    api = cluster.api
    step = "import pathlib, sys, time; d = pathlib.Path('/work'); "
    first = step + "time.sleep(1); (d / 'first').write_text('1')"
    # The second sees the first's file: it started only after the first exited 0.
    second = step + "assert (d / 'first').exists(); (d / 'second').write_text('2')"
    main = step + "assert (d / 'second').exists(); print('initialized'); time.sleep(60)"
    pod = python_pod("inits", ["python", "-c", main], volumes=[{"name": "work", "emptyDir": {}}])
    mount = [{"name": "work", "mountPath": "/work"}]
    pod["spec"]["containers"][0]["volumeMounts"] = mount
    pod["spec"]["initContainers"] = [
        {"name": "first", "image": PYTHON_IMAGE, "command": ["python", "-c", first], "volumeMounts": mount},
        {"name": "second", "image": PYTHON_IMAGE, "command": ["python", "-c", second], "volumeMounts": mount},
    ]
    api.create(pod)
    running_first = wait_for_pod(
        api,
        "inits",
        "the first init container running",
        lambda p: "running" in ((p["status"].get("initContainerStatuses") or [{}])[0].get("state") or {}),
    )
    status = running_first["status"]
    assert status["phase"] == "Pending"
    initialized = next(c for c in status["conditions"] if c["type"] == "Initialized")
    assert (initialized["status"], initialized["reason"]) == ("False", "ContainersNotInitialized")
    assert initialized["message"] == "containers with incomplete status: [first second]"
    assert status["initContainerStatuses"][1]["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert container(running_first)["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert pod_table_status(cluster, "inits") == "Init:0/2"
    done = wait_for_pod(api, "inits", "Running", lambda p: p["status"].get("phase") == "Running")
    for init in done["status"]["initContainerStatuses"]:
        assert (
            init["state"]["terminated"]["exitCode"] == 0
            and init["state"]["terminated"]["reason"] == "Completed"
        )
        assert init["ready"] is True and init["restartCount"] == 0
    assert next(c for c in done["status"]["conditions"] if c["type"] == "Initialized")["status"] == "True"
    wait_for(
        lambda: "initialized" in cluster.kubelet.log_path("default", "inits", "main").read_text(),
        what="main ran",
    )
    assert pod_table_status(cluster, "inits") == "Running"
    delete_and_wait(api, "inits")


def test_a_failing_init_container_backs_off_and_the_containers_never_start(cluster: Cluster) -> None:
    api = cluster.api
    pod = python_pod("initfail", ["python", "-c", "print('main ran')"])
    fail = "import sys; print('fatal: no model here'); sys.exit(3)"
    pod["spec"]["initContainers"] = [
        {
            "name": "fetch",
            "image": PYTHON_IMAGE,
            "command": ["python", "-c", fail],
            "terminationMessagePolicy": "FallbackToLogsOnError",
        }
    ]
    api.create(pod)
    seen: list[str] = []

    def backing_off() -> dict[str, Any] | None:
        pod_now = get_pod(api, "initfail")
        seen.append(pod_table_status(cluster, "initfail"))
        init = (pod_now["status"].get("initContainerStatuses") or [{}])[0]
        waiting = (init.get("state") or {}).get("waiting") or {}
        return (
            init if waiting.get("reason") == "CrashLoopBackOff" and init.get("restartCount", 0) >= 2 else None
        )

    init = wait_for(backing_off, what="the init container in CrashLoopBackOff", timeout=60)
    assert "Init:CrashLoopBackOff" in seen
    last = init["lastState"]["terminated"]
    assert last["exitCode"] == 3 and last["reason"] == "Error" and "fatal: no model here" in last["message"]
    now = get_pod(api, "initfail")
    assert now["status"]["phase"] == "Pending"
    assert container(now)["state"] == {"waiting": {"reason": "PodInitializing"}}
    assert not cluster.kubelet.log_path("default", "initfail", "main").exists()
    delete_and_wait(api, "initfail")

    # Under restartPolicy Never a failed init container fails the pod.
    never = python_pod("initnever", ["python", "-c", "print('main ran')"], restartPolicy="Never")
    never["spec"]["initContainers"] = [
        {"name": "fetch", "image": PYTHON_IMAGE, "command": ["python", "-c", fail]}
    ]
    api.create(never)
    failed = wait_for_pod(api, "initnever", "Failed", lambda p: p["status"].get("phase") == "Failed")
    assert failed["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 3
    assert pod_table_status(cluster, "initnever") == "Init:Error"
    delete_and_wait(api, "initnever")


def test_secrets_reach_the_environment_and_a_missing_one_is_a_config_error(cluster: Cluster) -> None:
    api = cluster.api
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "creds", "namespace": "default"},
        "data": {
            "HF_TOKEN": base64.b64encode(b"hf_secret").decode(),
            "user": base64.b64encode(b"ember").decode(),
        },
    }
    api.create(secret)
    script = "import os; print(os.environ['HF_TOKEN'], os.environ['WHO'])"
    pod = python_pod("secretenv", ["python", "-c", script], restartPolicy="Never")
    pod["spec"]["containers"][0].update(
        envFrom=[{"secretRef": {"name": "creds"}}],
        env=[{"name": "WHO", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "user"}}}],
    )
    api.create(pod)
    wait_for_pod(api, "secretenv", "Succeeded", lambda p: p["status"].get("phase") == "Succeeded")
    assert cluster.kubelet.log_path("default", "secretenv", "main").read_text().strip() == "hf_secret ember"
    delete_and_wait(api, "secretenv")

    for name, env, message in (
        ("nosecret", {"envFrom": [{"secretRef": {"name": "absent"}}]}, 'secret "absent" not found'),
        (
            "nokey",
            {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "nope"}}}]},
            "couldn't find key nope in Secret default/creds",
        ),
    ):
        bad = python_pod(name, ["python", "-c", "pass"])
        bad["spec"]["containers"][0].update(env)
        api.create(bad)
        waiting = wait_for_pod(
            api,
            name,
            "CreateContainerConfigError",
            lambda p: (
                ((container(p).get("state") or {}).get("waiting") or {}).get("reason")
                == "CreateContainerConfigError"
            ),
        )
        assert container(waiting)["state"]["waiting"]["message"] == message
        delete_and_wait(api, name)


def test_a_pods_dns_name_resolves_to_its_address_in_another_pods_arguments(cluster: Cluster) -> None:
    # What cluster DNS does for a pod with hostname and subdomain (a headless Service's pod).
    api = cluster.api
    api.create(python_pod("leader", ["sleep", "600"], hostname="leader-0", subdomain="group"))
    leader = wait_for_pod(api, "leader", "an address", lambda p: p["status"].get("podIP"))
    script = "import os, sys; print(sys.argv[1:]); print(os.environ['LEADER'])"
    names = ["--addr=leader-0.group.default", "leader-0.group.default.svc:29500", "other-0.group.default"]
    pod = python_pod("follower", ["python", "-c", script, *names], restartPolicy="Never")
    pod["spec"]["containers"][0]["env"] = [
        {"name": "LEADER", "value": "leader-0.group.default.svc.cluster.local"}
    ]
    api.create(pod)
    wait_for_pod(api, "follower", "Succeeded", lambda p: p["status"].get("phase") == "Succeeded")
    ip = leader["status"]["podIP"]
    argv_line, env_line = cluster.kubelet.log_path("default", "follower", "main").read_text().splitlines()
    assert argv_line == str([f"--addr={ip}", f"{ip}:29500", "other-0.group.default"])  # no such pod: kept
    assert env_line == ip
    delete_and_wait(api, "follower")
    delete_and_wait(api, "leader")


def test_stop_kills_every_process(tmp_path: Path) -> None:
    with APIServer(pod_graceful_deletion=True) as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        kubelet = ProcessKubelet(kubeconfig, tmp_path / "state", images=IMAGES, ip_prefix="127.2.")
        with Scheduler(kubeconfig), kubelet:
            api.create(python_pod("sleeper", ["sleep", "600"]))
            status = container(wait_for_pod(api, "sleeper", "ready", lambda p: container(p).get("ready")))
            assert get_pod(api, "sleeper")["status"]["podIP"] == "127.2.0.1"
        pid = int(status["containerID"].removeprefix("process://"))
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_nodes_lease_renewals_never_meet_each_others_writes(tmp_path: Path) -> None:
    """A node's lease is renewed by the renewal loop and, as the node comes back (`start_node`), at once;
    each reads the Lease and replaces it, so two at a time gave the later replace 409 Conflict, and a node
    could not come back. As the kubelet's single lease controller per node, a node's renewals go one at a
    time."""
    with APIServer() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        kubelet = ProcessKubelet(kubeconfig, tmp_path / "state", images=IMAGES, ip_prefix="127.2.")
        with kubelet:
            (node,) = kubelet.nodes
            wait_for(lambda: api.get("coordination.k8s.io/v1", "Lease", "kube-node-lease", node))
            before = api.get("coordination.k8s.io/v1", "Lease", "kube-node-lease", node)

            async def renew_together() -> list[Any]:
                renewals = (renew_lease(kubelet, node) for _ in range(4))
                return await asyncio.gather(*renewals, return_exceptions=True)

            failed = [r for r in kubelet._runtime.run(renew_together(), timeout=30) if r is not None]
            after = api.get("coordination.k8s.io/v1", "Lease", "kube-node-lease", node)
    assert failed == []
    assert before is not None and after is not None
    assert after["spec"]["renewTime"] > before["spec"]["renewTime"]


def test_write_atomically_swaps_the_whole_directory(tmp_path: Path) -> None:
    target = tmp_path / "volume"
    assert write_atomically(target, {"a.yaml": b"1", "dir/b.yaml": b"2"})
    first = os.readlink(target / "..data")
    assert (target / "a.yaml").read_bytes() == b"1" and (target / "dir" / "b.yaml").read_bytes() == b"2"
    assert not write_atomically(target, {"a.yaml": b"1", "dir/b.yaml": b"2"})  # unchanged: untouched
    assert write_atomically(target, {"a.yaml": b"3"})
    assert os.readlink(target / "..data") != first and not (target / first).exists()
    assert (target / "a.yaml").read_bytes() == b"3" and not (target / "dir").exists()
    with pytest.raises(ValueError):
        write_atomically(target, {"../escape": b""})


def test_crash_loop_back_off_is_the_kubelets_by_default(tmp_path: Path) -> None:
    """As the kubelet (pkg/kubelet: backOffPeriod 10 s, MaxContainerBackOff 300 s): the first exit restarts
    at once, the second waits 10 s, reported as `back-off 10s restarting failed container=...`."""
    with APIServer() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        kubelet = ProcessKubelet(kubeconfig, tmp_path / "state", images=IMAGES, ip_prefix="127.2.")
        assert (kubelet.backoff_initial, kubelet.backoff_max) == (10.0, 300.0)
        with Scheduler(kubeconfig), kubelet:
            uid = api.create(python_pod("crasher", ["python3", "-c", "raise SystemExit(3)"]))["metadata"][
                "uid"
            ]

            def backing_off() -> dict[str, Any] | None:
                status = container(get_pod(api, "crasher"))
                return (
                    status if status["state"].get("waiting", {}).get("reason") == "CrashLoopBackOff" else None
                )

            status = wait_for(backing_off, what="the container in CrashLoopBackOff")
            assert status["restartCount"] == 1
            assert status["state"]["waiting"]["message"] == (
                f"back-off 10s restarting failed container=main pod=crasher_default({uid})"
            )


def test_a_path_after_a_name_is_rewritten_as_after_a_flag() -> None:
    from ember_localcluster.kubelet.podvolumes import _Rewriter

    rewrite = _Rewriter(
        "10.1.0.5", [("/model-cache", Path("/host/cache")), ("/models", Path("/host/models"))]
    )
    assert rewrite("--model=/models/tiny") == "--model=/host/models/tiny"
    assert rewrite("org/sql=/model-cache/hf/x/main") == "org/sql=/host/cache/hf/x/main"  # --lora-modules
    assert rewrite("chat=/models/chat") == "chat=/host/models/chat"
    for kept in ("chat=/elsewhere/x", "/other/a=/models/x", "a=b=/models/x", "=/models/x"):
        assert rewrite(kept) == kept
