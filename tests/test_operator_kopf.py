"""The operator through the real kopf loop, against the in-process API server, driven with the official
`kubernetes` client: children, warm pool, autoscaling, rolls, drift, policy, stalls, External mode, GC."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import plainhttp
import pytest
import yaml
from operator_harness import NAMESPACE, TICK, PodRunner, operator_cluster, wait_for

from ember_localcluster.apiserver import APIServer
from ember_operator import metrics
from ember_operator.desired import HASH_LABEL, ROLE_LABEL
from ember_operator.spec import GROUP, PLURAL, VERSION

API_VERSION = f"{GROUP}/{VERSION}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[APIServer, PodRunner, Any]]:
    with operator_cluster(tmp_path_factory.mktemp("operator")) as running:
        yield running


def service(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": {"name": name, "source": f"/models/{name}"}, "resources": {"gpus": 0}}
    body.update(spec)
    return {"apiVersion": API_VERSION, "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def create(custom: Any, obj: dict[str, Any]) -> None:
    custom.create_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, obj)


def patch_spec(custom: Any, name: str, spec: dict[str, Any]) -> None:
    custom.patch_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name, {"spec": spec})


def get(api: APIServer, name: str) -> dict[str, Any]:
    obj = api.get(API_VERSION, "InferenceService", NAMESPACE, name)
    assert obj is not None
    return obj


def status(api: APIServer, name: str) -> dict[str, Any]:
    return get(api, name).get("status") or {}


def condition(api: APIServer, name: str, kind: str) -> dict[str, Any]:
    for c in status(api, name).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def pods(api: APIServer, name: str, role: str | None = None) -> list[dict[str, Any]]:
    selector = f"app.kubernetes.io/instance={name}" + (f",{ROLE_LABEL}={role}" if role else "")
    return [
        p
        for p in api.list("v1", "Pod", NAMESPACE, label_selector=selector)
        if not p["metadata"].get("deletionTimestamp")
    ]


def ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def shape(api: APIServer, name: str) -> tuple[int, int]:
    """(Ready active pods, Ready warm pods)."""
    return (
        sum(ready(p) for p in pods(api, name, "active")),
        sum(ready(p) for p in pods(api, name, "warm")),
    )


def events(api: APIServer, name: str) -> list[dict[str, Any]]:
    return [e for e in api.list("v1", "Event", NAMESPACE) if e["involvedObject"].get("name") == name]


def wait_for_event(api: APIServer, name: str, reason: str, kind: str | None = None) -> None:
    """kopf posts events from a queue of its own, so one may land after the status patch that says why."""
    wait_for(
        lambda: any(e["reason"] == reason and kind in (None, e["type"]) for e in events(api, name)),
        what=f"a {reason} event for {name}",
    )


def converged(api: APIServer, name: str, active: int, warm: int) -> bool:
    s = status(api, name)
    return (
        shape(api, name) == (active, warm)
        and len(pods(api, name)) == active + warm
        and s.get("observedGeneration") == get(api, name)["metadata"]["generation"]
        and condition(api, name, "Ready").get("status") == "True"
        and condition(api, name, "Reconciling").get("status") == "False"
    )


def test_an_idle_inference_service_lists_no_pods_and_patches_no_status(cluster: Any) -> None:
    # First in the module, so that no other InferenceService's passes are counted alongside.
    api, _runner, custom = cluster
    create(custom, service("idle", replicas={"min": 2, "max": 2}, autoscaling={"intervalSeconds": 1}))
    wait_for(lambda: converged(api, "idle", 2, 0), what="2 active")
    wait_for(lambda: condition(api, "idle", "MetricsAvailable").get("status") == "True", what="scraped")
    time.sleep(2)  # the pass after the last change has written its status
    before = api.request_counts()
    time.sleep(16 * TICK)  # 16 ticks, 4 scrapes
    after = api.request_counts()
    made = {k: n - before.get(k, 0) for k, n in after.items() if n > before.get(k, 0)}
    # kopf itself lists pods once each time its watch reconnects (every 10 s here), not every tick.
    assert made.get(("LIST", "pods", ""), 0) <= 1, made
    assert ("PATCH", "inferenceservices", "status") not in made, made
    assert ("PATCH", "inferenceservices", "") not in made, made
    assert condition(api, "idle", "MetricsAvailable").get("status") == "True"


def autoscaler_gauges(url: str, name: str) -> dict[str, float]:
    """The operator's `ember:operator_autoscaler_*` series for InferenceService `name`, from its /metrics."""
    found: dict[str, float] = {}
    for line in plainhttp.get(url, timeout=5).text.splitlines():
        series, _, value = line.rpartition(" ")
        if series.startswith("ember:operator_autoscaler_") and f'name="{name}"' in series:
            found[series.split("{")[0]] = float(value)
    return found


