"""The local control plane for the end-to-end scenarios, and what they use to drive and observe it.

`ControlPlane` runs the in-process API server (graceful pod deletion on, `pods/log` served from the
kubelet's files), the deployment and replicaset controllers, the scheduler, the process kubelet (one node; engine pods become real `ember serve`
processes; the claim `model-weights` maps to a directory holding the tiny test checkpoint as `tiny`), the service proxy (each Service gets a local address in its load-balancer status) and
the operator under kopf's `KopfRunner`, which can be stopped and started again. The helpers read pods and
InferenceServices, send OpenAI requests through a Service's published address and generate load.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import kopf
import kubernetes
import plainhttp
import pytest
from kopf.testing import KopfRunner
from operator_harness import crd_manifest
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.deployment_controller import DeploymentController
from ember_localcluster.kubelet.kubelet import ProcessKubelet
from ember_localcluster.kubelet.node import NodeConfig
from ember_localcluster.leaderworkerset import crd_manifest as lws_crd_manifest
from ember_localcluster.leaderworkerset_controller import LeaderWorkerSetController
from ember_localcluster.proxy import ServiceProxy
from ember_localcluster.scheduler import Scheduler
from ember_operator import main as operator_main
from ember_operator.desired import HASH_LABEL, ROLE_LABEL
from ember_operator.handlers import Settings, register
from ember_operator.spec import GROUP, PLURAL, VERSION

API_VERSION = f"{GROUP}/{VERSION}"
NAMESPACE = "default"
MODEL_CLAIM = "model-weights"
MODEL = "tiny"  # the checkpoint directory's name under the claim, and the model name clients send
TICK = 0.25
ENGINE_PORT = 8000


class Operator:
    """The real operator (its handlers, in a registry of its own) under `KopfRunner`; restartable."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url
        self.runner: KopfRunner | None = None
        self.starts = 0

    def start(self) -> None:
        assert self.runner is None, "the operator is already running"
        registry = kopf.OperatorRegistry()
        register(registry, Settings(tick=TICK, scrape_timeout=1.0))
        url = self.api_url

        @kopf.on.login(registry=registry)
        def login(**_: object) -> kopf.ConnectionInfo:
            return kopf.ConnectionInfo(server=url, insecure=True, default_namespace=NAMESPACE)

        parser = argparse.ArgumentParser()
        operator_main.add_arguments(parser)
        settings = operator_main.operator_settings(parser.parse_args(["--tick", str(TICK)]))
        settings.background.cancellation_polling = 0.25
        settings.watching.server_timeout = 10
        # `kopf run` makes the registry it is given the process-wide default: put the old one back on stop.
        self._default_registry = kopf.get_default_registry()
        self.runner = KopfRunner(
            ["run", "--standalone", "--namespace", NAMESPACE],
            registry=registry,
            settings=settings,
            timeout=30,
        )
        self.runner.__enter__()
        self.starts += 1

    def stop(self) -> None:
        runner, self.runner = self.runner, None
        if runner is None:
            return
        try:
            runner.__exit__(None, None, None)
        finally:
            kopf.set_default_registry(self._default_registry)
        assert runner.exception is None, f"the operator failed: {runner.output[-3000:]}"


