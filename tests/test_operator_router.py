"""The router's desired objects (operator/ember_operator/router.py): the Deployment's command line against
`ember router`'s own parser, what it takes of spec.pod and spec.lifecycle and what it leaves, its RBAC, and
what the Service selects."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

import pytest
from prometheus_client import generate_latest
from pydantic import ValidationError

from ember_engine.server.policy import parse_policy
from ember_localcluster import fit, interpod
from ember_localcluster.apiserver.podsecurity import violations
from ember_operator import router
from ember_operator.autoscaler import PodLoad
from ember_operator.desired import (
    ACTIVE,
    POLICY_DIR,
    POLICY_FILE,
    ROLE_LABEL,
    ROUTES_FILE,
    Owner,
    active_selector,
    desired_policy_configmap,
    desired_service,
    policy_configmap_name,
    template_hash,
)
from ember_operator.rollout import PodPlan, PodView
from ember_operator.scaling import Memory, fallback_condition
from ember_operator.scrape import PodSample, parse_pending, parse_router_fallback
from ember_operator.spec import InferenceServiceSpec
from ember_operator.status import Assessment
from ember_router import main as router_main
from ember_router.metrics import RouterMetrics
from ember_router.rules import Rule, parse_routes

OWNER = Owner("chat", "prod", "uid-1")


def make_spec(**changes: Any) -> InferenceServiceSpec:
    doc: dict[str, Any] = {"model": {"name": "chat", "source": "/models/chat", "volumeClaim": "weights"}}
    doc.update(changes)
    return InferenceServiceSpec.model_validate(doc)


def _pod_spec(spec: InferenceServiceSpec) -> dict[str, Any]:
    return dict(router.desired_router_deployment(OWNER, spec)["spec"]["template"]["spec"])


def test_the_router_is_on_by_default_with_two_replicas_in_front_of_the_active_engines() -> None:
    spec = make_spec()
    kinds = [o["kind"] for o in router.desired_objects(OWNER, spec)]
    assert kinds == ["ServiceAccount", "RoleBinding", "Deployment"]
    deploy = router.desired_router_deployment(OWNER, spec)
    assert deploy["metadata"]["name"] == "chat-router" and deploy["spec"]["replicas"] == 2
    assert deploy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # The Service selects exactly the router pods, and no engine pod carries those labels.
    selector = router.service_selector("chat", spec)
    assert desired_service(OWNER, selector)["spec"]["selector"] == selector
    assert selector.items() <= labels.items()
    assert not selector.items() <= {**active_selector("chat")}.items()
    assert "app.kubernetes.io/instance" not in labels


def test_router_args_parse_with_ember_routers_own_command_line() -> None:
    spec = make_spec(router={"epsilon": 0.5}, lifecycle={"drainSeconds": 12})
    (container,) = _pod_spec(spec)["containers"]
    assert container["command"] == ["ember", "router"]
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    # $(POD_NAMESPACE) is expanded by the kubelet from the downward API.
    args = [a.replace("$(POD_NAMESPACE)", "prod") for a in container["args"]]
    parsed = parser.parse_args(args)
    assert parsed.model == "/models/chat" and parsed.kube_namespace == "prod"
    assert parsed.served_model_name == [spec.model.name]
    assert (
        parsed.kube_selector
        == f"app.kubernetes.io/instance=chat,app.kubernetes.io/name=ember,{ROLE_LABEL}=active"
    )
    assert parsed.epsilon == 0.5 and parsed.drain_timeout == 12 and parsed.port == router.ROUTER_PORT
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]


def test_a_new_fallback_leaves_the_router_deployment_as_it_was() -> None:
    """spec.fallback (its address, published a moment after its user is applied, its model, its conditions)
    reaches the routers through the policy ConfigMap, read live, as it reaches the engines: no new pod."""
    first, second = "http://chat-small.prod.svc.cluster.local", "https://small.example.com"
    spec = make_spec(fallback={"service": "chat-small", "model": "small", "when": ["Unavailable"]})
    others = [make_spec(fallback={"url": second}), make_spec(fallback={"service": "chat-small"}), make_spec()]

    def deployment(spec: InferenceServiceSpec) -> dict[str, Any]:
        (deploy,) = [o for o in router.desired_objects(OWNER, spec) if o["kind"] == "Deployment"]
        return deploy

    assert all(deployment(other) == deployment(spec) for other in others)
    # Where the fallback goes instead: the ConfigMap mounted in the router pods, the file `--policy` names.
    assert desired_policy_configmap(OWNER, spec, first) != desired_policy_configmap(OWNER, spec, second)
    pod = deployment(spec)["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = parser.parse_args([a.replace("$(POD_NAMESPACE)", "prod") for a in container["args"]])
    assert args.fallback_url is None and args.policy == f"{POLICY_DIR}/{POLICY_FILE}"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == POLICY_DIR]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    # The whole directory, not a subPath: a ConfigMap update reaches a subPath mount only on a restart.
    assert "subPath" not in mount and volume["configMap"]["name"] == policy_configmap_name("chat")
    text = desired_policy_configmap(OWNER, spec, second)["data"][POLICY_FILE]
    fallback = parse_policy(text).fallback
    assert (fallback.url, fallback.model, fallback.when) == (second, "small", ["Unavailable"])


def test_routers_drain_like_engines_take_identity_but_no_gpu_placement() -> None:
    spec = make_spec(
        resources={
            "gpus": 2,
            "nodeSelector": {"pool": "gpu"},
            "tolerations": [{"key": "gpu", "operator": "Exists"}],
        },
        pod={
            "imagePullSecrets": [{"name": "regcred"}],
            "securityContext": {"runAsUser": 1000},
            "containerSecurityContext": {"readOnlyRootFilesystem": True},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]
                    }
                }
            },
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "DoNotSchedule",
                }
            ],
        },
        lifecycle={"drainSeconds": 40, "terminationGracePeriodSeconds": 60},
        router={"cpu": "500m", "memory": "1Gi"},
    )
    pod = _pod_spec(spec)
    assert pod["terminationGracePeriodSeconds"] == 60
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["securityContext"]["runAsUser"] == 1000
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    for field in ("nodeSelector", "tolerations", "affinity"):
        assert field not in pod
    # Their own spread over nodes only, not the engines'.
    assert [c["topologyKey"] for c in pod["topologySpreadConstraints"]] == ["kubernetes.io/hostname"]
    assert container["resources"] == {
        "requests": {"cpu": "500m", "memory": "1Gi"},
        "limits": {"memory": "1Gi"},
    }
    assert "--drain-timeout=40" in container["args"]
    assert pod["serviceAccountName"] == "chat-router"
    # The tokenizer comes from the engines' checkpoint, mounted the same way.
    assert {"name": "models", "persistentVolumeClaim": {"claimName": "weights", "readOnly": True}} in pod[
        "volumes"
    ]
    wrapped = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "r"}, "spec": pod}
    assert violations(wrapped, "restricted") == []


def test_the_role_binding_gives_the_routers_account_only_the_router_cluster_role() -> None:
    binding = router.desired_role_binding(OWNER)
    assert binding["metadata"]["namespace"] == "prod"
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "ember-router",
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "chat-router", "namespace": "prod"}]


def test_disabled_the_service_selects_the_engines_and_no_router_object_is_wanted() -> None:
    spec = make_spec(router={"enabled": False})
    assert router.desired_objects(OWNER, spec) == []
    assert router.service_selector("chat", spec) == active_selector("chat")
    assert router.router_status(spec, None) is None
    assert router.router_condition(spec, None).reason == "RouterDisabled"


def test_status_and_condition_follow_the_deployments_ready_pods() -> None:
    spec = make_spec(router={"replicas": 3})
    assert router.router_status(spec, None) == {"ready": 0, "desired": 3, "summary": "0/3"}
    none_ready = router.router_condition(spec, router.router_status(spec, {"status": {}}))
    assert (none_ready.status, none_ready.reason) == (False, "RouterUnavailable")
    one = router.router_status(spec, {"status": {"readyReplicas": 1}})
    assert one == {"ready": 1, "desired": 3, "summary": "1/3"}
    ready = router.router_condition(spec, one)
    assert (ready.status, ready.reason, ready.message) == (True, "RouterAvailable", "1/3 router pods Ready")


def test_routing_rules_become_a_routes_file_that_ember_router_parses() -> None:
    spec = make_spec(
        routing=[
            {
                "name": "short",
                "service": "small",
                "maxMaxTokens": 64,
                "header": "X-Tier",
                "headerValue": "free",
            },
            {"name": "mini", "service": "tiny", "models": ["mini"]},
            {"name": "gone", "service": "absent", "minPromptTokens": 10},
        ]
    )
    urls = {"small": "http://small.prod.svc.cluster.local", "tiny": "http://127.0.0.1:9"}
    cm = desired_policy_configmap(OWNER, spec, None, router.routes_document(spec, urls))
    parsed = parse_routes(cm["data"][ROUTES_FILE])
    assert parsed == (  # a rule whose service is not there is left out
        (Rule("short", "small", max_max_tokens=64, header="X-Tier", header_value="free"), urls["small"]),
        (Rule("mini", "tiny", models=("mini",)), urls["tiny"]),
    )
    # The router reads that file, from the ConfigMap mounted whole; the Deployment holds no address, so
    # a target's address (status.endpoint, published later) or a rule's change rolls no router pod.
    (container,) = router.desired_router_deployment(OWNER, spec)["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = parser.parse_args([a.replace("$(POD_NAMESPACE)", "prod") for a in container["args"]])
    assert args.routes == f"{POLICY_DIR}/{ROUTES_FILE}" and args.route == []
    assert router.desired_router_deployment(OWNER, spec) == router.desired_router_deployment(
        OWNER, make_spec(routing=[{"name": "other", "service": "elsewhere"}])
    )
    # Without spec.routing: no file, no option.
    assert ROUTES_FILE not in desired_policy_configmap(OWNER, make_spec(), None, [])["data"]
    (plain,) = router.desired_router_deployment(OWNER, make_spec())["spec"]["template"]["spec"]["containers"]
    assert not [a for a in plain["args"] if a.startswith("--route")]


def test_a_routing_rule_naming_no_service_or_itself_is_a_problem_naming_it() -> None:
    spec = make_spec(routing=[{"name": "a", "service": "small"}, {"name": "b", "service": "chat"}])
    assert router.routing_problem(spec, OWNER, {"small": True}) == (
        "spec.routing rule 'b': names this InferenceService itself"
    )
    assert router.routing_problem(spec, OWNER, {}) == (
        "spec.routing rule 'a': no InferenceService 'small' in prod; "
        "spec.routing rule 'b': names this InferenceService itself"
    )
    fine = make_spec(routing=[{"name": "a", "service": "small"}])
    assert router.routing_problem(fine, OWNER, {"small": True}) is None
    off = make_spec(routing=[{"name": "a", "service": "small"}], router={"enabled": False})
    assert router.routing_problem(off, OWNER, {"small": True}) == (
        "spec.routing needs the router: spec.router.enabled is false"
    )


def test_scale_from_zero_reads_the_ready_routers_held_requests() -> None:
    page = "# TYPE ember_router:pending_requests gauge\nember_router:pending_requests 3.0\n"
    assert parse_pending(page) == 3.0
    with pytest.raises(ValueError, match="no ember_router:pending_requests"):
        parse_pending("vllm:num_requests_waiting 1\n")
    ready = {"type": "Ready", "status": "True"}
    pods = [
        {"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1", "conditions": [ready]}},
        {"metadata": {"name": "b"}, "status": {"podIP": "10.0.0.2", "conditions": []}},
        {
            "metadata": {"name": "c", "deletionTimestamp": "x"},
            "status": {"podIP": "10.0.0.3", "conditions": [ready]},
        },
    ]
    assert router.router_metrics_targets(pods) == {"a": "http://10.0.0.1:8080/metrics"}
    spec = make_spec(replicas={"min": 0, "max": 2})
    assert router.wakes(spec, 0, 1) and not router.wakes(spec, 0, 0) and not router.wakes(spec, 1, 5)
    no_router = make_spec(
        replicas={"min": 0, "max": 2}, router={"enabled": False}, autoscaling={"mode": "External"}
    )
    assert not router.wakes(no_router, 0, 5)
    (container,) = _pod_spec(make_spec(router={"holdSeconds": 12}))["containers"]
    assert "--hold-seconds=12.0" in container["args"]


def test_the_routers_liveness_waits_for_their_start() -> None:
    """A router listens only once its tokenizer is loaded; liveness probing from the container's start
    killed one whose start took longer than the liveness probe's failures allow (a loaded node, a slow
    model volume), and the next run the same. A startup probe on /health gates liveness and readiness, with
    the engines' start-up allowance (spec.lifecycle.startupTimeoutSeconds) at the readiness period."""
    (container,) = _pod_spec(make_spec())["containers"]
    assert container["startupProbe"] == {
        "httpGet": {"path": "/health", "port": "http"},
        "periodSeconds": 2,
        "timeoutSeconds": 2,
        "failureThreshold": 900,
    }
    spec = make_spec(lifecycle={"startupTimeoutSeconds": 61, "readinessPeriodSeconds": 5})
    (container,) = _pod_spec(spec)["containers"]
    assert container["startupProbe"]["periodSeconds"] == 5
    assert container["startupProbe"]["failureThreshold"] == 13  # 61 s at least