def test_readings_no_pod_gives_are_dropped_from_status_and_the_operator_gauges(cluster: Any) -> None:
    # Second in the module: besides this one, only the idle service runs, which patches no status.
    api, runner, custom = cluster
    server = metrics.serve(0, addr="127.0.0.1")  # the operator runs in this process: its /metrics
    url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
    read = {
        "ember:operator_autoscaler_queue_depth": 7.0,
        "ember:operator_autoscaler_kv_cache_utilization": 0.9,
    }
    try:
        create(custom, service("stale", replicas={"min": 1, "max": 1}, autoscaling={"intervalSeconds": 1}))
        wait_for(lambda: converged(api, "stale", 1, 0), what="1 active")
        (pod,) = pods(api, "stale", "active")
        page = runner.pages[pod["metadata"]["name"]]
        page.waiting, page.kv = 7, 0.9
        readings = {"queueDepth": 7, "kvCacheUtilization": 0.9, "readyPods": 1}
        wait_for(lambda: status(api, "stale")["autoscaler"]["inputs"] == readings, what="the readings")
        assert autoscaler_gauges(url, "stale") == read
        page.broken = True
        wait_for(
            lambda: condition(api, "stale", "MetricsAvailable").get("status") == "False",
            what="MetricsAvailable=False",
        )
        # The pass that found no pod readable wrote the condition and the inputs together: no queue or KV
        # reading is left (kubectl shows none), and the gauges have no series for the service.
        assert status(api, "stale")["autoscaler"]["inputs"] == {"readyPods": 0}
        assert autoscaler_gauges(url, "stale") == {}
        # Nothing changes while no pod is readable, so the status is not patched again (the nulls are
        # compared as the keys absent that they leave).
        before = api.request_counts().get(("PATCH", "inferenceservices", "status"), 0)
        time.sleep(12 * TICK)  # 3 scrapes
        assert api.request_counts().get(("PATCH", "inferenceservices", "status"), 0) == before
        page.broken = False
        wait_for(lambda: status(api, "stale")["autoscaler"]["inputs"] == readings, what="the readings again")
        assert autoscaler_gauges(url, "stale") == read
    finally:
        server.shutdown()
        server.server_close()


def test_an_inference_service_becomes_pods_a_service_and_a_policy(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(
        custom,
        service(
            "basic", replicas={"min": 2, "max": 4}, warmPool={"size": 1}, loadShedding={"maxQueueDepth": 9}
        ),
    )
    wait_for(lambda: converged(api, "basic", 2, 1), what="2 active + 1 warm Ready")

    uid = get(api, "basic")["metadata"]["uid"]
    for p in pods(api, "basic"):
        assert p["metadata"]["ownerReferences"][0]["uid"] == uid
        assert p["metadata"]["labels"][HASH_LABEL]
    # The Service selects the router pods, which find the active engines themselves.
    svc = api.get("v1", "Service", NAMESPACE, "basic")
    assert svc is not None and svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "ember-router",
        "ember.dev/router": "basic",
    }
    routers = api.get("apps/v1", "Deployment", NAMESPACE, "basic-router")
    assert routers is not None and routers["spec"]["replicas"] == 2
    (container,) = routers["spec"]["template"]["spec"]["containers"]
    assert (
        f"--kube-selector=app.kubernetes.io/instance=basic,app.kubernetes.io/name=ember,{ROLE_LABEL}=active"
        in (container["args"])
    )
    wait_for(lambda: status(api, "basic").get("router", {}).get("summary") == "2/2", what="2/2 routers Ready")
    assert condition(api, "basic", "RouterReady")["reason"] == "RouterAvailable"
    cm = api.get("v1", "ConfigMap", NAMESPACE, "basic-policy")
    assert cm is not None and "maxQueueDepth: 9" in cm["data"]["policy.yaml"]

    s = status(api, "basic")
    assert (s["replicas"], s["warmReplicas"], s["readyReplicas"], s["desiredReplicas"]) == (2, 1, 2, 2)
    assert (
        s["selector"] == f"app.kubernetes.io/instance=basic,app.kubernetes.io/name=ember,{ROLE_LABEL}=active"
    )
    assert s["endpoint"] == "http://basic.default.svc.cluster.local"
    assert s["coldStartSeconds"] is not None and s["coldStartSeconds"] >= 0
    assert condition(api, "basic", "WarmPoolReady")["status"] == "True"
    assert condition(api, "basic", "Stalled")["status"] == "False"
    wait_for(lambda: condition(api, "basic", "MetricsAvailable")["status"] == "True", what="metrics scraped")
    # The scale subresource reports the active pods and the selector HPA needs.
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, PLURAL, "basic")
    assert scale["status"]["replicas"] == 2 and "instance=basic" in scale["status"]["selector"]


def test_load_promotes_a_warm_pod_at_once_refills_the_pool_and_scales_back_down(cluster: Any) -> None:
    api, runner, custom = cluster
    spec = {
        "replicas": {"min": 1, "max": 3},
        "warmPool": {"size": 1},
        "autoscaling": {"intervalSeconds": 1, "queueDepthPerReplica": 4, "scaleDownStabilizationSeconds": 3},
    }
    create(custom, service("spiky", **spec))
    wait_for(lambda: converged(api, "spiky", 1, 1), what="1 active + 1 warm")
    (active,) = pods(api, "spiky", "active")
    (warm,) = pods(api, "spiky", "warm")
    runner.pages[active["metadata"]["name"]].waiting = 10  # 10 waiting, 0 running: 3 pods' worth

    wait_for(
        lambda: warm["metadata"]["name"] in {p["metadata"]["name"] for p in pods(api, "spiky", "active")},
        timeout=10,
        what="the warm pod promoted",
    )
    wait_for(lambda: shape(api, "spiky") == (3, 1), timeout=20, what="3 active + a refilled pool")
    s = status(api, "spiky")
    last = s["autoscaler"]["decisions"][-1]
    assert "scale up" in last["reason"] and last["inputs"]["queueDepth"] == 10
    wait_for_event(api, "spiky", "Scaled")
    wait_for_event(api, "spiky", "Promoted")

    for page in runner.pages.values():
        page.waiting = 0
    wait_for(lambda: converged(api, "spiky", 1, 1), timeout=30, what="back to 1 active + 1 warm")
    assert "scale down" in status(api, "spiky")["autoscaler"]["decisions"][-1]["reason"]


