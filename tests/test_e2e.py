"""End-to-end scenarios: the real operator, real `ember serve` processes run by the process kubelet, and
traffic through each Service's published local address (the service proxy). No mocks.

One control plane serves every scenario; each scenario uses InferenceServices of its own and deletes them
at its end, so that no more than a few engine processes run at once. Deletion, kubectl, admission, `/scale`
and the operator stopped and restarted are in test_e2e_lifecycle.py, on a control plane of its own.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import plainhttp
import pytest
from e2e_harness import (
    NAMESPACE,
    ControlPlane,
    Load,
    alive,
    burst,
    container_pid,
    container_status,
    control_plane,
    elapsed_since,
    fresh_client,
    pod_counter,
    ready,
    say,
)
from waiting import wait_for

from ember_operator.desired import HASH_LABEL


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("e2e"), tiny_model) as plane:
        yield plane


def names(pods: list[dict[str, Any]]) -> set[str]:
    return {p["metadata"]["name"] for p in pods}


# -- 1 ----------------------------------------------------------------------------------------------------


def test_apply_then_a_chat_completion_is_served_through_the_service(cp: ControlPlane) -> None:
    cp.create("chat", replicas={"min": 1, "max": 1})
    cp.wait_converged("chat", 1, 0)
    base = cp.url("chat")
    assert cp.status("chat")["endpoint"] == base, "status.endpoint should be the Service's published address"

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", timeout=30, max_retries=3)
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8
    )
    assert reply.choices[0].message.content is not None, "a chat completion with content"
    assert reply.usage is not None and reply.usage.completion_tokens > 0, "completion tokens were generated"
    (pod,) = cp.pods("chat", "active")
    assert pod_counter(pod, "vllm:request_success_total") >= 1, "the active pod served the request"
    cp.remove("chat")


# -- 2 ----------------------------------------------------------------------------------------------------


def test_a_load_spike_promotes_the_warm_pod_and_refills_the_pool(cp: ControlPlane) -> None:
    cp.create(
        "spike",
        engine={"maxNumSeqs": 1},
        replicas={"min": 1, "max": 2},
        warmPool={"size": 1},
        autoscaling={"intervalSeconds": 1, "queueDepthPerReplica": 1, "scaleDownStabilizationSeconds": 300},
    )
    cp.wait_converged("spike", 1, 1)
    (first,) = cp.pods("spike", "active")
    (warm,) = cp.pods("spike", "warm")
    warm_name, warm_uid, warm_pid = warm["metadata"]["name"], warm["metadata"]["uid"], container_pid(warm)
    assert warm_pid is not None and alive(warm_pid), "the warm pod's engine process runs"
    assert pod_counter(warm, "vllm:request_success_total") == 0, "a warm pod gets no traffic"

    t0 = time.monotonic()
    with Load(cp.url("spike"), clients=4, max_tokens=64) as load:
        wait_for(
            lambda: warm_name in names(cp.pods("spike", "active")),
            timeout=60,
            what="the warm pod promoted to active under load",
        )
        promoted_after = elapsed_since(t0)
        promoted = cp.pod(warm_name)
        assert promoted is not None and promoted["metadata"]["uid"] == warm_uid, "the same pod, not a new one"
        assert container_pid(promoted) == warm_pid and alive(warm_pid), "the same engine process"
        assert container_status(promoted)["restartCount"] == 0, "the promoted engine was not restarted"

        wait_for(
            lambda: pod_counter(promoted, "vllm:request_success_total") > 0,
            timeout=30,
            what="the promoted pod serving requests (its vllm:request_success_total > 0)",
        )
        serving_after = elapsed_since(t0)
        say(
            f"\nspike -> warm pod promoted: {promoted_after} s; spike -> promoted pod serving: {serving_after} s"
        )

        new_warm = wait_for(
            lambda: [
                p
                for p in cp.pods("spike", "warm")
                if p["metadata"]["name"] not in {warm_name} | names([first])
            ],
            timeout=30,
            what="a new warm pod created to refill the pool",
        )
        wait_for(
            lambda: cp.shape("spike") == (2, 1) and cp.is_true("spike", "WarmPoolReady"),
            timeout=90,
            what=f"2 active + the refilled warm pod {new_warm[0]['metadata']['name']} Ready",
        )
        assert cp.status("spike")["desiredReplicas"] == 2
        assert first["metadata"]["name"] in names(cp.pods("spike", "active")), "the first pod still active"
    statuses = load.statuses()
    assert statuses.get(200, 0) > 0 and set(statuses) == {200}, f"every request served, got {statuses}"
    cp.remove("spike")


# -- 3 ----------------------------------------------------------------------------------------------------


def test_overload_sheds_with_retry_after_then_overflows_to_the_fallback(cp: ControlPlane) -> None:
    shedding = {"maxQueueDepth": 1, "retryAfterSeconds": 2}
    cp.create(
        "busy",
        engine={"maxNumSeqs": 1},
        replicas={"min": 1, "max": 1},
        loadShedding=shedding,
        autoscaling={"intervalSeconds": 1},
    )
    cp.create("spare", engine={"maxNumSeqs": 4}, replicas={"min": 1, "max": 1})
    cp.wait_converged("busy", 1, 0)
    cp.wait_converged("spare", 1, 0)
    base = cp.url("busy")

    outcomes = burst(base, 6, max_tokens=128)
    shed = [o for o in outcomes if o.status == 503]
    assert shed, f"a 503 for requests beyond maxQueueDepth, got {[o.status for o in outcomes]}"
    assert all(o.headers.get("retry-after") == "2" for o in shed), "each 503 carries Retry-After: 2"
    assert all(json.loads(o.body)["error"]["code"] == "queue_full" for o in shed), "shed as queue_full"
    assert any(o.status == 200 for o in outcomes), "requests within the limit are served"
    assert not any(o.fallback for o in outcomes), "no fallback configured yet"

    cp.patch_spec("busy", {"fallback": {"service": "spare"}})
    spare_url = cp.url("spare")
    wait_for(
        lambda: spare_url in cp.api.get("v1", "ConfigMap", NAMESPACE, "busy-policy")["data"]["policy.yaml"],
        what="the fallback's published address in busy's policy",
    )

    def overflow_served() -> list[Any]:
        outcomes = burst(base, 6, max_tokens=128)
        return (
            outcomes if all(o.status == 200 for o in outcomes) and any(o.fallback for o in outcomes) else []
        )

    outcomes = wait_for(
        overflow_served, timeout=30, what="a burst answered 200 throughout, overflow by the fallback"
    )
    served_by_fallback = sum(o.fallback for o in outcomes)
    (spare_pod,) = cp.pods("spare", "active")
    assert pod_counter(spare_pod, "vllm:request_success_total") >= served_by_fallback, "spare served them"

    with Load(base, clients=4, max_tokens=128) as load:
        wait_for(
            lambda: len(load.outcomes) >= 8 and cp.is_true("busy", "FallbackActive"),
            timeout=30,
            what="busy's FallbackActive=True while it overflows",
        )
        assert "served by the fallback" in cp.condition("busy", "FallbackActive")["message"]
    assert set(load.statuses()) == {200}, f"overflow served, not shed: {load.statuses()}"
    assert cp.condition("spare", "FallbackActive").get("status") != "True", "spare has no fallback of its own"
    cp.remove("busy", "spare")


# -- 4 ----------------------------------------------------------------------------------------------------


def test_a_killed_engine_is_restarted_and_a_request_in_flight_does_not_hang(cp: ControlPlane) -> None:
    cp.create("crash", replicas={"min": 1, "max": 1})
    cp.wait_converged("crash", 1, 0)
    (pod,) = cp.pods("crash", "active")
    pod_name, pid = pod["metadata"]["name"], container_pid(pod)
    assert pid is not None and alive(pid), "the engine process runs"
    base = cp.url("crash")

    client_timeout = 30.0
    first_chunk = threading.Event()
    result: dict[str, Any] = {}

    def in_flight() -> None:
        t0 = time.monotonic()
        try:
            with (
                fresh_client(client_timeout) as client,
                client.stream(
                    "POST",
                    f"{base}/v1/completions",
                    json={
                        "model": "tiny",
                        "prompt": "hi",
                        "max_tokens": 1800,
                        "ignore_eos": True,
                        "stream": True,
                    },
                ) as r,
            ):
                for _ in r.iter_lines():
                    first_chunk.set()
                result["outcome"] = f"completed with status {r.status_code}"
        except httpx.HTTPError as e:
            result["outcome"] = f"error {type(e).__name__}: {e}"
        finally:
            result["seconds"] = time.monotonic() - t0
            first_chunk.set()

    thread = threading.Thread(target=in_flight, daemon=True)
    thread.start()
    assert first_chunk.wait(client_timeout), "the streamed request started"
    assert thread.is_alive(), f"the request is still in flight at the kill, got {result}"

    stalled_seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watch_stalled() -> None:
        while not stop.wait(0.05):
            c = cp.condition("crash", "Stalled")
            if c.get("status") == "True":
                stalled_seen.append(c)

    watcher = threading.Thread(target=watch_stalled, daemon=True)
    watcher.start()
    try:
        os.kill(pid, signal.SIGKILL)
        thread.join(client_timeout + 5)
        assert not thread.is_alive(), (
            f"the in-flight request returned within its {client_timeout:g} s timeout"
        )
        say(f"\nin-flight request at the kill: {result['outcome']} after {result['seconds']:.1f} s")
        assert result["seconds"] < client_timeout, f"it returned before the client timeout: {result}"

        def recovered() -> bool:
            pods = cp.pods("crash", "active")
            if len(pods) != 1 or not ready(pods[0]):
                return False
            p = pods[0]
            restarted = p["metadata"]["name"] == pod_name and container_status(p)["restartCount"] >= 1
            replaced = p["metadata"]["name"] != pod_name
            new_pid = container_pid(p)
            return (restarted or replaced) and new_pid not in (None, pid) and cp.converged("crash", 1, 0)

        wait_for(
            recovered, timeout=90, what="the engine restarted (or the pod replaced) and Ready=True again"
        )
    finally:
        stop.set()
        watcher.join()
    assert not alive(pid), "the killed process is gone"
    with fresh_client(30) as client:
        reply = wait_for(
            lambda: client.post(
                f"{base}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4}
            ),
            timeout=30,
            what="a request served after the recovery",
        )
    assert reply.status_code == 200, reply.text
    assert cp.condition("crash", "Stalled").get("status") == "False", "Stalled=False once recovered"
    if stalled_seen:
        say(f"Stalled=True was reported while the engine restarted: {stalled_seen[0]}")
    cp.remove("crash")


# -- 5 ----------------------------------------------------------------------------------------------------


def test_a_policy_change_applies_live_and_an_engine_change_rolls_without_dropping_capacity(
    cp: ControlPlane,
) -> None:
    cp.create(
        "tune",
        engine={"maxNumSeqs": 1},
        replicas={"min": 1, "max": 1},
        loadShedding={"maxQueueDepth": 50},
    )
    cp.wait_converged("tune", 1, 0)
    (pod,) = cp.pods("tune", "active")
    pod_name, pid = pod["metadata"]["name"], container_pid(pod)
    base = cp.url("tune")
    assert "maxQueueDepth: 50" in cp.policy_file(pod_name), "the kubelet materialised the policy file"
    outcomes = burst(base, 5, max_tokens=128)
    assert all(o.status == 200 for o in outcomes), (
        f"no shedding below 50 queued: {[o.status for o in outcomes]}"
    )

    cp.patch_spec("tune", {"loadShedding": {"maxQueueDepth": 1}})
    wait_for(
        lambda: "maxQueueDepth: 1\n" in cp.policy_file(pod_name),
        what="the new limit in the running pod's policy file",
    )

    def sheds() -> bool:
        return any(o.status == 503 for o in burst(base, 5, max_tokens=128))

    wait_for(sheds, timeout=30, what="the running engine shedding at the new maxQueueDepth 1")
    assert "took effect" in cp.engine_log(pod_name), "the engine logged the policy reload"
    (same,) = cp.pods("tune")
    assert same["metadata"]["name"] == pod_name, "no new pod for a policy change"
    assert container_pid(same) == pid and container_status(same)["restartCount"] == 0, "no engine restart"

    old_hash = same["metadata"]["labels"][HASH_LABEL]
    lowest = [1]
    stop = threading.Event()

    def watch_capacity() -> None:
        while not stop.wait(0.02):
            lowest[0] = min(lowest[0], cp.shape("tune")[0])

    watcher = threading.Thread(target=watch_capacity, daemon=True)
    watcher.start()
    try:
        with Load(base, clients=1, max_tokens=16) as load:
            cp.patch_spec("tune", {"engine": {"maxNumSeqs": 2}})
            wait_for(
                lambda: cp.converged("tune", 1, 0) and pod_name not in names(cp.pods("tune", deleting=True)),
                timeout=90,
                what="the pod replaced by one with the new engine settings",
            )
    finally:
        stop.set()
        watcher.join()
    assert lowest[0] >= 1, "Ready active pods stayed at replicas.min (1) or more throughout the roll"
    (new,) = cp.pods("tune")
    assert new["metadata"]["labels"][HASH_LABEL] != old_hash, "a new template hash"
    assert "--max-num-seqs=2" in new["spec"]["containers"][0]["args"]
    assert not alive(pid), "the old engine process is gone"
    assert set(load.statuses()) == {200}, f"every request during the roll served, got {load.statuses()}"
    cp.remove("tune")


# -- 6: real-cluster semantics ------------------------------------------------------------------------------


def test_killing_the_only_active_engine_promotes_the_warm_pod_at_once(cp: ControlPlane) -> None:
    cp.create("failover", replicas={"min": 1, "max": 1}, warmPool={"size": 1})
    cp.wait_converged("failover", 1, 1)
    (victim,) = cp.pods("failover", "active")
    (standby,) = cp.pods("failover", "warm")
    pid = container_pid(victim)
    assert pid is not None
    base = cp.url("failover")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    def served_by_standby() -> bool:
        active = cp.pods("failover", "active")
        if names(active) != {standby["metadata"]["name"]}:
            return False
        return plainhttp.get(f"{base}/v1/models", timeout=2).status_code == 200

    wait_for(served_by_standby, timeout=10, what="the warm pod serving in the killed one's place")
    say(f"\nSIGKILL to the warm pod serving through the Service: {time.monotonic() - killed:.2f} s")
    cp.wait_converged("failover", 1, 1)  # the pool refilled
    cp.remove("failover")
