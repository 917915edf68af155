"""`ember bench scale`: from a load spike to added capacity serving, warm pool vs cold start, side by side.

Both runs use the local control plane (API server, process kubelet, service proxy, the operator) and real
engine processes on one test checkpoint. Each run applies an InferenceService with one active pod (and,
for the warm run, one warm pod), waits until it is settled, then starts an open-loop load through the
Service: arrivals at a fixed rate, more than one engine serves, each on a new connection. The clock starts
with the load and stops when a second engine pod serves: its own /metrics shows a request running or
finished. The autoscaler's interval is part of both times, so the ratio compares what follows its
decision: a relabel, or a process start, model load and warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

GROUP_VERSION = "ember.dev/v1alpha1"


def _resource(name: str, warm: int, interval: int) -> dict[str, Any]:
    return {
        "apiVersion": GROUP_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {"name": name, "source": "/models/bench", "volumeClaim": "model-weights"},
            # One running sequence per engine: a modest arrival rate is already a queue.
            "engine": {"maxNumSeqs": 1, "maxNumBatchedTokens": 256},
            "resources": {"gpus": 0},
            "replicas": {"min": 1, "max": 2},
            "warmPool": {"size": warm},
            "autoscaling": {
                "intervalSeconds": interval,
                "queueDepthPerReplica": 1,
                "scaleDownStabilizationSeconds": 600,
            },
        },
    }


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _conditions(obj: dict[str, Any] | None) -> dict[str, str]:
    return {c["type"]: c["status"] for c in ((obj or {}).get("status") or {}).get("conditions") or []}


async def _wait(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = await asyncio.to_thread(check)
        if result:
            return result
        await asyncio.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


async def _served(client: Any, pod_ip: str) -> bool:
    """True once the engine at `pod_ip` runs or has finished a request (warm-up requests are not counted)."""
    import httpx

    try:
        text = (await client.get(f"http://{pod_ip}:8000/metrics", timeout=1.0)).text
    except httpx.HTTPError:
        return False
    return any(
        line.startswith(("vllm:num_requests_running{", "vllm:request_success_total{"))
        and float(line.rsplit(" ", 1)[1]) > 0
        for line in text.splitlines()
    )


async def _load(base: str, model: str, stop: asyncio.Event, rate: float, max_tokens: int) -> dict[str, int]:
    """Open-loop arrivals through the Service, `rate` requests per second, until `stop`.

    Each request is a new connection, as from independent clients: the Service balances connections, and
    kept-alive ones would stay pinned to the first engine. Returns the statuses of the requests that ended
    before `stop` ("0" for a transport error); the rest are cancelled then.
    """
    import httpx

    codes: list[int] = []
    tasks: set[asyncio.Task[None]] = set()
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_keepalive_connections=0)) as client:

        async def one() -> None:
            body = {"model": model, "prompt": "def f(x):", "max_tokens": max_tokens, "ignore_eos": True}
            try:
                codes.append((await client.post(f"{base}/v1/completions", json=body)).status_code)
            except httpx.HTTPError:
                codes.append(0)

        while not stop.is_set():
            task = asyncio.create_task(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0 / rate)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {str(c): codes.count(c) for c in sorted(set(codes))}


async def _run_one(cluster: Any, name: str, warm: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    api = cluster.api
    api.create(_resource(name, warm, args.interval))

    def settled() -> bool:
        obj = api.get(GROUP_VERSION, "InferenceService", "default", name)
        pods = api.list("v1", "Pod", "default", label_selector=f"app.kubernetes.io/instance={name}")
        return (
            _conditions(obj).get("Reconciling") == "False"
            and len(pods) == 1 + warm
            and all(map(_ready, pods))
        )

    await _wait(settled, args.timeout, f"{name} settled")
    svc = await _wait(
        lambda: ((api.get("v1", "Service", "default", name) or {}).get("status") or {}).get("loadBalancer"),
        args.timeout,
        "the Service's local address",
    )
    ingress = svc["ingress"][0]
    base = f"http://{ingress['ip']}:{ingress['ports'][0]['port']}"
    selector = f"app.kubernetes.io/instance={name},ember.dev/role=active"
    (first,) = api.list("v1", "Pod", "default", label_selector=selector)
    first_name = first["metadata"]["name"]

    def snapshot() -> tuple[int | None, list[dict[str, Any]]]:
        """The active target, and the Ready active pods other than the first (from the API, off the loop)."""
        obj = api.get(GROUP_VERSION, "InferenceService", "default", name) or {}
        pods = api.list("v1", "Pod", "default", label_selector=selector)
        others = [p for p in pods if p["metadata"]["name"] != first_name and _ready(p)]
        return (obj.get("status") or {}).get("desiredReplicas"), others

    stop = asyncio.Event()
    start = time.monotonic()
    load = asyncio.create_task(_load(base, name, stop, args.rate, args.max_tokens))
    promoted_at = decided_at = None
    async with httpx.AsyncClient() as client:
        while True:
            if time.monotonic() - start > args.timeout:
                stop.set()
                await load
                status = (api.get(GROUP_VERSION, "InferenceService", "default", name) or {}).get("status")
                raise TimeoutError(
                    f"{name}: no second engine served within {args.timeout:g} s; status: {status}"
                )
            desired, others = await asyncio.to_thread(snapshot)
            if decided_at is None and desired == 2:
                decided_at = time.monotonic() - start
            if others and promoted_at is None:
                promoted_at = time.monotonic() - start
            ips = [(p.get("status") or {}).get("podIP") for p in others]
            served = [ip for ip in ips if ip and await _served(client, ip)]
            if served:
                seconds = time.monotonic() - start
                break
            await asyncio.sleep(0.02)
    stop.set()
    statuses = await load
    obj = api.get(GROUP_VERSION, "InferenceService", "default", name) or {}
    api.delete(GROUP_VERSION, "InferenceService", "default", name)
    await _wait(
        lambda: not api.list("v1", "Pod", "default", label_selector=f"app.kubernetes.io/instance={name}"),
        args.timeout,
        f"{name}'s pods gone",
    )
    return {
        "warm_pool": warm,
        "spike_to_serving_seconds": round(seconds, 3),
        "spike_to_decision_seconds": None if decided_at is None else round(decided_at, 3),
        "spike_to_second_active_ready_seconds": None if promoted_at is None else round(promoted_at, 3),
        "requests_finished": sum(statuses.values()),
        "request_statuses": statuses,
        "cold_start_seconds": (obj.get("status") or {}).get("coldStartSeconds"),
    }


async def _bench(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    from ember_engine.tools.testmodel import make_test_model
    from ember_localcluster.devcluster import DevCluster

    make_test_model(directory / "models" / "bench", size=args.size, force=True)
    runs: dict[str, list[dict[str, Any]]] = {"warm": [], "cold": []}
    with DevCluster(directory, port=0, tick=args.tick) as cluster:
        for i in range(args.repeats):
            # Alternated, so that drift in the machine's load affects both alike.
            for kind, warm in (("warm", 1), ("cold", 0)):
                result = await _run_one(cluster, f"{kind}-{i}", warm, args)
                runs[kind].append(result)
                print(f"{kind} #{i}: {json.dumps(result)}", file=sys.stderr, flush=True)
    warm_s = statistics.median(r["spike_to_serving_seconds"] for r in runs["warm"])
    cold_s = statistics.median(r["spike_to_serving_seconds"] for r in runs["cold"])
    return {
        "checkpoint": args.size,
        "autoscaling_interval_seconds": args.interval,
        "operator_tick_seconds": args.tick,
        "arrivals_per_second": args.rate,
        "warm_median_seconds": round(warm_s, 3),
        "cold_median_seconds": round(cold_s, 3),
        "cold_over_warm": round(cold_s / warm_s, 2),
        "runs": runs,
    }


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ember-bench-scale-") as tmp:
        result = asyncio.run(_bench(args, Path(tmp)))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=["tiny", "small"], default="tiny", help="test checkpoint (default tiny)")
    p.add_argument("--repeats", type=int, default=3, help="warm and cold runs each (default 3)")
    p.add_argument("--rate", type=float, default=20.0, help="arrivals per second in the spike (default 20)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--interval", type=int, default=1, help="autoscaling.intervalSeconds (default 1)")
    p.add_argument("--tick", type=float, default=0.25, help="operator reconcile tick (default 0.25 s)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per wait (default 300)")
    p.add_argument("--json", help="write the result here too")