def test_missing_metrics_hold_the_target_and_say_so(cluster: Any) -> None:
    api, runner, custom = cluster
    create(
        custom,
        service(
            "blind",
            replicas={"min": 1, "max": 3},
            autoscaling={"intervalSeconds": 1, "scaleDownStabilizationSeconds": 0},
        ),
    )
    wait_for(lambda: converged(api, "blind", 1, 0), what="1 active")
    (pod,) = pods(api, "blind", "active")
    runner.pages[pod["metadata"]["name"]].waiting = 20
    wait_for(lambda: status(api, "blind")["desiredReplicas"] == 3, what="scale-up to 3")
    wait_for(lambda: shape(api, "blind")[0] == 3, what="3 active Ready")
    for p in pods(api, "blind"):
        runner.pages[p["metadata"]["name"]].broken = True
    wait_for(
        lambda: condition(api, "blind", "MetricsAvailable").get("status") == "False",
        what="MetricsAvailable=False",
    )
    assert "scrape failed" in condition(api, "blind", "MetricsAvailable")["message"]
    assert status(api, "blind")["desiredReplicas"] == 3  # no scale-down without evidence
    wait_for_event(api, "blind", "MetricsUnavailable")
    # The event names the pods whose scrape failed and why (it gave only the scaling decision's reason).
    message = next(e["message"] for e in events(api, "blind") if e["reason"] == "MetricsUnavailable")
    assert "scrape failed" in message and pod["metadata"]["name"] in message, message


def test_drift_is_repaired(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("drift", replicas={"min": 2, "max": 2}, router={"enabled": False}))
    wait_for(lambda: converged(api, "drift", 2, 0), what="2 active")
    victim = pods(api, "drift")[0]["metadata"]["name"]
    api.delete("v1", "Pod", NAMESPACE, victim)
    svc = api.get("v1", "Service", NAMESPACE, "drift")
    assert svc is not None
    api.patch("v1", "Service", NAMESPACE, "drift", {"spec": {"selector": {ROLE_LABEL: "warm", "extra": "x"}}})
    api.patch("v1", "ConfigMap", NAMESPACE, "drift-policy", {"data": {"policy.yaml": "edited: true\n"}})

    def repaired() -> bool:
        svc = api.get("v1", "Service", NAMESPACE, "drift")
        cm = api.get("v1", "ConfigMap", NAMESPACE, "drift-policy")
        names = {p["metadata"]["name"] for p in pods(api, "drift")}
        return (
            svc is not None
            and svc["spec"]["selector"].get(ROLE_LABEL) == "active"
            and "extra" not in svc["spec"]["selector"]
            and cm is not None
            and "loadShedding" in cm["data"]["policy.yaml"]
            and victim not in names
            and converged(api, "drift", 2, 0)
        )

    wait_for(repaired, what="pod, Service and ConfigMap repaired")


def test_a_policy_change_touches_only_the_configmap(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("policy", replicas={"min": 1, "max": 1}, warmPool={"size": 1}))
    wait_for(lambda: converged(api, "policy", 1, 1), what="1 active + 1 warm")
    before = {p["metadata"]["name"] for p in pods(api, "policy")}
    patch_spec(
        custom,
        "policy",
        {"loadShedding": {"maxQueueDepth": 3, "retryAfterSeconds": 7}, "requestTimeoutSeconds": 12},
    )

    def applied() -> bool:
        cm = api.get("v1", "ConfigMap", NAMESPACE, "policy-policy")
        text = cm["data"]["policy.yaml"] if cm else ""
        return (
            "maxQueueDepth: 3" in text
            and "retryAfterSeconds: 7" in text
            and "requestTimeoutSeconds: 12" in text
        )

    wait_for(applied, what="the policy ConfigMap updated")
    wait_for(lambda: converged(api, "policy", 1, 1), what="converged at the new generation")
    assert {p["metadata"]["name"] for p in pods(api, "policy")} == before  # no engine restarted


def test_an_engine_change_rolls_the_pods_without_dropping_capacity(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("roll", replicas={"min": 2, "max": 2}, warmPool={"size": 1}))
    wait_for(lambda: converged(api, "roll", 2, 1), what="2 active + 1 warm")
    old = {p["metadata"]["name"] for p in pods(api, "roll")}
    old_hash = pods(api, "roll")[0]["metadata"]["labels"][HASH_LABEL]

    lowest = [2]
    stop = threading.Event()

    def watch_capacity() -> None:
        while not stop.wait(0.02):
            lowest[0] = min(lowest[0], shape(api, "roll")[0])

    watcher = threading.Thread(target=watch_capacity)
    watcher.start()
    try:
        patch_spec(custom, "roll", {"engine": {"maxNumSeqs": 64}})
        wait_for(
            lambda: (
                converged(api, "roll", 2, 1) and not old & {p["metadata"]["name"] for p in pods(api, "roll")}
            ),
            timeout=30,
            what="all pods replaced",
        )
    finally:
        stop.set()
        watcher.join()
    assert lowest[0] >= 2, "Ready active pods dropped below replicas.min during the roll"
    assert {p["metadata"]["labels"][HASH_LABEL] for p in pods(api, "roll")} != {old_hash}
    (new_pod,) = pods(api, "roll", "warm")
    assert "--max-num-seqs=64" in new_pod["spec"]["containers"][0]["args"]


