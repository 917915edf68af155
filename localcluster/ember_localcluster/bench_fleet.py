"""`ember bench fleet`: one InferenceService of N engines on the local control plane, reached through its
Service (the service proxy balances connections round robin, as kube-proxy does) and through `ember router`
(prefix- and load-aware), side by side in one run.

Two workloads, each run once per policy with fresh prompt content (so that no run inherits another's
cache) and the same arrival times (so that the policies meet the same bursts): `shared` — T tenants, each with its own long system prompt, short questions — and `random` —
prompts that share nothing. Arrivals are open-loop Poisson at a fixed rate from a pool of keep-alive
connections (httpx's default, as most clients), streaming, so time to first token is measured at the
client. Engine-side figures are deltas of the engines' own counters over the run: prefix-cache hit rate
(hit tokens / queried tokens) and requests per engine (`load_imbalance` = most / fewest). The `shared`
workload is also run whole (all `--requests` prompts, fresh content, the same tenants' share) against a
single engine, at rate / replicas (the load one engine of the fleet takes, so that it is not swamped;
the run takes replicas times as long): the hit rate of one cache that sees every prompt, with no split of
the prefixes, the ceiling routing could reach (`one_engine`; `shared_hit_rate_router_over_one_engine` is
the share of it the router reached). The router's added latency is measured at low load, one request at a
time, through the router and straight to one engine (`router_overhead_p50_s`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

GROUP_VERSION = "ember.dev/v1alpha1"
_COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:generation_tokens_total",
)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(("alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta", "zeta",
                                "lambda", "tensor", "vector", "matrix", "kernel", "buffer", "stream"))
                    + str(rng.randint(0, 99)) for _ in range(n))  # fmt: skip


def workload(kind: str, n: int, seed: int, tenants: int, system_words: int) -> list[str]:
    """`n` prompts: per-tenant system prompts plus a short question, or prompts that share nothing."""
    rng = random.Random(seed)
    if kind == "shared":
        systems = [f"You are assistant {t}. " + _words(rng, system_words) for t in range(tenants)]
        return [f"{rng.choice(systems)}\nQuestion: {_words(rng, 8)}\nAnswer:" for _ in range(n)]
    return [_words(rng, system_words // 2) for _ in range(n)]


async def _scrape(client: Any, urls: list[str]) -> dict[str, dict[str, float]]:
    pages = await asyncio.gather(*(client.get(f"{u}/metrics", timeout=5) for u in urls))
    out: dict[str, dict[str, float]] = {}
    for u, page in zip(urls, pages, strict=True):
        values: dict[str, float] = {}
        for line in page.text.splitlines():
            for name in _COUNTERS:
                if line.startswith(name + "{") or line.startswith(name + " "):
                    values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        out[u] = values
    return out


async def _run(
    base: str, model: str, prompts: list[str], rate: float, connections: int, max_tokens: int, seed: int
) -> dict[str, Any]:
    """Open-loop Poisson arrivals over a pool of keep-alive connections; streams, TTFT at the client. The
    arrival times follow `seed`: both policies of a workload get the same ones."""
    import httpx

    rng = random.Random(seed)
    ttfts: list[float] = []
    failures = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as client:

        async def one(prompt: str) -> None:
            nonlocal failures
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "stream": True,
                "ignore_eos": True,
            }
            start = time.perf_counter()
            first = None
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        failures += 1
                        await r.aread()
                        return
                    async for line in r.aiter_lines():
                        if first is None and line.startswith("data: ") and line != "data: [DONE]":
                            first = time.perf_counter() - start
            except httpx.HTTPError:
                failures += 1
                return
            if first is not None:
                ttfts.append(first)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    return {"ttfts": ttfts, "failures": failures, "wall_seconds": wall}


def _summarize(
    run: dict[str, Any], before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, Any]:
    queries = sum(after[u].get(_COUNTERS[0], 0) - before[u].get(_COUNTERS[0], 0) for u in after)
    hits = sum(after[u].get(_COUNTERS[1], 0) - before[u].get(_COUNTERS[1], 0) for u in after)
    per_engine = [after[u].get(_COUNTERS[2], 0) - before[u].get(_COUNTERS[2], 0) for u in after]
    # Output tokens as the engines counted them (a streamed chunk may carry several tokens).
    generated = sum(after[u].get(_COUNTERS[3], 0) - before[u].get(_COUNTERS[3], 0) for u in after)
    return {
        "prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "ttft_p50_s": _quantile(run["ttfts"], 0.5),
        "ttft_p99_s": _quantile(run["ttfts"], 0.99),
        "output_tokens_per_s": round(generated / run["wall_seconds"], 2),
        "requests_per_engine": per_engine,
        "load_imbalance": round(max(per_engine) / min(per_engine), 3) if min(per_engine) > 0 else None,
        "failures": run["failures"],
        "ttfts": [round(t, 4) for t in run["ttfts"]],
    }


def _decisions(router: Any) -> dict[str, float]:
    """The router's decisions so far, by reason (summed over engines)."""
    out: dict[str, float] = {}
    for family in router.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "ember_router:decisions_total":
                reason = sample.labels["reason"]
                out[reason] = out.get(reason, 0.0) + sample.value
    return out


