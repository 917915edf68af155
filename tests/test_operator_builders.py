"""The operator's pure parts: children manifests, the template hash, pod reading, status, /metrics parsing.

Where the engine is the other side of a contract (its command line, its policy file, its /metrics page),
the engine's own code is the oracle.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from operator_harness import EnginePage, _metrics_server

from ember_engine.cli import build_parser
from ember_engine.core.llm_engine import EngineStats
from ember_engine.server import serve
from ember_engine.server.metrics import EngineMetrics
from ember_engine.server.policy import parse_policy
from ember_localcluster.apiserver.podsecurity import violations
from ember_operator.desired import (
    ACTIVE,
    HASH_LABEL,
    ROLE_LABEL,
    WARM,
    Owner,
    desired_pdb,
    desired_pod,
    desired_policy_configmap,
    desired_service,
    engine_args,
    quantity_bytes,
    template_hash,
)
from ember_operator.pods import cold_start_seconds, held_troubles, trouble, view, waiting_for_capacity
from ember_operator.rollout import PodPlan, PodView
from ember_operator.scaling import Memory, autoscale, external_decision
from ember_operator.scrape import Scraper, parse_sample
from ember_operator.spec import InferenceServiceSpec
from ember_operator.status import Assessment, Condition, render_conditions

OWNER = Owner("chat", "prod", "uid-1")


def make_spec(**changes: Any) -> InferenceServiceSpec:
    doc: dict[str, Any] = {"model": {"name": "chat", "source": "/models/chat"}}
    doc.update(changes)
    return InferenceServiceSpec.model_validate(doc)


def test_engine_args_parse_with_the_engines_own_command_line() -> None:
    spec = make_spec(
        engine={
            "maxNumSeqs": 64,
            "blockSize": 32,
            "prefixCaching": False,
            "maxModelLen": 4096,
            "kvCacheMemory": "2Gi",
        },
        model={"name": "chat", "source": "/models/chat", "dtype": "bfloat16"},
    )
    pod = desired_pod(OWNER, spec, WARM, "abcdef0123")
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["ember", "serve"] and container["args"] == engine_args(spec)
    parsed = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert parsed.func is serve.main
    assert parsed.model == "/models/chat" and parsed.served_model_name == ["chat"]
    assert parsed.dtype == "bfloat16" and parsed.port == 8000
    assert parsed.max_num_seqs == 64 and parsed.block_size == 32 and parsed.max_model_len == 4096
    assert parsed.enable_prefix_caching is False
    assert parsed.kv_cache_memory == 2 * 2**30
    assert parsed.policy == "/etc/ember/policy/policy.yaml"


@pytest.mark.parametrize(
    ("speculative", "method", "draft", "k"),
    [
        ({"method": "draft", "draftSource": "/models/draft", "numTokens": 3}, "draft", "/models/draft", 3),
        ({"method": "ngram", "numTokens": 6}, "ngram", None, 6),
    ],
)
def test_speculative_fields_become_engine_options(
    speculative: dict[str, Any], method: str, draft: str | None, k: int
) -> None:
    spec = make_spec(speculative=speculative)
    parsed = build_parser().parse_args(["serve", *engine_args(spec)])
    config = serve.engine_config(parsed)
    config.validate()
    assert (config.speculation, config.draft_model, config.num_speculative_tokens) == (method, draft, k)


@pytest.mark.parametrize(
    ("quantity", "expected"),
    [("8Gi", 8 * 2**30), ("500M", 500_000_000), ("1.5Ki", 1536), ("2", 2), ("1k", 1000)],
)
def test_quantities(quantity: str, expected: int) -> None:
    assert quantity_bytes(quantity) == expected


def test_a_bad_quantity_is_refused() -> None:
    with pytest.raises(ValueError, match="not a Kubernetes quantity"):
        quantity_bytes("8 GB")


def test_the_pod_carries_the_contract_labels_owner_probes_and_policy_mount() -> None:
    spec = make_spec(
        resources={
            "gpus": 2,
            "cpu": "8",
            "memory": "64Gi",
            "nodeSelector": {"gpu": "h100"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}],
        }
    )
    pod = desired_pod(OWNER, spec, WARM, "abcdef0123")
    meta = pod["metadata"]
    assert meta["generateName"] == "chat-abcde-" and meta["namespace"] == "prod"
    assert meta["labels"] == {
        "app.kubernetes.io/name": "ember",
        "app.kubernetes.io/instance": "chat",
        "app.kubernetes.io/managed-by": "ember-operator",
        ROLE_LABEL: WARM,
        HASH_LABEL: "abcdef0123",
    }
    (ref,) = meta["ownerReferences"]
    assert ref["uid"] == "uid-1" and ref["controller"] is True and ref["kind"] == "InferenceService"
    (c,) = pod["spec"]["containers"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["resources"]["limits"] == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "2"}
    assert c["env"] == [{"name": "HF_HUB_OFFLINE", "value": "1"}]
    assert pod["spec"]["nodeSelector"] == {"gpu": "h100"}
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    # The grace period outlasts the preStop pause plus the engine's drain.
    prestop = int(c["lifecycle"]["preStop"]["exec"]["command"][1])
    drain = next(int(a.split("=")[1]) for a in c["args"] if a.startswith("--drain-timeout="))
    assert pod["spec"]["terminationGracePeriodSeconds"] > prestop + drain
    # No model volume claim (the checkpoint is in the image): the policy and /dev/shm only.
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert set(mounts) == set(volumes) == {"policy", "dshm"}
    assert "subPath" not in mounts["policy"]  # a subPath mount would never see ConfigMap updates
    assert volumes["policy"]["configMap"]["name"] == "chat-policy"


def test_engine_pods_meet_pod_security_restricted_and_mount_no_token() -> None:
    pod = desired_pod(
        OWNER, make_spec(model={"name": "m", "source": "/models/m", "volumeClaim": "w"}), WARM, "a1"
    )
    assert violations(pod, "restricted") == []
    assert pod["spec"]["automountServiceAccountToken"] is False
    (c,) = pod["spec"]["containers"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert pod["spec"]["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def test_a_model_volume_claim_is_mounted_read_only_at_models() -> None:
    spec = make_spec(model={"name": "chat", "source": "/models/chat", "volumeClaim": "weights"})
    pod = desired_pod(OWNER, spec, WARM, "abcdef0123")
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["models"] == {"name": "models", "mountPath": "/models", "readOnly": True}
    assert template_hash(spec) != template_hash(make_spec())


def test_the_service_selects_only_active_pods() -> None:
    svc = desired_service(OWNER)
    assert svc["spec"]["selector"][ROLE_LABEL] == ACTIVE
    assert svc["spec"]["ports"][0]["targetPort"] == "http"


def test_the_policy_configmap_is_a_policy_the_engine_accepts() -> None:
    spec = make_spec(
        loadShedding={"maxQueueDepth": 64, "maxQueueWaitSeconds": 2.5, "retryAfterSeconds": 3},
        fallback={"service": "chat-small", "when": ["Overloaded"], "timeoutSeconds": 5},
        requestTimeoutSeconds=90,
    )
    cm = desired_policy_configmap(OWNER, spec, "http://chat-small.prod.svc.cluster.local")
    policy = parse_policy(cm["data"]["policy.yaml"])
    assert policy.load_shedding.max_queue_depth == 64
    assert policy.load_shedding.max_queue_wait_seconds == 2.5
    assert policy.load_shedding.retry_after_seconds == 3
    assert [c.name for c in policy.load_shedding.priority_classes] == ["critical", "standard", "batch"]
    assert policy.fallback.url == "http://chat-small.prod.svc.cluster.local"
    assert policy.fallback.when == ["Overloaded"] and policy.fallback.timeout_seconds == 5
    assert policy.request_timeout_seconds == 90
    unresolved = desired_policy_configmap(OWNER, spec, None)
    assert parse_policy(unresolved["data"]["policy.yaml"]).fallback.url is None


def test_only_engine_affecting_fields_change_the_template_hash() -> None:
    base = template_hash(make_spec())
    assert template_hash(make_spec()) == base
    for unaffecting in (
        {"replicas": {"min": 2, "max": 9}},
        {"warmPool": {"size": 3}},
        {"autoscaling": {"queueDepthPerReplica": 9}},
        {"loadShedding": {"maxQueueDepth": 5}},
        {"fallback": {"url": "http://x"}},
        {"requestTimeoutSeconds": 5},
    ):
        assert template_hash(make_spec(**unaffecting)) == base, unaffecting
    for affecting in (
        {"engine": {"maxNumSeqs": 8}},
        {"resources": {"image": "other:1"}},
        {"model": {"name": "chat", "source": "/models/other"}},
        {"speculative": {"method": "ngram"}},
    ):
        assert template_hash(make_spec(**affecting)) != base, affecting


T0 = datetime(2026, 11, 1, 12, 0, 0, tzinfo=UTC)


def _stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod_dict(name: str = "chat-abcde-xyz12", **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "creationTimestamp": _stamp(T0),
            "labels": {ROLE_LABEL: ACTIVE, HASH_LABEL: "h1"},
        },
        "status": status,
    }


def test_reading_a_ready_pod_and_its_cold_start() -> None:
    pod = pod_dict(
        phase="Running",
        podIP="10.0.0.7",
        conditions=[
            {"type": "Ready", "status": "True", "lastTransitionTime": _stamp(T0 + timedelta(seconds=42))}
        ],
        containerStatuses=[{"name": "engine", "restartCount": 0, "ready": True}],
    )
    v = view(pod)
    assert (v.role, v.template_hash, v.ready, v.phase) == (ACTIVE, "h1", True, "Running")
    assert cold_start_seconds(pod) == 42.0
    assert trouble(pod) is None
    restarted = pod_dict(
        conditions=pod["status"]["conditions"], containerStatuses=[{"name": "engine", "restartCount": 1}]
    )
    assert cold_start_seconds(restarted) is None  # a restart resets the Ready clock


def test_a_crash_looping_pod_is_trouble_with_the_last_log_line() -> None:
    pod = pod_dict(
        phase="Running",
        containerStatuses=[
            {
                "name": "engine",
                "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {
                    "terminated": {
                        "exitCode": 1,
                        "message": "loading...\nFileNotFoundError: /models/chat/config.json",
                    }
                },
            }
        ],
    )
    t = trouble(pod)
    assert t is not None and t.reason == "PodsCrashLooping"
    assert "exit code 1" in t.message and "FileNotFoundError: /models/chat/config.json" in t.message
    assert "loading" not in t.message


def test_one_crash_or_old_restarts_are_not_trouble() -> None:
    first_crash = pod_dict(
        containerStatuses=[{"restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]
    )
    assert trouble(first_crash) is None  # the kubelet restarts it; a spec change is not needed yet
    running_again = pod_dict(containerStatuses=[{"restartCount": 7, "state": {"running": {}}}])
    assert trouble(running_again) is None  # restarts of a container that runs now are history


def test_unschedulable_and_image_problems_are_trouble() -> None:
    pending = pod_dict(
        phase="Pending",
        conditions=[
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/3 nodes"}
        ],
    )
    t = trouble(pending)
    assert t is not None and t.reason == "PodsUnschedulable" and "0/3 nodes" in t.message
    pulling = pod_dict(containerStatuses=[{"state": {"waiting": {"reason": "ImagePullBackOff"}}}])
    t = trouble(pulling)
    assert t is not None and t.reason == "ImageUnavailable"


def test_conditions_keep_their_transition_time_until_they_flip() -> None:
    first = render_conditions([Condition("Ready", False, "Starting")], [], 1, T0)
    later = T0 + timedelta(minutes=5)
    same = render_conditions([Condition("Ready", False, "Starting", "still")], first, 2, later)
    assert same[0]["lastTransitionTime"] == _stamp(T0) and same[0]["observedGeneration"] == 2
    flipped = render_conditions([Condition("Ready", True, "MinimumReplicasReady")], same, 2, later)
    assert flipped[0]["lastTransitionTime"] == _stamp(later) and flipped[0]["status"] == "True"


def _pods(*specs: tuple[str, str, bool]) -> list[PodView]:
    return [PodView(f"p{i}", role, h, ready, T0) for i, (role, h, ready) in enumerate(specs)]


def _by_type(conditions: list[Condition]) -> dict[str, Condition]:
    return {c.type: c for c in conditions}


def test_status_when_converged() -> None:
    a = Assessment(
        "h1", 2, 1, 1, _pods((ACTIVE, "h1", True), (ACTIVE, "h1", True), (WARM, "h1", True)), PodPlan()
    )
    assert a.counts() == {"replicas": 2, "warmReplicas": 1, "readyReplicas": 2, "desiredReplicas": 2}
    c = _by_type(a.conditions())
    assert c["Ready"].status is True and c["Reconciling"].status is False and c["Stalled"].status is False
    assert c["WarmPoolReady"].status is True


def test_status_while_rolling_and_while_stalled() -> None:
    rolling = Assessment("h2", 1, 0, 1, _pods((ACTIVE, "h1", True), (WARM, "h2", False)), PodPlan())
    c = _by_type(rolling.conditions())
    assert c["Ready"].status is True
    assert c["Reconciling"].status is True and c["Reconciling"].reason == "RollingUpdate"
    from ember_operator.pods import Trouble

    stalled = Assessment(
        "h2",
        1,
        0,
        1,
        _pods((WARM, "h2", False)),
        PodPlan(),
        troubles=[Trouble("PodsCrashLooping", "pod x: CrashLoopBackOff")],
    )
    c = _by_type(stalled.conditions())
    assert c["Stalled"].status is True and c["Stalled"].reason == "PodsCrashLooping"
    assert c["Reconciling"].status is False  # kstatus: Stalled wins only when Reconciling is not True
    assert c["Ready"].status is False
    # The warm pod that never came up stands in for nothing: it is not counted warm.
    assert c["Ready"].message == "0/1 active Ready, 0 warm Ready"


def test_parse_sample_reads_the_engines_own_metrics_page() -> None:
    m = EngineMetrics("chat")
    m.record_stats(
        EngineStats(
            num_running=5,
            num_waiting=7,
            kv_cache_usage=0.625,
            num_kv_blocks=100,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            prompt_tokens=0,
            generation_tokens=0,
            last_step_seconds=0.0,
            last_batch_size=0,
            last_batch_tokens=0,
            num_steps=0,
        )
    )
    m.record_fallback("served")
    m.record_fallback("served")
    m.record_fallback("failed")
    for reason in ("queue_full", "queue_wait", "queue_wait", "client_limit", "draining", "not_ready"):
        m.record_shed(reason, "default")
    sample = parse_sample(m.render()[0].decode())
    assert (sample.load.waiting, sample.load.running, sample.load.kv_cache) == (7, 5, 0.625)
    assert sample.fallback_served == 2
    # shed for want of capacity: a client over its own limit, or a draining or starting engine, is not
    assert sample.shed == 3


def test_parse_sample_refuses_a_page_without_the_gauges() -> None:
    with pytest.raises(ValueError, match="vllm:kv_cache_usage_perc"):
        parse_sample("vllm:num_requests_waiting 1\nvllm:num_requests_running 2\n")


UNSCHEDULABLE = "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


def _pending(seconds_ago: float) -> dict[str, Any]:
    since = _stamp(T0 + timedelta(minutes=10) - timedelta(seconds=seconds_ago))
    condition = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": UNSCHEDULABLE,
        "lastTransitionTime": since,
    }
    return pod_dict(phase="Pending", conditions=[condition])


def test_an_unschedulable_pod_waits_for_capacity_before_it_is_trouble() -> None:
    now = T0 + timedelta(minutes=10)
    young, old = _pending(30), _pending(301)
    assert trouble(young, now, 300) is None
    assert waiting_for_capacity(young, now, 300) == f"pod chat-abcde-xyz12: {UNSCHEDULABLE}"
    assert view(young).unschedulable
    late = trouble(old, now, 300)
    assert late is not None and late.reason == "PodsUnschedulable" and UNSCHEDULABLE in late.message
    assert waiting_for_capacity(old, now, 300) is None


def test_waiting_for_capacity_is_reconciling_not_stalled() -> None:
    pods = [PodView("a", ACTIVE, "h1", True, T0), PodView("b", WARM, "h1", False, T0, unschedulable=True)]
    a = Assessment("h1", 1, 1, 1, pods, PodPlan(), waiting_for_capacity=[f"pod b: {UNSCHEDULABLE}"])
    conditions = {c.type: c for c in a.conditions()}
    assert conditions["Reconciling"].status is True
    assert conditions["Reconciling"].reason == "WaitingForCapacity"
    assert UNSCHEDULABLE in conditions["Reconciling"].message
    assert conditions["Stalled"].status is False


def test_with_a_warm_pool_the_pdb_keeps_the_target_ready_among_active_and_warm_pods() -> None:
    pdb = desired_pdb(OWNER, make_spec(warmPool={"size": 1}, rollout={"maxUnavailable": 1}), 3)
    assert pdb["spec"]["minAvailable"] == 3
    selector = pdb["spec"]["selector"]
    assert ROLE_LABEL not in selector["matchLabels"]
    assert selector["matchExpressions"] == [{"key": ROLE_LABEL, "operator": "In", "values": [ACTIVE, "warm"]}]
    assert desired_pdb(OWNER, make_spec(warmPool={"size": 1}), 0)["spec"]["minAvailable"] == 0


def test_without_a_warm_pool_the_pdb_covers_active_pods_down_to_the_rollouts_max_unavailable() -> None:
    pdb = desired_pdb(OWNER, make_spec(rollout={"maxUnavailable": 1}), 3)
    assert pdb["apiVersion"] == "policy/v1" and pdb["kind"] == "PodDisruptionBudget"
    assert pdb["spec"]["minAvailable"] == 2
    assert pdb["spec"]["selector"]["matchLabels"][ROLE_LABEL] == ACTIVE
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert desired_pdb(OWNER, make_spec(), 0)["spec"]["minAvailable"] == 0


ENGINE_LOG_TAIL = """Traceback (most recent call last):
  File "/opt/ember/lib/python3.12/site-packages/ember_engine/model/model_config.py", line 46, in from_dir
    raise FileNotFoundError(f"{path} not found")