@dataclass
class ControlPlane:
    api: APIServer
    kubelet: ProcessKubelet
    proxy: ServiceProxy
    scheduler: Scheduler
    operator: Operator
    kubeconfig: Path
    models: Path  # the directory the claim `model-weights` maps to
    custom: Any = field(init=False)

    def __post_init__(self) -> None:
        self.custom = kubernetes.client.CustomObjectsApi(
            kubernetes.config.new_client_from_config(str(self.kubeconfig))
        )

    # -- InferenceServices -----------------------------------------------------------------------------

    def create(self, name: str, **spec: Any) -> None:
        self.custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, manifest(name, **spec))

    def patch_spec(self, name: str, spec: dict[str, Any]) -> None:
        self.custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": spec})

    def delete(self, name: str) -> None:
        with contextlib.suppress(kubernetes.client.ApiException):
            self.custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)

    def eis(self, name: str) -> dict[str, Any] | None:
        return self.api.get(API_VERSION, "InferenceService", NAMESPACE, name)

    def status(self, name: str) -> dict[str, Any]:
        return (self.eis(name) or {}).get("status") or {}

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        for c in self.status(name).get("conditions") or []:
            if c["type"] == kind:
                return dict(c)
        return {}

    def is_true(self, name: str, kind: str) -> bool:
        return self.condition(name, kind).get("status") == "True"

    # -- pods ------------------------------------------------------------------------------------------

    def pods(self, name: str, role: str | None = None, *, deleting: bool = False) -> list[dict[str, Any]]:
        """The InferenceService's pods (by role), without the terminating ones unless `deleting`."""
        selector = f"app.kubernetes.io/instance={name}" + (f",{ROLE_LABEL}={role}" if role else "")
        return [
            p
            for p in self.api.list("v1", "Pod", NAMESPACE, label_selector=selector)
            if deleting or not p["metadata"].get("deletionTimestamp")
        ]

    def pod(self, pod_name: str) -> dict[str, Any] | None:
        return self.api.get("v1", "Pod", NAMESPACE, pod_name)

    def shape(self, name: str) -> tuple[int, int]:
        """(Ready active pods, Ready warm pods)."""
        return (
            sum(ready(p) for p in self.pods(name, "active")),
            sum(ready(p) for p in self.pods(name, "warm")),
        )

    def converged(self, name: str, active: int, warm: int) -> bool:
        obj = self.eis(name)
        if obj is None:
            return False
        s = obj.get("status") or {}
        return (
            self.shape(name) == (active, warm)
            and len(self.pods(name, deleting=True)) == active + warm
            and s.get("observedGeneration") == obj["metadata"]["generation"]
            and self.is_true(name, "Ready")
            and self.condition(name, "Reconciling").get("status") == "False"
            and bool(self.service_url(name))
        )

    def wait_converged(self, name: str, active: int, warm: int, timeout: float = 90) -> None:
        try:
            wait_for(
                lambda: self.converged(name, active, warm),
                timeout=timeout,
                what=f"{name}: {active} active + {warm} warm pods Ready, Ready=True, Reconciling=False and "
                "an address published",
            )
        except AssertionError as e:
            raise AssertionError(f"{e}\nnow: {self.describe(name)}") from None

    def describe(self, name: str) -> str:
        """Pods, conditions and the last autoscaler decisions, for failure messages."""
        s = self.status(name)
        conditions = {
            c["type"]: f"{c['status']} ({c.get('reason')}: {c.get('message')})"
            for c in s.get("conditions") or []
        }
        decisions = ((s.get("autoscaler") or {}).get("decisions") or [])[-3:]
        return (
            f"pods: {self.describe_pods(name)}; desiredReplicas: {s.get('desiredReplicas')}; "
            f"conditions: {conditions}; last decisions: {decisions}"
        )

    def describe_pods(self, name: str) -> str:
        out = []
        for p in self.pods(name, deleting=True):
            labels = p["metadata"].get("labels") or {}
            out.append(
                f"{p['metadata']['name']}[{labels.get(ROLE_LABEL)},{labels.get(HASH_LABEL)},"
                f"ready={ready(p)},deleting={bool(p['metadata'].get('deletionTimestamp'))}]"
            )
        return " ".join(out) or "none"

    def engine_pids(self, name: str) -> set[int]:
        return {pid for p in self.pods(name, deleting=True) if (pid := container_pid(p)) is not None}

    def engine_log(self, pod_name: str) -> str:
        path = self.kubelet.log_path(NAMESPACE, pod_name, "engine")
        return path.read_text(errors="replace") if path.exists() else ""

    def policy_file(self, pod_name: str) -> str:
        """The policy file the kubelet materialised for a pod from its ConfigMap volume."""
        path = self.kubelet.pod_dir(NAMESPACE, pod_name) / "volumes" / "policy" / "policy.yaml"
        return path.read_text() if path.exists() else ""

    # -- the Service -----------------------------------------------------------------------------------

    def service_url(self, name: str) -> str | None:
        """http://ip:port from the Service's status.loadBalancer.ingress[0], as the proxy publishes it."""
        svc = self.api.get("v1", "Service", NAMESPACE, name)
        ingress = ((svc or {}).get("status") or {}).get("loadBalancer", {}).get("ingress") or []
        if not ingress or not ingress[0].get("ports"):
            return None
        return f"http://{ingress[0]['ip']}:{ingress[0]['ports'][0]['port']}"

    def url(self, name: str) -> str:
        url = self.service_url(name)
        assert url, f"the Service {name} has no published load-balancer address"
        return url

    def remove(self, *names: str, timeout: float = 60) -> None:
        """Delete InferenceServices and wait until their pods and engine processes are gone."""
        pids = set().union(*(self.engine_pids(n) for n in names))
        for n in names:
            self.delete(n)
        wait_for(
            lambda: (
                all(self.eis(n) is None and not self.pods(n, deleting=True) for n in names)
                and not any(alive(pid) for pid in pids)
            ),
            timeout=timeout,
            what=f"{', '.join(names)} and their pods and engine processes gone",
        )


