"""Monitoring with real parts. The shipped alerts (manifests/monitoring/prometheusrule.yaml) pass `promtool
check rules` and promtool's unit tests; `ember dev up --prometheus`'s real Prometheus scrapes real engines,
their routers and the operator with the shipped scrape jobs while real traffic runs through a router
(speculative decoding, shedding at the engine and the router, the fallback, a scale-up), and then the
counters add up to what the clients saw, every PromQL query of the Grafana dashboard returns data, the
alerts load and evaluate (the stalled, shed-rate and fallback alerts go pending), and the KEDA
ScaledObject's query returns the single value KEDA needs."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import plainhttp
import pytest
import yaml
from waiting import free_port, wait_for

from ember_localcluster.devcluster import DevCluster
from ember_localcluster.prometheus import MONITORING, shipped_rules
from ember_operator.spec import GROUP, KIND, VERSION, InferenceServiceSpec

REPO = Path(__file__).resolve().parents[1]
KEDA = REPO / "examples" / "keda"


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool is required (Debian: apt-get install prometheus)")
    return found


def _alert(labels: dict[str, str], summary: str, description: str) -> dict[str, Any]:
    return {"exp_labels": labels, "exp_annotations": {"summary": summary, "description": description}}


def _description(alert: str) -> str:
    (rule,) = [r for g in shipped_rules()["groups"] for r in g["rules"] if r.get("alert") == alert]
    return (
        str(rule["annotations"]["description"])
        .replace("{{ $labels.namespace }}", "prod")
        .replace("{{ $labels.name }}", "chat")
    )


def _histogram_buckets(name: str) -> dict[str, float]:
    """The `le` labels of a histogram's buckets as a real engine's /metrics writes them, with their edges."""
    from ember_engine.server.metrics import EngineMetrics
    from ember_router.metrics import RouterMetrics

    return {
        s.labels["le"]: float(s.labels["le"])
        for registry in (EngineMetrics("m").registry, RouterMetrics().registry)
        for family in registry.collect()
        for s in family.samples
        if s.name == name
    }


def test_each_latency_threshold_of_the_rules_is_a_bucket_edge() -> None:
    """histogram_quantile interpolates within a bucket, so a threshold between two edges is crossed by a
    quantile that is not over it: with no edge between 1 s and 2.5 s, first tokens of 1.1 s read as a p99
    of 2.485 s, over the 2 s objective. Each threshold a rule compares a histogram's quantile with must be
    an edge of that histogram's buckets."""
    checked = []
    for group in shipped_rules()["groups"]:
        for rule in group["rules"]:
            expr = " ".join(str(rule["expr"]).split())
            histograms = set(re.findall(r"([\w:]+_bucket)\b", expr))
            if not histograms:
                continue
            thresholds = re.findall(r"\)\s*(?:>|<|>=|<=)\s*([\d.]+)", expr)
            thresholds += re.findall(r'le\s*=~?\s*"([\d.]+)"', expr)
            assert thresholds, f"{rule.get('alert') or rule['record']}: no threshold found in {expr}"
            for name in histograms:
                edges = set(_histogram_buckets(name).values())
                assert edges, f"{name} is no histogram of the engine or the router"
                for t in thresholds:
                    assert float(t) in edges, (
                        f"{rule.get('alert') or rule['record']}: {t} s is no edge of {name}"
                    )
                    checked.append((name, float(t)))
    assert ("vllm:time_to_first_token_seconds_bucket", 2.0) in checked