FileNotFoundError: /models/x/config.json not found
INFO:     Waiting for application shutdown.
INFO:     Application shutdown complete.
INFO:     Finished server process [1]"""


def _crashed(message: str) -> dict[str, Any]:
    waiting = {"waiting": {"reason": "CrashLoopBackOff"}}
    last = {"terminated": {"exitCode": 1, "message": message}}
    return pod_dict(
        phase="Running",
        containerStatuses=[{"name": "engine", "restartCount": 5, "state": waiting, "lastState": last}],
    )


def test_a_crash_loop_reports_the_exception_not_the_shutdown_line() -> None:
    t = trouble(_crashed(ENGINE_LOG_TAIL))
    assert t is not None and "FileNotFoundError: /models/x/config.json not found" in t.message
    assert "Finished server process" not in t.message
    fatal = (
        ENGINE_LOG_TAIL
        + "\nember serve: fatal: cannot load the model: FileNotFoundError: /models/x/config.json not found"
    )
    t = trouble(_crashed(fatal))
    assert t is not None and t.message.endswith(
        "ember serve: fatal: cannot load the model: FileNotFoundError: /models/x/config.json not found"
    )


def test_a_crash_loop_stays_stalled_between_crashes_until_ready_for_a_while() -> None:
    now = T0 + timedelta(minutes=5)
    crashing = _crashed(ENGINE_LOG_TAIL)
    name = crashing["metadata"]["name"]
    held: dict[str, Any] = {}
    first = held_troubles(held, [crashing], {name: trouble(crashing)}, now)
    assert [t.reason for t in first] == ["PodsCrashLooping"]
    # Between two crashes the container runs again (loading): nothing is found, the trouble holds.
    running = pod_dict(
        phase="Running", containerStatuses=[{"name": "engine", "restartCount": 6, "state": {"running": {}}}]
    )
    assert [t.reason for t in held_troubles(held, [running], {}, now)] == ["PodsCrashLooping"]

    def ready_since(seconds: float) -> dict[str, Any]:
        since = _stamp(now - timedelta(seconds=seconds))
        return pod_dict(
            phase="Running", conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": since}]
        )

    assert held_troubles(held, [ready_since(10)], {}, now) != []
    assert held_troubles(held, [ready_since(31)], {}, now) == []
    held_troubles(held, [crashing], {name: trouble(crashing)}, now)
    assert held_troubles(held, [], {}, now) == []  # the pod is gone (e.g. replaced by a fixed template)


def test_a_fetch_failure_clears_once_the_fetch_has_completed() -> None:
    """An init container never runs again in the same pod, so a fetch that completed has fixed its own
    failure: the hold against flapping that a crash loop gets does not apply."""
    now = T0 + timedelta(minutes=5)
    backoff = {"waiting": {"reason": "CrashLoopBackOff"}}
    failed = {"terminated": {"exitCode": 1, "message": "ember fetch-model: fatal: repository not found"}}
    fetching = pod_dict(
        phase="Pending",
        initContainerStatuses=[
            {"name": "fetch-model", "restartCount": 4, "state": backoff, "lastState": failed}
        ],
    )
    name = fetching["metadata"]["name"]
    held: dict[str, Any] = {}
    assert [t.reason for t in held_troubles(held, [fetching], {name: trouble(fetching)}, now)] == [
        "ModelFetchFailed"
    ]
    # Running again (the next try): not found, and held as before.
    retrying = pod_dict(
        phase="Pending",
        initContainerStatuses=[{"name": "fetch-model", "restartCount": 5, "state": {"running": {}}}],
    )
    assert [t.reason for t in held_troubles(held, [retrying], {}, now)] == ["ModelFetchFailed"]
    done = {"terminated": {"exitCode": 0, "reason": "Completed"}}
    fetched = pod_dict(
        phase="Running",
        initContainerStatuses=[
            {"name": "fetch-model", "restartCount": 5, "state": done, "lastState": failed}
        ],
        conditions=[{"type": "Ready", "status": "True", "lastTransitionTime": _stamp(now)}],
    )
    assert held_troubles(held, [fetched], {}, now) == []
    # A crash loop of the engine in that same pod is still held for the while it needs.
    held_troubles(held, [fetching], {name: trouble(fetching)}, now)
    crashing = _crashed(ENGINE_LOG_TAIL)
    crashing["status"]["initContainerStatuses"] = [{"name": "fetch-model", "state": done}]
    assert [t.reason for t in held_troubles(held, [crashing], {name: trouble(crashing)}, now)] == [
        "PodsCrashLooping"
    ]


def test_shared_memory_counts_in_the_template_hash_as_the_pod_gets_it() -> None:
    """Writing the default /dev/shm size (1Gi for one rank) leaves the pod as it was, so rolls nothing."""
    base = make_spec(resources={"gpus": 1})
    assert (
        desired_pod(OWNER, base, ACTIVE, "h")["spec"]
        == desired_pod(OWNER, make_spec(resources={"gpus": 1, "sharedMemory": "1Gi"}), ACTIVE, "h")["spec"]
    )
    for same in ("1Gi", "1024Mi"):
        assert template_hash(make_spec(resources={"gpus": 1, "sharedMemory": same})) == template_hash(base)
    for other in ("2Gi", "0"):
        assert template_hash(make_spec(resources={"gpus": 1, "sharedMemory": other})) != template_hash(base)


async def _autoscale_once(
    spec: InferenceServiceSpec,
    pods: list[dict[str, Any]],
    views: list[PodView],
    live: list[dict[str, Any]] | None = None,
    memory: Memory | None = None,
) -> Memory:
    """One autoscaler evaluation (its first: no Event to post) with a real scraper; `live`: the pods as
    the operator's cache holds them once the reads are done."""
    memory = memory or Memory(desired=1)
    scraper = Scraper(1.0)
    try:
        await autoscale(
            None,  # type: ignore[arg-type]
            spec,
            OWNER,
            pods,
            views,
            memory,
            T0,
            scraper,
            None,
            None if live is None else (lambda: live),
        )
    finally:
        await scraper.close()
    return memory


