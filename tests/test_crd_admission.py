"""The committed CRD as the API server applies it: defaults, and the CEL rules that refuse a bad
InferenceService at apply time (what would otherwise be stored and fail later, in a pod)."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml

from ember_localcluster.apiserver import APIError, APIServer
from ember_operator.spec import GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec

REPO = Path(__file__).resolve().parents[1]
_names = (f"eis-{i}" for i in itertools.count())


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[APIServer]:
    with APIServer() as api:
        api.install_crd(yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text()))
        yield api


def _body(spec: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name or next(_names), "namespace": "default"},
        "spec": {"model": {"name": "m", "source": "/m"}, **spec},
    }


def create(server: APIServer, spec: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    return server.create(_body(spec, name))


def refused(server: APIServer, spec: dict[str, Any], name: str | None = None) -> str:
    """The 422 message the API server answers a create of `spec` with."""
    with pytest.raises(APIError) as caught:
        create(server, spec, name)
    assert caught.value.code == 422, caught.value
    return caught.value.message


def _custom(server: APIServer, tmp_path: Path) -> kubernetes.client.CustomObjectsApi:
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")),
        client_configuration=configuration,
    )
    return kubernetes.client.CustomObjectsApi(kubernetes.client.ApiClient(configuration))


def test_replicas_desired_defaults_to_one_so_the_scale_subresource_is_not_zero(
    server: APIServer, tmp_path: Path
) -> None:
    """An HPA reads spec.replicas 0 as "scaling disabled" (ScalingDisabled) and never writes: a service
    created without replicas.desired must show a replica count through /scale."""
    assert InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}}).replicas.desired == 1
    created = create(server, {"replicas": {"min": 1, "max": 3}, "autoscaling": {"mode": "External"}})
    assert created["spec"]["replicas"]["desired"] == 1
    custom = _custom(server, tmp_path)
    scale = custom.get_namespaced_custom_object_scale(
        GROUP, VERSION, "default", PLURAL, created["metadata"]["name"]
    )
    assert scale["spec"]["replicas"] == 1


def test_replicas_desired_set_at_creation_in_builtin_mode_is_refused(server: APIServer) -> None:
    message = refused(server, {"replicas": {"min": 1, "max": 4, "desired": 3}})
    assert "spec.replicas.desired" in message and "autoscaling.mode is External" in message, message
    # The default, and any value in External mode, are taken.
    assert create(server, {"replicas": {"min": 1, "max": 4}})["spec"]["replicas"]["desired"] == 1
    assert create(server, {"replicas": {"min": 1, "max": 4, "desired": 1}})
    external = {"replicas": {"min": 1, "max": 4, "desired": 3}, "autoscaling": {"mode": "External"}}
    assert create(server, external)["spec"]["replicas"]["desired"] == 3


def test_an_update_in_builtin_mode_keeps_the_transition_rule(server: APIServer) -> None:
    name = create(server, {"replicas": {"min": 1, "max": 4}})["metadata"]["name"]
    patch = functools.partial(server.patch, f"{GROUP}/{VERSION}", KIND, "default", name)
    with pytest.raises(APIError) as caught:
        patch({"spec": {"replicas": {"desired": 2}}})
    assert caught.value.code == 422 and "autoscaling.mode is External" in caught.value.message
    assert patch({"spec": {"warmPool": {"size": 1}}})["spec"]["warmPool"]["size"] == 1


BYTE_FIELDS = [
    ("engine", "kvCacheMemory", "engine.kvCacheMemory"),
    ("resources", "memory", "resources.memory"),
    ("resources", "sharedMemory", "resources.sharedMemory"),
    ("router", "memory", "router.memory"),
]


@pytest.mark.parametrize(("section", "key", "named"), BYTE_FIELDS)
@pytest.mark.parametrize("value", ["512m", "3u", "7n", "1.5"])
def test_a_byte_quantity_below_a_byte_is_refused_naming_the_field(
    server: APIServer, section: str, key: str, named: str, value: str
) -> None:
    """512m is 0.512 bytes (m is a thousandth), not 512 megabytes: the engine would get 0 bytes."""
    spec = {section: {key: value}}
    message = refused(server, spec)
    assert named in message and "bytes" in message, message
    with pytest.raises(ValueError, match=named.replace(".", "[.]")):
        InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}, **spec})
    fine = {section: {key: "512Mi"}}
    assert create(server, fine)["spec"][section][key] == "512Mi"


def test_model_cache_size_limit_is_bytes_too(server: APIServer) -> None:
    message = refused(server, {"model": {"name": "m", "source": "hf://org/m", "cache": {"sizeLimit": "20m"}}})
    assert "model.cache.sizeLimit" in message, message


def test_kv_cache_memory_of_zero_is_refused_and_fractions_round_up_as_kubernetes_does(
    server: APIServer,
) -> None:
    from ember_operator.desired import engine_args

    message = refused(server, {"engine": {"kvCacheMemory": "0Gi"}})
    assert "engine.kvCacheMemory" in message and "at least one byte" in message, message
    spec = InferenceServiceSpec.model_validate(
        {"model": {"name": "m", "source": "/m"}, "engine": {"kvCacheMemory": "0.0001k"}}
    )
    assert "--kv-cache-memory=1" in engine_args(spec)  # 0.1 bytes, rounded up as Quantity.Value() does
    assert create(server, {"engine": {"kvCacheMemory": "0.5Gi"}})


@pytest.mark.parametrize("draft", ["gs://bucket/draft", "hf://just-a-name", "s3://B/x"])
def test_a_draft_source_gets_the_checks_of_model_source(server: APIServer, draft: str) -> None:
    spec = {"speculative": {"method": "draft", "draftSource": draft}}
    message = refused(server, spec)
    assert "speculative.draftSource must be a path, hf://org/name[@revision]" in message, message
    with pytest.raises(ValueError, match="draftSource must be a path"):
        InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}, **spec})
    for fine in ("/models/draft", "hf://org/draft@main", "s3://bucket/draft", "pvc://claim/draft"):
        assert create(server, {"speculative": {"method": "draft", "draftSource": fine}})


def test_ngram_takes_no_draft_source(server: APIServer) -> None:
    spec = {"speculative": {"method": "ngram", "draftSource": "hf://org/draft"}}
    message = refused(server, spec)
    assert "draftSource" in message and "ngram" in message, message
    with pytest.raises(ValueError, match="ngram"):
        InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}, **spec})
    assert create(server, {"speculative": {"method": "ngram"}})


def test_builtin_scale_to_zero_without_the_router_is_refused(server: APIServer) -> None:
    """Only requests the router holds wake a target of 0: without it such a service never serves."""
    spec = {"replicas": {"min": 0, "max": 2}, "router": {"enabled": False}}
    message = refused(server, spec)
    assert "replicas.min 0" in message and "router.enabled" in message and "wake" in message, message
    with pytest.raises(ValueError, match=r"router\.enabled"):
        InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}, **spec})
    assert create(server, {"replicas": {"min": 0, "max": 2}})  # the router wakes it
    assert create(server, {**spec, "autoscaling": {"mode": "External"}})  # KEDA may scale from zero


def test_a_multi_node_name_leaves_room_for_the_leaderworkerset_revision_label(server: APIServer) -> None:
    """A group is a LeaderWorkerSet named `<name>-<5 random>`; its worker StatefulSet `<lws>-0` labels pods
    with controller-revision-hash `<statefulset>-<hash of up to 10>`, a label value of at most 63: the name
    may then take 63 - 11 - 2 - 6 = 44 characters."""
    multi = {"resources": {"gpus": 1, "nodes": 2}}
    message = refused(server, multi, "a" * 45)
    assert "44" in message and "resources.nodes" in message and "controller-revision-hash" in message, message
    assert create(server, multi, "b" * 44)
    assert create(server, {"resources": {"gpus": 1, "nodes": 1}}, "c" * 52)  # one node: no LeaderWorkerSet


QUALIFIED_NAME = (
    "must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric "
    "character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)
LABEL_VALUE = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used "
    "for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)


@pytest.mark.parametrize(
    ("toleration", "field", "says"),
    [
        (
            {"key": "gpu", "operator": "Exists", "value": "yes"},
            "operator",
            "value must be empty when `operator` is 'Exists'",
        ),
        (
            {"operator": "Equal", "value": "x"},
            "operator",
            'operator must be Exists when `key` is empty, which means "match all values and all keys"',
        ),
        ({"value": "x"}, "operator", "operator must be Exists when `key` is empty"),
        (
            {"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30},
            "effect",
            "effect must be 'NoExecute' when `tolerationSeconds` is set",
        ),
        (
            {"key": "gpu", "operator": "Exists", "tolerationSeconds": 30},
            "effect",
            "effect must be 'NoExecute'",
        ),
        ({"key": "bad key", "operator": "Exists"}, "key", "name part " + QUALIFIED_NAME),
        (
            {"key": "Example.com/gpu", "operator": "Exists"},
            "key",
            "prefix part a lowercase RFC 1123 subdomain",
        ),
        ({"key": "/gpu", "operator": "Exists"}, "key", "prefix part must be non-empty"),
        ({"key": "a/b/c", "operator": "Exists"}, "key", "a qualified name " + QUALIFIED_NAME),
        ({"key": "g" * 64, "operator": "Exists"}, "key", "name part must be no more than 63 characters"),
        ({"key": "gpu", "operator": "Equal", "value": "a b"}, "operator", LABEL_VALUE),
    ],
)
@pytest.mark.parametrize("section", ["resources", "router"])
def test_tolerations_kube_apiserver_refuses_for_a_pod_are_refused(
    server: APIServer, toleration: dict[str, Any], field: str, says: str, section: str
) -> None:
    """kube-apiserver's ValidateTolerations, at apply time rather than when the operator's pod is refused
    (the engines' and the routers' alike)."""
    spec = {section: {"tolerations": [toleration]}}
    message = refused(server, spec)
    assert f"spec.{section}.tolerations[0].{field}: Invalid value" in message and says in message, message
    with pytest.raises(ValueError, match=re.escape(says)):
        InferenceServiceSpec.model_validate({"model": {"name": "m", "source": "/m"}, **spec})


@pytest.mark.parametrize("section", ["resources", "router"])
def test_tolerations_kube_apiserver_takes_are_taken(server: APIServer, section: str) -> None:
    tolerations = [
        {"operator": "Exists"},
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "dedicated", "value": "inference", "effect": "NoExecute", "tolerationSeconds": 60},
        {"key": "k", "operator": "Equal", "value": ""},
    ]
    created = create(server, {section: {"tolerations": tolerations}})
    assert created["spec"][section]["tolerations"] == tolerations


@pytest.mark.parametrize(
    ("selector", "says"),
    [({"disk": "fast ssd"}, LABEL_VALUE), ({"disk": "x" * 64}, "63")],
)
@pytest.mark.parametrize("section", ["resources", "router"])
def test_node_selector_values_must_be_label_values(
    server: APIServer, selector: dict[str, str], says: str, section: str
) -> None:
    spec = {section: {"nodeSelector": selector}}
    message = refused(server, spec)
    assert f"spec.{section}.nodeSelector" in message and says in message, message


@pytest.mark.parametrize("section", ["resources", "router"])
def test_node_selector_keys_must_be_label_keys(section: str) -> None:
    """Checked by the operator (the CRD cannot bound a map key's length for CEL's cost estimate)."""
    for key, says in (("bad key", "name part " + QUALIFIED_NAME), ("a/b/c", "a qualified name")):
        with pytest.raises(ValueError, match=re.escape(says)):
            InferenceServiceSpec.model_validate(
                {"model": {"name": "m", "source": "/m"}, section: {"nodeSelector": {key: "x"}}}
            )


def _with_adapters(*adapters: dict[str, str], name: str = "m") -> dict[str, Any]:
    return {"model": {"name": name, "source": "/m", "adapters": list(adapters)}}


def test_lora_adapters_are_refused_where_their_names_or_sources_cannot_work(server: APIServer) -> None:
    """Each refusal by the API server (the list's keys, the CEL rules, the schema), and by the spec's own
    validation alike."""
    cases = [
        (
            _with_adapters({"name": "a", "source": "/x"}, {"name": "a", "source": "/y"}),
            # apiextensions-apiserver's list-type check: field.Duplicate, its value printed with Go's %#v
            'spec.model.adapters[1]: Duplicate value: map[string]interface {}{"name":"a"}',
            "adapters names must be unique",
        ),
        (
            _with_adapters({"name": "m", "source": "/x"}),
            "an adapter may not take the model's own name",
            "an adapter may not take the model's own name",
        ),
        (
            _with_adapters({"name": "a", "source": "gs://bucket/a"}),
            "adapters[].source must be a path, hf://org/name[@revision]",
            "adapters[].source must be a path",
        ),
        (
            _with_adapters({"name": "a=b", "source": "/x"}),
            "spec.model.adapters[0].name in body should match",
            "name",
        ),
    ]
    for spec, message, ours in cases:
        said = refused(server, spec)
        assert message in said, said
        with pytest.raises(ValueError, match=re.escape(ours)):
            InferenceServiceSpec.model_validate(spec)
    fine = _with_adapters(
        {"name": "org/sql-lora", "source": "hf://org/sql-lora@v1"}, {"name": "b", "source": "/x"}
    )
    assert create(server, fine)["spec"]["model"]["adapters"][0]["name"] == "org/sql-lora"


def test_api_keys_are_refused_where_a_server_could_end_up_without_one(server: APIServer) -> None:
    """An optional Secret (a pod without it would take requests without a key) and a key set through
    resources.env (it would not reach the routers), refused by the API server and by the spec alike."""
    secret = {"secretKeyRef": {"name": "keys", "key": "api-key"}}
    cases = [
        (
            {
                "model": {"name": "m", "source": "/m"},
                "apiKey": {"secretKeyRef": {**secret["secretKeyRef"], "optional": True}},
            },
            'spec.apiKey: Invalid value: "object": secretKeyRef.optional cannot be true',
        ),
        (
            {
                "model": {"name": "m", "source": "/m"},
                "fallback": {
                    "url": "http://x",
                    "apiKey": {"secretKeyRef": {"name": "k", "key": "k", "optional": True}},
                },
            },
            'spec.fallback.apiKey: Invalid value: "object": secretKeyRef.optional cannot be true',
        ),
        (
            {
                "model": {"name": "m", "source": "/m"},
                "resources": {"env": [{"name": "EMBER_API_KEY", "value": "sk"}]},
            },
            'spec.resources.env: Invalid value: "object": resources.env may not set EMBER_API_KEY',
        ),
    ]
    for spec, message in cases:
        said = refused(server, spec)
        assert message in said, said
        ours = message.split('"object": ')[1]
        with pytest.raises(ValueError, match=re.escape(ours)):
            InferenceServiceSpec.model_validate(spec)
    fine = {
        "model": {"name": "m", "source": "/m"},
        "apiKey": secret,
        "fallback": {"url": "http://x", "apiKey": secret},
    }
    created = create(server, fine)["spec"]
    assert created["apiKey"] == created["fallback"]["apiKey"] == secret
