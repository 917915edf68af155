"""The InferenceService models and the CRD generated from them: structural, complete, and not stale."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from pydantic import ValidationError

from ember_engine.server.policy import parse_policy
from ember_localcluster.apiserver import APIServer
from ember_operator.crd import REGENERATE, crd_manifest, render_crd_yaml
from ember_operator.spec import GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec

REPO = Path(__file__).resolve().parents[1]

FULL_SPEC: dict[str, Any] = {
    "model": {"name": "llama-3-8b", "source": "/models/llama-3-8b", "dtype": "bfloat16"},
    "speculative": {"method": "draft", "draftSource": "/models/llama-3-1b", "numTokens": 5},
    "engine": {
        "maxNumSeqs": 128,
        "maxNumBatchedTokens": 4096,
        "blockSize": 32,
        "prefixCaching": False,
        "maxModelLen": 8192,
        "kvCacheMemory": "8Gi",
        "gpuMemoryUtilization": 0.85,
    },
    "resources": {
        "gpus": 1,
        "cpu": "4",
        "memory": "32Gi",
        "nodeSelector": {"nvidia.com/gpu.product": "H100"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "image": "ghcr.io/ember-dev/ember-engine:0.1.0",
        "imagePullPolicy": "Always",
        "env": [{"name": "EMBER_LOG_LEVEL", "value": "debug"}],
    },
    "replicas": {"min": 1, "max": 8},
    "warmPool": {"size": 2},
    "autoscaling": {"mode": "Builtin", "queueDepthPerReplica": 8, "kvCacheUtilization": 0.75},
    "loadShedding": {
        "maxQueueDepth": 64,
        "maxQueueWaitSeconds": 2.5,
        "retryAfterSeconds": 2,
        "maxConcurrentPerClient": 4,
        "priorityClasses": [{"name": "interactive", "priority": 0}, {"name": "batch", "priority": 5}],
        "defaultPriorityClass": "interactive",
    },
    "fallback": {"url": "https://fallback.example.com/", "model": "small", "timeoutSeconds": 10},
    "requestTimeoutSeconds": 60,
}


def _version() -> dict[str, Any]:
    (version,) = crd_manifest()["spec"]["versions"]
    return version


def _spec_schema() -> dict[str, Any]:
    return _version()["schema"]["openAPIV3Schema"]["properties"]["spec"]


def _walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from _walk(node[key], f"{path}[{key}]")


def test_committed_crd_is_current() -> None:
    committed = (REPO / "crds" / "inferenceservice.yaml").read_text()
    assert committed == render_crd_yaml(), (
        f"crds/inferenceservice.yaml is stale; regenerate with: {REGENERATE}"
    )
    assert yaml.safe_load(committed) == crd_manifest()


def test_schema_is_structural() -> None:
    nodes = list(_walk(_version()["schema"]["openAPIV3Schema"]))
    assert len(nodes) > 50
    for path, node in nodes:
        for banned in ("$ref", "$defs", "anyOf", "oneOf", "allOf", "title"):
            assert banned not in node, f"{path or '<root>'} has {banned}"
        assert "type" in node, f"{path} has no type"
        if "properties" in node or "additionalProperties" in node:
            assert node["type"] == "object", path
        if "exclusiveMinimum" in node:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_defaults_enums_and_ranges() -> None:
    spec = _spec_schema()["properties"]
    assert spec["engine"]["properties"]["blockSize"]["default"] == 16
    assert spec["engine"]["properties"]["blockSize"]["enum"] == [8, 16, 32, 64, 128]
    assert spec["engine"]["default"] == {}
    assert spec["model"]["properties"]["dtype"]["enum"] == ["auto", "float32", "bfloat16", "float16"]
    assert spec["resources"]["properties"]["imagePullPolicy"]["enum"] == ["Always", "IfNotPresent", "Never"]
    selector_value = spec["resources"]["properties"]["nodeSelector"]["additionalProperties"]
    assert (selector_value["type"], selector_value["maxLength"]) == ("string", 63)
    assert spec["autoscaling"]["properties"]["mode"] == {
        "default": "Builtin",
        "enum": ["Builtin", "External"],
        "type": "string",
    }
    kv = spec["autoscaling"]["properties"]["kvCacheUtilization"]
    assert (kv["minimum"], kv["exclusiveMinimum"], kv["maximum"]) == (0, True, 1)
    assert spec["replicas"]["properties"]["max"]["minimum"] == 1
    assert spec["replicas"]["properties"]["desired"] == {"default": 1, "minimum": 0, "type": "integer"}
    classes = spec["loadShedding"]["properties"]["priorityClasses"]["default"]
    assert [c["name"] for c in classes] == ["critical", "standard", "batch"]
    assert _spec_schema()["required"] == ["model"]


def test_cel_rules() -> None:
    spec = _spec_schema()["properties"]
    rules = {
        name: [(v["rule"], v["message"]) for v in spec[name]["x-kubernetes-validations"]]
        for name in ("replicas", "speculative", "fallback", "loadShedding")
    }
    assert rules["replicas"] == [
        ("self.min <= self.max", "replicas.min must be less than or equal to replicas.max")
    ]
    assert rules["speculative"][0][0] == "self.method != 'draft' || has(self.draftSource)"
    assert "draftSource" in rules["speculative"][0][1]
    assert rules["fallback"][0][0] == "has(self.service) != has(self.url)"
    assert "service" in rules["fallback"][0][1] and "url" in rules["fallback"][0][1]
    assert all(message for rule_list in rules.values() for _, message in rule_list)


def test_crd_metadata_subresources_and_columns() -> None:
    crd = crd_manifest()
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == "inferenceservices.ember.dev"
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == ("ember.dev", "Namespaced")
    assert spec["names"]["kind"] == "InferenceService"
    assert spec["names"]["plural"] == "inferenceservices"
    assert spec["names"]["shortNames"] == ["eis"]
    assert spec["names"]["categories"] == ["ember"]
    version = _version()
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas.desired",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }
    columns = {c["name"]: (c["type"], c["jsonPath"]) for c in version["additionalPrinterColumns"]}
    assert columns == {
        "Ready": ("string", '.status.conditions[?(@.type=="Ready")].status'),
        "Active": ("integer", ".status.replicas"),
        "Warm": ("integer", ".status.warmReplicas"),
        "Desired": ("integer", ".status.desiredReplicas"),
        "Queue": ("number", ".status.autoscaler.inputs.queueDepth"),
        "KV": ("number", ".status.autoscaler.inputs.kvCacheUtilization"),
        "Routers": ("string", ".status.router.summary"),
        "Age": ("date", ".metadata.creationTimestamp"),
    }
    described = {c["name"]: c["description"] for c in version["additionalPrinterColumns"]}
    # What the autoscaler last saw, averaged over the Ready active pods it scraped (not a total).
    assert described["Queue"] == "Requests waiting per Ready active pod (mean, at the last scrape)"
    assert described["KV"] == "KV-cache use per Ready active pod, 0..1 (mean, at the last scrape)"


def test_full_spec_and_defaults() -> None:
    spec = InferenceServiceSpec.model_validate(FULL_SPEC)
    assert spec.engine.block_size == 32 and spec.replicas.max == 8
    assert spec.speculative is not None and spec.speculative.draft_source == "/models/llama-3-1b"
    minimal = InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}})
    assert minimal.engine.block_size == 16
    assert minimal.autoscaling.scale_down_stabilization_seconds == 120
    assert minimal.load_shedding.default_priority_class == "standard"
    assert minimal.speculative is None and minimal.fallback is None


def _with(section: str, value: Any) -> dict[str, Any]:
    return {**FULL_SPEC, section: value}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        (_with("replicas", {"min": 3, "max": 2}), "replicas.min"),
        (_with("speculative", {"method": "draft"}), "draftSource"),
        (_with("fallback", {"service": "other", "url": "http://x"}), "exactly one of service or url"),
        (_with("fallback", {"model": "small"}), "exactly one of service or url"),
        (_with("engine", {"blockSiz": 16}), "blockSiz"),
        (_with("loadShedding", {"maxQueueDepth": -1}), "maxQueueDepth"),
        (_with("loadShedding", {"defaultPriorityClass": "gold"}), "defaultPriorityClass"),
        (
            _with(
                "loadShedding",
                {"priorityClasses": [{"name": "a", "priority": 0}, {"name": "a", "priority": 1}]},
            ),
            "unique",
        ),
        (_with("resources", {"memory": "lots"}), "memory"),
    ],
)
def test_invalid_specs_name_the_field(data: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        InferenceServiceSpec.model_validate(data)
    assert named in str(caught.value)


def test_kubectl_scale_is_refused_in_builtin_mode_with_a_message(tmp_path: Path) -> None:
    """The scale subresource writes replicas.desired, which only External mode follows: in Builtin mode the
    API server refuses the write (a CEL transition rule), so `kubectl scale` is not silently ignored."""
    crd = yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text())
    with APIServer() as server:
        server.install_crd(crd)
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")),
            client_configuration=configuration,
        )
        custom = kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(configuration))
        scale = functools.partial(
            custom.patch_namespaced_custom_object_scale, GROUP, VERSION, "default", PLURAL
        )
        patch = functools.partial(custom.patch_namespaced_custom_object, GROUP, VERSION, "default", PLURAL)
        for name, mode in (("builtin", "Builtin"), ("external", "External")):
            body = {"model": {"name": "m", "source": "/m"}, "autoscaling": {"mode": mode}}
            custom.create_namespaced_custom_object(
                GROUP,
                VERSION,
                "default",
                PLURAL,
                {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name}, "spec": body},
            )
        with pytest.raises(kubernetes.client.ApiException) as refused:
            scale("builtin", {"spec": {"replicas": 3}})
        assert refused.value.status == 422
        message = json.loads(refused.value.body)["message"]
        assert "autoscaling.mode is External" in message and "kubectl scale" in message, message
        # Other changes in Builtin mode still go through, and External mode follows /scale.
        assert patch("builtin", {"spec": {"warmPool": {"size": 1}}})["spec"]["warmPool"]["size"] == 1
        assert scale("external", {"spec": {"replicas": 3}})["spec"]["replicas"] == 3
        # Leaving External mode keeps the value it had: nothing changed it, so nothing is refused.
        switched = patch("external", {"spec": {"autoscaling": {"mode": "Builtin"}}})
        assert switched["spec"]["replicas"]["desired"] == 3


def test_policy_fields_parse_as_the_engine_policy() -> None:
    spec = InferenceServiceSpec.model_validate(FULL_SPEC)
    fields = {"load_shedding", "fallback", "request_timeout_seconds"}
    policy_yaml = yaml.safe_dump(spec.model_dump(by_alias=True, include=fields, exclude_none=True))
    policy = parse_policy(policy_yaml)
    assert policy.load_shedding.max_queue_depth == 64
    assert policy.load_shedding.default_priority_class == "interactive"
    assert policy.fallback.url == "https://fallback.example.com"
    assert policy.request_timeout_seconds == 60
    # The defaults too: an InferenceService that sets no policy writes one the engine accepts.
    minimal = InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}})
    defaults = minimal.model_dump(by_alias=True, include=fields - {"fallback"}, exclude_none=True)
    assert parse_policy(yaml.safe_dump(defaults)) == parse_policy("")


def test_operator_modules_do_not_import_torch(tmp_path: Path) -> None:
    code = "import sys, ember_operator.spec, ember_operator.crd; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_the_readme_lists_the_printer_columns_kubectl_shows() -> None:
    columns = " ".join(
        c["name"].upper() for c in crd_manifest()["spec"]["versions"][0]["additionalPrinterColumns"]
    )
    listed = [
        line.split("#", 1)[1].strip()
        for line in (REPO / "README.md").read_text().splitlines()
        if line.startswith(("kubectl get eis ", "kubectl get inferenceservices ")) and "# READY" in line
    ]
    assert len(listed) >= 2 and all(text == columns for text in listed), (columns, listed)