@contextlib.contextmanager
def control_plane(
    root: Path, tiny_model: Path, nodes: list[NodeConfig] | None = None, leaderworkersets: bool = False
) -> Iterator[ControlPlane]:
    """`nodes`: the kubelet's (default: one); `leaderworkersets`: serve that API and run its controller."""
    models = root / "models"
    models.mkdir()
    (models / MODEL).symlink_to(tiny_model)
    mp = pytest.MonkeyPatch()
    with APIServer(pod_graceful_deletion=True, bookmark_interval=1.0) as api:
        kubeconfig = api.write_kubeconfig(root / "kubeconfig")
        # The operator's client reads $KUBECONFIG when it first connects.
        mp.setenv("KUBECONFIG", str(kubeconfig))
        api.install_crd(crd_manifest())
        lws = None
        if leaderworkersets:
            api.install_crd(lws_crd_manifest())
            lws = LeaderWorkerSetController(kubeconfig).start()
        deployments = DeploymentController(kubeconfig).start()
        scheduler = Scheduler(kubeconfig).start()
        # Crash loops quicker than the kubelet's 10 s doubling to 300 s, so they show in seconds.
        kubelet = ProcessKubelet(
            kubeconfig,
            root / "kubelet",
            claims={MODEL_CLAIM: models},
            nodes=nodes,
            backoff_initial=1.0,
            backoff_max=10.0,
        ).start()
        api.attach_kubelet(kubelet.node_names, kubelet.pods_dir)
        proxy = ServiceProxy(kubeconfig).start()
        operator = Operator(api.url)
        try:
            operator.start()
            yield ControlPlane(api, kubelet, proxy, scheduler, operator, kubeconfig, models)
        finally:
            try:
                operator.stop()
            finally:
                if lws is not None:
                    lws.stop()
                proxy.stop()
                kubelet.stop()
                scheduler.stop()
                deployments.stop()
                mp.undo()


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    """An InferenceService on the tiny checkpoint, on the CPU; `spec` adds or replaces top-level fields.
    The Service selects the engines directly unless the test gives `router`."""
    body: dict[str, Any] = {
        "model": {"name": MODEL, "source": f"/models/{MODEL}", "volumeClaim": MODEL_CLAIM},
        "resources": {"gpus": 0},
        "engine": {"maxNumSeqs": 2},
        "router": {"enabled": False},
    }
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def container_status(pod: dict[str, Any]) -> dict[str, Any]:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return dict(statuses[0]) if statuses else {}


def container_pid(pod: dict[str, Any]) -> int | None:
    """The engine's pid, from the kubelet's `containerID: process://<pid>`."""
    match = re.fullmatch(r"process://(\d+)", container_status(pod).get("containerID") or "")
    return int(match.group(1)) if match else None


def alive(pid: int) -> bool:
    """Whether a process runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def pod_ip(pod: dict[str, Any]) -> str:
    return str((pod.get("status") or {}).get("podIP") or "")


def pod_counter(pod: dict[str, Any], metric: str) -> float:
    """A counter summed over its labels, from the engine's own /metrics at podIP:8000."""
    text = plainhttp.get(f"http://{pod_ip(pod)}:{ENGINE_PORT}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric + "{") or line.startswith(metric + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


# -- traffic -----------------------------------------------------------------------------------------------


def completion_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True}


def fresh_client(timeout: float = 60) -> httpx.Client:
    """A client that opens a new connection per request: the proxy balances per connection. Its SSL context
    is the shared one (a client of its own would parse the CA bundle again, per request here)."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(verify=plainhttp.SSL_CONTEXT, limits=limits, timeout=timeout)


@dataclass
class Outcome:
    status: int | None  # None: no HTTP response (the error is in `error`)
    headers: dict[str, str]
    error: str = ""
    body: str = ""

    @property
    def fallback(self) -> bool:
        return self.headers.get("x-ember-served-by") == "fallback"


def complete(client: httpx.Client, base: str, max_tokens: int) -> Outcome:
    try:
        r = client.post(f"{base}/v1/completions", json=completion_body(max_tokens))
    except httpx.HTTPError as e:
        return Outcome(None, {}, f"{type(e).__name__}: {e}")
    return Outcome(r.status_code, dict(r.headers), body=r.text[:500])


def burst(base: str, n: int, max_tokens: int, timeout: float = 60) -> list[Outcome]:
    """`n` requests sent at once, each on its own connection."""
    start = threading.Barrier(n)

    def one(_: int) -> Outcome:
        with fresh_client(timeout) as client:
            start.wait()
            return complete(client, base, max_tokens)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


class Load:
    """Closed-loop clients: each sends its next request as soon as the previous one is answered."""

    def __init__(self, base: str, clients: int, max_tokens: int, timeout: float = 60) -> None:
        self.base, self.clients, self.max_tokens, self.timeout = base, clients, max_tokens, timeout
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> Load:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout + 5)

    def _run(self) -> None:
        with fresh_client(self.timeout) as client:
            while not self._stop.is_set():
                self.outcomes.append(complete(client, self.base, self.max_tokens))

    def statuses(self) -> dict[int | None, int]:
        counts: dict[int | None, int] = {}
        for o in list(self.outcomes):
            counts[o.status] = counts.get(o.status, 0) + 1
        return counts


def elapsed_since(t0: float) -> float:
    return round(time.monotonic() - t0, 2)


def say(message: str) -> None:
    """Print to the test's output. `KopfRunner` runs the operator under click's `CliRunner`, which swaps
    `sys.stdout` for its own buffer while the operator runs, so a plain print() would land there."""
    print(message, file=sys.__stdout__, flush=True)
