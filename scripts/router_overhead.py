"""The router's added latency, two or more builds of `ember router` side by side in one run, in front of one
`ember serve` engine (the tiny test checkpoint). One short completion at a time, as `ember bench fleet`'s
overhead phase sends them; rounds visit every build in turn, so that drift in the machine's speed touches
them all alike. Prints, per build, the median latency through the router minus the median straight to the
engine (`overhead_p50_ms`, as the bench computes it), the median over rounds of that difference within
each round (`overhead_paired_ms`, less touched by drift), and the router's own mean
`ember_router:routing_seconds` (its time before sending a request on).

    python scripts/router_overhead.py [--mode embedded|process] [--rounds 10] [--requests 30] NAME=DIR ...

A build is a directory put first on PYTHONPATH holding its `ember_router` package (an empty DIR: this
checkout's), e.g. `old=/tmp/old` after `git archive main router/ember_router | tar -x --strip-components=1
-C /tmp/old`. `--mode embedded` (default) runs each router on a thread of a process of its own that is also
the client, as `ember bench fleet` does, and measures the engine directly from there too; `--mode process`
runs each router as its own process (as deployed) and one client for all. `--profile DIR` (process mode)
runs each router under cProfile and writes DIR/NAME.prof.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from ember_engine.tools.testmodel import make_test_model


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ready(url: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready")


def _routing_mean_ms(url: str) -> float:
    """The router's own account of its time before sending a request on, on average."""
    got = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in httpx.get(f"{url}/metrics").text.splitlines()
        if line.startswith(("ember_router:routing_seconds_sum", "ember_router:routing_seconds_count"))
    }
    return round(got["ember_router:routing_seconds_sum"] / got["ember_router:routing_seconds_count"] * 1e3, 3)


async def _latencies(base: str, n: int, start_at: int) -> list[float]:
    """`ember bench fleet`'s overhead phase: one keep-alive client, one request at a time."""
    out = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        for i in range(start_at, start_at + n):
            start = time.perf_counter()
            r = await client.post(
                "/v1/completions", json={"model": "m", "prompt": f"ping {i}", "max_tokens": 1}
            )
            r.raise_for_status()
            out.append(time.perf_counter() - start)
    return out


_PROCESS_ROUTER = """
import argparse, cProfile, signal, sys
from ember_router import main
p = argparse.ArgumentParser(); main.add_arguments(p)
args = p.parse_args(sys.argv[2:])
prof = cProfile.Profile() if sys.argv[1] else None
def stop(*_):
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, stop)
try:
    if prof: prof.enable()
    main.main(args)
finally:
    if prof:
        prof.disable(); prof.dump_stats(sys.argv[1])
"""


def _worker(model: str, engine: str) -> int:
    """Embedded mode: a router on a thread here, as in `ember bench fleet`; each stdin line `N START` runs N
    requests straight to the engine, then N through the router, and prints both lists of latencies."""
    from ember_engine.core.tokenizer import Tokenizer
    from ember_router.embedded import serving
    from ember_router.pool import EnginePool
    from ember_router.proxy import Router

    router = Router(EnginePool([engine], poll_interval=0.1), Tokenizer(model))
    with serving(router) as url:
        while not all(e.state.ready and e.events_live for e in router.pool.engines.values()):
            time.sleep(0.05)
        print("ready", flush=True)
        for line in sys.stdin:
            n, start_at = map(int, line.split())
            direct = asyncio.run(_latencies(engine, n, start_at))
            routed = asyncio.run(_latencies(url, n, start_at + n))
            print(
                json.dumps({"direct": direct, "routed": routed, "routing_mean_ms": _routing_mean_ms(url)}),
                flush=True,
            )
    return 0


