"""`ember dev up --prometheus`: a real Prometheus (the `prometheus` binary; Debian's package) that scrapes the
local control plane's engines, routers and operator with ember's shipped scrape jobs
(`manifests/monitoring/scrape-configs.yaml`, read as they are) and evaluates the shipped rules and alerts
(`manifests/monitoring/prometheusrule.yaml`).

Debian builds Prometheus without its Kubernetes service discovery, so each job's `kubernetes_sd_configs` is
swapped for a `file_sd_configs` whose targets this module writes from the API server, with the
`__meta_kubernetes_*` labels Prometheus's own Kubernetes discovery gives them (discovery/kubernetes: role
`pod`, one target per container port of a pod with an IP; role `endpoints`, one target per address and port
of an Endpoints object, with its Service's labels). The jobs' relabelings then run unchanged. Left out of the
meta labels: node and controller metadata, EndpointSlices, and ports-less pods' bare targets.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client, config

from ember_localcluster.informer import Informer, _key

REPOSITORY = Path(__file__).resolve().parents[2]
MONITORING = REPOSITORY / "manifests" / "monitoring"


def sanitize(name: str) -> str:
    """A Kubernetes label or annotation name as a Prometheus label name (strutil.SanitizeLabelName)."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _object_labels(prefix: str, meta: Mapping[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for kind, field in (("label", "labels"), ("annotation", "annotations")):
        for key, value in (meta.get(field) or {}).items():
            out[f"{prefix}_{kind}_{sanitize(key)}"] = str(value)
            out[f"{prefix}_{kind}present_{sanitize(key)}"] = "true"
    return out


def _ready(pod: Mapping[str, Any]) -> str:
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Ready":
            return str(c.get("status", "unknown")).lower()
    return "unknown"


def pod_groups(pods: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Role `pod`: a target per container port of each pod that has an IP."""
    groups = []
    for pod in pods:
        meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
        ip = status.get("podIP")
        if not ip:
            continue
        common = {
            "__meta_kubernetes_namespace": meta.get("namespace", ""),
            "__meta_kubernetes_pod_name": meta["name"],
            "__meta_kubernetes_pod_ip": ip,
            "__meta_kubernetes_pod_uid": meta.get("uid", ""),
            "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
            "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
            "__meta_kubernetes_pod_ready": _ready(pod),
            "__meta_kubernetes_pod_phase": status.get("phase", ""),
            **_object_labels("__meta_kubernetes_pod", meta),
        }
        kinds = (("initContainers", "true"), ("containers", "false"))
        for field, init in kinds:
            for c in spec.get(field) or []:
                for port in c.get("ports") or []:
                    number = port.get("containerPort")
                    labels = {
                        **common,
                        "__meta_kubernetes_pod_container_name": c.get("name", ""),
                        "__meta_kubernetes_pod_container_image": c.get("image", ""),
                        "__meta_kubernetes_pod_container_init": init,
                        "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                        "__meta_kubernetes_pod_container_port_number": str(number),
                        "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
                    }
                    groups.append({"targets": [f"{ip}:{number}"], "labels": labels})
    return groups


def endpoints_groups(
    endpoints: Iterable[Mapping[str, Any]], services: Mapping[tuple[str, str], Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Role `endpoints`: a target per address and port of each Endpoints object, with its Service's labels."""
    groups = []
    for ep in endpoints:
        meta = ep["metadata"]
        service = services.get(_key(ep))
        common = {
            "__meta_kubernetes_namespace": meta.get("namespace", ""),
            "__meta_kubernetes_endpoints_name": meta["name"],
            **_object_labels("__meta_kubernetes_endpoints", meta),
        }
        if service is not None:
            common["__meta_kubernetes_service_name"] = service["metadata"]["name"]
            common.update(_object_labels("__meta_kubernetes_service", service["metadata"]))
        for subset in ep.get("subsets") or []:
            addresses = [(a, "true") for a in subset.get("addresses") or []]
            addresses += [(a, "false") for a in subset.get("notReadyAddresses") or []]
            for address, ready in addresses:
                for port in subset.get("ports") or []:
                    labels = {
                        **common,
                        "__meta_kubernetes_endpoint_port_name": port.get("name", ""),
                        "__meta_kubernetes_endpoint_port_protocol": port.get("protocol", "TCP"),
                        "__meta_kubernetes_endpoint_ready": ready,
                    }
                    if address.get("hostname"):
                        labels["__meta_kubernetes_endpoint_hostname"] = address["hostname"]
                    groups.append({"targets": [f"{address['ip']}:{port['port']}"], "labels": labels})
    return groups


def shipped_rules() -> dict[str, Any]:
    """The PrometheusRule's groups as a plain rule file."""
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    return {"groups": rule["spec"]["groups"]}


def dev_config(directory: Path, scrape_interval: float) -> dict[str, Any]:
    """prometheus.yml: the shipped jobs with file-based discovery of what the API server holds."""
    jobs = yaml.safe_load((MONITORING / "scrape-configs.yaml").read_text())
    for job in jobs:
        (sd,) = job.pop("kubernetes_sd_configs")
        job["file_sd_configs"] = [
            {"files": [str(directory / f"targets-{sd['role']}.json")], "refresh_interval": "1s"}
        ]
    interval = f"{scrape_interval:g}s"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(directory / "rules.yaml")],
        "scrape_configs": jobs,
    }


