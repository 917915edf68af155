"""`ember bench scale`: from a load spike to added capacity serving, warm pool vs cold start, side by side;
with `--scenario failover`, from SIGKILL of the only active engine to the Service serving again; and with
`--scenario roll`, an engine change rolled on a pool of GPUs with none to spare.

Both runs use the local control plane (API server, process kubelet, service proxy, the operator) and real
engine processes on one test checkpoint. Each run applies an InferenceService with one active pod (and,
for the warm run, one warm pod), waits until it is settled, then starts an open-loop load through the
Service: arrivals at a fixed rate, more than one engine serves, each on a new connection. The clock starts
with the load and stops when a second engine pod serves: its own /metrics shows a request running or
finished. The autoscaler's interval is part of both times, so the ratio compares what follows its
decision: a relabel, or a process start, model load and warm-up.

The failover scenario runs one active engine (replicas 1..1), with a warm pod or without, kills the
active engine's process with SIGKILL, and reports two clocks from the kill: until the API shows a Ready
pod behind the Service again (`endpoint_ready_seconds`), and until a request through the Service is
answered 200 (`served_seconds`; one request every 20 ms, each on a new connection). With a pool the
operator promotes the warm pod as soon as it sees the active one go down; without, the kubelet restarts
the engine, which loads and warms up again.

The roll scenario starts a one-node cluster whose GPUs the InferenceService fills exactly (replicas ×
1 GPU, plus the warm pool's), changes an engine field, and reports how long the roll took until every pod
runs the new template, Ready, and the fewest Ready active pods seen meanwhile (sampled every 50 ms), once
without a warm pool (the default rollout, maxSurge 1 and maxUnavailable 1: the surge pod waits
Unschedulable, so one old pod is retired for it) and once with a warm pool of one (the pool is the surge).
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
            # What is measured is the Service reaching new engine pods, as without a router.
            "router": {"enabled": False},
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


async def _apply_settled(api: Any, resource: dict[str, Any], pods: int, timeout: float) -> str:
    """Create the InferenceService, wait until its `pods` pods are Ready and it is no longer Reconciling,
    and return its Service's local address."""
    name = resource["metadata"]["name"]
    api.create(resource)

    def settled() -> bool:
        obj = api.get(GROUP_VERSION, "InferenceService", "default", name)
        listed = api.list("v1", "Pod", "default", label_selector=f"app.kubernetes.io/instance={name}")
        return (
            _conditions(obj).get("Reconciling") == "False"
            and len(listed) == pods
            and all(map(_ready, listed))
        )

    await _wait(settled, timeout, f"{name} settled")
    svc = await _wait(
        lambda: ((api.get("v1", "Service", "default", name) or {}).get("status") or {}).get("loadBalancer"),
        timeout,
        "the Service's local address",
    )
    ingress = svc["ingress"][0]
    return f"http://{ingress['ip']}:{ingress['ports'][0]['port']}"


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
    base = await _apply_settled(api, _resource(name, warm, args.interval), 1 + warm, args.timeout)
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


def _kill_engine(pod_ip: str) -> int:
    """SIGKILL the engine process serving on `pod_ip` (the process kubelet runs it on this machine)."""
    import os
    import signal

    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in argv and f"--host={pod_ip}".encode() in argv:
            os.kill(int(entry.name), signal.SIGKILL)
            return int(entry.name)
    raise RuntimeError(f"no engine process serves on {pod_ip}")