def test_the_alert_rules_pass_promtools_checks_and_unit_tests(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(shipped_rules(), sort_keys=False))
    checked = subprocess.run([_promtool(), "check", "rules", str(rules)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    chat = {"namespace": "prod", "inferenceservice": "chat"}
    calm = {"namespace": "prod", "inferenceservice": "calm"}
    # Behind routers: `edge`'s routers send to the fallback and shed themselves; `retry`'s engines shed, but
    # its routers sent every one of those requests to another engine, which served it.
    edge = {"namespace": "prod", "inferenceservice": "edge"}
    retry = {"namespace": "prod", "inferenceservice": "retry"}
    # `down` has no engine left (scaled to zero, crash-looping): no engine series at all, and its router
    # sheds every request. `spill`'s engines hand most requests to the fallback, which serves them, and
    # shed 4 % of them.
    down = {"namespace": "prod", "inferenceservice": "down"}
    spill = {"namespace": "prod", "inferenceservice": "spill"}

    def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
        body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
        return {"series": f"{name}{{{body}}}", "values": values}

    ttft = "vllm:time_to_first_token_seconds_bucket"
    tests = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [
                    series(
                        "ember:operator_condition",
                        {
                            "namespace": "prod",
                            "name": "chat",
                            "condition": "Stalled",
                            "reason": "ModelFetchFailed",
                        },
                        "1x30",
                    ),
                    series(
                        "ember:operator_condition",
                        {"namespace": "prod", "name": "calm", "condition": "Stalled", "reason": "NoProblems"},
                        "0x30",
                    ),
                    # 1 request/s to the fallback.
                    series(
                        "ember:fallback_requests_total",
                        {**chat, "pod": "chat-a", "outcome": "served"},
                        "0+60x30",
                    ),
                    series(
                        "ember:fallback_requests_total",
                        {**calm, "pod": "calm-a", "outcome": "served"},
                        "0x30",
                    ),
                    # Half of chat's requests shed; calm sheds nothing.
                    series(
                        "ember:requests_shed_total",
                        {**chat, "pod": "chat-a", "reason": "queue_full"},
                        "0+30x30",
                    ),
                    series(
                        "vllm:request_success_total",
                        {**chat, "pod": "chat-a", "finished_reason": "stop"},
                        "0+30x30",
                    ),
                    series(
                        "vllm:request_success_total",
                        {**calm, "pod": "calm-a", "finished_reason": "stop"},
                        "0+30x30",
                    ),
                    series(
                        "ember:requests_shed_total", {**calm, "pod": "calm-a", "reason": "queue_full"}, "0x30"
                    ),
                    # 1 request/s to the fallback from edge's router; half of edge's requests shed by it.
                    series(
                        "ember_router:fallback_requests_total",
                        {**edge, "pod": "edge-router-a", "role": "router", "outcome": "served"},
                        "0+60x30",
                    ),
                    series(
                        "ember_router:shed_requests_total",
                        {**edge, "pod": "edge-router-a", "role": "router", "reason": "fleet_overloaded"},
                        "0+30x30",
                    ),
                    series(
                        "vllm:request_success_total",
                        {**edge, "pod": "edge-a", "finished_reason": "stop"},
                        "0+30x30",
                    ),
                    # retry's engine sheds 30 requests a minute, each one retried by the router and served
                    # by the other engine: its clients saw no shed.
                    series(
                        "ember:requests_shed_total",
                        {**retry, "pod": "retry-a", "reason": "queue_full"},
                        "0+30x30",
                    ),
                    series(
                        "ember_router:engine_sheds_retried_total",
                        {**retry, "pod": "retry-router-a", "role": "router"},
                        "0+30x30",
                    ),
                    series(
                        "vllm:request_success_total",
                        {**retry, "pod": "retry-b", "finished_reason": "stop"},
                        "0+60x30",
                    ),
                    series(
                        "ember_router:shed_requests_total",
                        {**down, "pod": "down-router-a", "role": "router", "reason": "no_engine_ready"},
                        "0+60x30",
                    ),
                    series(
                        "ember_router:engine_sheds_retried_total",
                        {**down, "pod": "down-router-a", "role": "router"},
                        "0x30",
                    ),
                    # spill: 100 requests/s, 10 served by its engine, 86 by the fallback and 4 shed.
                    series(
                        "vllm:request_success_total",
                        {**spill, "pod": "spill-a", "finished_reason": "stop"},
                        "0+600x30",
                    ),
                    series(
                        "ember:fallback_requests_total",
                        {**spill, "pod": "spill-a", "outcome": "served"},
                        "0+5160x30",
                    ),
                    series(
                        "ember:requests_shed_total",
                        {**spill, "pod": "spill-a", "reason": "queue_full"},
                        "0+240x30",
                    ),
                    # A serving pod at 97 % KV-cache use; a warm pod's cache does not count.
                    series(
                        "vllm:kv_cache_usage_perc", {**chat, "pod": "chat-a", "role": "active"}, "0.97x30"
                    ),
                    series("vllm:kv_cache_usage_perc", {**calm, "pod": "calm-w", "role": "warm"}, "0.99x30"),
                    # In the engine's own buckets: each of chat's first tokens takes 2.2 s (p99 2.495 s,
                    # over the objective); each of calm's 1.1 s, which meets it.
                    *(
                        series(ttft, {**labels, "pod": pod, "le": le}, "0+60x30" if edge >= t else "0x30")
                        for labels, pod, t in ((chat, "chat-a", 2.2), (calm, "calm-a", 1.1))
                        for le, edge in _histogram_buckets(ttft).items()
                    ),
                ],
                "alert_rule_test": [
                    {"eval_time": "4m", "alertname": "EmberInferenceServiceStalled", "exp_alerts": []},
                    {
                        "eval_time": "6m",
                        "alertname": "EmberInferenceServiceStalled",
                        "exp_alerts": [
                            _alert(
                                {
                                    "severity": "critical",
                                    "namespace": "prod",
                                    "name": "chat",
                                    "reason": "ModelFetchFailed",
                                },
                                "InferenceService prod/chat is stalled: ModelFetchFailed",
                                _description("EmberInferenceServiceStalled"),
                            )
                        ],
                    },
                    {"eval_time": "5m", "alertname": "EmberFallbackActive", "exp_alerts": []},
                    {
                        "eval_time": "20m",
                        "alertname": "EmberFallbackActive",
                        "exp_alerts": [
                            _alert(
                                {"severity": "warning", **chat},
                                "prod/chat sends 1 requests/s to its fallback",
                                _description("EmberFallbackActive"),
                            ),
                            _alert(
                                {"severity": "warning", **edge},
                                "prod/edge sends 1 requests/s to its fallback",
                                _description("EmberFallbackActive"),
                            ),
                            _alert(
                                {"severity": "warning", **spill},
                                "prod/spill sends 86 requests/s to its fallback",
                                _description("EmberFallbackActive"),
                            ),
                        ],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "EmberHighShedRate",
                        # A request the fallback served is a request too: chat's and edge's clients sent 2
                        # a second, of which 0.5 were shed. spill's 4 % stays under the threshold.
                        "exp_alerts": [
                            _alert(
                                {"severity": "warning", **chat},
                                "prod/chat sheds 25% of its requests",
                                _description("EmberHighShedRate"),
                            ),
                            _alert(
                                {"severity": "warning", **edge},
                                "prod/edge sheds 25% of its requests",
                                _description("EmberHighShedRate"),
                            ),
                            _alert(
                                {"severity": "warning", **down},
                                "prod/down sheds 100% of its requests",
                                _description("EmberHighShedRate"),
                            ),
                        ],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "EmberKVCacheNearlyFull",
                        "exp_alerts": [
                            _alert(
                                {"severity": "warning", **chat, "pod": "chat-a"},
                                "KV cache of prod/chat-a is 97% full",
                                _description("EmberKVCacheNearlyFull"),
                            )
                        ],
                    },
                    {
                        "eval_time": "20m",
                        "alertname": "EmberTTFTOverSLO",
                        "exp_alerts": [
                            _alert(
                                {"severity": "warning", **chat},
                                "p99 time to first token of prod/chat is 2.495s",
                                _description("EmberTTFTOverSLO"),
                            )
                        ],
                    },
                ],
            }
        ],
    }
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    tested = subprocess.run(
        [_promtool(), "test", "rules", str(tmp_path / "tests.yaml")], capture_output=True, text=True
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_pod_monitors_give_the_same_labels_as_the_scrape_configs() -> None:
    jobs = {j["job_name"]: j for j in yaml.safe_load((MONITORING / "scrape-configs.yaml").read_text())}
    monitors = {
        m["metadata"]["name"]: m for m in yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text())
    }
    assert set(monitors) == {"ember-engines", "ember-routers"}
    for name, monitor in monitors.items():
        job = jobs[name]
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        # The Prometheus Operator adds namespace and pod itself; the rest must match the hand-written job.
        relabel = {
            (tuple(r.get("source_labels", ())), r["target_label"], r.get("replacement", "$1"))
            for r in job["relabel_configs"]
            if "target_label" in r
        }
        assert {
            (tuple(r.get("sourceLabels", ())), r["targetLabel"], r.get("replacement", "$1"))
            for r in endpoint["relabelings"]
        } <= relabel
        assert {"namespace", "pod", "inferenceservice", "role"} <= {t for _, t, _ in relabel}
        # The job keeps exactly the pods the monitor selects, at the monitor's port.
        (keep,) = [r for r in job["relabel_configs"] if r.get("action") == "keep"]
        wanted = dict(monitor["spec"]["selector"]["matchLabels"])
        sources = [s.removeprefix("__meta_kubernetes_pod_label_") for s in keep["source_labels"]]
        assert sources[-1] == "__meta_kubernetes_pod_container_port_name"
        assert dict(zip(sources[:-1], keep["regex"].split(";")[:-1], strict=True)) == {
            k.replace(".", "_").replace("/", "_").replace("-", "_"): v for k, v in wanted.items()
        }
        assert keep["regex"].split(";")[-1] == endpoint["port"] == "http"
    engines, routers = monitors["ember-engines"], monitors["ember-routers"]
    assert engines["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "ember-operator",
        "app.kubernetes.io/name": "ember",
    }
    assert routers["spec"]["selector"]["matchLabels"] == {
        "app.kubernetes.io/managed-by": "ember-operator",
        "app.kubernetes.io/name": "ember-router",
    }
    service_monitor = yaml.safe_load((MONITORING / "servicemonitor.yaml").read_text())
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert jobs["ember-operator"]["honor_labels"] is True


