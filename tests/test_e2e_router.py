"""End to end on the local control plane: the operator runs `ember router` as a Deployment (real router
processes started by the process kubelet from the deployment and replicaset controllers' pods), the
InferenceService's Service reaches the engines through it, a warm pod the operator promotes receives
traffic within a second, a service scaled to zero holds its first request until an engine serves it, and
killing a router replica mid-stream ends that stream with an error or its
end, never silence, while the other replica serves the next request."""

from __future__ import annotations

import os
import random
import signal
import string
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2e_harness import (
    MODEL,
    NAMESPACE,
    ControlPlane,
    container_pid,
    container_status,
    control_plane,
    pod_ip,
    ready,
    say,
)
from waiting import wait_for

NAME = "front"
ROUTER_SELECTOR = f"app.kubernetes.io/name=ember-router,ember.dev/router={NAME}"


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("e2e-router"), tiny_model) as plane:
        plane.create(
            NAME,
            router={"enabled": True, "replicas": 2},
            replicas={"min": 1, "max": 1},
            warmPool={"size": 1},
        )
        yield plane


def routers(cp: ControlPlane) -> list[dict[str, Any]]:
    pods = cp.api.list("v1", "Pod", NAMESPACE, label_selector=ROUTER_SELECTOR)
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def prompt() -> str:
    """A prompt shorter than one KV block, so no engine holds its prefix and load alone decides."""
    return "".join(random.choices(string.ascii_lowercase, k=6))


def body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": prompt(),
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def routed_ok(cp: ControlPlane) -> bool:
    with httpx.Client(timeout=30) as client:
        r = client.post(f"{cp.url(NAME)}/v1/completions", json=body(2))
    return r.status_code == 200 and "x-ember-routed-to" in r.headers


