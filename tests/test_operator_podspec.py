"""The engine pod's placement, identity, timing, model sources and podTemplate: each field of the spec reaches
the pod the operator builds, bad values are refused by the CRD (on ember's API server) or by the model, and
the podTemplate patch is checked against the Kubernetes API's own types before it is applied last."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from pydantic import ValidationError

from ember_engine.cli import build_parser
from ember_engine.server import serve
from ember_localcluster.apiserver import APIServer
from ember_localcluster.apiserver.podsecurity import violations
from ember_operator.desired import WARM, Owner, desired_pod, engine_args, template_hash
from ember_operator.podpatch import PodTemplateError, strategic_merge
from ember_operator.spec import GROUP, KIND, PLURAL, PROTECTED_FLAGS, VERSION, InferenceServiceSpec

REPO = Path(__file__).resolve().parents[1]
OWNER = Owner("chat", "prod", "uid-1")


def make_spec(**changes: Any) -> InferenceServiceSpec:
    doc: dict[str, Any] = {"model": {"name": "chat", "source": "/models/chat"}}
    doc.update(changes)
    return InferenceServiceSpec.model_validate(doc)


def pod_of(**changes: Any) -> dict[str, Any]:
    return desired_pod(OWNER, make_spec(**changes), WARM, "abcdef0123")


def engine(pod: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in pod["spec"]["containers"] if c["name"] == "engine")


AFFINITY = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchExpressions": [{"key": "gpu.product", "operator": "In", "values": ["H100", "H200"]}]}
            ]
        },
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 50, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}
        ],
    },
    "podAntiAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {
                "weight": 100,
                "podAffinityTerm": {
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": "chat"}},
                    "topologyKey": "kubernetes.io/hostname",
                },
            }
        ]
    },
}


def test_placement_and_identity_reach_the_pod_as_written() -> None:
    pod = pod_of(
        pod={
            "labels": {"team": "search", "cost-center": "42"},
            "annotations": {"prometheus.io/scrape": "true"},
            "affinity": AFFINITY,
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                },
                {
                    "maxSkew": 2,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {"tier": "gpu"}},
                },
            ],
            "priorityClassName": "inference-high",
            "serviceAccountName": "chat-engine",
            "runtimeClassName": "nvidia",
            "imagePullSecrets": [{"name": "registry-creds"}],
            "securityContext": {
                "runAsUser": 1000,
                "fsGroup": 2000,
                "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}],
            },
            "containerSecurityContext": {"readOnlyRootFilesystem": True, "runAsGroup": 3000},
        },
        resources={"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]},
    )
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["labels"]["team"] == "search" and meta["labels"]["cost-center"] == "42"
    assert meta["labels"]["app.kubernetes.io/instance"] == "chat"  # the operator's own stay
    assert meta["annotations"] == {"prometheus.io/scrape": "true"}
    assert spec["affinity"] == AFFINITY
    zone, host = spec["topologySpreadConstraints"]
    # Without a selector a constraint would count no pods: it spreads this service's engines.
    assert zone["labelSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "ember", "app.kubernetes.io/instance": "chat"}
    }
    assert zone["whenUnsatisfiable"] == "ScheduleAnyway" and host["labelSelector"] == {
        "matchLabels": {"tier": "gpu"}
    }
    assert spec["priorityClassName"] == "inference-high"
    assert spec["serviceAccountName"] == "chat-engine" and spec["automountServiceAccountToken"] is False
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["imagePullSecrets"] == [{"name": "registry-creds"}]
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["tolerations"] == [
        {"key": "gpu", "operator": "Exists"}
    ]
    # Security contexts are merged over the operator's restricted defaults.
    assert spec["securityContext"] == {
        "runAsNonRoot": True,
        "seccompProfile": {"type": "RuntimeDefault"},
        "runAsUser": 1000,
        "fsGroup": 2000,
        "sysctls": [{"name": "net.core.somaxconn", "value": "1024"}],
    }
    assert engine(pod)["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsGroup": 3000,
    }
    assert violations(pod, "restricted") == []


HOSTNAME_SPREAD = {
    "maxSkew": 1,
    "topologyKey": "kubernetes.io/hostname",
    "whenUnsatisfiable": "ScheduleAnyway",
    "labelSelector": {
        "matchLabels": {"app.kubernetes.io/name": "ember", "app.kubernetes.io/instance": "chat"}
    },
}


def test_engine_pods_spread_softly_over_nodes_unless_the_spec_says_otherwise() -> None:
    """So that the warm pod stands by on another node than the active one where there is one."""
    assert pod_of()["spec"]["topologySpreadConstraints"] == [HOSTNAME_SPREAD]
    node_only = {"nodeAffinity": AFFINITY["nodeAffinity"]}
    assert pod_of(pod={"affinity": node_only})["spec"]["topologySpreadConstraints"] == [HOSTNAME_SPREAD]
    own = {"maxSkew": 2, "topologyKey": "topology.kubernetes.io/zone", "whenUnsatisfiable": "DoNotSchedule"}
    assert [
        c["topologyKey"]
        for c in pod_of(pod={"topologySpreadConstraints": [own]})["spec"]["topologySpreadConstraints"]
    ] == ["topology.kubernetes.io/zone"]
    assert "topologySpreadConstraints" not in pod_of(pod={"affinity": AFFINITY})["spec"]  # podAntiAffinity
    anti = {"affinity": {"podAntiAffinity": AFFINITY["podAntiAffinity"]}}
    assert "topologySpreadConstraints" not in pod_of(podTemplate={"spec": anti})["spec"]
    patched = pod_of(podTemplate={"spec": {"topologySpreadConstraints": [own]}})["spec"]
    assert [c["topologyKey"] for c in patched["topologySpreadConstraints"]] == ["topology.kubernetes.io/zone"]
    # Not in the template hash: an operator upgrade rolls no running pod (the value before this change).
    assert template_hash(make_spec()) == "c9517172b0"


def test_env_from_secrets_and_config_maps_and_env_from() -> None:
    pod = pod_of(
        resources={
            "env": [
                {"name": "PLAIN", "value": "1"},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "api", "key": "token"}}},
                {
                    "name": "MODE",
                    "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode", "optional": True}},
                },
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                {"name": "EMPTY"},
            ],
            "envFrom": [
                {"secretRef": {"name": "all-secrets"}},
                {"configMapRef": {"name": "cfg"}, "prefix": "CFG_"},
            ],
        }
    )
    c = engine(pod)
    assert c["env"] == [
        {"name": "PLAIN", "value": "1"},
        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "api", "key": "token"}}},
        {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode", "optional": True}}},
        {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        {"name": "EMPTY", "value": ""},
    ]
    assert c["envFrom"] == [
        {"secretRef": {"name": "all-secrets"}},
        {"prefix": "CFG_", "configMapRef": {"name": "cfg"}},
    ]


def test_extra_args_come_last_and_parse_with_the_engines_own_command_line() -> None:
    spec = make_spec(
        engine={"maxNumSeqs": 8, "extraArgs": ["--scheduling-policy=fcfs", "--log-interval", "3"]}
    )
    args = engine_args(spec)
    assert args[-3:] == ["--scheduling-policy=fcfs", "--log-interval", "3"]
    parsed = build_parser().parse_args(["serve", *args])
    assert parsed.scheduling_policy == "fcfs" and parsed.log_interval == 3 and parsed.max_num_seqs == 8


@pytest.mark.parametrize(
    "arg", ["--port=9000", "--model", "--served-model-name=x", "--max-num-s=4", "--dra=x"]
)
def test_extra_args_may_not_set_what_the_operator_sets(arg: str) -> None:
    with pytest.raises(ValidationError, match="extraArgs may not set"):
        make_spec(engine={"extraArgs": [arg]})


def test_every_option_the_operator_passes_is_protected() -> None:
    """Whatever a future field adds to the command line must be protected from extraArgs too."""
    spec = make_spec(
        model={"name": "chat", "source": "/m", "dtype": "bfloat16"},
        engine={"maxModelLen": 4096, "kvCacheMemory": "1Gi", "prefixCaching": False},
        speculative={"method": "draft", "draftSource": "/d"},
    )
    spec_ngram = make_spec(speculative={"method": "ngram"})
    for args in (engine_args(spec), engine_args(spec_ngram), engine_args(make_spec())):
        flags = {a.split("=", 1)[0].removeprefix("--") for a in args if a.startswith("--")}
        assert flags <= set(PROTECTED_FLAGS), flags - set(PROTECTED_FLAGS)


def test_gpu_resource_shared_memory_probes_and_drain() -> None:
    pod = pod_of(
        resources={"gpus": 2, "gpuResource": "amd.com/gpu", "sharedMemory": "16Gi"},
        lifecycle={
            "startupTimeoutSeconds": 1200,
            "readinessPeriodSeconds": 5,
            "readinessFailureThreshold": 3,
            "livenessPeriodSeconds": 20,
            "livenessFailureThreshold": 6,
            "drainSeconds": 600,
        },
    )
    c = engine(pod)
    assert c["resources"]["limits"] == {"amd.com/gpu": "2"}
    shm = next(v for v in pod["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    # A 70B model may take many minutes to load: the startup probe allows startupTimeoutSeconds.
    startup = c["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] == 1200
    assert (c["readinessProbe"]["periodSeconds"], c["readinessProbe"]["failureThreshold"]) == (5, 3)
    assert (c["livenessProbe"]["periodSeconds"], c["livenessProbe"]["failureThreshold"]) == (20, 6)
    # Streams may run for ten minutes: the engine drains that long and the grace period covers it.
    assert "--drain-timeout=600" in c["args"]
    assert pod["spec"]["terminationGracePeriodSeconds"] == 600 + 5 + 10
    no_shm = pod_of(resources={"sharedMemory": "0"})
    assert "dshm" not in {v["name"] for v in no_shm["spec"]["volumes"]}
    assert (
        pod_of(lifecycle={"terminationGracePeriodSeconds": 900})["spec"]["terminationGracePeriodSeconds"]
        == 900
    )


def test_the_template_hash_rolls_for_pod_fields_and_not_for_defaults() -> None:
    base = template_hash(make_spec())
    assert template_hash(make_spec(lifecycle={"drainSeconds": 30}, pod={})) == base  # defaults written out
    assert template_hash(make_spec(pod={"annotations": {"a": "b"}})) != base
    assert template_hash(make_spec(lifecycle={"drainSeconds": 60})) != base
    assert template_hash(make_spec(podTemplate={"spec": {"hostNetwork": False}})) != base


# -- model sources -----------------------------------------------------------------------------------------


def test_an_hf_source_is_fetched_by_an_init_container_into_the_cache() -> None:
    pod = pod_of(
        model={
            "name": "llama",
            "source": "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f",
            "credentialsSecret": "hf-token",
            "endpoint": "https://hf-mirror.internal",
            "cache": {"sizeLimit": "40Gi"},
        }
    )
    (fetch,) = pod["spec"]["initContainers"]
    cache = "/model-cache/hf/meta-llama/Llama-3.1-8B-Instruct/0e9e39f"
    assert fetch["command"] == ["ember", "fetch-model"]
    assert fetch["args"] == [
        "hf://meta-llama/Llama-3.1-8B-Instruct@0e9e39f",
        cache,
        "--endpoint=https://hf-mirror.internal",
    ]
    assert fetch["envFrom"] == [{"secretRef": {"name": "hf-token"}}]
    assert fetch["volumeMounts"] == [{"name": "model-cache", "mountPath": "/model-cache"}]
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    c = engine(pod)
    assert f"--model={cache}" in c["args"] and "envFrom" not in c  # the engine never sees the token
    assert {"name": "model-cache", "mountPath": "/model-cache", "readOnly": True} in c["volumeMounts"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model-cache"] == {"name": "model-cache", "emptyDir": {"sizeLimit": "40Gi"}}
    assert violations(pod, "restricted") == []  # the init container is as locked down as the engine
    parsed = build_parser().parse_args(["fetch-model", *fetch["args"]])
    assert (
        parsed.source.startswith("hf://")
        and parsed.dest == cache
        and parsed.endpoint == "https://hf-mirror.internal"
    )


def test_s3_and_pvc_sources_and_a_fetched_draft_share_one_cache() -> None:
    pod = pod_of(
        model={
            "name": "m",
            "source": "s3://models/llama/8b/",
            "endpoint": "http://minio.storage:9000",
            "credentialsSecret": "s3-creds",
            "cache": {"volumeClaim": "shared-cache"},
        },
        speculative={"method": "draft", "draftSource": "pvc://drafts/llama-1b"},
    )
    fetch, draft = pod["spec"]["initContainers"]
    assert fetch["args"][:2] == ["s3://models/llama/8b/", "/model-cache/s3/models/llama/8b"]
    assert draft["name"] == "fetch-draft"
    assert draft["args"][:2] == ["/model-source/drafts/llama-1b", "/model-cache/pvc/drafts/llama-1b"]
    assert {"name": "model-source-0", "mountPath": "/model-source/drafts", "readOnly": True} in draft[
        "volumeMounts"
    ]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["model-cache"]["persistentVolumeClaim"] == {"claimName": "shared-cache"}
    assert volumes["model-source-0"]["persistentVolumeClaim"] == {"claimName": "drafts", "readOnly": True}
    args = engine(pod)["args"]
    assert "--model=/model-cache/s3/models/llama/8b" in args
    assert "--draft-model=/model-cache/pvc/drafts/llama-1b" in args
    # A path source fetches nothing.
    assert "initContainers" not in pod_of()


def test_a_gguf_file_of_the_source_is_fetched_alone_and_served() -> None:
    pod = pod_of(model={"name": "m", "source": "hf://org/Llama-GGUF@v2", "file": "Llama-Q4_K_M.gguf"})
    (fetch,) = pod["spec"]["initContainers"]
    cache = "/model-cache/hf/org/Llama-GGUF/v2"
    assert fetch["args"] == ["hf://org/Llama-GGUF@v2", cache, "--include=Llama-Q4_K_M.gguf"]
    assert f"--model={cache}/Llama-Q4_K_M.gguf" in engine(pod)["args"]
    parsed = build_parser().parse_args(["fetch-model", *fetch["args"]])
    assert parsed.include == ["Llama-Q4_K_M.gguf"]
    # the first part of a split model: every part is fetched, and the engine names the first
    split = "Q8_0/Llama-Q8_0-00001-of-00003.gguf"
    pod = pod_of(model={"name": "m", "source": "s3://models/gguf", "file": split})
    (fetch,) = pod["spec"]["initContainers"]
    assert fetch["args"][2:] == [
        f"--include={split}",
        "--include=Q8_0/Llama-Q8_0-[0-9][0-9][0-9][0-9][0-9]-of-00003.gguf",
    ]
    assert f"--model=/model-cache/s3/models/gguf/{split}" in engine(pod)["args"]
    # a path source: the file in it, nothing fetched
    pod = pod_of(model={"name": "m", "source": "/models/gguf/", "file": "m.gguf", "volumeClaim": "w"})
    assert "initContainers" not in pod and "--model=/models/gguf/m.gguf" in engine(pod)["args"]
    # the file is part of the pod template: changing it rolls the pods
    assert template_hash(make_spec(model={"name": "m", "source": "/m", "file": "a.gguf"})) != template_hash(
        make_spec(model={"name": "m", "source": "/m", "file": "b.gguf"})
    )


@pytest.mark.parametrize(
    ("model", "named"),
    [
        ({"source": "/m", "file": "../m.gguf"}, "file"),
        ({"source": "/m", "file": "/abs/m.gguf"}, "file"),
        ({"source": "/m", "file": "model.safetensors"}, "file"),
        ({"source": "gs://bucket/x"}, "source must be"),
        ({"source": "hf://just-a-name"}, "source must be"),
        ({"source": "s3://Bad_Bucket/x"}, "source must be"),
        ({"source": "hf://org/name", "volumeClaim": "w"}, "volumeClaim goes with a path source"),
        ({"source": "/m", "cache": {"volumeClaim": "c", "sizeLimit": "1Gi"}}, "not both"),
        ({"source": "/m", "endpoint": "ftp://x"}, "endpoint"),
    ],
)
def test_bad_model_sources_are_refused(model: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError, match=named):
        make_spec(model={"name": "m", **model})


# -- podTemplate -------------------------------------------------------------------------------------------


def test_the_pod_template_is_merged_last_by_the_kubernetes_merge_keys() -> None:
    pod = pod_of(
        resources={"env": [{"name": "A", "value": "1"}]},
        podTemplate={
            "metadata": {"labels": {"sidecar": "yes"}, "annotations": {"x": "y"}},
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "env": [{"name": "B", "value": "2"}],
                        "resources": {"limits": {"memory": "8Gi"}},
                    },
                    {"name": "logs", "image": "busybox", "command": ["tail", "-f", "/dev/null"]},
                ],
                "volumes": [{"name": "scratch", "emptyDir": {}}],
                "hostAliases": [{"ip": "10.0.0.1", "hostnames": ["registry"]}],
                "dnsPolicy": "ClusterFirstWithHostNet",
            },
        },
    )
    names = [c["name"] for c in pod["spec"]["containers"]]
    assert names == ["engine", "logs"]
    c = engine(pod)
    assert c["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]  # merged by name
    assert c["resources"]["limits"] == {"memory": "8Gi", "nvidia.com/gpu": "1"}
    assert c["args"] == engine_args(make_spec())  # what the patch did not touch stays
    assert {v["name"] for v in pod["spec"]["volumes"]} == {"policy", "dshm", "scratch"}
    assert pod["spec"]["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pod["metadata"]["labels"]["sidecar"] == "yes" and pod["metadata"]["annotations"] == {"x": "y"}
    # $patch: delete removes by merge key; a list without one (tolerations) is replaced whole.
    pod = pod_of(
        resources={
            "tolerations": [{"key": "a", "operator": "Exists"}],
            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        },
        podTemplate={
            "spec": {
                "containers": [{"name": "engine", "env": [{"name": "A", "$patch": "delete"}]}],
                "tolerations": [{"key": "b", "operator": "Exists"}],
            }
        },
    )
    assert engine(pod)["env"] == [{"name": "B", "value": "2"}]
    assert pod["spec"]["tolerations"] == [{"key": "b", "operator": "Exists"}]


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"containers": [{"name": "engine", "imagePullPolicyy": "Always"}]},
            "containers[engine].imagePullPolicyy: no such field in Container",
        ),
        ({"nodeSelector": {"a": 1}}, "nodeSelector.a: expected str, got int"),
        ({"terminationGracePeriodSeconds": "60"}, "terminationGracePeriodSeconds: expected int, got str"),
        ({"hostNetwork": "yes"}, "hostNetwork: expected bool, got str"),
        ({"tolerations": {"key": "a"}}, "tolerations: expected a list"),
        (
            {"affinity": {"nodeAffinity": {"required": {}}}},
            "nodeAffinity.required: no such field in NodeAffinity",
        ),
        ({"$retain": ["a"]}, "not a strategic-merge directive"),
    ],
)
def test_a_pod_template_the_kubernetes_api_would_not_take_names_the_field(
    patch: dict[str, Any], message: str
) -> None:
    spec = make_spec(podTemplate={"spec": patch})
    with pytest.raises(PodTemplateError, match=message.replace("[", r"\[").replace("]", r"\]")):
        desired_pod(OWNER, spec, WARM, "abcdef0123")


@pytest.mark.parametrize(
    ("patch", "named"),
    [
        ({"containers": [{"name": "engine", "command": ["sh"]}]}, "the engine's command"),
        ({"containers": [{"name": "engine", "args": ["--model=/elsewhere"]}]}, "the engine's args"),
        ({"containers": [{"name": "engine", "ports": [{"containerPort": 9000}]}]}, "the engine's ports"),
        ({"containers": [{"name": "engine", "$patch": "delete"}]}, "the engine container"),
        ({"containers": [{"$patch": "replace"}, {"name": "other", "image": "x"}]}, "the engine container"),
        ({"volumes": [{"name": "policy", "emptyDir": {}}]}, "the operator's volumes"),
    ],
)
def test_a_pod_template_may_not_break_the_operators_contract(patch: dict[str, Any], named: str) -> None:
    with pytest.raises(PodTemplateError, match=named):
        desired_pod(OWNER, make_spec(podTemplate={"spec": patch}), WARM, "abcdef0123")


def test_pod_template_labels_may_not_take_the_operators() -> None:
    with pytest.raises(ValidationError, match="may not set"):
        make_spec(podTemplate={"metadata": {"labels": {"ember.dev/role": "active"}}})
    with pytest.raises(ValidationError, match="may not set"):
        make_spec(pod={"labels": {"app.kubernetes.io/instance": "other"}})


def test_strategic_merge_directives() -> None:
    target = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}]}], "finalizers": ["f"]}
    merged = strategic_merge(
        target,
        {
            "containers": [
                {"name": "a", "env": [{"name": "X", "$patch": "delete"}, {"name": "Y", "value": "2"}]}
            ],
            "finalizers": ["g"],
        },
    )
    assert merged == {
        "containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}],
        "finalizers": ["f", "g"],
    }
    assert strategic_merge({"a": {"b": 1, "c": 2}}, {"a": {"$patch": "replace", "d": 3}}) == {"a": {"d": 3}}
    assert strategic_merge({"a": 1, "b": 2}, {"$retainKeys": ["b"], "b": 3}) == {"b": 3}
    assert target["containers"][0]["env"] == [{"name": "X", "value": "1"}]  # the target is left alone


# -- the CRD refuses on the API server what the models refuse ------------------------------------------


@pytest.fixture(scope="module")
def custom(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    crd = yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text())
    with APIServer() as server:
        server.install_crd(crd)
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=str(server.write_kubeconfig(tmp_path_factory.mktemp("kc") / "kubeconfig")),
            client_configuration=configuration,
        )
        yield kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(configuration))


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"engine": {"extraArgs": ["--port=1"]}}, "extraArgs may not set an option the operator sets"),
        # argparse takes an unambiguous prefix for the option: the engine would read these as
        # --quantization, --kv-cache-dtype, --max-num-seqs and --draft-model.
        ({"engine": {"extraArgs": ["--quant=w8a16"]}}, "extraArgs may not set an option the operator sets"),
        ({"engine": {"extraArgs": ["--kv-cache-dt=fp8"]}}, "extraArgs may not set an option the operator"),
        (
            {"engine": {"extraArgs": ["--max-num-s", "4"]}},
            "extraArgs may not set an option the operator sets",
        ),
        ({"engine": {"extraArgs": ["--dra=x"]}}, "extraArgs may not set an option the operator sets"),
        # A value ending in a newline: RE2's `.` (CEL's `matches`) does not take it.
        ({"engine": {"extraArgs": ["--quant=fp8\n"]}}, "extraArgs may not set an option the operator sets"),
        ({"engine": {"extraArgs": ["--kv-cache-dtype=fp8_e5m2\n"]}}, "extraArgs may not set an option"),
        # Go's `$` (the schema's `pattern`) is the end of the text, not before a last newline as Python's.
        ({"model": {"name": "m", "source": "/m", "file": "m.gguf\n"}}, "file"),
        ({"pod": {"labels": {"ember.dev/role": "active"}}}, "labels may not set"),
        ({"podTemplate": {"metadata": {"labels": {"app.kubernetes.io/name": "x"}}}}, "labels may not set"),
        ({"model": {"name": "m", "source": "gs://x/y"}}, "source must be"),
        ({"model": {"name": "m", "source": "hf://a/b", "volumeClaim": "w"}}, "volumeClaim goes with a path"),
        ({"model": {"name": "m", "source": "hf://a/b", "file": "q/../../etc.gguf"}}, "file"),
        (
            {"lifecycle": {"drainSeconds": 120, "terminationGracePeriodSeconds": 60}},
            "must cover drainSeconds",
        ),
        ({"resources": {"gpuResource": "gpu"}}, "gpuResource"),
        (
            {
                "resources": {
                    "env": [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "x"}}}]
                }
            },
            "exclusive",
        ),
        ({"resources": {"env": [{"name": "A", "valueFrom": {}}]}}, "exactly one of"),
        ({"resources": {"envFrom": [{"prefix": "P"}]}}, "exactly one of configMapRef, secretRef"),
        (
            {
                "pod": {
                    "topologySpreadConstraints": [
                        {"maxSkew": 0, "topologyKey": "z", "whenUnsatisfiable": "DoNotSchedule"}
                    ]
                }
            },
            "maxSkew",
        ),
        (
            {
                "pod": {
                    "affinity": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [
                                    {"matchExpressions": [{"key": "a", "operator": "Near"}]}
                                ]
                            }
                        }
                    }
                }
            },
            "operator",
        ),
    ],
)
def test_the_api_server_refuses_what_the_model_refuses(custom: Any, spec: dict[str, Any], named: str) -> None:
    body = {"model": {"name": "m", "source": "/m"}, **spec}
    with pytest.raises(ValidationError, match=named):
        InferenceServiceSpec.model_validate(body)
    obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "bad"}, "spec": body}
    with pytest.raises(kubernetes.client.ApiException) as refused:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, obj)
    assert refused.value.status == 422
    assert named in json.loads(refused.value.body)["message"]


def test_the_api_server_takes_every_engine_option_the_operator_does_not_set(custom: Any) -> None:
    """The CRD's rule refuses the operator's options and their prefixes, and nothing else `ember serve`
    takes: each other option, as extraArgs, is created."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    free = [o for o in options if o.removeprefix("--") not in PROTECTED_FLAGS]
    assert len(free) > 10 and "--seed" in free
    body = {"model": {"name": "m", "source": "/m"}, "engine": {"extraArgs": [f"{o}=1" for o in free]}}
    InferenceServiceSpec.model_validate(body)
    obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "free"}, "spec": body}
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, obj)
    custom.delete_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "free")