def test_the_pod_monitors_select_the_operators_engine_and_router_pods() -> None:
    """The labels the monitors select by are the ones the operator puts on its pods, and no pod is both."""
    from ember_operator import router
    from ember_operator.desired import Owner, desired_pod

    spec = InferenceServiceSpec.model_validate(_eis("chat")["spec"])
    owner = Owner("chat", "prod", "uid-1")
    engine = desired_pod(owner, spec, "active", "hash")["metadata"]["labels"]
    routers = router.desired_router_deployment(owner, spec)["spec"]["template"]["metadata"]["labels"]
    selects = {
        m["metadata"]["name"]: m["spec"]["selector"]["matchLabels"]
        for m in yaml.safe_load_all((MONITORING / "podmonitor.yaml").read_text())
    }
    assert selects["ember-engines"].items() <= engine.items()
    assert not selects["ember-engines"].items() <= routers.items()
    assert selects["ember-routers"].items() <= routers.items()
    assert not selects["ember-routers"].items() <= engine.items()
    assert routers["ember.dev/router"] == "chat"  # the job's inferenceservice label


def test_the_operator_serves_its_metric_names_as_they_are_to_prometheus() -> None:
    """Prometheus asks for OpenMetrics first; the names must still read `ember:operator_...`."""
    from ember_operator import metrics

    metrics.DESIRED.labels("prod", "chat").set(3)
    server = metrics.serve(0, addr="127.0.0.1")
    try:
        accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        reply = plainhttp.get(
            f"http://127.0.0.1:{server.server_address[1]}/metrics", headers={"Accept": accept}
        )
    finally:
        server.shutdown()
        server.server_close()
    assert 'ember:operator_desired_replicas{name="chat",namespace="prod"} 3.0' in reply.text
    metrics.forget("prod", "chat")