class LocalPrometheus:
    """Prometheus for a local control plane: its config, its targets (kept current), its process."""

    def __init__(self, kubeconfig: Path, directory: Path, port: int, scrape_interval: float = 2.0) -> None:
        self.kubeconfig = kubeconfig
        self.dir = directory
        self.port = port
        self.scrape_interval = scrape_interval
        self.process: subprocess.Popen[bytes] | None = None
        self._objects: dict[str, dict[tuple[str, str], dict[str, Any]]] = {
            "pods": {},
            "services": {},
            "endpoints": {},
        }
        self._lock = threading.Lock()
        self._informers: list[Informer] = []
        self._api_client: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LocalPrometheus:
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError(
                "--prometheus needs the prometheus binary (Debian: apt-get install prometheus)"
            )
        if not (MONITORING / "scrape-configs.yaml").exists():
            raise RuntimeError(
                f"--prometheus reads ember's monitoring files from a checkout: {MONITORING} is missing"
            )
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "rules.yaml").write_text(yaml.safe_dump(shipped_rules(), sort_keys=False))
        (self.dir / "prometheus.yml").write_text(
            yaml.safe_dump(dev_config(self.dir, self.scrape_interval), sort_keys=False)
        )
        self._api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        core = client.CoreV1Api(self._api_client)
        for kind, call in (
            ("pods", core.list_pod_for_all_namespaces),
            ("services", core.list_service_for_all_namespaces),
            ("endpoints", core.list_endpoints_for_all_namespaces),
        ):
            informer = Informer(call, functools.partial(self._changed, kind), name=f"prometheus-{kind}")
            informer.start()
            self._informers.append(informer)
        for informer in self._informers:
            informer.synced.wait(timeout=10)
        with self._lock:
            self._write_targets()
        log = (self.dir / "prometheus.log").open("ab")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={self.dir / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                tail = (self.dir / "prometheus.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"prometheus exited with {self.process.returncode}: {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"prometheus did not become ready on {self.url}")

    def _changed(self, kind: str, event: str, obj: dict[str, Any]) -> None:
        with self._lock:
            if event == "DELETED":
                self._objects[kind].pop(_key(obj), None)
            else:
                self._objects[kind][_key(obj)] = obj
            if all(i.synced.is_set() for i in self._informers):
                self._write_targets()

    def _write_targets(self) -> None:
        files = {
            "pod": pod_groups(self._objects["pods"].values()),
            "endpoints": endpoints_groups(self._objects["endpoints"].values(), self._objects["services"]),
        }
        for role, groups in files.items():
            staged = self.dir / f"targets-{role}.json.tmp"
            staged.write_text(json.dumps(groups))
            os.replace(staged, self.dir / f"targets-{role}.json")  # Prometheus never reads half a file

    def stop(self) -> None:
        for informer in self._informers:
            informer.stop()
        self._informers = []
        if self._api_client is not None:
            self._api_client.close()
            self._api_client = None
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None