def _env(path: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [path, os.environ.get("PYTHONPATH")]))}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("builds", nargs="*", help="NAME=DIR")
    p.add_argument("--mode", choices=["embedded", "process"], default="embedded")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--requests", type=int, default=30, help="requests per side per round")
    p.add_argument("--profile", help="process mode: a directory for a cProfile of each router")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "ENGINE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return _worker(*args.worker)
    procs: list[subprocess.Popen[str]] = []
    with tempfile.TemporaryDirectory(prefix="router-overhead-") as tmp:
        model = make_test_model(Path(tmp) / "model", size="tiny")
        engine = f"http://127.0.0.1:{_port()}"
        cmd = [str(Path(sys.executable).parent / "ember"), "serve", "--model", str(model)]
        cmd += ["--served-model-name", "m", "--block-size", "16", "--host", "127.0.0.1"]
        procs.append(
            subprocess.Popen(
                [*cmd, "--port", engine.rsplit(":", 1)[1]],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        builds = dict(b.partition("=")[::2] for b in args.builds)
        direct: dict[str, list[float]] = {n: [] for n in builds}
        routed: dict[str, list[float]] = {n: [] for n in builds}
        routing: dict[str, float] = {}
        paired: dict[str, list[float]] = {n: [] for n in builds}  # per round: routed p50 - direct p50
        try:
            _ready(engine)
            if args.mode == "embedded":
                workers = {}
                for name, path in builds.items():
                    me = [sys.executable, __file__, "--worker", str(model), engine]
                    w = subprocess.Popen(
                        me, env=_env(path), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
                    )
                    procs.append(w)
                    workers[name] = w
                for w in workers.values():
                    assert w.stdout is not None and w.stdout.readline().strip() == "ready"
                i = 0
                for _ in range(args.rounds):
                    for name, w in workers.items():
                        assert w.stdin is not None and w.stdout is not None
                        w.stdin.write(f"{args.requests} {i}\n")
                        w.stdin.flush()
                        got = json.loads(w.stdout.readline())
                        i += 2 * args.requests
                        direct[name] += got["direct"]
                        routed[name] += got["routed"]
                        paired[name].append(
                            statistics.median(got["routed"]) - statistics.median(got["direct"])
                        )
                        routing[name] = got["routing_mean_ms"]
                for w in workers.values():
                    assert w.stdin is not None
                    w.stdin.close()
            else:
                urls = {}
                for name, path in builds.items():
                    port = _port()
                    profile = str(Path(args.profile) / f"{name}.prof") if args.profile else ""
                    rcmd = [
                        sys.executable,
                        "-c",
                        _PROCESS_ROUTER,
                        profile,
                        "--model",
                        str(model),
                        "--endpoint",
                        engine,
                    ]
                    rcmd += ["--host", "127.0.0.1", "--port", str(port)]  # the default --log-level, info
                    procs.append(subprocess.Popen(rcmd, env=_env(path), stderr=subprocess.DEVNULL))
                    urls[name] = f"http://127.0.0.1:{port}"
                for url in urls.values():
                    _ready(url)
                time.sleep(1.0)  # every router has polled the engine
                i = 0
                for _ in range(args.rounds):
                    for name, url in urls.items():
                        d = asyncio.run(_latencies(engine, args.requests, i))
                        r = asyncio.run(_latencies(url, args.requests, i + args.requests))
                        direct[name] += d
                        routed[name] += r
                        paired[name].append(statistics.median(r) - statistics.median(d))
                        i += 2 * args.requests
                for name, url in urls.items():
                    routing[name] = _routing_mean_ms(url)
            out: dict[str, object] = {"mode": args.mode, "rounds": args.rounds, "requests": args.requests}
            for name in builds:
                d, r = statistics.median(direct[name]), statistics.median(routed[name])
                out[name] = {
                    "direct_p50_ms": round(d * 1e3, 3),
                    "routed_p50_ms": round(r * 1e3, 3),
                    "overhead_p50_ms": round((r - d) * 1e3, 3),
                    "overhead_paired_ms": round(statistics.median(paired[name]) * 1e3, 3),
                    "routing_mean_ms": routing[name],
                }
            print(json.dumps(out, indent=1))
        finally:
            for proc in reversed(procs):
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