def test_the_api_server_takes_a_full_placement_spec(custom: Any) -> None:
    body = {
        "model": {
            "name": "m",
            "source": "hf://org/name@v1",
            "credentialsSecret": "hf",
            "cache": {"sizeLimit": "10Gi"},
        },
        "engine": {"extraArgs": ["--scheduling-policy=fcfs"]},
        "resources": {
            "gpuResource": "amd.com/gpu",
            "sharedMemory": "2Gi",
            "env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
            "envFrom": [{"configMapRef": {"name": "c"}}],
        },
        "pod": {"affinity": AFFINITY, "priorityClassName": "high", "labels": {"team": "a"}},
        "lifecycle": {"drainSeconds": 300},
        "podTemplate": {"spec": {"containers": [{"name": "engine", "stdin": False}]}},
    }
    obj = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": "full"}, "spec": body}
    created = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, obj)
    spec = InferenceServiceSpec.model_validate(created["spec"])
    assert spec.pod.affinity is not None and spec.pod.affinity.to_kube() == AFFINITY
    assert created["spec"]["podTemplate"]["spec"] == {"containers": [{"name": "engine", "stdin": False}]}
    assert spec.lifecycle.grace_seconds == 315


def test_a_crash_looping_model_fetch_is_trouble_with_its_fatal_line() -> None:
    from ember_operator.pods import trouble

    fatal = "ember fetch-model: fatal: the hub answered 401 Unauthorized: repository org/m not found"
    pod = {
        "metadata": {"name": "chat-abc"},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": "fetch-model",
                    "restartCount": 3,
                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                    "lastState": {
                        "terminated": {"exitCode": 1, "reason": "Error", "message": f"progress\n{fatal}\n"}
                    },
                }
            ],
            "containerStatuses": [
                {"name": "engine", "restartCount": 0, "state": {"waiting": {"reason": "PodInitializing"}}}
            ],
        },
    }
    found = trouble(pod)
    assert found is not None and found.reason == "ModelFetchFailed"
    assert (
        found.message == f"pod chat-abc: init container fetch-model: CrashLoopBackOff (exit code 1): {fatal}"
    )
    # The first failures are the kubelet's to retry: no trouble yet.
    pod["status"]["initContainerStatuses"][0]["restartCount"] = 1
    assert trouble(pod) is None


