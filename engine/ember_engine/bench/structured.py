"""`ember bench serve --structured`: JSON-schema-constrained completions side by side with the same
requests unconstrained, against a running server.

At each batch size B (closed loop: B requests in flight), the same prompts and sampling run once free and
once with `response_format` set to one of `schemas.SCHEMAS` (round robin). An unmeasured pair of rounds
warms each batch size up (and compiles its schemas); then pairs alternate which kind goes first
(constrained-free, free-constrained, ...), so warm-up and drift hit both alike. With `--server-pid` (a
server on this machine) each round also reads the server process's CPU seconds, a measure that other
load on the machine disturbs far less than wall time. Reported: the share of outputs that end `stop` and validate against their
schema (truncated ones, `length`, are counted apart), output tokens/s of each and the overhead, the
compile time of a schema as the client sees it (a new schema's 1-token request less the same request
once the schema is cached), and whether a compiling request holds up others (`/health` latency while a
large schema compiles, against idle). `--header` is sent with every request. A request that fails (a
non-2xx answer or a transport error) is counted by kind as plain `bench serve` counts them ("503",
"ConnectError"); the run stops at the end of the phase in which any failed (the compile times, the
/health probe, or a batch size), reports the failures and exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ember_engine.bench.schemas import SCHEMAS


def _fmt(schema: dict[str, Any], nonce: str | None = None) -> dict[str, Any]:
    if nonce is not None:
        schema = {**schema, "description": nonce}  # a new schema to the server's compile cache
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def _prompt(tag: str, i: int) -> str:
    # The tag leads, so no round finds another's prompts in the server's prefix cache.
    return f"[{tag}] Request {i}. Answer with JSON that fits: {json.dumps(SCHEMAS[i % len(SCHEMAS)])[:160]}\n"


def _valid(text: str, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


class _Client:
    """The HTTP client, and the requests that failed, by kind."""

    def __init__(self, http: Any, failed: Counter[str]) -> None:
        self.http, self.failed = http, failed

    async def request(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = await self.http.request(method, url, json=body)
        except httpx.HTTPError as exc:
            self.failed[type(exc).__name__] += 1
            return None
        if not r.is_success:
            self.failed[str(r.status_code)] += 1
            return None
        return r


async def _post(client: _Client, url: str, body: dict[str, Any]) -> dict[str, Any] | None:
    r = await client.request("POST", url, body)
    return None if r is None else r.json()


class _Failed(Exception):
    pass


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU seconds of process `pid`, all its threads (Linux /proc); 0 without a pid."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pair_order(k: int) -> tuple[str, str]:
    """Which kind of round goes first in measured pair k: constrained first in even pairs, free in odd."""
    return ("constrained", "free") if k % 2 == 0 else ("free", "constrained")


async def _round(
    client: Any, url: str, args: argparse.Namespace, batch: int, tag: str, lengths: list[int] | None
) -> tuple[dict[str, float], list[int]]:
    """One round of max(2B, 8) requests: constrained when `lengths` is None, else free, each free request
    made to write exactly as many tokens as its constrained twin did (ignore_eos), so both rounds do the
    same work and differ only by the constraint."""
    n = max(2 * batch, 8)
    slots = asyncio.Semaphore(batch)
    stats: dict[str, float] = {"tokens": 0, "valid": 0, "invalid": 0, "truncated": 0}
    written = [0] * n

    async def one(i: int) -> None:
        kind = "free" if lengths is not None else "constrained"
        body: dict[str, Any] = {
            "model": args.model,
            "prompt": _prompt(f"{kind} {batch} {tag}", i),
            "temperature": 1.0,
            "seed": i,
        }
        if lengths is None:
            body["response_format"] = _fmt(SCHEMAS[i % len(SCHEMAS)])
            body["max_tokens"] = args.structured_max_tokens
        else:
            body["max_tokens"], body["ignore_eos"] = lengths[i], True
        async with slots:
            out = await _post(client, url, body)
        if out is None:
            return
        written[i] = out["usage"]["completion_tokens"]
        stats["tokens"] += written[i]
        choice = out["choices"][0]
        if lengths is not None:
            return
        if choice["finish_reason"] == "length":
            stats["truncated"] += 1
        elif _valid(choice["text"], SCHEMAS[i % len(SCHEMAS)]):
            stats["valid"] += 1
        else:
            stats["invalid"] += 1

    start, cpu = time.perf_counter(), cpu_seconds(args.server_pid)
    await asyncio.gather(*(one(i) for i in range(n)))
    stats["seconds"] = time.perf_counter() - start
    stats["cpu"] = cpu_seconds(args.server_pid) - cpu
    return stats, written


async def _pairs(
    client: Any, url: str, args: argparse.Namespace, batch: int
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """The warm-up pair, then the measured pairs in alternating order. A free round writes exactly what the
    latest constrained round wrote, request by request."""
    _, lengths = await _round(client, url, args, batch, "warm-up", None)
    await _round(client, url, args, batch, "warm-up", lengths)
    free, cons = [], []
    for k in range(args.structured_rounds):
        for kind in pair_order(k):
            if kind == "constrained":
                stats, lengths = await _round(client, url, args, batch, str(k), None)
                cons.append(stats)
            else:
                free.append((await _round(client, url, args, batch, str(k), lengths))[0])
    return free, cons


async def _compile_times(client: Any, url: str, args: argparse.Namespace) -> list[float]:
    """Per schema: a new schema's 1-token request less the same request with the schema cached."""
    out = []
    for i, schema in enumerate(SCHEMAS):
        body = {"model": args.model, "prompt": "x", "max_tokens": 1, "temperature": 0}
        body["response_format"] = _fmt(schema, f"compile-{time.time_ns()}-{i}")
        t0 = time.perf_counter()
        await _post(client, url, body)
        fresh = time.perf_counter() - t0
        t0 = time.perf_counter()
        await _post(client, url, body)
        cached = time.perf_counter() - t0
        out.append(max(0.0, fresh - cached))
    return out