@contextmanager
def _router(model_dir: Path, urls: list[str]) -> Any:
    """`ember router` in this process, once it sees every engine Ready with its events."""
    from ember_engine.core.tokenizer import Tokenizer
    from ember_router.embedded import serving
    from ember_router.pool import EnginePool
    from ember_router.proxy import Router

    router = Router(EnginePool(urls, poll_interval=0.1), Tokenizer(str(model_dir)))
    with serving(router) as url:
        deadline = time.monotonic() + 30
        while not all(e.state.ready and e.events_live for e in router.pool.engines.values()):
            if time.monotonic() > deadline:
                raise TimeoutError("the router never saw every engine Ready")
            time.sleep(0.05)
        yield url, router


async def _overhead(router_url: str, engine_url: str, model: str, n: int) -> float:
    import httpx

    async def latencies(base: str) -> list[float]:
        out = []
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            for i in range(n):
                start = time.perf_counter()
                r = await client.post(
                    "/v1/completions", json={"model": model, "prompt": f"ping {i}", "max_tokens": 1}
                )
                r.raise_for_status()
                out.append(time.perf_counter() - start)
        return out

    direct, routed = [], []
    for _ in range(2):  # interleaved, so drift in the machine's speed affects both alike
        direct += await latencies(engine_url)
        routed += await latencies(router_url)
    return round(statistics.median(routed) - statistics.median(direct), 5)