def test_a_crash_loop_of_oom_kills_says_so() -> None:
    """The runtime's reason for the last exit is the cause a user needs (a memory limit too small)."""
    from ember_operator.pods import trouble

    terminated = {"exitCode": 137, "reason": "OOMKilled", "finishedAt": "2026-01-01T00:00:00Z"}
    pod = {
        "metadata": {"name": "chat-abc"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "engine",
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": terminated},
                }
            ],
        },
    }
    found = trouble(pod)
    assert found is not None and found.reason == "PodsCrashLooping"
    assert found.message == "pod chat-abc: CrashLoopBackOff (exit code 137, OOMKilled)"


def test_lora_adapters_are_fetched_like_the_model_and_served_by_name() -> None:
    adapters = [
        {"name": "org/sql", "source": "hf://org/sql-lora@v1"},
        {"name": "chat", "source": "/models/adapters/chat"},  # a path: read where it is
        {"name": "pvc", "source": "pvc://adapters/pvc-lora"},
    ]
    spec = make_spec(model={"name": "m", "source": "hf://org/base", "adapters": adapters})
    pod = pod_of(model={"name": "m", "source": "hf://org/base", "adapters": adapters})
    names = [c["name"] for c in pod["spec"]["initContainers"]]
    assert names == ["fetch-model", "fetch-adapter-0", "fetch-adapter-2"]
    first, third = pod["spec"]["initContainers"][1:]
    assert first["args"] == ["hf://org/sql-lora@v1", "/model-cache/hf/org/sql-lora/v1"]
    assert third["args"] == ["/model-source/adapters/pvc-lora", "/model-cache/pvc/adapters/pvc-lora"]
    args = engine(pod)["args"]
    at = args.index("--lora-modules")
    wanted = [
        "org/sql=/model-cache/hf/org/sql-lora/v1",
        "chat=/models/adapters/chat",
        "pvc=/model-cache/pvc/adapters/pvc-lora",
    ]
    assert args[at + 1 : at + 4] == wanted
    parsed = build_parser().parse_args(["serve", *args])
    assert serve.engine_config(parsed).lora_modules == dict(w.split("=", 1) for w in wanted)
    # They change what the engines run: a new adapter rolls the pods; none set rolls nothing.
    assert template_hash(spec) != template_hash(make_spec(model={"name": "m", "source": "hf://org/base"}))
    with pytest.raises(
        ValidationError, match=r"--lora-modules \(got .--lora-modules.\) comes from model.adapters"
    ):
        make_spec(engine={"extraArgs": ["--lora-modules", "x=/y"]})