def test_a_fallback_to_itself_stalls_and_a_fix_recovers(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("loop", fallback={"service": "loop"}))
    wait_for(lambda: condition(api, "loop", "Stalled").get("status") == "True", what="Stalled=True")
    stalled = condition(api, "loop", "Stalled")
    assert stalled["reason"] == "FallbackInvalid" and "itself" in stalled["message"]
    assert condition(api, "loop", "Reconciling")["status"] == "False"
    wait_for_event(api, "loop", "FallbackInvalid", "Warning")

    patch_spec(custom, "loop", {"fallback": {"service": "nowhere"}})
    wait_for(
        lambda: "nowhere" in condition(api, "loop", "Stalled").get("message", ""), what="missing target named"
    )

    create(custom, service("loop-small"))
    patch_spec(custom, "loop", {"fallback": {"service": "loop-small"}})
    wait_for(lambda: condition(api, "loop", "Stalled").get("status") == "False", what="recovered")
    cm = api.get("v1", "ConfigMap", NAMESPACE, "loop-policy")
    assert cm is not None and "http://loop-small.default.svc.cluster.local" in cm["data"]["policy.yaml"]

    # An address published on the fallback's Service (a load balancer) becomes its endpoint, and the
    # engines' fallback URL follows.
    api.patch(
        "v1",
        "Service",
        NAMESPACE,
        "loop-small",
        {
            "status": {
                "loadBalancer": {
                    "ingress": [{"ip": "127.0.0.1", "ports": [{"port": 31234, "protocol": "TCP"}]}]
                }
            }
        },
        subresource="status",
    )
    wait_for(
        lambda: status(api, "loop-small").get("endpoint") == "http://127.0.0.1:31234",
        what="published endpoint",
    )
    wait_for(
        lambda: (
            "http://127.0.0.1:31234"
            in api.get("v1", "ConfigMap", NAMESPACE, "loop-policy")["data"]["policy.yaml"]
        ),
        what="the fallback URL in the policy",
    )


def test_pods_that_cannot_start_stall_with_the_reason_and_a_fix_recovers(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("crashy", resources={"gpus": 0, "image": "broken:1"}))
    wait_for(
        lambda: condition(api, "crashy", "Stalled").get("reason") == "PodsCrashLooping",
        what="PodsCrashLooping",
    )
    assert "FileNotFoundError" in condition(api, "crashy", "Stalled")["message"]
    assert condition(api, "crashy", "Ready")["status"] == "False"
    patch_spec(custom, "crashy", {"resources": {"gpus": 0, "image": "ghcr.io/ember-dev/ember-engine:0.1.0"}})
    wait_for(
        lambda: converged(api, "crashy", 1, 0) and condition(api, "crashy", "Stalled")["status"] == "False",
        what="recovered after the fix",
    )
    wait_for_event(api, "crashy", "Recovered")


def test_a_priority_class_that_does_not_exist_stalls_forbidden_with_the_api_servers_message(
    cluster: Any,
) -> None:
    """kube-apiserver's Priority admission plugin refuses the pod (403); the operator says so."""
    api, _runner, custom = cluster
    create(custom, service("no-class", pod={"priorityClassName": "nope-pc"}))
    wait_for(
        lambda: condition(api, "no-class", "Stalled").get("reason") == "Forbidden",
        what="Stalled Forbidden",
    )
    message = condition(api, "no-class", "Stalled")["message"]
    assert "is forbidden: no PriorityClass with name nope-pc was found" in message, message
    assert not pods(api, "no-class")


def test_external_mode_follows_the_scale_subresource(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("ext", replicas={"min": 1, "max": 4}, autoscaling={"mode": "External"}))
    wait_for(lambda: converged(api, "ext", 1, 0), what="1 active")
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, NAMESPACE, PLURAL, "ext", {"spec": {"replicas": 3}}
    )
    wait_for(lambda: converged(api, "ext", 3, 0), what="3 active after kubectl-scale")
    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, NAMESPACE, PLURAL, "ext")
    assert scale["spec"]["replicas"] == 3 and scale["status"]["replicas"] == 3
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, NAMESPACE, PLURAL, "ext", {"spec": {"replicas": 9}}
    )
    wait_for(lambda: status(api, "ext")["desiredReplicas"] == 4, what="clamped to replicas.max")


def test_fallback_traffic_shows_in_status(cluster: Any) -> None:
    api, runner, custom = cluster
    create(
        custom,
        service("spill", fallback={"url": "http://elsewhere:8000"}, autoscaling={"intervalSeconds": 1}),
    )
    wait_for(lambda: converged(api, "spill", 1, 0), what="1 active")
    assert condition(api, "spill", "FallbackActive").get("status") == "False"
    wait_for(
        lambda: condition(api, "spill", "MetricsAvailable").get("status") == "True", what="a first scrape"
    )
    (pod,) = pods(api, "spill")
    runner.pages[pod["metadata"]["name"]].fallback_served = 5
    wait_for(lambda: condition(api, "spill", "FallbackActive").get("status") == "True", what="FallbackActive")
    assert "5 requests" in condition(api, "spill", "FallbackActive")["message"]
    wait_for(lambda: condition(api, "spill", "FallbackActive").get("status") == "False", what="idle again")


def test_what_the_routers_send_to_the_fallback_shows_in_status(cluster: Any) -> None:
    api, runner, custom = cluster
    create(
        custom,
        service("relay", fallback={"url": "http://elsewhere:8000"}, autoscaling={"intervalSeconds": 1}),
    )
    wait_for(lambda: converged(api, "relay", 1, 0), what="1 active")
    selector = "app.kubernetes.io/name=ember-router,ember.dev/router=relay"

    def routers() -> list[dict[str, Any]]:
        return [p for p in api.list("v1", "Pod", NAMESPACE, label_selector=selector) if ready(p)]

    wait_for(lambda: len(routers()) == 2, what="two Ready router pods")
    pages = [runner.pages[p["metadata"]["name"]] for p in routers()]
    for page in pages:
        page.router_fallback_served = 0
    # Two reads of each router after that: the pass that made the first has kept its 0 (a counter's first
    # reading is where it starts from, not traffic), however late the operator's pod index saw the routers.
    since = [page.reads for page in pages]
    wait_for(
        lambda: all(page.reads >= n + 2 for page, n in zip(pages, since, strict=True)),
        what=lambda: (
            f"each router read twice (reads {[p.reads - n for p, n in zip(pages, since, strict=True)]})"
        ),
    )
    assert condition(api, "relay", "FallbackActive").get("status") == "False"
    # The engines handed nothing on; a router sent 3 requests there itself (its failed ones do not count).
    pages[0].router_fallback_served = 3
    wait_for(lambda: condition(api, "relay", "FallbackActive").get("status") == "True", what="FallbackActive")
    assert "3 requests" in condition(api, "relay", "FallbackActive")["message"]
    assert "3 sent by the routers" in condition(api, "relay", "FallbackActive")["message"]
    wait_for(lambda: condition(api, "relay", "FallbackActive").get("status") == "False", what="idle again")


