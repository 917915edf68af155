"""End to end on the local control plane, with real engines: an InferenceService's placement, identity,
environment, timing and podTemplate reach the running engine process; a GPU resource no node offers waits
for capacity with the scheduler's message; and a model fetched from a local Hugging Face hub by the init
container is served, a fetch that fails stalls the service with the fetch's own error, and fixing the
Secret recovers it."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from e2e_harness import (
    MODEL,
    MODEL_CLAIM,
    NAMESPACE,
    ControlPlane,
    container_pid,
    control_plane,
    fresh_client,
    pod_ip,
)
from hub_server import Hub, serving
from waiting import wait_for

REPO_ID = "ember-test/tiny"


@pytest.fixture(scope="module")
def cp(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> Iterator[ControlPlane]:
    with control_plane(tmp_path_factory.mktemp("e2e-podspec"), tiny_model) as plane:
        yield plane


def _process(pid: int) -> tuple[list[str], dict[str, str]]:
    """A running process's command line and environment, as the kubelet started it."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    env = dict(item.decode().split("=", 1) for item in environ if b"=" in item)
    return [a.decode() for a in argv if a], env


def _apply(cp: ControlPlane, kind: str, body: dict[str, Any]) -> None:
    body = {"apiVersion": "v1", "kind": kind, **body}
    body["metadata"] = {"namespace": NAMESPACE, **body["metadata"]}
    cp.api.create(body)