async def _bench(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    import httpx

    from ember_engine.tools.testmodel import make_test_model
    from ember_localcluster.devcluster import DevCluster

    models = directory / "models"
    make_test_model(models / "bench", size=args.size, force=True)
    name = "fleet"
    resource = {
        "apiVersion": GROUP_VERSION,
        "kind": "InferenceService",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "model": {"name": name, "source": "/models/bench", "volumeClaim": "model-weights"},
            "engine": {"maxNumSeqs": args.max_num_seqs, "blockSize": 16}
            | ({"kvCacheMemory": args.kv_cache_memory} if args.kv_cache_memory else {}),
            "resources": {"gpus": 0},
            "replicas": {"min": args.replicas, "max": args.replicas},
            # The round-robin side is the Service straight to the engines; the router side is run here.
            "router": {"enabled": False},
        },
    }
    result: dict[str, Any] = {"checkpoint": args.size, "replicas": args.replicas, "rate": args.rate,
                              "requests_per_run": args.requests, "kv_cache_memory": args.kv_cache_memory,
                              "workloads": {}}  # fmt: skip
    with DevCluster(directory, port=0, tick=1.0) as cluster:
        api = cluster.api
        api.create(resource)
        deadline = time.monotonic() + args.timeout

        def pods() -> list[dict[str, Any]]:
            selector = f"app.kubernetes.io/instance={name},ember.dev/role=active"
            return api.list("v1", "Pod", "default", label_selector=selector)

        def ready(p: dict[str, Any]) -> bool:
            return any(
                c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions") or []
            )

        while not (len(pods()) == args.replicas and all(map(ready, pods()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{args.replicas} engines not Ready within {args.timeout:g} s")
            await asyncio.sleep(0.2)
        urls = [f"http://{p['status']['podIP']}:8000" for p in pods()]
        while not ((api.get("v1", "Service", "default", name) or {}).get("status") or {}).get("loadBalancer"):
            await asyncio.sleep(0.1)
        ingress = api.get("v1", "Service", "default", name)["status"]["loadBalancer"]["ingress"][0]
        service_url = f"http://{ingress['ip']}:{ingress['ports'][0]['port']}"
        with _router(models / "bench", urls) as (router_url, router):
            async with httpx.AsyncClient() as scraper:
                seed = 0
                for arrivals, kind in enumerate(("shared", "random"), start=1000):
                    runs: dict[str, Any] = {}
                    for policy, base in (("round_robin", service_url), ("router", router_url)):
                        seed += 1
                        prompts = workload(kind, args.requests, seed, args.tenants, args.system_words)
                        before, decided = await _scrape(scraper, urls), _decisions(router)
                        run = await _run(
                            base, name, prompts, args.rate, args.connections, args.max_tokens, arrivals
                        )
                        runs[policy] = _summarize(run, before, await _scrape(scraper, urls))
                        if policy == "router":  # why it chose as it did, over this run
                            runs[policy]["decisions"] = {
                                k: v - decided.get(k, 0.0) for k, v in sorted(_decisions(router).items())
                            }
                        print(f"{kind}/{policy}: " + json.dumps({k: v for k, v in runs[policy].items() if k != "ttfts"}),
                              file=sys.stderr, flush=True)  # fmt: skip
                    if (
                        kind == "shared"
                    ):  # the whole workload on one engine, at one engine's share of the rate
                        seed += 1
                        prompts = workload(kind, args.requests, seed, args.tenants, args.system_words)
                        rate = args.rate / args.replicas
                        before = await _scrape(scraper, urls[:1])
                        run = await _run(
                            urls[0], name, prompts, rate, args.connections, args.max_tokens, seed
                        )
                        single = _summarize(run, before, await _scrape(scraper, urls[:1]))
                        runs["one_engine"] = {
                            "prefix_hit_rate": single["prefix_hit_rate"],
                            "requests": single["requests_per_engine"][0],
                            "rate": rate,
                            "failures": single["failures"],
                        }
                    result["workloads"][kind] = runs
            result["router_overhead_p50_s"] = await _overhead(
                router_url, urls[0], name, args.overhead_requests
            )
        api.delete(GROUP_VERSION, "InferenceService", "default", name)
    shared = result["workloads"]["shared"]
    rr, rt = shared["round_robin"], shared["router"]
    result["ratios"] = {
        "shared_hit_rate_router_over_round_robin": _ratio(rt["prefix_hit_rate"], rr["prefix_hit_rate"]),
        "shared_hit_rate_router_over_one_engine": _ratio(
            rt["prefix_hit_rate"], shared["one_engine"]["prefix_hit_rate"]
        ),
        "shared_ttft_p50_round_robin_over_router": _ratio(rr["ttft_p50_s"], rt["ttft_p50_s"]),
        "shared_ttft_p99_round_robin_over_router": _ratio(rr["ttft_p99_s"], rt["ttft_p99_s"]),
        "random_throughput_router_over_round_robin": _ratio(
            result["workloads"]["random"]["router"]["output_tokens_per_s"],
            result["workloads"]["random"]["round_robin"]["output_tokens_per_s"],
        ),
    }
    return result


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main(args: argparse.Namespace) -> int:
    from ember_localcluster.interrupt import run_interruptible

    return run_interruptible("fleet", lambda: _main(args))


def _main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="ember-bench-fleet-") as tmp:
        result = asyncio.run(_bench(args, Path(tmp)))
    text = json.dumps({**result, "workloads": {k: {p: ({kk: vv for kk, vv in v.items() if kk != "ttfts"} if isinstance(v, dict) else v)
                                                  for p, v in w.items()} for k, w in result["workloads"].items()}}, indent=2)  # fmt: skip
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        from ember_localcluster.bench_fleet_plot import plot

        plot(result, Path(args.plot))
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", choices=["tiny", "small"], default="tiny", help="test checkpoint (default tiny)")
    p.add_argument("--replicas", type=int, default=4, help="engines in the fleet (default 4)")
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per second (default 6)")
    p.add_argument("--requests", type=int, default=120, help="requests per run (default 120)")
    p.add_argument(
        "--connections", type=int, default=8, help="keep-alive connections of the client (default 8)"
    )
    p.add_argument("--tenants", type=int, default=8, help="tenants in the shared workload (default 8)")
    p.add_argument("--system-words", type=int, default=400, help="words per system prompt (~2.5 tokens each)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=16, help="engine.maxNumSeqs (default 16)")
    p.add_argument(
        "--kv-cache-memory",
        help="engine.kvCacheMemory (e.g. 10Mi): a cache too small for every tenant, as on a busy GPU",
    )
    p.add_argument("--overhead-requests", type=int, default=30, help="requests per side for the overhead")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds allowed for the fleet to start")
    p.add_argument("--json", help="write the full result (with every TTFT) here")
    p.add_argument("--plot", help="write a PNG of the TTFT distributions here")