def test_deleting_the_service_garbage_collects_every_child(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("gone", warmPool={"size": 1}))
    wait_for(lambda: converged(api, "gone", 1, 1), what="1 active + 1 warm")
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "gone")
    wait_for(
        lambda: api.get(API_VERSION, "InferenceService", NAMESPACE, "gone") is None, what="the resource gone"
    )
    wait_for(
        lambda: (
            not pods(api, "gone")
            and api.get("v1", "Service", NAMESPACE, "gone") is None
            and api.get("v1", "ConfigMap", NAMESPACE, "gone-policy") is None
        ),
        what="children garbage-collected",
    )


def test_the_operator_never_writes_the_spec(cluster: Any) -> None:
    api, runner, custom = cluster
    create(custom, service("hands-off", replicas={"min": 1, "max": 3}, autoscaling={"intervalSeconds": 1}))
    wait_for(lambda: converged(api, "hands-off", 1, 0), what="1 active")
    generation = get(api, "hands-off")["metadata"]["generation"]
    (pod,) = pods(api, "hands-off")
    runner.pages[pod["metadata"]["name"]].waiting = 30
    wait_for(lambda: shape(api, "hands-off")[0] == 3, what="scaled to 3")
    obj = get(api, "hands-off")
    assert obj["metadata"]["generation"] == generation  # Argo CD sees no drift
    assert obj["spec"]["replicas"]["desired"] == 1  # the schema's default, never the operator's target


# -- real-cluster semantics ---------------------------------------------------------------------------


def test_a_failed_active_pod_is_replaced_by_the_ready_warm_pod(cluster: Any) -> None:
    api, runner, custom = cluster
    create(custom, service("failover", warmPool={"size": 1}))
    wait_for(lambda: converged(api, "failover", 1, 1), what="1 active, 1 warm")
    (active,) = pods(api, "failover", "active")
    (warm,) = pods(api, "failover", "warm")
    runner.fail(active["metadata"]["name"])
    wait_for(
        lambda: (
            [p["metadata"]["name"] for p in pods(api, "failover", "active")] == [warm["metadata"]["name"]]
        ),
        what="the warm pod promoted in the failed pod's place",
    )
    assert api.get("v1", "Pod", NAMESPACE, active["metadata"]["name"]) is None  # replaced, not kept
    wait_for_event(api, "failover", "FailedOver", "Warning")
    wait_for(lambda: converged(api, "failover", 1, 1), what="the pool refilled")


def test_a_failover_keeps_the_service_ready_in_every_status_written(cluster: Any) -> None:
    """The pass that promotes a warm pod in place of a lost active one reports the pods as that pass left
    them: one Ready active pod. Every status written meanwhile says Ready, and neither Ready's nor
    MetricsAvailable's lastTransitionTime moves."""
    api, runner, custom = cluster
    name = "steady"
    spec = {"warmPool": {"size": 1}, "autoscaling": {"intervalSeconds": 1}}
    create(custom, service(name, **spec))
    wait_for(lambda: converged(api, name, 1, 1), what="1 active, 1 warm")
    wait_for(lambda: condition(api, name, "MetricsAvailable").get("status") == "True", what="metrics read")
    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watch() -> None:
        w = kubernetes.watch.Watch()
        version = get(api, name)["metadata"]["resourceVersion"]
        while not stop.is_set():
            for event in w.stream(
                custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                NAMESPACE,
                PLURAL,
                resource_version=version,
                timeout_seconds=1,
            ):
                obj = event["object"]
                version = obj["metadata"]["resourceVersion"]
                if obj["metadata"]["name"] == name and obj.get("status"):
                    seen.append(obj["status"])

    watcher = threading.Thread(target=watch)
    watcher.start()
    moved: list[tuple[str, dict[str, str], dict[str, str]]] = []
    try:
        for lose in ("delete", "kill"):
            before = {k: condition(api, name, k)["lastTransitionTime"] for k in ("Ready", "MetricsAvailable")}
            time.sleep(1.1)  # a flip would stamp a later second
            (active,) = pods(api, name, "active")
            (warm,) = pods(api, name, "warm")
            if lose == "delete":  # kubectl delete pod
                api.delete("v1", "Pod", NAMESPACE, active["metadata"]["name"])
            else:  # the engine is killed and stays down
                runner.fail(active["metadata"]["name"])
            promoted = [warm["metadata"]["name"]]
            wait_for(
                lambda: [p["metadata"]["name"] for p in pods(api, name, "active")] == promoted,  # noqa: B023
                what=f"the warm pod promoted ({lose})",
            )
            wait_for(lambda: converged(api, name, 1, 1), what=f"the pool refilled ({lose})")
            after = {k: condition(api, name, k)["lastTransitionTime"] for k in ("Ready", "MetricsAvailable")}
            moved += [(lose, before, after)] if after != before else []
    finally:
        stop.set()
        watcher.join()
    for s in seen:
        conditions = {c["type"]: c for c in s.get("conditions") or []}
        assert conditions["Ready"]["status"] == "True", (conditions["Ready"], s.get("readyReplicas"))
        assert s["readyReplicas"] >= 1 and s["replicas"] >= 1, s
        assert conditions.get("MetricsAvailable", {}).get("status") != "False", conditions["MetricsAvailable"]
    assert not moved, f"a condition flipped and back: {moved}"
    assert not [e for e in events(api, name) if e["reason"] == "MetricsUnavailable"]
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)