def test_the_local_discovery_gives_kubernetes_sd_meta_labels() -> None:
    """The labels Prometheus's Kubernetes discovery documents for roles pod and endpoints, for the ones the
    shipped jobs relabel from."""
    from ember_localcluster.prometheus import endpoints_groups, pod_groups

    pod = {
        "metadata": {
            "name": "chat-abc",
            "namespace": "prod",
            "uid": "u1",
            "labels": {"app.kubernetes.io/instance": "chat", "ember.dev/role": "active"},
        },
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"name": "engine", "image": "img", "ports": [{"name": "http", "containerPort": 8000}]}
            ],
        },
        "status": {
            "podIP": "10.0.0.5",
            "hostIP": "10.1.0.1",
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    (group,) = pod_groups([pod, {**pod, "status": {}}])  # a pod without an IP has no target
    assert group["targets"] == ["10.0.0.5:8000"]
    labels = group["labels"]
    assert (
        labels["__meta_kubernetes_namespace"] == "prod" and labels["__meta_kubernetes_pod_name"] == "chat-abc"
    )
    assert labels["__meta_kubernetes_pod_label_app_kubernetes_io_instance"] == "chat"
    assert labels["__meta_kubernetes_pod_labelpresent_ember_dev_role"] == "true"
    assert labels["__meta_kubernetes_pod_container_port_name"] == "http"
    assert labels["__meta_kubernetes_pod_container_port_number"] == "8000"
    assert (
        labels["__meta_kubernetes_pod_ready"] == "true"
        and labels["__meta_kubernetes_pod_container_init"] == "false"
    )
    service = {
        "metadata": {"name": "m", "namespace": "ops", "labels": {"app.kubernetes.io/name": "ember-operator"}}
    }
    endpoints = {
        "metadata": {"name": "m", "namespace": "ops"},
        "subsets": [
            {
                "addresses": [{"ip": "1.2.3.4"}],
                "notReadyAddresses": [{"ip": "1.2.3.5"}],
                "ports": [{"name": "metrics", "port": 8080}],
            }
        ],
    }
    ready, not_ready = endpoints_groups([endpoints], {("ops", "m"): service})
    assert ready["targets"] == ["1.2.3.4:8080"] and not_ready["targets"] == ["1.2.3.5:8080"]
    assert ready["labels"]["__meta_kubernetes_service_label_app_kubernetes_io_name"] == "ember-operator"
    assert ready["labels"]["__meta_kubernetes_endpoint_port_name"] == "metrics"
    assert (
        ready["labels"]["__meta_kubernetes_endpoint_ready"],
        not_ready["labels"]["__meta_kubernetes_endpoint_ready"],
    ) == ("true", "false")


# -- a real Prometheus over real engines --------------------------------------------------------------------


@dataclass
class Observed:
    cluster: DevCluster
    prometheus: str
    outcomes: dict[int | str, int]


def _eis(name: str, **spec: Any) -> dict[str, Any]:
    body = {
        "model": {"name": "tiny", "source": "/models/tiny", "volumeClaim": "model-weights"},
        "resources": {"gpus": 0},
        **spec,
    }
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": "default"},
        "spec": body,
    }


