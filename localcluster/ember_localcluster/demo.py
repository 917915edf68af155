"""`ember demo`: the operator at work on the local control plane, narrated step by step.

It starts the local control plane (`ember dev up`, in a state directory and on a port of its own), applies
`examples/local-fallback.yaml` with kubectl (`demo_kubectl`: the Python client where there is no
kubectl), waits for both InferenceServices to be Ready, streams a chat completion through `tiny`'s
Service, starts a load spike that makes the operator promote `tiny`'s warm pod (`kubectl get eis -w`
lines meanwhile), sends a burst beyond what `tiny` and its fallback can queue (served by `tiny`, by the
fallback, or shed with a 503 and Retry-After), deletes the example and stops the control plane. Every
request goes to the address the InferenceService publishes (`status.endpoint`, its Service), whatever
serves behind it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROLE = "ember.dev/role"
MODEL = "tiny"
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "local-fallback.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="state directory for the control plane (default: a new temporary one)")
    p.add_argument("--port", type=int, default=0, help="API server port (default: a free one)")
    p.add_argument(
        "--kubectl",
        default=shutil.which("kubectl") or "",
        help="the kubectl to run (default: the one on PATH, %(default)r); '' for the Kubernetes Python "
        "client in its place",
    )
    p.add_argument("--example", default=str(EXAMPLE), help="what to apply (default: %(default)s)")
    p.add_argument(
        "--timeout", type=float, default=120, help="seconds each step may wait (default: %(default)s)"
    )


def say(title: str, *lines: str) -> None:
    print(f"\n== {title}", flush=True)
    for line in lines:
        print(f"   {line}", flush=True)


def main(args: argparse.Namespace) -> int:
    start = time.monotonic()
    directory = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="ember-demo-"))
    port = args.port or _free_port()
    ember = str(Path(sys.executable).parent / "ember")
    dev = ["--dir", str(directory)]
    say(
        "1. The local control plane",
        "An API server, the scheduler, the deployment controllers, a kubelet that runs each pod as local",
        "processes (engines on the CPU), a service proxy that gives each Service a local address, and the",
        "operator (kopf) watching InferenceServices.",
    )
    example = Path(args.example)
    if not example.is_file():
        print(f"ember demo: no {example}: run it from a clone of the repository, or pass --example")
        return 1
    if _ember(ember, "dev", "up", *dev, "--port", str(port)) != 0:
        return 1
    failed: Exception | None = None
    try:
        Demo(directory, example, args.timeout, args.kubectl).run()
    except (TimeoutError, RuntimeError, OSError) as error:  # said plainly; the log tells the rest
        failed = error
        print(f"\nember demo: {error}\nember demo: the control plane's log: {directory / 'dev.log'}")
    finally:
        say("8. Teardown", "Stops the control plane; it returns once every engine process has exited.")
        stopped = _ember(ember, "dev", "down", *dev) == 0
    if failed is None and stopped and not args.dir:
        shutil.rmtree(directory, ignore_errors=True)  # the temporary state: engine logs, test checkpoint
    print(f"\nThe demo took {time.monotonic() - start:.0f} s.", flush=True)
    return 0 if failed is None and stopped else 1


def _ember(ember: str, *args: str) -> int:
    print(f"$ ember {' '.join(args)}", flush=True)
    done = subprocess.run([ember, *args], capture_output=True, text=True, timeout=180)
    for line in (done.stdout + done.stderr).splitlines():
        print(f"  {line}", flush=True)
    return done.returncode


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Demo:
    def __init__(self, directory: Path, example: Path, timeout: float, kubectl: str) -> None:
        from ember_localcluster.demo_kubectl import EisWatch, Kubectl

        self.kubectl = Kubectl(directory / "kubeconfig", directory / "kubectl-cache", binary=kubectl)
        self.watch = EisWatch(self.kubectl)
        self.example = example
        self.timeout = timeout

    def run(self) -> None:
        k = self.kubectl
        print(f"   kubectl here: {k.how}", flush=True)
        k.show("get", "nodes")
        say(
            "2. Apply the example",
            f"{self.example.name}: `tiny` (1 to 2 engine pods plus one loaded standby in a warm pool, a",
            "short queue per pod, the overflow handed to `tiny-fallback`) and `tiny-fallback`.",
        )
        k.show("apply", "-f", str(self.example))
        say(
            "3. Ready",
            "The operator creates each one's engine pods, its routers (a Deployment of `ember router`), its",
            "Service (which selects the routers) and policy ConfigMap; the kubelet starts the processes; each",
            "is Ready when its engines answer /ready, and reachable once its routers are Ready too (ROUTERS:",
            "Ready routers / wanted).",
        )
        with self.watch.running():
            self.wait(lambda: self.ready("tiny", warm=True) and self.ready("tiny-fallback"), "both Ready")
        k.show("get", "pods", "-L", ROLE)
        base = self.endpoint("tiny")
        say(
            "4. A streamed chat through the Service",
            f"POST {base}/v1/chat/completions (stream), the address in tiny's status.endpoint; a router",
            "picks the engine. The model is a random-weight test checkpoint: its words are noise; they",
            "arrive token by token.",
        )
        self.stream_chat(base)
        self.spike(base)
        self.overload(base)
        say(
            "7. Delete", "The pods, Services and ConfigMaps go with their owners; the engines drain and exit."
        )
        k.show("delete", "-f", str(self.example))
        self.wait(lambda: not self.kubectl.read("pods")["items"], "every pod gone")
        k.show("get", "pods")

    # -- steps ---------------------------------------------------------------------------------------------

    def stream_chat(self, base: str) -> None:
        import httpx

        body = {
            "model": MODEL,
            "stream": True,
            "max_tokens": 24,
            "messages": [{"role": "user", "content": "Say hello to the cluster."}],
        }
        sent, first, tokens = time.monotonic(), 0.0, 0
        print("   ", end="", flush=True)
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                choices = json.loads(line[6:]).get("choices") or [{}]
                text = (choices[0].get("delta") or {}).get("content") or ""
                if text:
                    first = first or time.monotonic()
                    tokens += 1
                    print(text, end="", flush=True)
        print(f"\n   [{tokens} chunks; the first after {1000 * (first - sent):.0f} ms]", flush=True)

    def spike(self, base: str) -> None:
        (warm,) = self.pods("tiny", "warm")
        say(
            "5. A load spike",
            "5 clients send requests back to back. The queue grows; the autoscaler (every second) wants a",
            f"second pod and the operator relabels the warm pod {warm} as active: the same process, already",
            "loaded, serves at once. Then it starts a new warm pod to refill the pool.",
        )
        stop = threading.Event()
        load = ThreadPoolExecutor(5)
        codes: Counter[str] = Counter()
        for _ in range(5):
            load.submit(self._client, base, stop, codes)
        t0 = time.monotonic()
        try:
            with self.watch.running():
                self.wait(lambda: warm in self.pods("tiny", "active"), f"{warm} promoted")
                print(
                    f"   -- {warm} promoted from warm to active {time.monotonic() - t0:.1f} s into the spike"
                )
                self.wait(lambda: self.ready("tiny", warm=True, active=2), "the warm pool refilled")
        finally:
            stop.set()
            load.shutdown()
        served = ", ".join(f"{n} × {code}" for code, n in sorted(codes.items()))
        print(f"   the spike's requests: {served}", flush=True)
        self.kubectl.show("get", "pods", "-L", ROLE)

    def overload(self, base: str) -> None:
        say(
            "6. An overload",
            "40 requests at once. Each of tiny's pods runs 2 and queues a few (loadShedding.maxQueueDepth);",
            "beyond that the request goes to tiny-fallback (whose reply carries x-ember-served-by:",
            "fallback); what neither can take is shed at once: a 503 with Retry-After (fleet_overloaded",
            "from a router, queue_full from an engine), so that clients back off instead of piling up.",
        )
        barrier = threading.Barrier(40)
        with ThreadPoolExecutor(40) as pool:
            outcomes = list(pool.map(lambda _: self._one(base, barrier), range(40)))
        tally = Counter(what for what, _ in outcomes)
        for what, n in sorted(tally.items()):
            print(f"   {n:3d} × {what}", flush=True)
        shed = next((extra for what, extra in outcomes if what.startswith("503")), None)
        if shed:
            print(f"   a shed reply: {shed}", flush=True)

    # -- helpers -------------------------------------------------------------------------------------------

    def _client(self, base: str, stop: threading.Event, codes: Counter[str]) -> None:
        import httpx

        body = {"model": MODEL, "prompt": "hello", "max_tokens": 48, "ignore_eos": True}
        # A new connection each time, as from many clients: the Service balances connections. One client
        # all the same (a client per request parses the CA bundle each time, a good part of a core here).
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(timeout=60, limits=limits) as client:
            while not stop.is_set():
                try:
                    r = client.post(f"{base}/v1/completions", json=body)
                    codes[str(r.status_code)] += 1
                except httpx.HTTPError as e:
                    codes[type(e).__name__] += 1

    def _one(self, base: str, barrier: threading.Barrier) -> tuple[str, str]:
        import httpx

        body = {"model": MODEL, "prompt": "hello", "max_tokens": 96, "ignore_eos": True}
        with httpx.Client(timeout=120) as client:
            barrier.wait()
            try:
                r = client.post(f"{base}/v1/completions", json=body)
            except httpx.HTTPError as e:
                return type(e).__name__, ""
        if r.status_code == 200:
            by = r.headers.get("x-ember-served-by")
            return (
                "200 served by tiny-fallback (x-ember-served-by: fallback)" if by else "200 served by tiny"
            ), ""
        error = (
            (r.json().get("error") or {})
            if r.headers.get("content-type", "").startswith("application/json")
            else {}
        )
        what = f"{r.status_code} {error.get('code', '')} Retry-After: {r.headers.get('retry-after')}"
        return (
            what,
            f"{r.status_code}, Retry-After: {r.headers.get('retry-after')}, {error.get('message', r.text[:120])}",
        )

    def wait(self, check: Any, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            with contextlib.suppress(Exception):  # the API briefly unreachable: try again
                if check():
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {self.timeout:g} s for {what}")
            time.sleep(0.25)

    def eis(self, name: str) -> dict[str, Any]:
        return self.kubectl.read("eis", name)

    def ready(self, name: str, warm: bool = False, active: int = 1) -> bool:
        status = self.eis(name).get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
        # The Service selects the routers: until they are Ready too, nothing reaches the engines; the demo
        # waits for every router it wants, so that the spike goes through all of them.
        routers = status.get("router") or {}
        return (
            conditions.get("Ready") == "True"
            and conditions.get("RouterReady") == "True"
            and (routers.get("ready") or 0) >= (routers.get("desired") or 0)
            and (not warm or conditions.get("WarmPoolReady") == "True")
            and (status.get("readyReplicas") or 0) >= active
            and bool(status.get("endpoint"))
        )

    def endpoint(self, name: str) -> str:
        return str(self.eis(name)["status"]["endpoint"])

    def pods(self, name: str, role: str) -> list[str]:
        selector = f"app.kubernetes.io/instance={name},{ROLE}={role}"
        pods = self.kubectl.read("pods", selector=selector)["items"]
        return [p["metadata"]["name"] for p in pods if not p["metadata"].get("deletionTimestamp")]