def test_no_finalizer_so_deletion_never_waits_for_the_operator(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("unblocked"))
    wait_for(lambda: converged(api, "unblocked", 1, 0), what="1 active")
    assert not get(api, "unblocked")["metadata"].get("finalizers")


def _quota(api: APIServer, gpus: int) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpus", "namespace": NAMESPACE},
        "spec": {"hard": {"requests.nvidia.com/gpu": str(gpus)}},
    }
    if api.get("v1", "ResourceQuota", NAMESPACE, "gpus") is None:
        api.create(body)
    else:
        api.patch("v1", "ResourceQuota", NAMESPACE, "gpus", {"spec": body["spec"]})


def test_a_quota_refusal_stalls_with_its_message_and_recovers_when_raised(cluster: Any) -> None:
    api, _runner, custom = cluster
    _quota(api, 1)
    try:
        create(custom, service("quota", resources={"gpus": 1}, warmPool={"size": 1}))
        wait_for(
            lambda: condition(api, "quota", "Stalled").get("reason") == "QuotaExceeded",
            what="Stalled QuotaExceeded",
        )
        stalled = condition(api, "quota", "Stalled")
        assert stalled["status"] == "True"
        assert "exceeded quota: gpus, requested: requests.nvidia.com/gpu=1" in stalled["message"]
        assert status(api, "quota").get("observedGeneration") == get(api, "quota")["metadata"]["generation"]
        wait_for_event(api, "quota", "QuotaExceeded", "Warning")
        _quota(api, 2)
        wait_for(lambda: converged(api, "quota", 1, 1), what="both pods once the quota allows")
        assert condition(api, "quota", "Stalled").get("status") == "False"
    finally:
        api.delete("v1", "ResourceQuota", NAMESPACE, "gpus")


def test_a_namespace_enforcing_pod_security_restricted_admits_engine_pods(cluster: Any) -> None:
    api, _runner, custom = cluster
    label = "pod-security.kubernetes.io/enforce"
    api.patch("v1", "Namespace", None, NAMESPACE, {"metadata": {"labels": {label: "restricted"}}})
    try:
        create(custom, service("hardened", warmPool={"size": 1}))
        wait_for(lambda: converged(api, "hardened", 1, 1), what="pods admitted under restricted")
    finally:
        api.patch("v1", "Namespace", None, NAMESPACE, {"metadata": {"labels": {label: None}}})


def test_a_foreign_object_of_the_same_name_is_never_adopted(cluster: Any) -> None:
    api, _runner, custom = cluster
    foreign = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "squatter", "namespace": NAMESPACE, "labels": {"team": "other"}},
        "spec": {"selector": {"app": "other"}, "ports": [{"port": 80}]},
    }
    api.create(foreign)
    create(custom, service("squatter"))
    wait_for(
        lambda: condition(api, "squatter", "Stalled").get("reason") == "NameConflict", what="NameConflict"
    )
    assert "Service squatter" in condition(api, "squatter", "Stalled")["message"]
    svc = api.get("v1", "Service", NAMESPACE, "squatter")
    assert svc is not None
    assert not svc["metadata"].get("ownerReferences") and svc["spec"]["selector"] == {"app": "other"}


def test_fields_the_operator_does_not_manage_are_left_alone(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("tended"))
    wait_for(lambda: converged(api, "tended", 1, 0), what="1 active")
    changes = {
        "metadata": {"annotations": {"service.beta.kubernetes.io/aws-load-balancer-type": "nlb"}},
        "spec": {"type": "LoadBalancer"},
    }
    api.patch("v1", "Service", NAMESPACE, "tended", changes)
    time.sleep(8 * TICK)  # several passes
    svc = api.get("v1", "Service", NAMESPACE, "tended")
    assert svc is not None
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["metadata"]["annotations"]["service.beta.kubernetes.io/aws-load-balancer-type"] == "nlb"
    # What it does manage stays its own: the selector, here of the router pods.
    assert svc["spec"]["selector"] == {"app.kubernetes.io/name": "ember-router", "ember.dev/router": "tended"}


def test_a_key_added_to_a_managed_selector_is_taken_out(cluster: Any) -> None:
    """A Service selector (or a budget's matchLabels) with a key someone added selects other pods or none:
    it is compared whole and put back, not taken as covering what the operator set."""
    api, _runner, custom = cluster
    create(custom, service("narrowed"))
    wait_for(lambda: converged(api, "narrowed", 1, 0), what="1 active")
    want = api.get("v1", "Service", NAMESPACE, "narrowed")["spec"]["selector"]  # type: ignore[index]
    budget = api.get("policy/v1", "PodDisruptionBudget", NAMESPACE, "narrowed")["spec"]["selector"]  # type: ignore[index]
    api.patch("v1", "Service", NAMESPACE, "narrowed", {"spec": {"selector": {"app": "elsewhere"}}})
    api.patch(
        "policy/v1",
        "PodDisruptionBudget",
        NAMESPACE,
        "narrowed",
        {"spec": {"selector": {"matchLabels": {"x": "y"}}}},
    )

    def selectors() -> tuple[Any, Any]:
        svc = api.get("v1", "Service", NAMESPACE, "narrowed")
        pdb = api.get("policy/v1", "PodDisruptionBudget", NAMESPACE, "narrowed")
        return svc["spec"]["selector"], pdb["spec"]["selector"]  # type: ignore[index]

    wait_for(lambda: selectors() == (want, budget), timeout=20, what="both selectors put back")
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "narrowed")