def _condition(cluster: DevCluster, name: str, kind: str) -> dict[str, Any]:
    obj = cluster.api.get(f"{GROUP}/{VERSION}", KIND, "default", name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def _ready_shape(cluster: DevCluster, name: str, active: int, warm: int) -> bool:
    obj = cluster.api.get(f"{GROUP}/{VERSION}", KIND, "default", name) or {}
    status = obj.get("status") or {}
    return (
        status.get("readyReplicas") == active
        and status.get("warmReplicas") == warm
        and _condition(cluster, name, "WarmPoolReady").get("status") == "True"
        and _condition(cluster, name, "Ready").get("status") == "True"
    )


def _service_url(cluster: DevCluster, name: str) -> str:
    obj = cluster.api.get(f"{GROUP}/{VERSION}", KIND, "default", name) or {}
    return str((obj.get("status") or {})["endpoint"])


def _load(base: str, seconds: float) -> dict[int | str, int]:
    """Streams from 8 clients at once for `seconds`; six of them as one client, over its per-client limit
    even when the router spreads them over two engines (two each would fit: three cannot). Counts the
    answers by status, and those the fallback served (`x-ember-served-by: fallback`)."""
    outcomes: dict[int | str, int] = {}
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(i: int) -> None:
        headers = {"x-ember-client": "batch" if i % 4 else f"user-{i}"}
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < deadline:
                body = {
                    "model": "tiny",
                    "prompt": "def fib(n): return fib(n - 1) + fib(n - 2)\n" * 3,
                    "max_tokens": 24,
                    "stream": True,
                }
                with http.stream("POST", f"{base}/v1/completions", json=body, headers=headers) as response:
                    for _ in response.iter_bytes():
                        pass
                with lock:
                    outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
                    if response.headers.get("x-ember-served-by") == "fallback":
                        outcomes["fallback"] = outcomes.get("fallback", 0) + 1
                if response.status_code == 503:  # as a client should: back off for Retry-After
                    time.sleep(min(float(response.headers.get("Retry-After", 1)), 1.0))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(client, range(8)))
    return outcomes