def test_the_routers_spread_over_the_nodes() -> None:
    """Both routers on one node: losing that node leaves the Service with no endpoint while an engine still
    serves. On two nodes, one already running an engine, nothing asked otherwise and the least-allocated
    score put the second router beside the first. The routers carry a soft spread over hostnames among
    their own ReplicaSet's pods, and kube-scheduler's default profile (the local scheduler's scores) puts
    the second on the other node."""
    spec = make_spec()
    pod_spec = _pod_spec(spec)
    assert pod_spec["topologySpreadConstraints"] == [
        {
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": router.router_selector("chat")},
            "matchLabelKeys": ["pod-template-hash"],
        }
    ]
    template = router.desired_router_deployment(OWNER, spec)["spec"]["template"]
    labels = {**template["metadata"]["labels"], "pod-template-hash": "5d8f7c9b6"}

    def router_pod(name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "prod", "labels": labels}, "spec": pod_spec}

    def node(name: str) -> fit.NodeInfo:
        labels = {"kubernetes.io/hostname": name}
        allocatable = {"cpu": "6", "memory": "24Gi", "pods": "110"}
        return fit.NodeInfo(
            {"metadata": {"name": name, "labels": labels}, "status": {"allocatable": allocatable}}
        )

    nodes = [node("node-a"), node("node-b")]
    engine = {"cpu": "3", "memory": "8Gi"}  # node-b already runs an engine: node-a is the less allocated
    nodes[1].pods.append(
        {
            "metadata": {"name": "chat-7f3e1-x2x4q", "namespace": "prod"},
            "spec": {"containers": [{"name": "engine", "resources": {"requests": engine}}]},
        }
    )
    first = interpod.select(router_pod("chat-router-1"), nodes, nodes)
    assert first.name == "node-a"
    first.pods.append(router_pod("chat-router-1"))
    second = interpod.select(router_pod("chat-router-2"), nodes, nodes)
    assert {first.name, second.name} == {"node-a", "node-b"}