def _refusing_address() -> tuple[socket.socket, str]:
    """A loopback address whose engine port is bound but not listening: a connection to it is refused."""
    while True:
        ip = f"127.{random.randint(20, 250)}.{random.randint(0, 250)}.{random.randint(1, 250)}"
        sock = socket.socket()
        try:
            sock.bind((ip, 8000))
        except OSError:
            sock.close()
            continue
        return sock, ip


def test_a_pod_that_went_away_while_it_was_read_is_read_again_not_counted_as_failed() -> None:
    """The pass saw the active pod Ready; by the time its read was refused the operator's cache held it
    deleted, being deleted or unready (the pass started before that event came). That reading is dropped:
    MetricsAvailable keeps what it said and the next pass reads again. A pod the cache still holds Ready
    whose read fails is a failed scrape, as before."""
    spec = make_spec(warmPool={"size": 1}, autoscaling={"intervalSeconds": 1})
    h = template_hash(spec)
    sock, ip = _refusing_address()
    try:
        views = [PodView("a", ACTIVE, h, True, T0)]
        ready = {
            "metadata": {"name": "a"},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }
        deleting = {**ready, "metadata": {"name": "a", "deletionTimestamp": "2026-11-01T12:00:00Z"}}
        unready = {**ready, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "False"}]}}
        for live in ([], [deleting], [unready]):
            before = Memory(desired=1, metrics=Condition("MetricsAvailable", True, "Scraped", "read"))
            memory = asyncio.run(_autoscale_once(spec, [ready], views, live, before))
            assert memory.metrics == Condition("MetricsAvailable", True, "Scraped", "read"), live
            assert memory.inputs is None and memory.next_scrape <= time.monotonic(), live
        before = Memory(desired=1, metrics=Condition("MetricsAvailable", True, "Scraped", "read"))
        memory = asyncio.run(_autoscale_once(spec, [ready], views, [ready], before))
        assert memory.metrics is not None and memory.metrics.status is False
        assert (
            memory.metrics.reason == "ScrapeFailed" and "a: ConnectionRefusedError" in memory.metrics.message
        )
        assert memory.next_scrape > time.monotonic()
    finally:
        sock.close()