def _over_the_client_limit(cluster: DevCluster, name: str, attempts: int = 4) -> dict[int | str, int]:
    """One client's three requests straight at one of `name`'s engines (one running, one waiting: all
    the engine takes), the third sent while the engine holds the first two: maxConcurrentPerClient 2
    refuses it with 429, whatever the queue holds (the engine checks a client's limit first, and a
    client-limit refusal never goes to the fallback). Behind the router, `_load`'s clients may meet only its
    own sheds and the engines' full queues (503), so this is where the limit is sure to be reached. The
    second is sent once the first runs (its first token has come): sent at once, it can find the first
    still waiting to be scheduled, the queue (depth 1) full, and go to the fallback, where it does not
    count against the client's limit on this engine. Should either stream not be on the engine when the
    third's answer comes (sent to the fallback, or ended), the client was not over its limit there, and the
    three are sent again, up to `attempts` times. Counts every answer by status, and those the fallback
    served."""
    selector = f"app.kubernetes.io/instance={name},ember.dev/role=active"
    pod = next(
        p
        for p in cluster.api.list("v1", "Pod", "default", label_selector=selector)
        if p["status"].get("podIP")
    )
    url = f"http://{pod['status']['podIP']}:8000/v1/completions"
    body = {"model": "tiny", "prompt": "def fib(n):\n", "max_tokens": 512, "ignore_eos": True, "stream": True}
    headers = {"x-ember-client": "over-the-limit"}
    outcomes: dict[int | str, int] = {}
    lock = threading.Lock()

    def count(response: httpx.Response) -> None:
        with lock:
            outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
            if response.headers.get("x-ember-served-by") == "fallback":
                outcomes["fallback"] = outcomes.get("fallback", 0) + 1

    def stream(i: int, events: list[threading.Event], by_fallback: list[bool]) -> None:
        """events: admitted (the headers came), running (so did the first token), ended."""
        with (
            httpx.Client(timeout=120) as http,
            http.stream("POST", url, json=body, headers=headers) as response,
        ):
            by_fallback[i] = response.headers.get("x-ember-served-by") == "fallback"
            events[0].set()
            for _ in response.iter_bytes():
                events[1].set()
        events[1].set()
        events[2].set()
        count(response)

    for _ in range(attempts):
        events = [[threading.Event() for _ in range(3)] for _ in range(2)]
        by_fallback = [False, False]
        threads = [threading.Thread(target=stream, args=(i, events[i], by_fallback)) for i in range(2)]
        threads[0].start()
        assert events[0][1].wait(60), "the first stream's first token"
        threads[1].start()
        assert events[1][0].wait(60), "the second stream's headers"
        third = plainhttp.post(
            url, json={**body, "stream": False, "max_tokens": 4}, headers=headers, timeout=60
        )
        both_ran = not any(by_fallback) and not any(e[2].is_set() for e in events)
        count(third)
        for thread in threads:
            thread.join()
        if both_ran:
            assert third.status_code == 429, (third.status_code, third.text)
            break
    return outcomes


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[Observed]:
    root = tmp_path_factory.mktemp("prometheus")
    cluster = DevCluster(
        root / "dev",
        port=free_port(),
        prometheus_port=free_port(),
        scrape_interval=1.0,
        backoff_initial=1.0,  # the broken engine's crash loop in seconds, not the kubelet's 10 s to 300 s
        backoff_max=10.0,
    )
    (root / "dev" / "models").mkdir(parents=True)
    (root / "dev" / "models" / "tiny").symlink_to(tiny_model)
    with cluster:
        api = cluster.api
        # The fallback: one request at a time and one waiting, so that it too refuses some of chat's overflow.
        api.create(
            _eis(
                "small",
                replicas={"min": 1, "max": 1},
                engine={"maxNumSeqs": 1},
                loadShedding={"maxQueueDepth": 1},
                router={"replicas": 1},
            )
        )
        api.create(
            _eis(
                "chat",
                replicas={"min": 1, "max": 2},
                warmPool={"size": 1},
                engine={"maxNumSeqs": 1, "extraArgs": ["--no-speculative-adaptive"]},
                speculative={"method": "ngram", "numTokens": 3},
                loadShedding={"maxQueueDepth": 1, "maxConcurrentPerClient": 2},
                fallback={"service": "small"},
                # Behind a router: what the engine refuses (its fallback full too) the router sends to the
                # fallback itself or sheds; the alerts count both, and the engine's refusals once.
                router={"replicas": 1},
                # With one request running and one waiting (all the queue takes) the autoscaler wants more.
                autoscaling={
                    "intervalSeconds": 1,
                    "queueDepthPerReplica": 0.25,
                    "scaleDownStabilizationSeconds": 600,
                },
            )
        )
        # A model that is not there: the engine crash-loops and the service stalls.
        api.create(
            _eis(
                "broken",
                model={"name": "broken", "source": "/models/missing", "volumeClaim": "model-weights"},
            )
        )
        wait_for(
            lambda: _ready_shape(cluster, "small", 1, 0) and _ready_shape(cluster, "chat", 1, 1),
            timeout=180,
            what="chat and small Ready",
        )
        outcomes = _load(_service_url(cluster, "chat"), seconds=25)
        for status, count in _over_the_client_limit(cluster, "chat").items():
            outcomes[status] = outcomes.get(status, 0) + count
        wait_for(
            lambda: _condition(cluster, "broken", "Stalled").get("status") == "True",
            timeout=120,
            what="broken Stalled",
        )
        time.sleep(3)  # a few more scrapes and rule evaluations after the traffic
        assert cluster.prometheus is not None
        yield Observed(cluster, cluster.prometheus.url, outcomes)