def test_the_routers_stream_idle_timeout_comes_from_the_spec_when_set() -> None:
    """The operator ran its routers with no bound on an idle stream: a frozen engine held its clients'
    streams for ever. spec.router.streamIdleTimeoutSeconds sets the router's; unset, the routers' own
    default applies (300 s) and their arguments are as before (no roll on upgrade)."""
    (container,) = _pod_spec(make_spec(router={"streamIdleTimeoutSeconds": 60}))["containers"]
    assert "--stream-idle-timeout=60.0" in container["args"]
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    parsed = parser.parse_args([a.replace("$(POD_NAMESPACE)", "prod") for a in container["args"]])
    assert parsed.stream_idle_timeout == 60
    (container,) = _pod_spec(make_spec(router={"streamIdleTimeoutSeconds": 0}))["containers"]
    assert "--stream-idle-timeout=0.0" in container["args"]
    (container,) = _pod_spec(make_spec())["containers"]
    assert not any(a.startswith("--stream-idle-timeout") for a in container["args"])
    for bad in (-1, 86401, "soon"):
        with pytest.raises(ValidationError):
            make_spec(router={"streamIdleTimeoutSeconds": bad})


def test_fallback_active_counts_what_the_routers_and_the_engines_sent_each_once() -> None:
    """An engine counts what it hands to the fallback, a router what it sends there itself (an engine's
    fallback answer it relays is not the router's): the condition adds both, as deltas since the last
    scrape, per pod."""
    spec = make_spec(fallback={"url": "http://elsewhere:8000"})
    memory = Memory()

    def engines(**served: float) -> dict[str, PodSample]:
        return {pod: PodSample(PodLoad(0, 0, 0), n) for pod, n in served.items()}

    first = fallback_condition(spec, memory, engines(e1=4), 5, {"r1": 10, "r2": 1})
    assert first.status is False and first.reason == "Idle"  # the first reading of each counter is its base
    second = fallback_condition(spec, memory, engines(e1=6), 5, {"r1": 13, "r2": 1})
    assert second.status is True and second.reason == "Overflowing"
    assert second.message == (
        "5 requests served by the fallback in the last 5 s (2 handed on by the engines, 3 sent by the routers)"
    )
    # A router that restarted (its counter went back) counts from zero; one gone is forgotten.
    third = fallback_condition(spec, memory, engines(e1=6), 5, {"r1": 2})
    assert (
        third.status is True
        and third.message.startswith("2 requests")
        and "r2" not in memory.fallback_counters
    )
    assert fallback_condition(spec, memory, engines(e1=6), 5, {"r1": 2}).status is False
    # With no fallback there is no traffic to tell of.
    assert fallback_condition(make_spec(), memory, engines(e1=9), 5, {"r1": 2}).reason == "NoFallback"