def test_unschedulable_pods_wait_for_capacity_then_stall(cluster: Any) -> None:
    api, _runner, custom = cluster
    spec = {"resources": {"gpus": 0, "nodeSelector": {"pool": "nowhere"}}, "capacityWaitSeconds": 8}
    create(custom, service("nowhere", **spec))
    wait_for(
        lambda: condition(api, "nowhere", "Reconciling").get("reason") == "WaitingForCapacity",
        what="Reconciling WaitingForCapacity",
    )
    assert condition(api, "nowhere", "Stalled").get("status") == "False"
    assert "didn't match Pod's node affinity/selector" in condition(api, "nowhere", "Reconciling")["message"]
    wait_for(
        lambda: condition(api, "nowhere", "Stalled").get("reason") == "PodsUnschedulable",
        what="Stalled once the wait is over",
    )
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, "nowhere")


def test_router_pods_no_node_can_take_leave_the_service_not_ready_and_stall(cluster: Any) -> None:
    """The Service points at the routers: with none Ready nothing is served, whatever the engines do. Router
    pods no node can take wait for capacity, then stall, as engine pods do; spec.router's placement fixes it."""
    api, _runner, custom = cluster
    name = "unplaced"
    toleration = {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    spec = {
        "router": {"nodeSelector": {"pool": "nowhere"}, "tolerations": [toleration]},
        "capacityWaitSeconds": 8,
    }
    create(custom, service(name, **spec))
    wait_for(lambda: shape(api, name) == (1, 0), what="the engine Ready")
    routers = api.get("apps/v1", "Deployment", NAMESPACE, f"{name}-router")
    assert routers is not None
    template = routers["spec"]["template"]["spec"]
    assert template["nodeSelector"] == {"pool": "nowhere"} and template["tolerations"] == [toleration]
    wait_for(
        lambda: condition(api, name, "Reconciling").get("reason") == "WaitingForCapacity",
        what="Reconciling WaitingForCapacity for the routers",
    )
    assert "didn't match Pod's node affinity/selector" in condition(api, name, "Reconciling")["message"]
    assert f"{name}-router-" in condition(api, name, "Reconciling")["message"]
    ready = condition(api, name, "Ready")
    assert ready["status"] == "False" and ready["reason"] == "RouterUnavailable", ready
    wait_for(
        lambda: condition(api, name, "Stalled").get("reason") == "PodsUnschedulable",
        what="Stalled once the wait is over",
    )
    assert f"{name}-router-" in condition(api, name, "Stalled")["message"]
    assert condition(api, name, "Ready")["status"] == "False"

    # Taking the selector away again takes it out of the routers' template.
    patch_spec(custom, name, {"router": {"nodeSelector": None}})
    # (Until the Deployment's roll has deleted the old router pods, they are still reported.)
    wait_for(
        lambda: converged(api, name, 1, 0) and condition(api, name, "Stalled")["status"] == "False",
        what="Ready and no longer Stalled once the routers are placed",
    )
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)


def test_crash_looping_router_pods_stall_the_service_until_they_run(cluster: Any) -> None:
    """Router pods that keep crashing (here OOMKilled: a spec.router.memory too small for the process) will
    not come right without a change: Stalled with the pod and the reason, as for engine pods."""
    api, runner, custom = cluster
    name = "oomrouter"
    create(custom, service(name))
    wait_for(lambda: converged(api, name, 1, 0), what="converged")
    routers = api.list("v1", "Pod", NAMESPACE, label_selector=f"ember.dev/router={name}")
    assert len(routers) == 2
    for p in routers:
        runner.crash_loop(p["metadata"]["name"])
    wait_for(
        lambda: condition(api, name, "Stalled").get("reason") == "PodsCrashLooping",
        what="Stalled PodsCrashLooping",
    )
    stalled = condition(api, name, "Stalled")
    assert f"{name}-router-" in stalled["message"] and "OOMKilled" in stalled["message"], stalled
    assert condition(api, name, "Reconciling")["status"] == "False"
    # (Once the Deployment's status, which the router count is read from, has caught up.)
    wait_for(
        lambda: condition(api, name, "Ready").get("reason") == "RouterUnavailable", what="RouterUnavailable"
    )
    assert condition(api, name, "Ready")["status"] == "False"

    # New router pods (as after a fix to the spec) that run clear it.
    for p in routers:
        api.delete("v1", "Pod", NAMESPACE, p["metadata"]["name"])
    wait_for(lambda: converged(api, name, 1, 0), what="Ready with new router pods")
    assert condition(api, name, "Stalled")["status"] == "False"
    custom.delete_namespaced_custom_object(GROUP, VERSION, NAMESPACE, PLURAL, name)


def test_a_routing_rule_naming_a_missing_service_stalls_until_it_exists(cluster: Any) -> None:
    api, _runner, custom = cluster
    create(custom, service("picky", routing=[{"name": "short", "service": "smaller", "maxMaxTokens": 16}]))
    wait_for(
        lambda: condition(api, "picky", "Stalled").get("reason") == "RoutingInvalid", what="RoutingInvalid"
    )
    assert "no InferenceService 'smaller'" in condition(api, "picky", "Stalled")["message"]

    def template() -> dict[str, Any]:
        deploy = api.get("apps/v1", "Deployment", NAMESPACE, "picky-router")
        return deploy["spec"]["template"] if deploy else {}

    def routes() -> list[dict[str, Any]]:
        cm = api.get("v1", "ConfigMap", NAMESPACE, "picky-policy") or {}
        return yaml.safe_load((cm.get("data") or {}).get("routes.yaml") or "[]")

    wait_for(lambda: template() != {}, what="picky's router Deployment")
    before = template()
    assert routes() == []
    args = before["spec"]["containers"][0]["args"]
    assert "--routes=/etc/ember/policy/routes.yaml" in args and not [
        a for a in args if a.startswith("--route=")
    ]
    create(custom, service("smaller", router={"enabled": False}))
    wait_for(
        lambda: condition(api, "picky", "Stalled").get("status") == "False", what="picky no longer stalled"
    )
    wait_for(lambda: len(routes()) == 1, what="the route in the routers' routes file")
    assert routes() == [
        {
            "name": "short",
            "target": "smaller",
            "url": "http://smaller.default.svc.cluster.local",
            "maxMaxTokens": 16,
        }
    ]
    # The routers read the file live (the ConfigMap is mounted whole): the target's address rolled no pod.
    assert template() == before