def _secret(name: str, **data: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name},
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def test_placement_identity_env_timing_and_pod_template_reach_the_engine(cp: ControlPlane) -> None:
    _apply(cp, "ServiceAccount", {"metadata": {"name": "engine-sa"}})
    _apply(cp, "Secret", _secret("api-keys", OPENAI_KEY="sk-local", EXTRA_TOKEN="t0k"))
    _apply(cp, "ConfigMap", {"metadata": {"name": "tuning"}, "data": {"MODE": "fast", "LEVEL": "3"}})
    cp.create(
        "placed",
        replicas={"min": 1, "max": 1},
        engine={"maxNumSeqs": 2, "extraArgs": ["--log-interval=1"]},
        resources={
            "gpus": 0,
            "sharedMemory": "256Mi",
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "env": [
                {"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "api-keys", "key": "OPENAI_KEY"}}},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "tuning", "key": "MODE"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
            "envFrom": [
                {"configMapRef": {"name": "tuning"}, "prefix": "CFG_"},
                {"secretRef": {"name": "api-keys"}},
            ],
        },
        pod={
            "labels": {"team": "search"},
            "annotations": {"example.com/owner": "search-team"},
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "kubernetes.io/hostname",
                                        "operator": "In",
                                        "values": ["ember-local"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
            "topologySpreadConstraints": [
                {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
            ],
            "serviceAccountName": "engine-sa",
            "imagePullSecrets": [{"name": "registry"}],
            "securityContext": {"fsGroup": 2000},
            "containerSecurityContext": {"readOnlyRootFilesystem": True},
        },
        lifecycle={"startupTimeoutSeconds": 300, "drainSeconds": 90},
        podTemplate={
            "metadata": {"annotations": {"example.com/patched": "yes"}},
            "spec": {"containers": [{"name": "engine", "env": [{"name": "FROM_TEMPLATE", "value": "1"}]}]},
        },
    )
    cp.wait_converged("placed", 1, 0)
    (pod,) = cp.pods("placed", "active")
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "search"
    assert meta["annotations"] == {"example.com/owner": "search-team", "example.com/patched": "yes"}
    assert spec["nodeName"] == "ember-local"  # the scheduler honoured the required node affinity
    assert spec["serviceAccountName"] == "engine-sa" and spec["imagePullSecrets"] == [{"name": "registry"}]
    assert spec["terminationGracePeriodSeconds"] == 90 + 5 + 10
    assert spec["securityContext"]["fsGroup"] == 2000
    engine = next(c for c in spec["containers"] if c["name"] == "engine")
    assert engine["startupProbe"]["httpGet"]["path"] == "/ready"
    assert {v["name"]: v for v in spec["volumes"]}["dshm"]["emptyDir"] == {
        "medium": "Memory",
        "sizeLimit": "256Mi",
    }

    pid = container_pid(pod)
    assert pid is not None
    argv, env = _process(pid)
    assert argv[-1] == "--log-interval=1" and "--drain-timeout=90" in argv  # extraArgs last
    assert env["KEY"] == "sk-local" and env["MODE"] == "fast" and env["NODE"] == "ember-local"
    assert env["CFG_MODE"] == "fast" and env["CFG_LEVEL"] == "3" and env["EXTRA_TOKEN"] == "t0k"
    assert env["FROM_TEMPLATE"] == "1"
    with fresh_client(30) as client:
        reply = client.post(
            f"{cp.url('placed')}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4}
        )
    assert reply.status_code == 200, reply.text
    cp.remove("placed")


def test_a_gpu_resource_no_node_offers_waits_with_the_schedulers_message(cp: ControlPlane) -> None:
    cp.create("amd", replicas={"min": 1, "max": 1}, resources={"gpus": 1, "gpuResource": "amd.com/gpu"})
    reconciling = wait_for(
        lambda: (c := cp.condition("amd", "Reconciling")).get("reason") == "WaitingForCapacity" and c,
        timeout=30,
        what="amd: Reconciling WaitingForCapacity",
    )
    assert "Insufficient amd.com/gpu" in reconciling["message"]
    (pod,) = cp.pods("amd")
    assert pod["spec"]["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "1"}
    cp.remove("amd")


# -- model sources ------------------------------------------------------------------------------------------


@pytest.fixture
def hub(tiny_model: Path) -> Iterator[Hub]:
    with serving(REPO_ID, tiny_model) as hub:
        yield hub


def test_a_model_fetched_from_the_hub_is_served_and_a_failed_fetch_stalls_with_its_cause(
    cp: ControlPlane, hub: Hub
) -> None:
    _apply(cp, "Secret", _secret("hf-token", HF_TOKEN="hf_wrong"))
    cp.create(
        "fetched",
        model={
            "name": MODEL,
            "source": f"hf://{REPO_ID}@main",
            "endpoint": hub.hub_url,
            "credentialsSecret": "hf-token",
        },
        replicas={"min": 1, "max": 1},
    )
    # The wrong token: the init container fails, is restarted with back-off, and the service says why.
    stalled = wait_for(
        lambda: (c := cp.condition("fetched", "Stalled")).get("reason") == "ModelFetchFailed" and c,
        timeout=90,
        what="fetched: Stalled ModelFetchFailed",
    )
    assert "init container fetch-model" in stalled["message"]
    assert (
        f"repository {REPO_ID} not found, or private and not readable with the given HF_TOKEN"
        in stalled["message"]
    )
    (pod,) = cp.pods("fetched")
    assert pod["status"]["phase"] == "Pending"
    assert pod["status"]["containerStatuses"][0]["state"] == {"waiting": {"reason": "PodInitializing"}}

    # The right token: the next restart of the init container reads it, fetches, and the engine serves.
    cp.api.patch("v1", "Secret", NAMESPACE, "hf-token", _secret("hf-token", HF_TOKEN=hub.token))
    cp.wait_converged("fetched", 1, 0, timeout=120)
    # The fetch has completed, so the failure is over at once (no wait for the pod to stay Ready a while).
    wait_for(
        lambda: cp.condition("fetched", "Stalled").get("status") == "False",
        what=lambda: f"no longer stalled (Stalled: {cp.condition('fetched', 'Stalled')})",
    )
    (pod,) = cp.pods("fetched", "active")
    (init,) = pod["status"]["initContainerStatuses"]
    assert init["name"] == "fetch-model" and init["state"]["terminated"]["exitCode"] == 0
    assert f"--model=/model-cache/hf/{REPO_ID}/main" in pod["spec"]["containers"][0]["args"]
    log = cp.kubelet.log_path(NAMESPACE, pod["metadata"]["name"], "fetch-model").read_text()
    assert "ember fetch-model: done:" in log and "1 sha256" in log
    with fresh_client(30) as client:
        reply = client.post(
            f"{cp.url('fetched')}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
    assert reply.status_code == 200, reply.text
    # The storage origin never saw the token.
    assert not any("Authorization" in h for origin, _, h in hub.requests if origin == "storage")
    cp.remove("fetched")


def test_a_gguf_file_of_a_hub_repository_is_fetched_alone_and_served(
    cp: ControlPlane,
    quantized_model,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """A "…-GGUF" repository holds a file per quantization: `model.file` takes one, the fetch brings that
    file alone, and the engine serves it with the tokenizer and chat template the file carries."""
    repo = tmp_path / "repo"
    repo.mkdir()
    for preset in ("Q8_0", "Q4_0"):
        shutil.copy(
            quantized_model("tiny", preset, "gguf_build.py") / "model.gguf", repo / f"tiny-{preset}.gguf"
        )
    (repo / "README.md").write_text("two quantizations of tiny\n")
    with serving("ember-test/tiny-GGUF", repo, private=False) as hub:
        cp.create(
            "gguf",
            model={
                "name": MODEL,
                "source": "hf://ember-test/tiny-GGUF@main",
                "file": "tiny-Q4_0.gguf",
                "endpoint": hub.hub_url,
            },
            replicas={"min": 1, "max": 1},
        )
        cp.wait_converged("gguf", 1, 0, timeout=120)
        (pod,) = cp.pods("gguf", "active")
        assert (
            "--model=/model-cache/hf/ember-test/tiny-GGUF/main/tiny-Q4_0.gguf"
            in pod["spec"]["containers"][0]["args"]
        )
        log = cp.kubelet.log_path(NAMESPACE, pod["metadata"]["name"], "fetch-model").read_text()
        assert "ember fetch-model: done: 1 files" in log, log
        downloaded = {path for origin, path, _ in hub.requests if "/resolve/" in path or origin == "storage"}
        assert not any("Q8_0" in path or "README" in path for path in downloaded), downloaded
        with fresh_client(30) as client:
            reply = client.post(
                f"{cp.url('gguf')}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            )
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["role"] == "assistant"
    cp.remove("gguf")


def test_lora_adapters_fetched_from_the_hub_are_served_by_name_through_the_router(
    cp: ControlPlane, hub: Hub, tiny_model: Path, tmp_path: Path
) -> None:
    from test_lora import ALL, build_adapter

    adapter = build_adapter(tiny_model, tmp_path / "sql", 0, r=8, lora_alpha=16, target_modules=ALL)
    hub.add("ember-test/sql-lora", adapter)  # public: no token
    cp.create(
        "adapted",
        model={
            "name": MODEL,
            "source": f"/models/{MODEL}",
            "volumeClaim": MODEL_CLAIM,
            "endpoint": hub.hub_url,
            "adapters": [{"name": "org/sql", "source": "hf://ember-test/sql-lora@main"}],
        },
        replicas={"min": 1, "max": 1},
        router={"enabled": True},
    )
    cp.wait_converged("adapted", 1, 0, timeout=120)
    (pod,) = cp.pods("adapted", "active")
    inits = [s["name"] for s in pod["status"]["initContainerStatuses"]]
    assert inits == ["fetch-adapter-0"]
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--lora-modules") + 1] == "org/sql=/model-cache/hf/ember-test/sql-lora/main"
    texts = {}
    with fresh_client(30) as client:
        listed = client.get(f"{cp.url('adapted')}/v1/models").json()["data"]
        assert [(m["id"], m.get("parent")) for m in listed] == [(MODEL, None), ("org/sql", MODEL)]
        for model in (MODEL, "org/sql"):
            body = {
                "model": model,
                "prompt": [5, 6, 7, 8, 9],
                "max_tokens": 8,
                "temperature": 0,
                "ignore_eos": True,
            }
            reply = client.post(f"{cp.url('adapted')}/v1/completions", json=body)
            assert reply.status_code == 200 and reply.json()["model"] == model, reply.text
            texts[model] = reply.json()["choices"][0]["text"]
    assert texts[MODEL] != texts["org/sql"]  # the adapter ran
    cp.remove("adapted")


def test_an_api_key_from_a_secret_guards_the_engines_and_the_router(cp: ControlPlane) -> None:
    cp.create(
        "keyed",
        apiKey={"secretKeyRef": {"name": "serve-key", "key": "key"}},
        replicas={"min": 1, "max": 1},
        router={"enabled": True},
    )
    # Before its Secret exists no pod can start, and the service says why.
    wait_for(lambda: cp.is_true("keyed", "Stalled"), 60, lambda: cp.describe("keyed"))
    assert (
        'CreateContainerConfigError: secret "serve-key" not found'
        in cp.condition("keyed", "Stalled")["message"]
    )
    _apply(cp, "Secret", _secret("serve-key", key="sk-e2e"))
    cp.wait_converged("keyed", 1, 0, timeout=120)
    (pod,) = cp.pods("keyed", "active")
    engine = f"http://{pod_ip(pod)}:8000"
    key = {"Authorization": "Bearer sk-e2e"}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    with fresh_client(30) as client:
        # The router is Ready once it reaches the engine, which it does with the key.
        wait_for(
            lambda: (
                client.post(f"{cp.url('keyed')}/v1/completions", json=body, headers=key).status_code == 200
            ),
            60,
        )
        for base in (cp.url("keyed"), engine):
            refused = client.post(f"{base}/v1/completions", json=body)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", base
            assert client.post(f"{base}/v1/completions", json=body, headers=key).status_code == 200, base
            assert client.get(f"{base}/metrics").status_code == 200, base
    wait_for(lambda: not cp.is_true("keyed", "Stalled"), 30, lambda: cp.describe("keyed"))
    cp.remove("keyed")