def test_the_operator_reads_a_routers_own_fallback_counter() -> None:
    metrics = RouterMetrics()
    metrics.fallback.labels("served").inc(2)
    metrics.fallback.labels("failed").inc()
    page = generate_latest(metrics.registry).decode()
    assert parse_router_fallback(page) == 2.0
    with pytest.raises(ValueError, match="no ember_router:fallback_requests_total"):
        parse_router_fallback("vllm:num_requests_waiting 1\n")


def test_a_failed_scrape_keeps_a_pods_fallback_baseline() -> None:
    """A pod whose scrape failed in one pass lost its counter, so the next reading became its base and what
    it handed to the fallback in between went uncounted: with scrapes failing every other pass,
    FallbackActive stayed False while hundreds of requests went to the fallback."""
    spec = make_spec(fallback={"url": "http://elsewhere:8000"})
    memory = Memory()
    sample = {"e1": PodSample(PodLoad(0, 0, 0), 4)}
    fallback_condition(spec, memory, sample, 5, {"r1": 1})
    assert fallback_condition(spec, memory, {}, 5, {}, unread={"e1", "r1"}).status is False  # both unread
    later = {"e1": PodSample(PodLoad(0, 0, 0), 10)}
    third = fallback_condition(spec, memory, later, 5, {"r1": 3})
    assert third.status is True and third.message.startswith("8 requests"), third.message