def _query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    reply = plainhttp.get(f"{prometheus}/api/v1/query", params={"query": expr}, timeout=30).json()
    assert reply["status"] == "success", f"{expr}: {reply}"
    return list(reply["data"]["result"])


def _concrete(expr: str) -> str:
    """A dashboard query as Grafana sends it with every namespace and InferenceService selected, over a
    window that still holds the traffic when the query comes a minute or more after it (a quantile of the
    rates of a histogram that did not grow in its window is NaN)."""
    return (
        expr.replace("$namespace", ".*").replace("$inferenceservice", ".*").replace("$__rate_interval", "10m")
    )


def test_the_traffic_was_served_shed_and_overflowed(observed: Observed) -> None:
    outcomes = observed.outcomes
    assert outcomes.get(200, 0) > 0 and outcomes.get(429, 0) > 0 and outcomes.get("fallback", 0) > 0, outcomes


def test_every_target_is_up(observed: Observed) -> None:
    up = {
        (r["metric"]["job"], r["metric"].get("inferenceservice", "")): r["value"][1]
        for r in _query(observed.prometheus, "up")
    }
    assert up[("ember-operator", "")] == "1"
    assert up[("ember-engines", "chat")] == "1" and up[("ember-engines", "small")] == "1"
    assert up[("ember-routers", "chat")] == "1" and up[("ember-routers", "small")] == "1"
    roles = {r["metric"]["role"] for r in _query(observed.prometheus, 'up{job="ember-routers"}')}
    assert roles == {"router"}


