"""The InferenceService examples stay valid against the operator's own spec model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from ember_operator.desired import WARM, Owner, desired_pod, template_hash
from ember_operator.spec import GROUP, KIND, VERSION, InferenceServiceSpec

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def test_the_examples_exist() -> None:
    assert [p.name for p in FILES] == [
        "fallback-pair.yaml",
        "gguf.yaml",
        "inferenceservice.yaml",
        "local-fallback.yaml",
        "local.yaml",
        "lora.yaml",
        "production.yaml",
        "tensor-parallel.yaml",
    ]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_example_is_a_valid_inference_service(path: Path) -> None:
    docs = _documents(path)
    assert docs
    for doc in docs:
        assert doc["apiVersion"] == f"{GROUP}/{VERSION}"
        assert doc["kind"] == KIND
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        assert "namespace" not in doc["metadata"]  # applied into the user's namespace
        # By alias, the way the API server hands the object to the operator; extra="forbid" catches typos.
        spec = InferenceServiceSpec.model_validate(doc["spec"])
        assert spec.replicas.min <= spec.replicas.max


def test_fallback_pair_points_at_its_partner() -> None:
    chat, small = _documents(EXAMPLES / "fallback-pair.yaml")
    chat_spec = InferenceServiceSpec.model_validate(chat["spec"])
    small_spec = InferenceServiceSpec.model_validate(small["spec"])
    assert chat_spec.fallback is not None
    assert chat_spec.fallback.service == small["metadata"]["name"] == "chat-small"
    assert sorted(chat_spec.fallback.when) == ["Overloaded", "Unavailable"]
    assert chat_spec.fallback.model == small_spec.model.name
    assert small_spec.fallback is None
    assert small_spec.replicas.min >= 1  # a fallback must be up before it is needed


def test_single_example_uses_the_documented_features() -> None:
    (doc,) = _documents(EXAMPLES / "inferenceservice.yaml")
    spec = InferenceServiceSpec.model_validate(doc["spec"])
    assert spec.model.source.startswith("/models/")
    assert spec.model.dtype == "bfloat16"
    assert spec.resources.gpus == 1
    assert (spec.replicas.min, spec.replicas.max, spec.warm_pool.size) == (1, 4, 1)
    assert spec.autoscaling.mode == "Builtin"
    assert "priorityClasses" not in doc["spec"]["loadShedding"]
    assert [c.name for c in spec.load_shedding.priority_classes] == ["critical", "standard", "batch"]
    assert spec.fallback is not None and spec.fallback.service == "chat-small"


def test_production_example_builds_its_pod() -> None:
    """Every field reaches the pod, and its podTemplate passes the operator's checks."""
    (doc,) = _documents(EXAMPLES / "production.yaml")
    spec = InferenceServiceSpec.model_validate(doc["spec"])
    pod = desired_pod(Owner("llama-70b", "ai", "uid"), spec, WARM, template_hash(spec))
    assert [c["name"] for c in pod["spec"]["initContainers"]] == ["fetch-model"]
    assert [c["name"] for c in pod["spec"]["containers"]] == ["engine", "log-shipper"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 615
    assert pod["spec"]["priorityClassName"] == "inference-high"


def test_tensor_parallel_examples_use_every_gpu_of_their_replicas() -> None:
    big, huge = (
        InferenceServiceSpec.model_validate(d["spec"]) for d in _documents(EXAMPLES / "tensor-parallel.yaml")
    )
    assert (big.tensor_parallel_size, big.resources.nodes) == (4, 1)
    assert (huge.tensor_parallel_size, huge.resources.nodes) == (16, 2)


def test_gguf_example_fetches_its_file_alone() -> None:
    (doc,) = _documents(EXAMPLES / "gguf.yaml")
    pod = desired_pod(
        Owner("llama-gguf", "default", "uid"), InferenceServiceSpec.model_validate(doc["spec"]), WARM, "h"
    )
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["args"][2:] == ["--include=Llama-3.2-3B-Instruct-Q4_K_M.gguf"]
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    assert any(
        a.startswith("--model=/model-cache/hf/bartowski/") and a.endswith("Q4_K_M.gguf")
        for a in engine["args"]
    )


def test_lora_example_fetches_one_adapter_and_serves_both() -> None:
    (doc,) = _documents(EXAMPLES / "lora.yaml")
    pod = desired_pod(
        Owner("assistant", "default", "uid"), InferenceServiceSpec.model_validate(doc["spec"]), WARM, "h"
    )
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["name"] == "fetch-adapter-1"
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    at = engine["args"].index("--lora-modules")
    assert engine["args"][at + 1 : at + 3] == [
        "sql=/models/adapters/sql-lora",
        "acme/support=/model-cache/hf/acme/llama-3.1-8b-support-lora/v3",
    ]


def test_the_keda_example_adds_a_pod_once_the_engines_batches_are_full() -> None:
    """The ScaledObject's threshold is per pod, against requests waiting plus running: at or below what
    engine.maxNumSeqs keeps running it would add pods while the engines still had room in their batch."""
    (doc,) = _documents(EXAMPLES / "keda" / "inferenceservice.yaml")
    spec = InferenceServiceSpec.model_validate(doc["spec"])
    (scaled,) = _documents(EXAMPLES / "keda" / "scaledobject.yaml")
    (trigger,) = scaled["spec"]["triggers"]
    threshold = int(trigger["metadata"]["threshold"])
    assert (
        spec.engine.max_num_seqs
        < threshold
        <= spec.engine.max_num_seqs + spec.autoscaling.queue_depth_per_replica
    )
    readme = (EXAMPLES.parent / "README.md").read_text()
    assert f'threshold: "{threshold}"' in readme  # the README quotes the example