async def _failover_one(cluster: Any, name: str, warm: int, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    api = cluster.api
    resource = _resource(name, warm, args.interval)
    resource["spec"]["replicas"] = {"min": 1, "max": 1}
    base = await _apply_settled(api, resource, 1 + warm, args.timeout)
    label = f"app.kubernetes.io/instance={name}"
    (victim,) = api.list("v1", "Pod", "default", label_selector=f"{label},ember.dev/role=active")
    _kill_engine(victim["status"]["podIP"])
    killed = time.monotonic()

    def serving_pod() -> bool:
        pods = api.list("v1", "Pod", "default", label_selector=f"{label},ember.dev/role=active")
        # The victim counts again only once it has stopped being Ready and come back.
        return any(_ready(p) for p in pods if p["metadata"]["name"] != victim["metadata"]["name"]) or any(
            _ready(p) and (p["status"].get("containerStatuses") or [{}])[0].get("restartCount", 0) > 0
            for p in pods
        )

    endpoint_at = served_at = None
    async with httpx.AsyncClient(timeout=2.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while endpoint_at is None or served_at is None:
            now = time.monotonic() - killed
            if now > args.timeout:
                raise TimeoutError(f"{name}: not serving again within {args.timeout:g} s of the kill")
            if endpoint_at is None and await asyncio.to_thread(serving_pod):
                endpoint_at = time.monotonic() - killed
            if served_at is None:
                with contextlib.suppress(httpx.HTTPError):
                    response = await client.get(f"{base}/v1/models")
                    # A request the dying engine still answered does not count: wait for the endpoint.
                    if response.status_code == 200 and endpoint_at is not None:
                        served_at = time.monotonic() - killed
            await asyncio.sleep(0.02)
    events = [
        e["reason"]
        for e in api.list("v1", "Event", "default")
        if e["involvedObject"].get("name") == name and e["reason"] in ("FailedOver", "Promoted")
    ]
    api.delete(GROUP_VERSION, "InferenceService", "default", name)
    await _wait(
        lambda: not api.list("v1", "Pod", "default", label_selector=label),
        args.timeout,
        f"{name}'s pods gone",
    )
    return {
        "warm_pool": warm,
        "endpoint_ready_seconds": round(endpoint_at, 3),
        "served_seconds": round(served_at, 3),
        "operator_events": events,
    }


async def _failover(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    runs = await _warm_and_cold(args, directory, _failover_one, "failover-")
    med = {k: statistics.median(r["served_seconds"] for r in v) for k, v in runs.items()}
    return {
        "scenario": "failover",
        "checkpoint": args.size,
        "operator_tick_seconds": args.tick,
        "warm_median_served_seconds": round(med["warm"], 3),
        "cold_median_served_seconds": round(med["cold"], 3),
        "warm_median_endpoint_ready_seconds": round(
            statistics.median(r["endpoint_ready_seconds"] for r in runs["warm"]), 3
        ),
        "runs": runs,
    }


async def _roll_one(
    directory: Path, name: str, active: int, warm: int, args: argparse.Namespace
) -> dict[str, Any]:
    from ember_localcluster.devcluster import DevCluster

    gpus = active + warm
    with DevCluster(directory / name, port=0, tick=args.tick, nodes=1, gpus_per_node=gpus) as cluster:
        api = cluster.api
        resource = _resource(name, warm, args.interval)
        resource["spec"]["model"]["volumeClaim"] = "model-weights"
        resource["spec"]["resources"] = {"gpus": 1}
        resource["spec"]["replicas"] = {"min": active, "max": active}
        api.create(resource)
        label = f"app.kubernetes.io/instance={name}"

        def pods() -> list[dict[str, Any]]:
            return api.list("v1", "Pod", "default", label_selector=label)

        def settled(template: str | None) -> bool:
            obj = api.get(GROUP_VERSION, "InferenceService", "default", name)
            live = [p for p in pods() if not p["metadata"].get("deletionTimestamp")]
            return (
                _conditions(obj).get("Reconciling") == "False"
                and len(live) == len(pods()) == gpus
                and all(map(_ready, live))
                and (
                    template is None
                    or all(p["metadata"]["labels"]["ember.dev/template-hash"] == template for p in live)
                )
            )

        await _wait(lambda: settled(None), args.timeout, f"{name} settled")
        old = {p["metadata"]["labels"]["ember.dev/template-hash"] for p in pods()}
        api.patch(GROUP_VERSION, "InferenceService", "default", name, {"spec": {"engine": {"maxNumSeqs": 2}}})
        start = time.monotonic()
        fewest = active
        new_hash = None
        unschedulable_seen = False
        while time.monotonic() - start < args.timeout:
            current = pods()
            ready_active = sum(
                _ready(p)
                and p["metadata"]["labels"].get("ember.dev/role") == "active"
                and not p["metadata"].get("deletionTimestamp")
                for p in current
            )
            fewest = min(fewest, ready_active)
            unschedulable_seen = unschedulable_seen or any(
                c.get("reason") == "Unschedulable"
                for p in current
                for c in (p.get("status") or {}).get("conditions") or []
            )
            hashes = {p["metadata"]["labels"]["ember.dev/template-hash"] for p in current} - old
            new_hash = next(iter(hashes), new_hash)
            if new_hash is not None and settled(new_hash):
                break
            await asyncio.sleep(0.05)
        else:
            raise TimeoutError(f"{name}: the roll did not finish within {args.timeout:g} s")
        return {
            "active": active,
            "warm_pool": warm,
            "gpus": gpus,
            "roll_seconds": round(time.monotonic() - start, 2),
            "fewest_ready_active": fewest,
            "a_surge_pod_waited_unschedulable": unschedulable_seen,
        }


async def _roll(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    from ember_engine.tools.testmodel import make_test_model

    runs = []
    for i, (active, warm) in enumerate(((2, 0), (2, 1))):
        make_test_model(directory / f"roll-{i}" / "models" / "bench", size=args.size, force=True)
        result = await _roll_one(directory, f"roll-{i}", active, warm, args)
        runs.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    return {"scenario": "roll", "checkpoint": args.size, "runs": runs}


async def _warm_and_cold(
    args: argparse.Namespace, directory: Path, one: Any, prefix: str
) -> dict[str, list[dict[str, Any]]]:
    """`one(cluster, name, warm_pool, args)` with a warm pod and without, alternated `args.repeats` times
    on one local cluster, so that drift in the machine's load affects both alike."""
    from ember_engine.tools.testmodel import make_test_model
    from ember_localcluster.devcluster import DevCluster

    make_test_model(directory / "models" / "bench", size=args.size, force=True)
    runs: dict[str, list[dict[str, Any]]] = {"warm": [], "cold": []}
    with DevCluster(directory, port=0, tick=args.tick) as cluster:
        for i in range(args.repeats):
            for kind, warm in (("warm", 1), ("cold", 0)):
                result = await one(cluster, f"{prefix}{kind}-{i}", warm, args)
                runs[kind].append(result)
                print(f"{kind} #{i}: {json.dumps(result)}", file=sys.stderr, flush=True)
    return runs


async def _bench(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    runs = await _warm_and_cold(args, directory, _run_one, "")
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
    from ember_localcluster.interrupt import run_interruptible

    return run_interruptible("scale", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ember-bench-scale-") as tmp:
        bench = {"failover": _failover, "roll": _roll}.get(args.scenario, _bench)
        result = asyncio.run(bench(args, Path(tmp)))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ember_engine.bench.arg_types import positive, positive_int

    p.add_argument(
        "--scenario",
        choices=["spike", "failover", "roll"],
        default="spike",
        help="spike: load spike to a second engine serving; failover: SIGKILL of the only active engine "
        "to the Service serving again; roll: an engine change on a full GPU pool (default spike)",
    )
    p.add_argument("--size", choices=["tiny", "small"], default="tiny", help="test checkpoint (default tiny)")
    p.add_argument("--repeats", type=positive_int, default=3, help="warm and cold runs each (default 3)")
    p.add_argument(
        "--rate", type=positive, default=20.0, help="arrivals per second in the spike (default 20)"
    )
    p.add_argument("--max-tokens", type=positive_int, default=64, help="tokens per request (default 64)")
    p.add_argument("--interval", type=int, default=1, help="autoscaling.intervalSeconds (default 1)")
    p.add_argument(
        "--tick", type=float, default=0.25, help="operator reconcile tick (default 0.25 s; failover: use 2)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed per wait (default 300)")
    p.add_argument("--json", help="write the result here too")