def test_the_scrape_of_a_failover_pass_reads_the_warm_pod_it_promotes() -> None:
    """The active pod is gone (deleted, or its engine down) and a Ready warm pod takes its place in this
    pass: the autoscaler reads that pod, not "no Ready active pod", and metrics stay available."""
    spec = make_spec(warmPool={"size": 1}, autoscaling={"intervalSeconds": 1})
    h = template_hash(spec)
    page = EnginePage(waiting=1.0, running=2.0)
    ip = f"127.{random.randint(20, 250)}.{random.randint(0, 250)}.{random.randint(1, 250)}"
    server = _metrics_server(ip, page)
    try:
        for lost in (
            PodView("a", ACTIVE, h, False, T0, deleting=True),  # kubectl delete pod
            PodView("a", ACTIVE, h, False, T0, container_down=True),  # kill -9, restarts failing
        ):
            views = [lost, PodView("w", WARM, h, True, T0)]
            pods = [{"status": {"podIP": "127.0.0.1"}}, {"status": {"podIP": ip}}]
            memory = asyncio.run(_autoscale_once(spec, pods, views))
            assert memory.metrics is not None and memory.metrics.status is True, memory.metrics
            assert memory.inputs is not None and memory.inputs["readyPods"] == 1
            assert memory.inputs["queueDepth"] == 1.0
    finally:
        server.shutdown()
        server.server_close()


def test_external_mode_reports_no_ready_pods_as_builtin_does_and_numbers_its_decisions() -> None:
    spec = make_spec(
        autoscaling={"mode": "External", "intervalSeconds": 1}, replicas={"min": 0, "desired": 1}
    )
    memory = asyncio.run(_autoscale_once(spec, [], []))
    assert memory.metrics is not None
    assert (memory.metrics.status, memory.metrics.reason) == (False, "NoReadyPods"), memory.metrics
    to_zero = make_spec(autoscaling={"mode": "External"}, replicas={"min": 0, "desired": 0})
    decision = external_decision(to_zero, Memory(desired=1))
    assert (decision.desired, decision.reason) == (0, "scale down 1 -> 0: spec.replicas.desired (External)")


def test_a_restored_memory_knows_the_stall_already_announced() -> None:
    stalled = {
        "type": "Stalled",
        "status": "True",
        "reason": "PodsUnschedulable",
        "message": "pod x: no node",
    }
    assert Memory.restored({"conditions": [stalled]}).stalled == "pod x: no node"
    assert Memory.restored({"conditions": [{**stalled, "status": "False"}]}).stalled is None