def test_requests_held_at_the_routers_wake_a_service_scaled_to_zero(cluster: Any) -> None:
    api, runner, custom = cluster
    create(custom, service("sleeper", replicas={"min": 0, "max": 1}))
    wait_for(lambda: status(api, "sleeper").get("desiredReplicas") == 0, what="sleeper at 0")
    selector = "app.kubernetes.io/name=ember-router,ember.dev/router=sleeper"

    def routers() -> list[dict[str, Any]]:
        return [p for p in api.list("v1", "Pod", NAMESPACE, label_selector=selector) if ready(p)]

    wait_for(lambda: len(routers()) == 2, what="two Ready router pods")
    assert pods(api, "sleeper") == []
    pages = [runner.pages[p["metadata"]["name"]] for p in routers()]
    for page in pages:
        page.pending = 0
    # Nothing held: it stays at zero while each router is read twice.
    since = [page.reads for page in pages]
    wait_for(
        lambda: all(page.reads >= n + 2 for page, n in zip(pages, since, strict=True)), what="two reads each"
    )
    assert pods(api, "sleeper") == [] and status(api, "sleeper")["desiredReplicas"] == 0
    pages[0].pending = 2
    wait_for(lambda: converged(api, "sleeper", 1, 0), what="sleeper woken to 1 active")
    decisions = status(api, "sleeper")["autoscaler"]["decisions"]
    woke = "2 requests held by the routers with no engine (scale from zero)"
    assert any(d["reason"] == woke and d["desired"] == 1 for d in decisions), decisions


def test_a_service_woken_from_zero_keeps_its_pod_through_the_scale_down_window(cluster: Any) -> None:
    api, runner, custom = cluster
    create(
        custom,
        service(
            "dozer",
            replicas={"min": 0, "max": 1},
            warmPool={"size": 0},
            autoscaling={"intervalSeconds": 1, "scaleDownStabilizationSeconds": 600},
        ),
    )
    wait_for(lambda: status(api, "dozer").get("desiredReplicas") == 0, what="dozer at 0")
    selector = "app.kubernetes.io/name=ember-router,ember.dev/router=dozer"

    def routers() -> list[dict[str, Any]]:
        return [p for p in api.list("v1", "Pod", NAMESPACE, label_selector=selector) if ready(p)]

    wait_for(lambda: len(routers()) == 2, what="two Ready router pods")
    pages = [runner.pages[p["metadata"]["name"]] for p in routers()]
    for page in pages:
        page.pending = 0
    pages[0].pending = 1
    wait_for(lambda: converged(api, "dozer", 1, 0), what="dozer woken to 1 active")
    pages[0].pending = 0  # the held request went to the engine, which is idle once it is answered
    (engine,) = pods(api, "dozer", "active")
    page = runner.pages[engine["metadata"]["name"]]
    since = page.reads
    wait_for(
        lambda: page.reads >= since + 3 or status(api, "dozer")["desiredReplicas"] == 0,
        what="the idle engine read three times",
    )
    decisions = status(api, "dozer")["autoscaler"]["decisions"]
    # The wake is a proposal of 1 in the scale-down window, as any other proposal is.
    assert status(api, "dozer")["desiredReplicas"] == 1, decisions
    assert not [d for d in decisions if d["desired"] == 0 and "scale down" in d["reason"]], decisions


def test_in_external_mode_requests_held_at_zero_leave_the_count_to_the_external_scaler(
    cluster: Any,
) -> None:
    """The external scaler owns the count: the operator does not raise a target of 0 itself (it would
    be put back to 0 on the next pass, and the woken pod deleted, on every pass); a trigger on the routers'
    held requests wakes it through the scale subresource (README, KEDA)."""
    api, runner, custom = cluster
    create(
        custom,
        service("outside", replicas={"min": 0, "max": 2, "desired": 0}, autoscaling={"mode": "External"}),
    )
    selector = "app.kubernetes.io/name=ember-router,ember.dev/router=outside"

    def routers() -> list[dict[str, Any]]:
        return [p for p in api.list("v1", "Pod", NAMESPACE, label_selector=selector) if ready(p)]

    wait_for(lambda: len(routers()) == 2, what="two Ready router pods")
    for p in routers():
        runner.pages[p["metadata"]["name"]].pending = 2
    # Passes that see the requests held: each spec change is observed by one.
    for n in (3, 4):
        patch_spec(custom, "outside", {"replicas": {"min": 0, "max": n, "desired": 0}})
        generation = get(api, "outside")["metadata"]["generation"]
        wait_for(
            lambda g=generation: status(api, "outside").get("observedGeneration") == g,  # type: ignore[misc]
            what="a pass of the new generation",
        )
    decisions = status(api, "outside")["autoscaler"]["decisions"]
    assert all(d["desired"] == 0 for d in decisions), decisions
    assert pods(api, "outside") == [] and status(api, "outside")["desiredReplicas"] == 0
    assert not [e for e in events(api, "outside") if e["reason"] == "Scaled"]
    # The external scaler writes 1: the held requests find an engine.
    custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, NAMESPACE, PLURAL, "outside", {"spec": {"replicas": 1}}
    )
    wait_for(lambda: converged(api, "outside", 1, 0), what="1 active after the scale subresource")