def test_the_service_reaches_the_engines_through_the_router(cp: ControlPlane) -> None:
    wait_for(lambda: cp.converged(NAME, 1, 1), 120, lambda: cp.describe(NAME))
    wait_for(
        lambda: (cp.status(NAME).get("router") or {}).get("summary") == "2/2",
        60,
        lambda: f"2/2 routers Ready: {cp.status(NAME).get('router')}",
    )
    assert cp.condition(NAME, "RouterReady")["reason"] == "RouterAvailable"
    pods = routers(cp)
    assert len(pods) == 2 and all(ready(p) for p in pods)
    owner = pods[0]["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "ReplicaSet" and owner["name"].startswith(f"{NAME}-router-")
    # Each router pod is a real `ember router` process.
    for p in pods:
        pid = container_pid(p)
        assert pid is not None
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"router" in argv
    wait_for(lambda: routed_ok(cp), 30, "a completion through the router")
    (active,) = cp.pods(NAME, "active")
    with httpx.Client(timeout=30) as client:
        r = client.post(f"{cp.url(NAME)}/v1/completions", json=body(3))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert r.headers["x-ember-routed-to"] == f"http://{pod_ip(active)}:8000"


def test_a_promoted_pod_receives_traffic_within_a_second(cp: ControlPlane) -> None:
    wait_for(lambda: cp.converged(NAME, 1, 1), 120, lambda: cp.describe(NAME))
    (warm,) = [p for p in cp.pods(NAME, "warm") if ready(p)]
    target = f"http://{pod_ip(warm)}:8000"
    seen: dict[str, float] = {}
    stop = threading.Event()

    def traffic() -> None:
        # Two clients, so that both engines have work once both may take it.
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                r = client.post(f"{cp.url(NAME)}/v1/completions", json=body(4))
                to = r.headers.get("x-ember-routed-to", "")
                if r.status_code == 200 and to not in seen:
                    seen[to] = time.monotonic()

    threads = [threading.Thread(target=traffic, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(seen) == 1, 30, "traffic on the active engine")
        assert target not in seen
        cp.patch_spec(NAME, {"replicas": {"min": 2, "max": 2}})

        def promoted() -> float | None:
            pod = cp.pod(warm["metadata"]["name"])
            return (
                time.monotonic() if pod and pod["metadata"]["labels"]["ember.dev/role"] == "active" else None
            )

        promoted_at = wait_for(promoted, 30, "the warm pod promoted")
        wait_for(lambda: target in seen, 10, lambda: f"traffic on {target}: {seen}")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    # A response's arrival is after the decision; measured from when the test saw the relabel (polled
    # every 50 ms, so the promotion itself was up to 50 ms earlier).
    delay = max(0.0, seen[target] - promoted_at)
    say(f"promotion to first routed response: {delay:.3f} s")
    assert delay < 1.0


def test_a_service_at_zero_holds_the_first_request_then_serves_it(cp: ControlPlane) -> None:
    cp.create(
        "sleepy",
        router={"enabled": True, "replicas": 1, "holdSeconds": 120},
        replicas={"min": 0, "max": 1},
    )
    wait_for(
        lambda: (cp.status("sleepy").get("router") or {}).get("summary") == "1/1",
        60,
        lambda: f"the router Ready with no engine: {cp.status('sleepy')}",
    )
    assert cp.pods("sleepy") == [] and cp.status("sleepy")["desiredReplicas"] == 0
    # A client listing the models first (a chat UI does) finds the service's model at zero engines: the
    # router answered 503 there, so such a client never sent the request that scales it up.
    listed = httpx.get(f"{cp.url('sleepy')}/v1/models", timeout=30)
    assert listed.status_code == 200, listed.text
    assert [m["id"] for m in listed.json()["data"]] == [MODEL], listed.text
    assert cp.status("sleepy")["desiredReplicas"] == 0  # listing is no request to serve
    started = time.monotonic()
    with httpx.Client(timeout=180) as client:
        r = client.post(f"{cp.url('sleepy')}/v1/completions", json=body(2))
    waited = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    say(f"first request at zero: held and served after {waited:.1f} s")
    decisions = cp.status("sleepy")["autoscaler"]["decisions"]
    assert any("scale from zero" in d["reason"] and d["desired"] == 1 for d in decisions), decisions
    cp.remove("sleepy")


def test_a_router_is_not_killed_while_it_starts(cp: ControlPlane) -> None:
    """With a liveness probe that restarts at its first failure, a router still comes up on its first run:
    liveness counts only after the startup probe has seen it answer. Without one, the kubelet probed it at
    the container's start, before it listened, and killed every run."""
    cp.create(
        "brisk",
        router={"enabled": True, "replicas": 1},
        replicas={"min": 0, "max": 1},
        lifecycle={"livenessPeriodSeconds": 1, "livenessFailureThreshold": 1},
    )

    def pods() -> list[dict[str, Any]]:
        return cp.api.list("v1", "Pod", NAMESPACE, label_selector="ember.dev/router=brisk")

    pod = wait_for(
        lambda: next((p for p in pods() if ready(p)), None),
        90,
        lambda: f"a Ready router: {[container_status(p) for p in pods()]}",
    )
    assert container_status(pod)["restartCount"] == 0, container_status(pod)
    cp.remove("brisk")


def test_killing_a_router_mid_stream_ends_the_stream_and_the_other_replica_serves(cp: ControlPlane) -> None:
    assert len(routers(cp)) == 2
    # The Service balances per connection, taking its endpoints in turn: two new connections, one on
    # each router replica.
    clients = [httpx.Client(timeout=httpx.Timeout(10.0)) for _ in range(2)]
    try:
        streams = []
        for client in clients:
            request = client.build_request("POST", f"{cp.url(NAME)}/v1/completions", json=body(400, True))
            response = client.send(request, stream=True)
            assert response.status_code == 200
            lines = response.iter_lines()
            first = next(lines)
            assert first.startswith("data:"), first
            streams.append(lines)
        pid = container_pid(routers(cp)[0])
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        outcomes = []
        for lines in streams:
            try:
                outcome = "cut without an error"
                for line in lines:
                    if line == "data: [DONE]":
                        outcome = "complete"
                outcomes.append(outcome)
            except httpx.ReadTimeout:
                outcomes.append("silence")
            except httpx.HTTPError as e:
                outcomes.append(f"error: {type(e).__name__}")
        say(f"streams when a router was killed: {outcomes}")
        assert all(o == "complete" or o.startswith("error") for o in outcomes), outcomes
        assert any(o.startswith("error") for o in outcomes), outcomes
    finally:
        for client in clients:
            client.close()
    # The next request goes to the replica that lives (the proxy moves past a refused connect).
    for _ in range(2):
        with httpx.Client(timeout=30) as client:
            r = client.post(f"{cp.url(NAME)}/v1/completions", json=body(2))
        assert r.status_code == 200