def _large_schema(nonce: str) -> dict[str, Any]:
    """Hundreds of patterned and enumerated properties: a compile of a visible fraction of a second."""
    props: dict[str, Any] = {}
    for i in range(3000):
        if i % 2:
            props[f"field_{i}"] = {
                "type": "string",
                "pattern": f"^[a-z]{{{1 + i % 5}}}-[0-9]{{{1 + i % 7}}}$",
            }
        else:
            props[f"field_{i}"] = {"type": "string", "enum": [f"v{i}_{k}" for k in range(12)]}
    return {"type": "object", "properties": props, "required": list(props)[:50], "description": nonce}


async def _health_during_compile(client: Any, base: str, url: str, args: argparse.Namespace) -> dict:
    async def probe(until: asyncio.Event | float) -> list[float]:
        times = []
        while (not until.is_set()) if isinstance(until, asyncio.Event) else time.perf_counter() < until:
            t0 = time.perf_counter()
            if await client.request("GET", f"{base}/health") is None:
                break
            times.append(time.perf_counter() - t0)
            await asyncio.sleep(0.005)
        return times

    idle = await probe(time.perf_counter() + 1.0)
    done = asyncio.Event()
    body = {"model": args.model, "prompt": "x", "max_tokens": 1, "temperature": 0}
    body["response_format"] = _fmt(_large_schema(f"large-{time.time_ns()}"))

    async def compile_once() -> float:
        t0 = time.perf_counter()
        try:
            await _post(client, url, body)
        finally:
            done.set()
        return time.perf_counter() - t0

    seconds, during = await asyncio.gather(compile_once(), probe(done))
    if client.failed:
        raise _Failed
    during = during or [0.0]
    return {
        "large_schema_request_s": round(seconds, 3),
        "health_idle_p50_ms": round(_pct(idle, 0.5) * 1e3, 1),
        "health_idle_max_ms": round(max(idle) * 1e3, 1),
        "health_during_compile_p50_ms": round(_pct(during, 0.5) * 1e3, 1),
        "health_during_compile_max_ms": round(max(during) * 1e3, 1),
        "health_probes_during_compile": len(during),
    }


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