def test_api_keys_reach_the_engines_and_routers_from_their_secrets_and_roll_the_pods() -> None:
    from ember_operator.router import desired_router_deployment

    key = {"secretKeyRef": {"name": "serve-key", "key": "key"}}
    other = {"secretKeyRef": {"name": "fb-key", "key": "k"}}
    spec = make_spec(apiKey=key, fallback={"url": "http://fb:8000", "apiKey": other})
    wanted = [
        {"name": "EMBER_API_KEY", "valueFrom": {"secretKeyRef": {"name": "serve-key", "key": "key"}}},
        {"name": "EMBER_FALLBACK_API_KEY", "valueFrom": {"secretKeyRef": {"name": "fb-key", "key": "k"}}},
    ]
    assert engine(desired_pod(OWNER, spec, WARM, "abcdef0123"))["env"] == wanted
    router = desired_router_deployment(
        OWNER,
        make_spec(router={"enabled": True}, apiKey=key, fallback={"url": "http://fb:8000", "apiKey": other}),
    )
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert container["env"][1:] == wanted and container["env"][0]["name"] == "POD_NAMESPACE"
    # The keys (as Secret references) are in the template hash; a spec without them hashes as before.
    hashes = {
        template_hash(make_spec()),
        template_hash(make_spec(apiKey=key)),
        template_hash(make_spec(apiKey=other)),
        template_hash(make_spec(fallback={"url": "http://fb:8000", "apiKey": other})),
    }
    assert len(hashes) == 4
    assert template_hash(make_spec(fallback={"url": "http://fb:8000"})) == template_hash(make_spec())


def test_the_engines_chat_template_reaches_the_routers_too() -> None:
    from ember_operator.router import router_args

    for extra, passed in (
        (
            ["--chat-template", "/models/chat/t.jinja", "--seed=1"],
            ["--chat-template", "/models/chat/t.jinja"],
        ),
        (["--chat-template={{ messages }}"], ["--chat-template={{ messages }}"]),
        (["--seed=1"], []),
    ):
        args = router_args(OWNER, make_spec(router={"enabled": True}, engine={"extraArgs": extra}))
        assert [a for a in args if a.startswith("--chat-template")] == passed[:1]
        assert args[len(args) - len(passed) :] == passed