def test_the_routers_and_engines_count_each_shed_and_fallback_once(observed: Observed) -> None:
    """What chat's clients saw, from the series the alerts read: the engine's sheds less those its router
    did not pass on, plus the router's own; the fallback's answers from the engine and from the router."""
    chat = 'namespace="default", inferenceservice="chat"'

    def total(series: str) -> float:
        return sum(float(r["value"][1]) for r in _query(observed.prometheus, series))

    def counted() -> tuple[float, float]:
        shed = (
            total(f"ember:requests_shed_total{{{chat}}}")
            - total(f"ember_router:engine_sheds_retried_total{{{chat}}}")
            + total(f"ember_router:shed_requests_total{{{chat}}}")
        )
        served = f'{chat}, outcome="served"'
        fallback = total(f"ember:fallback_requests_total{{{served}}}") + total(
            f"ember_router:fallback_requests_total{{{served}}}"
        )
        return shed, fallback

    outcomes = observed.outcomes
    seen = (outcomes.get(429, 0) + outcomes.get(503, 0), outcomes.get("fallback", 0))
    wait_for(
        lambda: counted() == seen,
        timeout=15,
        what=lambda: f"the counts {counted()} to match what the clients saw, {seen}",
    )
    # The routers took part: they passed on none of some engine refusals, and the fallback served some of
    # what they sent it or they shed it themselves.
    assert total(f"ember_router:engine_sheds_retried_total{{{chat}}}") > 0
    routers_own = f'ember_router:fallback_requests_total{{{chat}, outcome="served"}}'
    assert total(routers_own) + total(f"ember_router:shed_requests_total{{{chat}}}") > 0


def test_every_dashboard_query_returns_data(observed: Observed) -> None:
    dashboard = json.loads((MONITORING / "dashboard.json").read_text())
    targets = [(panel["title"], t["expr"]) for panel in dashboard["panels"] for t in panel["targets"]]
    assert len(targets) >= 20

    def empty() -> list[str]:
        out = []
        for title, expr in targets:
            result = _query(observed.prometheus, _concrete(expr))
            values = [float(r["value"][1]) for r in result]
            if not values or all(math.isnan(v) for v in values):
                out.append(f"{title}: {expr} -> {result}")
        return out

    # A rate or increase needs two scrapes of its series in the window; a series first written late in
    # the traffic (one more scaling decision) has its second a scrape interval (1 s) later.
    wait_for(
        lambda: not empty(), timeout=15, what=lambda: "queries with data; without:\n" + "\n".join(empty())
    )
    for variable in dashboard["templating"]["list"][1:]:
        series = variable["query"]["query"].removeprefix("label_values(").rsplit(",", 1)[0]
        assert _query(observed.prometheus, _concrete(series)), variable["name"]


def test_the_alerts_load_evaluate_and_fire_on_what_happened(observed: Observed) -> None:
    groups = plainhttp.get(f"{observed.prometheus}/api/v1/rules", timeout=30).json()["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    shipped = {r.get("alert") or r["record"] for g in shipped_rules()["groups"] for r in g["rules"]}
    assert set(rules) == shipped
    for name, rule in rules.items():
        assert rule["health"] == "ok" and not rule.get("lastError"), (name, rule)

    def active() -> set[tuple[str, str]]:
        alerts = plainhttp.get(f"{observed.prometheus}/api/v1/alerts", timeout=30).json()["data"]["alerts"]
        return {
            (a["labels"]["alertname"], a["labels"].get("name") or a["labels"].get("inferenceservice", ""))
            for a in alerts
        }

    wanted = {
        ("EmberInferenceServiceStalled", "broken"),
        ("EmberHighShedRate", "chat"),
        ("EmberFallbackActive", "chat"),
    }
    wait_for(lambda: wanted <= active(), timeout=30, what=f"{wanted} pending or firing")


def test_the_keda_scaled_object_query_returns_one_value(observed: Observed) -> None:
    (eis,) = [d for d in yaml.safe_load_all((KEDA / "inferenceservice.yaml").read_text()) if d]
    spec = InferenceServiceSpec.model_validate(eis["spec"])
    assert spec.autoscaling.mode == "External"
    scaled = yaml.safe_load((KEDA / "scaledobject.yaml").read_text())
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        f"{GROUP}/{VERSION}",
        KIND,
        eis["metadata"]["name"],
    )
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    # The example is `chat` in `default`, as the traffic here: KEDA needs exactly one value.
    (result,) = _query(observed.prometheus, trigger["metadata"]["query"])
    assert float(result["value"][1]) >= 0 and int(trigger["metadata"]["threshold"]) > 0