async def _run(args: argparse.Namespace, failed: Counter[str]) -> dict[str, Any]:
    import httpx

    base = args.url.rstrip("/").removesuffix("/v1")
    url = base + "/v1/completions"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = dict(args.header)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as http:
        client = _Client(http, failed)

        def check() -> None:
            if client.failed:
                raise _Failed

        compile_s = await _compile_times(client, url, args)
        check()
        blocking = await _health_during_compile(client, base, url, args)
        check()
        rows = []
        for batch in args.structured_batch:
            print(f"batch {batch}: free and constrained rounds", file=sys.stderr)
            free, cons = await _pairs(client, url, args, batch)
            check()
            free_tps = sum(r["tokens"] for r in free) / sum(r["seconds"] for r in free)
            cons_tps = sum(r["tokens"] for r in cons) / sum(r["seconds"] for r in cons)
            done = sum(r["valid"] + r["invalid"] for r in cons)
            cpu: dict[str, Any] = {}
            if args.server_pid is not None:
                free_cpu = 1e3 * sum(r["cpu"] for r in free) / sum(r["tokens"] for r in free)
                cons_cpu = 1e3 * sum(r["cpu"] for r in cons) / sum(r["tokens"] for r in cons)
                cpu = {
                    "free_cpu_ms_per_token": round(free_cpu, 2),
                    "constrained_cpu_ms_per_token": round(cons_cpu, 2),
                    "cpu_overhead_pct": round(100 * (cons_cpu / free_cpu - 1), 1),
                }
            rows.append(
                {
                    "batch": batch,
                    "free_tok_s": round(free_tps, 1),
                    "constrained_tok_s": round(cons_tps, 1),
                    "overhead_pct": round(100 * (1 - cons_tps / free_tps), 1),
                    "valid": sum(r["valid"] for r in cons),
                    "invalid": sum(r["invalid"] for r in cons),
                    "truncated": sum(r["truncated"] for r in cons),
                    "valid_pct_of_finished": round(100 * sum(r["valid"] for r in cons) / done, 1)
                    if done
                    else None,
                    **cpu,
                }
            )
    return {
        "schemas": len(SCHEMAS),
        "compile_p50_ms": round(_pct(compile_s, 0.5) * 1e3, 2),
        "compile_p99_ms": round(_pct(compile_s, 0.99) * 1e3, 2),
        "compile_mean_ms": round(statistics.fmean(compile_s) * 1e3, 2),
        **blocking,
        "batches": rows,
    }


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in vars(args).items() if not callable(v)}


async def _run_or_fail(args: argparse.Namespace) -> dict[str, Any]:
    failed: Counter[str] = Counter()
    try:
        return {"args": _settings(args), **await _run(args, failed), "failed": {}}
    except _Failed:
        return {"args": _settings(args), "failed": dict(failed)}


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(_run_or_fail(args))
    if result["failed"]:
        failed = ", ".join(f"{kind} x{n}" for kind, n in sorted(result["failed"].items()))
        print(f"failed {failed}; stopped")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
        return 1
    for row in result["batches"]:
        print(
            f"batch {row['batch']:>3}: free {row['free_tok_s']:8.1f} tok/s  constrained "
            f"{row['constrained_tok_s']:8.1f} tok/s  overhead {row['overhead_pct']:5.1f} %  valid "
            f"{row['valid']}/{row['valid'] + row['invalid']} finished ({row['truncated']} truncated)"
        )
        if "cpu_overhead_pct" in row:
            print(
                f"           server CPU per token: free {row['free_cpu_ms_per_token']:.2f} ms  constrained "
                f"{row['constrained_cpu_ms_per_token']:.2f} ms  overhead {row['cpu_overhead_pct']:5.1f} %"
            )
    print(
        f"compile (client-side, {result['schemas']} schemas): p50 {result['compile_p50_ms']} ms, "
        f"p99 {result['compile_p99_ms']} ms"
    )
    print(
        f"/health while a large schema compiles ({result['large_schema_request_s']} s request): p50 "
        f"{result['health_during_compile_p50_ms']} ms, max {result['health_during_compile_max_ms']} ms over "
        f"{result['health_probes_during_compile']} probes (idle: p50 {result['health_idle_p50_ms']} ms, "
        f"max {result['health_idle_max_ms']} ms)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if all(r["invalid"] == 0 for r in result["batches"]) else 1


def add_arguments(add: Any, positive_int: Any) -> None:
    add("--structured", action="store_true", help="JSON-schema-constrained against free requests")
    add("--structured-batch", type=positive_int, nargs="+", default=[1, 32], metavar="B")
    add("--structured-rounds", type=positive_int, default=2, metavar="N", help="free/constrained pairs")
    add("--structured-max-tokens", type=positive_int, default=96, metavar="N")
    add("--server-pid", type=positive_int, metavar="PID", help="the server's process: also its CPU per token")
