"""`ember bench operator`: what the operator costs the cluster and itself at fleet size.

The run starts the local API server (in this process), a stand-in kubelet, and the operator as its own
process (`ember operator`, standalone, one namespace). It applies N InferenceServices of M active pods each
(default 20 x 50 = 1,000 pods). The pods are lightweight fakes, not engines: the stand-in kubelet gives each
a loopback IP, marks it Running and Ready, and serves on port 8000 a fixed /metrics page of the size a real
engine serves (~30 KB: the three autoscaling gauges among histogram series). Nothing changes while the fleet
idles, so every request the operator makes in the window is its cost of watching an idle fleet.

Once every pod is Ready and the operator has let a settling period pass, the run measures over a window:
API requests per second by verb and resource (counted by the API server, as kube-apiserver counts
`apiserver_request_total`), and the operator process's CPU time over the window divided by its length
(cores). Then it changes one field of several InferenceServices in turn (`requestTimeoutSeconds`, which only
the policy ConfigMap carries) and times each change until that child shows it: the reconcile latency (a
change not shown within `--latency-timeout` is reported as such).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ember_localcluster.apiserver import APIServer

NAMESPACE = "default"
GROUP_VERSION = "ember.dev/v1alpha1"


def metrics_page(index: int) -> bytes:
    """A /metrics page of a real engine's size: the gauges the autoscaler reads among histograms."""
    lines = [
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 0',
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 1',
        f'# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{{model_name="m"}} {0.1 + index % 7 / 100}',
        "# TYPE ember:fallback_requests counter",
        'ember:fallback_requests_total{model_name="m",outcome="served"} 0',
    ]
    for family in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ):
        lines.append(f"# TYPE vllm:{family} histogram")
        for le in [f"{0.001 * 2**i:g}" for i in range(28)] + ["+Inf"]:
            for phase in ("prefill", "decode", "queue", "total"):
                lines.append(f'vllm:{family}_bucket{{le="{le}",model_name="m",phase="{phase}"}} {index % 5}')
    return ("\n".join(lines) + "\n").encode()


