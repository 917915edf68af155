"""A place for the real operator to run in tests: the in-process API server, the operator under kopf's
`KopfRunner`, the deployment and replicaset controllers, and a minimal pod runner standing in for a kubelet.

The pod runner gives each engine pod a loopback IP, an HTTP server on its first container port (8000 for engines, 8080 for routers)
that serves a /metrics page
whose gauges the test sets, and a Ready condition after a short start-up delay. Pods whose image is
`broken:*` crash-loop instead, and pods whose nodeSelector asks for `pool: nowhere` stay Pending as
kube-scheduler leaves a pod no node can take. It models only what the operator reads from pods; the engines themselves are
exercised end to end elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import kopf
import kubernetes
import pytest
import yaml
from kopf.testing import KopfRunner
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_localcluster.deployment_controller import DeploymentController
from ember_operator import main as operator_main

REPO = Path(__file__).resolve().parents[1]
NAMESPACE = "default"
__all__ = ["NAMESPACE", "EnginePage", "PodRunner", "crd_manifest", "operator_cluster", "wait_for"]
TICK = 0.25
RESYNC = 3.0  # the operator's 60 s, scaled down as the tick is
OPERATOR_FILE = f"""
import kopf
from ember_operator.handlers import Settings, register

kopf.on.login()(kopf.login_via_client)
register(
    kopf.get_default_registry(),
    Settings(tick={TICK}, cluster_domain="cluster.local", scrape_timeout=2.0, resync={{resync}}),
)
"""


@contextlib.contextmanager
def operator_cluster(
    tmp: Path, crd: dict[str, Any] | None = None, resync: float = RESYNC, peering: str | None = None
) -> Iterator[tuple[APIServer, PodRunner, Any]]:
    """The API server (the InferenceService CRD installed: `crd`, or the repository's), a pod runner, and
    the real operator under `KopfRunner` watching NAMESPACE (`resync`: its Settings.resync); yields (API
    server, pod runner, a CustomObjectsApi). With `peering`, the operator runs as a peering replica of
    priority 1 under that KopfPeering (made in NAMESPACE, with kopf's peering CRDs) instead of standalone."""
    mp = pytest.MonkeyPatch()
    with APIServer(pod_graceful_deletion=False, bookmark_interval=1.0) as api:
        kubeconfig = api.write_kubeconfig(tmp / "kubeconfig")
        # kopf logs in through the kubernetes client, which fixed its default path when it was imported.
        mp.setenv("KUBECONFIG", str(kubeconfig))
        mp.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        api.install_crd(crd or crd_manifest())
        if peering is not None:
            for manifest in yaml.safe_load_all((REPO / "manifests" / "peering" / "crds.yaml").read_text()):
                api.install_crd(manifest)
            api.create(
                {
                    "apiVersion": "kopf.dev/v1",
                    "kind": "KopfPeering",
                    "metadata": {"name": peering, "namespace": NAMESPACE},
                }
            )
        mode = ["--standalone"] if peering is None else ["--peering", peering, "--priority", "1"]
        runner = PodRunner(api).start()
        deployments = DeploymentController(kubeconfig).start()
        script = tmp / "operator.py"
        script.write_text(OPERATOR_FILE.replace("{resync}", str(resync)))
        parser = argparse.ArgumentParser()
        operator_main.add_arguments(parser)
        args = parser.parse_args(["--tick", str(TICK), *mode])
        settings = operator_main.operator_settings(args)
        settings.watching.server_timeout = 10
        # A registry of its own (`kopf run` makes it the process-wide default while the script loads):
        # handlers other tests' operators registered must not run here, nor these in theirs.
        previous = kopf.get_default_registry()
        with KopfRunner(
            ["run", *mode, "--namespace", NAMESPACE, str(script)],
            registry=kopf.OperatorRegistry(),
            settings=settings,
            timeout=30,
        ) as kopf_runner:
            custom = kubernetes.client.CustomObjectsApi(
                kubernetes.config.new_client_from_config(str(kubeconfig))
            )
            try:
                yield api, runner, custom
            finally:
                runner.stop()
                deployments.stop()
        kopf.set_default_registry(previous)
        mp.undo()
    assert kopf_runner.exception is None, kopf_runner.output[-3000:]


def crd_manifest() -> dict[str, Any]:
    return yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text())


@dataclass
class EnginePage:
    waiting: float = 0.0
    running: float = 0.0
    kv: float = 0.0
    fallback_served: float = 0.0
    broken: bool = False  # answer 500
    pending: float | None = None  # a router's held requests (ember_router:pending_requests)
    router_fallback_served: float | None = None  # a router's ember_router:fallback_requests{outcome="served"}
    reads: int = 0  # GET /metrics answered

    def text(self) -> str:
        if self.pending is not None or self.router_fallback_served is not None:
            return (
                f"ember_router:pending_requests {self.pending or 0.0}\n"
                f'ember_router:fallback_requests_total{{outcome="failed"}} 7.0\n'
                f'ember_router:fallback_requests_total{{outcome="served"}} {self.router_fallback_served or 0.0}\n'
            )
        return (
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {self.running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv}\n'
            f'ember:fallback_requests_total{{model_name="m",outcome="served"}} {self.fallback_served}\n'
        )


def _metrics_server(ip: str, page: EnginePage, port: int = 8000) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if page.broken or self.path != "/metrics":
                self.send_response(500 if page.broken else 404)
                self.end_headers()
                return
            body = page.text().encode()
            page.reads += 1
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer((ip, port), Handler)
    # shutdown() waits for the serving loop to notice, which polls every poll_interval (0.5 s by default):
    # stopping a runner that served a module's worth of pods one by one took half a minute.
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


# The fields a kubelet always reports for a container (the client's models require them).
_CONTAINER = {"name": "engine", "image": "engine:test", "imageID": "engine@sha256:0"}


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRunner:
    """Marks pods Running and Ready (or crash-looping) and serves their /metrics."""

    api: APIServer
    startup_seconds: float = 0.3
    pages: dict[str, EnginePage] = field(default_factory=dict)  # by pod name
    _servers: dict[str, ThreadingHTTPServer] = field(default_factory=dict)
    _ips: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    failed: set[str] = field(default_factory=set)  # pods whose engine died and stays down
    _subnet: int = field(default_factory=lambda: int(time.time() * 1000) % 200 + 20)

    def start(self) -> PodRunner:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()  # its pass may still be adding or removing servers
        for server in self._servers.values():
            server.shutdown()
            server.server_close()

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            pods = self.api.list("v1", "Pod", NAMESPACE)
            names = {p["metadata"]["name"] for p in pods}
            for gone in set(self._servers) - names:
                server = self._servers.pop(gone)
                server.shutdown()
                server.server_close()
            for pod in pods:
                with contextlib.suppress(Exception):  # the pod may vanish between list and patch
                    self._tend(pod)

    def _tend(self, pod: dict[str, Any]) -> None:
        name = pod["metadata"]["name"]
        status = pod.get("status") or {}
        if pod["metadata"].get("deletionTimestamp") or name in self.failed:
            return
        if (pod["spec"].get("nodeSelector") or {}).get("pool") == "nowhere":
            # What kube-scheduler reports for a pod no node can take.
            if not status.get("conditions"):
                message = "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
                condition = {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                    "lastTransitionTime": _stamp(datetime.now(UTC)),
                }
                self._patch_status(name, {"phase": "Pending", "conditions": [condition]})
            return
        image = pod["spec"]["containers"][0]["image"]
        if image.startswith("broken:"):
            if status.get("phase") != "Running":
                self._patch_status(name, self._crashloop_status())
            return
        if "podIP" not in status:
            n = next(self._ips)
            ip = f"127.{self._subnet}.{n // 250}.{n % 250 + 1}"
            page = self.pages.setdefault(name, EnginePage())
            ports = pod["spec"]["containers"][0].get("ports") or [{"containerPort": 8000}]
            self._servers[name] = _metrics_server(ip, page, ports[0]["containerPort"])
            self._patch_status(name, {"phase": "Running", "podIP": ip, "conditions": self._ready(False)})
            return
        created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
        if not ready and (datetime.now(UTC) - created).total_seconds() >= self.startup_seconds:
            self._patch_status(
                name,
                {
                    "conditions": self._ready(True),
                    "containerStatuses": [{**_CONTAINER, "ready": True, "restartCount": 0}],
                },
            )

    def fail(self, name: str) -> None:
        """The pod's engine process dies (SIGKILL) and its restarts keep failing: not Ready, not running."""
        self.crash_loop(name, "Error", restarts=1)

    def crash_loop(
        self, name: str, reason: str = "OOMKilled", exit_code: int = 137, restarts: int = 5
    ) -> None:
        """The pod's container has been restarted `restarts` times, each run ending as `reason`, and is in
        the kubelet's back-off: CrashLoopBackOff, not Ready."""
        self.failed.add(name)
        now = _stamp(datetime.now(UTC))
        container = {
            **_CONTAINER,
            "ready": False,
            "restartCount": restarts,
            "state": {"waiting": {"reason": "CrashLoopBackOff"}},
            "lastState": {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": now}},
        }
        self._patch_status(name, {"conditions": self._ready(False), "containerStatuses": [container]})

    @staticmethod
    def _ready(ready: bool) -> list[dict[str, Any]]:
        now = _stamp(datetime.now(UTC))
        return [
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
            {"type": "Ready", "status": str(ready), "lastTransitionTime": now},
        ]

    @staticmethod
    def _crashloop_status() -> dict[str, Any]:
        return {
            "phase": "Running",
            "conditions": PodRunner._ready(False),
            "containerStatuses": [
                {
                    **_CONTAINER,
                    "ready": False,
                    "restartCount": 5,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {
                            "exitCode": 1,
                            "message": "FileNotFoundError: /models/missing/config.json",
                        }
                    },
                }
            ],
        }

    def _patch_status(self, name: str, status: dict[str, Any]) -> None:
        self.api.patch("v1", "Pod", NAMESPACE, name, {"status": status}, subresource="status")