def test_routers_take_the_placement_of_spec_router_not_the_engines() -> None:
    toleration = {"key": "gpu", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    engines = {
        "gpus": 0,
        "nodeSelector": {"pool": "gpu"},
        "tolerations": [{"key": "gpu", "operator": "Exists"}],
    }
    placed = make_spec(
        resources=engines, router={"nodeSelector": {"pool": "cpu"}, "tolerations": [toleration]}
    )
    pod = _pod_spec(placed)
    assert pod["nodeSelector"] == {"pool": "cpu"} and pod["tolerations"] == [toleration]
    # In the Deployment's template, so a change rolls the routers; the engines' pods stay as they are.
    unplaced = make_spec(resources=engines)
    assert "nodeSelector" not in _pod_spec(unplaced) and "tolerations" not in _pod_spec(unplaced)
    assert template_hash(placed) == template_hash(unplaced)


def test_with_no_router_pod_ready_nothing_is_served_and_waiting_routers_are_progress() -> None:
    """The Service selects the routers: none Ready is not Ready, whatever the engines; routers no node can
    take yet make Reconciling WaitingForCapacity as engine pods do."""
    engine = [PodView("e", ACTIVE, "h", True, datetime(2026, 1, 1, tzinfo=UTC))]
    waiting = ["pod chat-router-1: 0/1 nodes are available: 1 node(s) had untolerated taint(s)."]
    a = Assessment("h", 1, 0, 1, engine, PodPlan(), routers=(0, 2), waiting_for_capacity=waiting)
    c = {x.type: x for x in a.conditions()}
    assert (c["Ready"].status, c["Ready"].reason) == (False, "RouterUnavailable")
    assert "0/2 router pods Ready" in c["Ready"].message
    assert (c["Reconciling"].status, c["Reconciling"].reason) == (True, "WaitingForCapacity")
    assert "untolerated taint" in c["Reconciling"].message
    one = {x.type: x for x in Assessment("h", 1, 0, 1, engine, PodPlan(), routers=(1, 2)).conditions()}
    assert one["Ready"].status is True
    converged = {x.type: x for x in Assessment("h", 1, 0, 1, engine, PodPlan(), routers=(2, 2)).conditions()}
    assert (converged["Ready"].status, converged["Reconciling"].status) == (True, False)