class _Page(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, enough for GET /metrics."""

    def __init__(self, page: bytes) -> None:
        self.page = page
        self.buffer = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while b"\r\n\r\n" in self.buffer and self.transport is not None:
            _, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
            head = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: %d\r\n\r\n"
            self.transport.write(head % len(self.page) + self.page)


class FakePods:
    """The stand-in kubelet: every pod of NAMESPACE gets a loopback IP serving /metrics, Running and Ready."""

    def __init__(self, api: APIServer) -> None:
        self.api = api
        self.loop = asyncio.new_event_loop()
        self.servers: dict[str, asyncio.Server] = {}
        self.count = 0
        self.subnet = int(time.time()) % 100 + 100
        threading.Thread(target=self.loop.run_forever, name="fake-pods", daemon=True).start()

    def tend(self) -> int:
        """Bring up every new pod; returns how many pods are Ready."""
        ready = 0
        for pod in self.api.list("v1", "Pod", NAMESPACE):
            name = pod["metadata"]["name"]
            if (pod.get("status") or {}).get("podIP"):
                ready += 1
                continue
            n = self.count
            self.count += 1
            ip = f"127.{self.subnet + n // 62500}.{n // 250 % 250}.{n % 250 + 1}"
            page = metrics_page(n)
            server = asyncio.run_coroutine_threadsafe(
                self.loop.create_server(functools.partial(_Page, page), ip, 8000), self.loop
            ).result(timeout=10)
            self.servers[name] = server
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            container = {"name": "engine", "image": "engine:bench", "imageID": "engine@sha256:0"}
            status = {
                "phase": "Running",
                "podIP": ip,
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
                    {"type": "Ready", "status": "True", "lastTransitionTime": now},
                ],
                "containerStatuses": [{**container, "ready": True, "restartCount": 0}],
            }
            self.api.patch("v1", "Pod", NAMESPACE, name, {"status": status}, subresource="status")
            ready += 1
        return ready


def inference_service(name: str, pods: int, scrape_interval: int) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"name": name, "source": "/models/bench"},
            "resources": {"gpus": 0},
            "replicas": {"min": pods, "max": pods},
            "warmPool": {"size": 0},
            "autoscaling": {"intervalSeconds": scrape_interval},
        },
    }


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait(check: Any, timeout: float, what: str, period: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = check()
        if result:
            return result
        time.sleep(period)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def _settled(api: APIServer, names: list[str], pods: int) -> bool:
    for name in names:
        obj = api.get(GROUP_VERSION, "InferenceService", NAMESPACE, name) or {}
        if (obj.get("status") or {}).get("readyReplicas") != pods:
            return False
    return True


def _latency(api: APIServer, name: str, seconds: int, timeout: float) -> float | None:
    """Seconds from a spec change to the child showing it; None when it did not within `timeout`."""
    started = time.monotonic()
    api.patch(
        GROUP_VERSION, "InferenceService", NAMESPACE, name, {"spec": {"requestTimeoutSeconds": seconds}}
    )
    wanted = f"requestTimeoutSeconds: {seconds}"

    def shown() -> bool:
        cm = api.get("v1", "ConfigMap", NAMESPACE, f"{name}-policy") or {}
        return any(wanted in text for text in (cm.get("data") or {}).values())

    try:
        _wait(shown, timeout, f"{name}'s policy ConfigMap to show the change", period=0.01)
    except TimeoutError:
        return None
    return time.monotonic() - started


def bench(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    from ember_operator.crd import crd_manifest

    with APIServer(pod_graceful_deletion=False, bookmark_interval=10.0) as api:
        kubeconfig = api.write_kubeconfig(directory / "kubeconfig")
        api.install_crd(crd_manifest())
        fake = FakePods(api)
        log = (directory / "operator.log").open("w")
        command = [
            sys.executable,
            "-m",
            "ember_engine",
            "operator",
            "-n",
            NAMESPACE,
            "--tick",
            str(args.tick),
        ]
        command += ["--health-port", "0", "--metrics-port", "0"]
        operator = subprocess.Popen(
            command, env={**os.environ, "KUBECONFIG": str(kubeconfig)}, stdout=log, stderr=log
        )
        try:
            names = [f"svc-{i:03d}" for i in range(args.services)]
            started = time.monotonic()
            for name in names:
                api.create(inference_service(name, args.pods, args.scrape_interval))
            total = args.services * args.pods
            _wait(
                lambda: operator.poll() is None and fake.tend() >= total, args.timeout, f"{total} pods Ready"
            )
            _wait(lambda: _settled(api, names, args.pods), args.timeout, "every InferenceService Ready")
            setup = time.monotonic() - started
            time.sleep(args.settle)
            if operator.poll() is not None:
                raise RuntimeError(f"the operator exited with {operator.returncode}; see its log")
            before, cpu0, t0 = Counter(api.request_counts()), cpu_seconds(operator.pid), time.monotonic()
            time.sleep(args.window)
            after, cpu1, t1 = Counter(api.request_counts()), cpu_seconds(operator.pid), time.monotonic()
            window = t1 - t0
            made = after - before
            by_kind = {
                f"{verb} {res}{'/' + sub if sub else ''}": round(n / window, 3)
                for (verb, res, sub), n in sorted(made.items())
            }
            latencies = [
                _latency(api, names[i * len(names) // args.changes], 30 + i, args.latency_timeout)
                for i in range(args.changes)
            ]
        finally:
            operator.terminate()
            try:
                operator.wait(timeout=15)
            except subprocess.TimeoutExpired:
                operator.kill()
            log.close()
        total_rate = sum(made.values()) / window
        seen = [x for x in latencies if x is not None]
        missed = len(latencies) - len(seen)
        return {
            "pods": "fake: loopback HTTP servers with a fixed ~30 KB /metrics page, marked Ready by the bench",
            "metrics_page_bytes": len(metrics_page(0)),
            "services": args.services,
            "pods_per_service": args.pods,
            "operator_tick_seconds": args.tick,
            "scrape_interval_seconds": args.scrape_interval,
            "setup_seconds": round(setup, 1),
            "window_seconds": round(window, 1),
            "api_requests_per_second": round(total_rate, 3),
            "api_requests_per_second_per_service": round(total_rate / args.services, 4),
            "api_requests_per_second_by_kind": by_kind,
            "operator_cpu_cores": round((cpu1 - cpu0) / window, 3),
            "reconcile_latency_seconds": {
                "median": round(statistics.median(seen), 3) if seen else None,
                "max": round(max(seen), 3) if seen else None,
                "samples": [None if x is None else round(x, 3) for x in latencies],
                "not_within_timeout": missed,
                "timeout": args.latency_timeout,
            },
        }


def main(args: argparse.Namespace) -> int:
    from ember_localcluster.interrupt import run_interruptible

    return run_interruptible("operator", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ember-bench-operator-") as tmp:
        try:
            result = bench(args, Path(tmp))
        except (TimeoutError, RuntimeError) as e:
            print(f"ember bench operator: {e}", file=sys.stderr)
            print((Path(tmp) / "operator.log").read_text()[-3000:], file=sys.stderr)
            return 1
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ember_engine.bench.arg_types import non_negative_int, positive, positive_int

    p.add_argument("--services", type=positive_int, default=20, help="InferenceServices (default 20)")
    p.add_argument(
        "--pods", type=positive_int, default=50, help="active pods per InferenceService (default 50)"
    )
    p.add_argument("--tick", type=float, default=2.0, help="the operator's --tick (default 2, its default)")
    p.add_argument("--scrape-interval", type=int, default=15, help="autoscaling.intervalSeconds (default 15)")
    p.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="seconds idle before the window (default 20: past the first scrape)",
    )
    p.add_argument("--window", type=positive, default=60.0, help="seconds measured (default 60)")
    p.add_argument("--changes", type=non_negative_int, default=5, help="spec changes timed (default 5)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed for the fleet to start")
    p.add_argument(
        "--latency-timeout", type=float, default=60.0, help="seconds a spec change may take (default 60)"
    )
    p.add_argument("--json", help="write the result here too")
