"""The in-process Kubernetes API server, through real clients: the official `kubernetes` client, a kopf
operator run by `KopfRunner`, kubectl, and raw HTTP where a client would hide the server's answer."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import kopf
import kubernetes
import pytest
import yaml
from apiserver_http import http
from kopf.testing import KopfRunner
from kubectl_run import kubectl
from kubernetes.client import ApiClient, ApiException, CoreV1Api, CustomObjectsApi
from waiting import wait_for

from ember_localcluster.apiserver import APIError, APIServer

REPO = Path(__file__).resolve().parents[1]
CRD = yaml.safe_load((REPO / "crds" / "inferenceservice.yaml").read_text())
GROUP, VERSION, PLURAL = "ember.dev", "v1alpha1", "inferenceservices"
EIS = f"{GROUP}/{VERSION}"

T = TypeVar("T")


def api_client(server: APIServer, path: Path) -> ApiClient:
    """A client configured from the server's kubeconfig file, leaving the library's default alone."""
    configuration = kubernetes.client.Configuration()
    kubernetes.config.load_kube_config(
        config_file=str(server.write_kubeconfig(path)), client_configuration=configuration
    )
    return ApiClient(configuration)


def eis(name: str, **spec: Any) -> dict[str, Any]:
    body = {"model": {"name": "llama", "source": "/models/llama"}, **spec}
    return {"apiVersion": EIS, "kind": "InferenceService", "metadata": {"name": name}, "spec": body}


def configmap(name: str, **metadata: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, **metadata}, "data": {"a": "1"}}


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False, bookmark_interval=0.5) as running:
        yield running


@pytest.fixture
def client(server: APIServer, tmp_path: Path) -> Iterator[ApiClient]:
    with api_client(server, tmp_path / "kubeconfig") as api:
        yield api


@pytest.fixture
def core(client: ApiClient) -> CoreV1Api:
    return CoreV1Api(client)


@pytest.fixture
def custom(client: ApiClient, server: APIServer) -> CustomObjectsApi:
    server.install_crd(CRD)
    return CustomObjectsApi(client)


# -- the official client ----------------------------------------------------------------------------


def test_configmap_crud(core: CoreV1Api, server: APIServer) -> None:
    created = core.create_namespaced_config_map("default", configmap("cfg"))
    meta = created.metadata
    # ConfigMaps keep no metadata.generation (their registry strategy sets none).
    assert meta.uid and meta.generation is None and meta.namespace == "default"
    stored = server.get("v1", "ConfigMap", "default", "cfg")
    assert stored is not None and re.fullmatch(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stored["metadata"]["creationTimestamp"]
    )
    assert core.read_namespaced_config_map("cfg", "default").data == {"a": "1"}
    assert [cm.metadata.name for cm in core.list_namespaced_config_map("default").items] == ["cfg"]

    created.data = {"a": "2"}
    replaced = core.replace_namespaced_config_map("cfg", "default", created)
    assert int(replaced.metadata.resource_version) > int(meta.resource_version)
    assert replaced.metadata.generation is None

    patched = core.patch_namespaced_config_map("cfg", "default", {"data": {"b": "3"}})
    assert patched.data == {"a": "2", "b": "3"}
    again = core.patch_namespaced_config_map("cfg", "default", {"data": {"b": "3"}})
    assert again.metadata.resource_version == patched.metadata.resource_version, "a no-op write bumped the RV"

    core.delete_namespaced_config_map("cfg", "default")
    with pytest.raises(ApiException) as error:
        core.read_namespaced_config_map("cfg", "default")
    assert error.value.status == 404
    assert json.loads(error.value.body)["reason"] == "NotFound"


def test_requests_are_counted_by_verb_and_resource(core: CoreV1Api, server: APIServer) -> None:
    core.create_namespaced_config_map("default", configmap("cfg"))
    core.list_namespaced_config_map("default")
    core.list_namespaced_config_map("default", label_selector="app=x")
    core.read_namespaced_config_map("cfg", "default")
    core.patch_namespaced_config_map("cfg", "default", {"data": {"b": "3"}})
    core.list_namespaced_config_map("default", watch=True, timeout_seconds=1, _preload_content=False).read()
    core.delete_collection_namespaced_config_map("default")
    with pytest.raises(ApiException):
        CustomObjectsApi(core.api_client).list_namespaced_custom_object("x.dev", "v1", "default", "nothings")
    # The blocking helpers are not requests.
    server.create(
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "default"}}
    )
    counts = {k: v for k, v in server.request_counts().items() if k[1] in ("configmaps", "nothings")}
    assert counts == {
        ("POST", "configmaps", ""): 1,
        ("LIST", "configmaps", ""): 2,
        ("GET", "configmaps", ""): 1,
        ("PATCH", "configmaps", ""): 1,
        ("WATCH", "configmaps", ""): 1,
        ("DELETECOLLECTION", "configmaps", ""): 1,
        ("LIST", "nothings", ""): 1,  # not served (404), counted all the same
    }


def test_list_selectors_and_pages(core: CoreV1Api) -> None:
    for name, labels in (
        ("a", {"app": "a", "tier": "web"}),
        ("b", {"app": "b"}),
        ("c", {"app": "c", "tier": "db"}),
    ):
        core.create_namespaced_config_map("default", configmap(name, labels=labels))

    def names(**kwargs: Any) -> list[str]:
        return [cm.metadata.name for cm in core.list_namespaced_config_map("default", **kwargs).items]

    assert names(label_selector="app=a") == ["a"]
    assert names(label_selector="app!=a") == ["b", "c"]
    assert names(label_selector="app in (a,c)") == ["a", "c"]
    assert names(label_selector="app notin (a)") == ["b", "c"]
    assert names(label_selector="tier") == ["a", "c"]
    assert names(label_selector="!tier") == ["b"]
    assert names(label_selector="app=c,tier=db") == ["c"]
    assert names(field_selector="metadata.name=b") == ["b"]
    assert names(field_selector="metadata.name!=b,metadata.namespace=default") == ["a", "c"]

    first = core.list_namespaced_config_map("default", limit=2)
    assert [cm.metadata.name for cm in first.items] == ["a", "b"] and first.metadata._continue
    rest = core.list_namespaced_config_map("default", limit=2, _continue=first.metadata._continue)
    assert [cm.metadata.name for cm in rest.items] == ["c"] and not rest.metadata._continue


def test_stale_replace_is_a_conflict(core: CoreV1Api) -> None:
    stale = core.create_namespaced_config_map("default", configmap("cfg"))
    core.patch_namespaced_config_map("cfg", "default", {"data": {"a": "2"}})
    stale.data = {"a": "3"}
    with pytest.raises(ApiException) as error:
        core.replace_namespaced_config_map("cfg", "default", stale)
    assert error.value.status == 409
    assert json.loads(error.value.body)["reason"] == "Conflict"


def test_pod_strategic_merge_patch(core: CoreV1Api) -> None:
    containers = [{"name": "engine", "image": "engine:1"}, {"name": "sidecar", "image": "sidecar:1"}]
    pod = {"metadata": {"name": "p", "labels": {"app": "ember"}}, "spec": {"containers": containers}}
    assert core.create_namespaced_pod("default", pod).status.phase == "Pending"

    # The client sends dict bodies for built-ins as strategic merge patches: lists merge by key.
    patch = {
        "metadata": {"labels": {"role": "active"}},
        "spec": {"containers": [{"name": "engine", "image": "engine:2"}]},
    }
    patched = core.patch_namespaced_pod("p", "default", patch)
    assert patched.metadata.labels == {"app": "ember", "role": "active"}
    assert [(c.name, c.image) for c in patched.spec.containers] == [
        ("engine", "engine:2"),
        ("sidecar", "sidecar:1"),
    ]

    # The directive removes the sidecar from the patched spec, which ValidatePodUpdate then refuses: a
    # Pod's containers cannot change but for their images.
    with pytest.raises(ApiException) as refused:
        core.patch_namespaced_pod(
            "p", "default", {"spec": {"containers": [{"name": "sidecar", "$patch": "delete"}]}}
        )
    assert refused.value.status == 422
    assert "pod updates may not change fields other than" in json.loads(refused.value.body)["message"]


def test_generate_name(core: CoreV1Api) -> None:
    names = {
        core.create_namespaced_config_map("default", {"metadata": {"generateName": "cfg-"}}).metadata.name
        for _ in range(3)
    }
    assert len(names) == 3
    assert all(re.fullmatch(r"cfg-[a-z0-9]{5}", name) for name in names)


def test_server_side_apply(core: CoreV1Api) -> None:
    document = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"a": "1"}}
    apply = {"field_manager": "tests", "_content_type": "application/apply-patch+yaml"}
    created = core.patch_namespaced_config_map("applied", "default", document, **apply)
    assert created.data == {"a": "1"}
    updated = core.patch_namespaced_config_map(
        "applied", "default", {**document, "data": {"a": "2"}}, **apply
    )
    assert updated.data == {"a": "2"} and updated.metadata.uid == created.metadata.uid


def test_watch_streams_every_write_with_its_resource_version(core: CoreV1Api) -> None:
    start = core.list_namespaced_config_map("default").metadata.resource_version
    written = [core.create_namespaced_config_map("default", configmap("w")).metadata.resource_version]
    watch = kubernetes.watch.Watch()
    seen = []
    for event in watch.stream(
        core.list_namespaced_config_map, "default", resource_version=start, timeout_seconds=5
    ):
        seen.append((event["type"], event["object"].metadata.resource_version))
        if len(seen) == 1:  # the replayed ADDED; the next writes reach the open stream live
            written.append(
                core.patch_namespaced_config_map(
                    "w", "default", {"data": {"k": "v"}}
                ).metadata.resource_version
            )
            core.delete_namespaced_config_map("w", "default")
        if event["type"] == "DELETED":
            watch.stop()
    assert [kind for kind, _ in seen] == ["ADDED", "MODIFIED", "DELETED"]
    assert [rv for _, rv in seen[:2]] == written
    versions = [int(rv) for _, rv in seen]
    assert versions == sorted(versions) and len(set(versions)) == 3


def test_watch_from_a_compacted_resource_version_is_gone(core: CoreV1Api, server: APIServer) -> None:
    old = core.list_namespaced_config_map("default").metadata.resource_version
    core.create_namespaced_config_map("default", configmap("cfg"))
    server.compact()
    with pytest.raises(ApiException) as error:
        for _ in kubernetes.watch.Watch().stream(
            core.list_namespaced_config_map, "default", resource_version=old, timeout_seconds=2
        ):
            pass
    assert error.value.status == 410


def test_watch_initial_events_and_bookmarks(core: CoreV1Api, server: APIServer) -> None:
    core.create_namespaced_config_map("default", configmap("cfg"))
    query = "watch=1&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true&timeoutSeconds=1"
    started = time.monotonic()
    with urllib.request.urlopen(
        f"{server.url}/api/v1/namespaces/default/configmaps?{query}", timeout=10
    ) as stream:
        events = [json.loads(line) for line in stream]  # ends when the server closes the stream
    assert time.monotonic() - started >= 0.9
    assert events[0]["type"] == "ADDED" and events[0]["object"]["metadata"]["name"] == "cfg"
    assert events[1]["type"] == "BOOKMARK"
    assert events[1]["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert any(
        event["type"] == "BOOKMARK" and "annotations" not in event["object"]["metadata"]
        for event in events[2:]
    )


def test_finalizers_hold_deletion(core: CoreV1Api) -> None:
    core.create_namespaced_config_map("default", configmap("cfg", finalizers=["ember.dev/cleanup"]))
    core.delete_namespaced_config_map("cfg", "default")
    held = core.read_namespaced_config_map("cfg", "default")
    assert held.metadata.deletion_timestamp is not None and held.metadata.deletion_grace_period_seconds == 0

    with pytest.raises(ApiException) as error:
        core.patch_namespaced_config_map("cfg", "default", {"metadata": {"finalizers": ["ember.dev/more"]}})
    assert error.value.status == 422

    core.patch_namespaced_config_map(
        "cfg", "default", {"metadata": {"$deleteFromPrimitiveList/finalizers": ["ember.dev/cleanup"]}}
    )
    with pytest.raises(ApiException) as gone:
        core.read_namespaced_config_map("cfg", "default")
    assert gone.value.status == 404


def test_owner_references_are_garbage_collected(core: CoreV1Api) -> None:
    def child_of(owner: Any, name: str) -> dict[str, Any]:
        ref = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "name": owner.metadata.name,
            "uid": owner.metadata.uid,
        }
        return configmap(name, ownerReferences=[ref])

    owner = core.create_namespaced_config_map("default", configmap("owner"))
    core.create_namespaced_config_map("default", child_of(owner, "child"))
    core.delete_namespaced_config_map("owner", "default")
    assert [cm.metadata.name for cm in core.list_namespaced_config_map("default").items] == []

    owner = core.create_namespaced_config_map("default", configmap("owner"))
    core.create_namespaced_config_map("default", child_of(owner, "orphan"))
    core.delete_namespaced_config_map("owner", "default", propagation_policy="Orphan")
    # The garbage collector's patch leaves no `ownerReferences` at all once the last one is taken out.
    orphan = json.loads(core.read_namespaced_config_map("orphan", "default", _preload_content=False).data)
    assert "ownerReferences" not in orphan["metadata"], orphan["metadata"]


def test_pod_security_admission_enforces_the_namespace_label(core: CoreV1Api) -> None:
    for level in ("restricted", "baseline"):
        core.create_namespace(
            {"metadata": {"name": level, "labels": {"pod-security.kubernetes.io/enforce": level}}}
        )
    plain = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "engine", "image": "x"}]}}
    with pytest.raises(ApiException) as error:
        core.create_namespaced_pod("restricted", plain)
    assert error.value.status == 403
    body = json.loads(error.value.body)
    assert body["reason"] == "Forbidden"
    assert body["message"] == (
        'pods "p" is forbidden: violates PodSecurity "restricted:latest": allowPrivilegeEscalation != false '
        '(container "engine" must set securityContext.allowPrivilegeEscalation=false), unrestricted '
        'capabilities (container "engine" must set securityContext.capabilities.drop=["ALL"]), runAsNonRoot '
        '!= true (pod or container "engine" must set securityContext.runAsNonRoot=true), seccompProfile (pod '
        'or container "engine" must set securityContext.seccompProfile.type to "RuntimeDefault" or "Localhost")'
    )
    core.create_namespaced_pod("baseline", plain)  # baseline asks nothing of it
    host = {"metadata": {"name": "h"}, "spec": {**plain["spec"], "hostNetwork": True}}
    with pytest.raises(ApiException) as error:
        core.create_namespaced_pod("baseline", host)
    assert json.loads(error.value.body)["message"] == (
        'pods "h" is forbidden: violates PodSecurity "baseline:latest": host namespaces (hostNetwork=true)'
    )
    core.create_namespaced_pod("default", host)  # no label: privileged
    hardened = {
        "metadata": {"name": "ok"},
        "spec": {
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "engine",
                    "image": "x",
                    "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                }
            ],
        },
    }
    core.create_namespaced_pod("restricted", hardened)


def test_resource_quota_admission_refuses_pods_past_a_hard_limit(core: CoreV1Api) -> None:
    core.create_namespace({"metadata": {"name": "team"}})
    hard = {"pods": "2", "requests.nvidia.com/gpu": "1"}
    core.create_namespaced_resource_quota("team", {"metadata": {"name": "gpu"}, "spec": {"hard": hard}})

    def pod(name: str, gpus: int) -> dict[str, Any]:
        resources = {"limits": {"nvidia.com/gpu": str(gpus)}} if gpus else {}
        return {
            "metadata": {"name": name},
            "spec": {"containers": [{"name": "c", "image": "x", "resources": resources}]},
        }

    core.create_namespaced_pod("team", pod("a", 1))  # an extended resource's request is its limit
    with pytest.raises(ApiException) as error:
        core.create_namespaced_pod("team", pod("b", 1))
    assert error.value.status == 403
    assert json.loads(error.value.body)["message"] == (
        'pods "b" is forbidden: exceeded quota: gpu, requested: requests.nvidia.com/gpu=1, '
        "used: requests.nvidia.com/gpu=1, limited: requests.nvidia.com/gpu=1"
    )
    core.create_namespaced_pod("team", pod("c", 0))
    with pytest.raises(ApiException) as error:
        core.create_namespaced_pod("team", pod("d", 0))
    assert json.loads(error.value.body)["message"] == (
        'pods "d" is forbidden: exceeded quota: gpu, requested: pods=1, used: pods=2, limited: pods=2'
    )


def test_pod_graceful_deletion(tmp_path: Path) -> None:
    with APIServer(pod_kill_margin=0.5) as server, api_client(server, tmp_path / "kubeconfig") as client:
        core = CoreV1Api(client)
        for name, grace in (("slow", 30), ("quick", 1)):
            # Bound to a node: an unbound pod has no kubelet to stop it and goes at once.
            spec = {
                "nodeName": "n1",
                "containers": [{"name": "c", "image": "x"}],
                "terminationGracePeriodSeconds": grace,
            }
            core.create_namespaced_pod("default", {"metadata": {"name": name}, "spec": spec})

        core.delete_namespaced_pod("slow", "default")
        terminating = core.read_namespaced_pod("slow", "default")
        assert terminating.metadata.deletion_timestamp is not None
        assert terminating.metadata.deletion_grace_period_seconds == 30
        core.delete_namespaced_pod("slow", "default", grace_period_seconds=0)  # what a kubelet does
        assert server.get("v1", "Pod", "default", "slow") is None

        core.delete_namespaced_pod("quick", "default")
        assert server.get("v1", "Pod", "default", "quick") is not None
        wait_for(
            lambda: server.get("v1", "Pod", "default", "quick") is None, what="the grace period to run out"
        )

        spec = {"containers": [{"name": "c", "image": "x"}], "terminationGracePeriodSeconds": 30}
        core.create_namespaced_pod("default", {"metadata": {"name": "unbound"}, "spec": spec})
        core.delete_namespaced_pod("unbound", "default")
        assert server.get("v1", "Pod", "default", "unbound") is None, "not scheduled: deleted at once"


# -- custom resources --------------------------------------------------------------------------------


def test_status_and_scale_subresources(custom: CustomObjectsApi) -> None:
    # External mode: in Builtin mode the CRD refuses writes through /scale (see test_crd).
    body = {**eis("chat", autoscaling={"mode": "External"}), "status": {"replicas": 9}}
    created = custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
    assert "status" not in created, "status is the status subresource's business"

    status = {"status": {"replicas": 2, "selector": "app=chat", "observedGeneration": 1}}
    with_status = custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, "default", PLURAL, "chat", status
    )
    assert with_status["status"]["replicas"] == 2 and with_status["metadata"]["generation"] == 1
    ignored = custom.patch_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, "chat", {"status": {"replicas": 5}}
    )
    assert ignored["status"]["replicas"] == 2

    scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "chat")
    assert scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
    assert scale["status"] == {"replicas": 2, "selector": "app=chat"}
    scaled = custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, "default", PLURAL, "chat", {"spec": {"replicas": 3}}
    )
    assert scaled["spec"]["replicas"] == 3
    stored = custom.get_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, "chat")
    assert stored["spec"]["replicas"]["desired"] == 3 and stored["metadata"]["generation"] == 2

    with pytest.raises(ApiException) as error:
        custom.replace_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, "chat", scale)
    assert error.value.status == 409


WIDGETS = {
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "listKind": "WidgetList"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"replicas": {"type": "integer"}}},
                            "status": {"type": "object", "properties": {"replicas": {"type": "integer"}}},
                        },
                    }
                },
                "subresources": {
                    "status": {},
                    "scale": {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas"},
                },
            }
        ],
    },
}


def test_scale_without_the_spec_replicas_field_is_an_internal_error_as_apiextensions_answers(
    server: APIServer,
) -> None:
    # apiextensions-apiserver's ScaleREST.Get: NewInternalError("the spec replicas field %q does not exist");
    # its Update accepts a write that sets the field and refuses one that leaves it empty (400).
    server.install_crd(WIDGETS)
    path = "/apis/example.com/v1/namespaces/default/widgets/w"
    created, _ = http(
        server,
        "POST",
        "/apis/example.com/v1/namespaces/default/widgets",
        {
            "apiVersion": "example.com/v1",
            "kind": "Widget",
            "metadata": {"name": "w"},
            "spec": {},
        },
    )
    assert created == 201
    code, body = http(server, "GET", path + "/scale")
    assert code == 500
    assert body["reason"] == "InternalError"
    assert (
        body["message"] == 'Internal error occurred: the spec replicas field ".spec.replicas" does not exist'
    )
    assert body["details"] == {
        "causes": [{"message": 'the spec replicas field ".spec.replicas" does not exist'}]
    }

    code, body = http(
        server,
        "PATCH",
        path + "/scale",
        {"metadata": {"labels": {"a": "b"}}},
        content_type="application/merge-patch+json",
    )
    assert code == 400 and body["reason"] == "BadRequest"
    assert body["message"] == 'the spec replicas field ".spec.replicas" cannot be empty'

    code, body = http(
        server,
        "PATCH",
        path + "/scale",
        {"spec": {"replicas": 2}},
        content_type="application/merge-patch+json",
    )
    assert code == 200 and body["spec"]["replicas"] == 2
    code, body = http(server, "GET", path + "/scale")
    assert code == 200 and body["spec"]["replicas"] == 2


def test_every_valid_inferenceservice_serves_scale(custom: CustomObjectsApi) -> None:
    # What an HPA or KEDA does first: GET /scale, on an object applied from git without `desired`.
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, eis("plain"))
    custom.create_namespaced_custom_object(
        GROUP,
        VERSION,
        "default",
        PLURAL,
        eis("external", autoscaling={"mode": "External"}, replicas={"min": 2, "max": 4}),
    )
    for name in ("plain", "external"):
        scale = custom.get_namespaced_custom_object_scale(GROUP, VERSION, "default", PLURAL, name)
        assert scale["spec"]["replicas"] == 1  # the default, clamped by the operator to min..max
    scaled = custom.patch_namespaced_custom_object_scale(
        GROUP, VERSION, "default", PLURAL, "external", {"spec": {"replicas": 3}}
    )
    assert scaled["spec"]["replicas"] == 3


@pytest.mark.parametrize("name", ["9lives", "a" * 53, "chat.v2"])
def test_names_the_children_cannot_take_are_refused_by_the_crd(custom: CustomObjectsApi, name: str) -> None:
    with pytest.raises(ApiException) as error:
        custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, eis(name))
    assert error.value.status == 422
    body = json.loads(error.value.body)
    assert body["details"]["causes"][0]["field"] == "metadata.name"
    assert "metadata.name must be a DNS-1035 label" in body["message"]
    custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, eis("a" * 52))


def test_schema_validation_pruning_and_defaults(custom: CustomObjectsApi) -> None:
    def create_error(body: dict[str, Any]) -> dict[str, Any]:
        with pytest.raises(ApiException) as error:
            custom.create_namespaced_custom_object(GROUP, VERSION, "default", PLURAL, body)
        assert error.value.status == 422
        return json.loads(error.value.body)

    refused = create_error(eis("bad", replicas={"min": 3, "max": 1}))
    assert refused["reason"] == "Invalid"
    assert refused["message"] == (
        'InferenceService.ember.dev "bad" is invalid: spec.replicas: Invalid value: "object": '
        "replicas.min must be less than or equal to replicas.max"
    )
    assert refused["details"]["causes"] == [
        {
            "reason": "FieldValueInvalid",
            "message": 'Invalid value: "object": replicas.min must be less than or equal to replicas.max',
            "field": "spec.replicas",
        }
    ]
    no_model = eis("bad")
    del no_model["spec"]["model"]
    assert "spec.model: Required value" in create_error(no_model)["message"]
    assert (
        "spec.engine.blockSize: Unsupported value: 7"
        in create_error(eis("bad", engine={"blockSize": 7}))["message"]
    )

    created = custom.create_namespaced_custom_object(
        GROUP, VERSION, "default", PLURAL, eis("chat", bogus=1, engine={"maxNumSeqs": 8, "extra": True})
    )
    spec = created["spec"]
    assert "bogus" not in spec and "extra" not in spec["engine"]
    assert spec["engine"]["maxNumSeqs"] == 8 and spec["engine"]["blockSize"] == 16
    assert spec["engine"]["prefixCaching"] is True
    assert spec["replicas"]["min"] == 1
    assert spec["model"]["dtype"] == "auto"
    # Defaults inside a defaulted object: loadShedding is defaulted to {}, then its own fields are.
    assert [c["name"] for c in spec["loadShedding"]["priorityClasses"]] == ["critical", "standard", "batch"]


def test_crd_registration_and_removal(client: ApiClient, server: APIServer) -> None:
    extensions = kubernetes.client.ApiextensionsV1Api(client)
    created = extensions.create_custom_resource_definition(CRD)
    assert {c.type: c.status for c in created.status.conditions} == {
        "NamesAccepted": "True",
        "Established": "True",
    }
    groups = kubernetes.client.ApisApi(client).get_api_versions().groups
    assert "ember.dev" in [group.name for group in groups]
    resources = kubernetes.client.CustomObjectsApi(client).get_api_resources(GROUP, VERSION).resources
    assert {r.name for r in resources} == {
        "inferenceservices",
        "inferenceservices/status",
        "inferenceservices/scale",
    }

    server.create({**eis("chat"), "metadata": {"name": "chat", "namespace": "default"}})
    extensions.delete_custom_resource_definition("inferenceservices.ember.dev")
    status, _ = http(server, "GET", f"/apis/{GROUP}/{VERSION}")
    assert status == 404
    with pytest.raises(APIError):
        server.get(EIS, "InferenceService", "default", "chat")


def test_client_mistakes_get_status_bodies(server: APIServer) -> None:
    server.install_crd(CRD)
    server.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"}})
    eis_path = f"/apis/{GROUP}/{VERSION}/namespaces/default/{PLURAL}"
    server.create(eis("chat"))
    cases = [
        (
            "POST",
            "/api/v1/namespaces/default/configmaps",
            b"{not json",
            "application/json",
            400,
            "BadRequest",
        ),
        ("GET", "/api/v1/namespaces/default/widgets", None, "application/json", 404, "NotFound"),
        ("GET", "/apis/example.com/v1/things", None, "application/json", 404, "NotFound"),
        ("PUT", "/api/v1/namespaces/default/configmaps", {}, "application/json", 405, "MethodNotAllowed"),
        (
            "POST",
            "/api/v1/namespaces/nope/configmaps",
            {"metadata": {"name": "x"}},
            "application/json",
            404,
            "NotFound",
        ),
        (
            "POST",
            "/api/v1/namespaces/default/configmaps",
            {"metadata": {"name": "cfg"}},
            "application/json",
            409,
            "AlreadyExists",
        ),
        (
            "POST",
            "/api/v1/namespaces/default/configmaps",
            {"metadata": {"name": "Bad_Name"}},
            "application/json",
            422,
            "Invalid",
        ),
        (
            "PATCH",
            f"{eis_path}/chat",
            {"spec": {}},
            "application/strategic-merge-patch+json",
            415,
            "UnsupportedMediaType",
        ),
        (
            "PATCH",
            f"{eis_path}/chat",
            [{"op": "test", "path": "/metadata/resourceVersion", "value": "1"}],
            "application/json-patch+json",
            422,
            "Invalid",
        ),
        (
            "PATCH",
            "/api/v1/namespaces/default/configmaps/new",
            b"data: {}",
            "application/apply-patch+yaml",
            422,  # ValidatePatchOptions: an apply needs a fieldManager
            "Invalid",
        ),
        ("PATCH", "/api/v1/namespaces/default/configmaps/cfg", {}, "text/plain", 415, "UnsupportedMediaType"),
        (
            "GET",
            "/api/v1/namespaces/default/configmaps?labelSelector=a%20in%20(",
            None,
            "application/json",
            400,
            "BadRequest",
        ),
        (
            "GET",
            "/api/v1/namespaces/default/configmaps/cfg/status",
            None,
            "application/json",
            404,
            "NotFound",
        ),
    ]
    for method, path, body, content_type, code, reason in cases:
        status, answer = http(server, method, path, body, content_type)
        assert (status, answer.get("kind"), answer.get("reason"), answer.get("code")) == (
            code,
            "Status",
            reason,
            code,
        ), (method, path)


# -- kopf ----------------------------------------------------------------------------------------------

OPERATOR = """
import kopf
import kubernetes

GROUP, VERSION, PLURAL = "ember.dev", "v1alpha1", "inferenceservices"

kopf.on.login()(kopf.login_via_client)


@kopf.on.create(GROUP, VERSION, PLURAL)
def create_fn(body, name, namespace, patch, **_):
    child = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": f"{name}-policy"}, "data": {"m": "1"}}
    kopf.adopt(child)
    kubernetes.client.CoreV1Api().create_namespaced_config_map(namespace, child)
    patch.status["observedGeneration"] = body["metadata"]["generation"]
    patch.status["conditions"] = [{"type": "Ready", "status": "True", "reason": "Created"}]


@kopf.on.update(GROUP, VERSION, PLURAL)
def update_fn(body, patch, **_):
    patch.status["observedGeneration"] = body["metadata"]["generation"]


@kopf.timer(GROUP, VERSION, PLURAL, interval=0.2)
def tick(spec, patch, **_):
    patch.status["desiredReplicas"] = spec["replicas"]["max"]


@kopf.on.delete(GROUP, VERSION, PLURAL)
def delete_fn(name, logger, **_):
    logger.info(f"cleaning up {name}")
"""


@pytest.mark.parametrize("initial_streaming", [False, True], ids=["list-then-watch", "initial-streaming"])
def test_kopf_operator_lifecycle(
    server: APIServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
    initial_streaming: bool,
) -> None:
    server.install_crd(CRD)
    kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
    operator = tmp_path / "operator.py"
    operator.write_text(OPERATOR)
    # kopf logs in through the official client's default kubeconfig loader, as `ember operator` will.
    # The client read $KUBECONFIG into KUBE_CONFIG_DEFAULT_LOCATION when it was imported, so both are
    # set; the login also replaces the client's default Configuration, which is restored afterwards.
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
    monkeypatch.setattr(kubernetes.client.Configuration, "_default", kubernetes.client.Configuration._default)
    settings = kopf.OperatorSettings()
    settings.background.cancellation_polling = 0.2
    settings.watching.server_timeout = 10
    settings.persistence.consistency_timeout = 2
    settings.watching.initial_streaming = initial_streaming  # watch with sendInitialEvents, no list

    def get(name: str) -> dict[str, Any]:
        return server.get(EIS, "InferenceService", "default", name) or {}

    def status(name: str) -> dict[str, Any]:
        return get(name).get("status") or {}

    args = ["run", "--standalone", "--verbose", "--namespace", "default", str(operator)]
    # A registry of the test's own: `kopf run` makes it the process-wide default and loads the script's
    # handlers into it; left in kopf's shared one, they would run in every later test's operator.
    previous = kopf.get_default_registry()
    request.addfinalizer(lambda: kopf.set_default_registry(previous))
    with KopfRunner(args, registry=kopf.OperatorRegistry(), settings=settings, timeout=60) as runner:
        uid = server.create(eis("a"))["metadata"]["uid"]
        wait_for(lambda: status("a").get("observedGeneration") == 1, what="the create handler's status")
        assert "kopf.zalando.org/KopfFinalizerMarker" in get("a")["metadata"]["finalizers"]
        assert status("a")["conditions"][0]["type"] == "Ready"
        child = server.get("v1", "ConfigMap", "default", "a-policy")
        assert child is not None and child["metadata"]["ownerReferences"][0]["uid"] == uid
        wait_for(lambda: status("a").get("desiredReplicas") == 1, what="the timer's status")

        server.patch(EIS, "InferenceService", "default", "a", {"spec": {"replicas": {"max": 3}}})
        assert get("a")["metadata"]["generation"] == 2
        wait_for(lambda: status("a").get("observedGeneration") == 2, what="the update handler's status")
        wait_for(lambda: status("a").get("desiredReplicas") == 3, what="the timer to see the new spec")

        # A 410 in every stream: kopf must re-list, re-watch and keep handling new objects.
        server.expire_watches()
        server.create(eis("b"))
        wait_for(
            lambda: server.get("v1", "ConfigMap", "default", "b-policy"),
            what="kopf to handle an object after a 410",
        )

        server.delete(EIS, "InferenceService", "default", "a")
        wait_for(lambda: not get("a"), what="kopf to remove its finalizer")
        wait_for(
            lambda: server.get("v1", "ConfigMap", "default", "a-policy") is None,
            what="the child's garbage collection",
        )
    assert runner.exception is None and runner.exit_code == 0
    assert "Restarting the watch-stream" in runner.output
    assert "cleaning up a" in runner.output


# -- kubectl -------------------------------------------------------------------------------------------


def test_kubectl(server: APIServer, tmp_path: Path) -> None:
    def run(*args: str) -> str:
        return kubectl(server, tmp_path, *args).stdout

    assert "created" in run("apply", "-f", str(REPO / "crds" / "inferenceservice.yaml"))
    manifest = tmp_path / "chat.yaml"
    manifest.write_text(yaml.safe_dump(eis("chat", replicas={"min": 1, "max": 2})))
    assert "inferenceservice.ember.dev/chat created" in run("apply", "-f", str(manifest))
    status = {"replicas": 2, "warmReplicas": 1, "conditions": [{"type": "Ready", "status": "True"}]}
    server.patch(EIS, "InferenceService", "default", "chat", {"status": status}, subresource="status")

    header, row = run("get", "inferenceservices").splitlines()
    (version,) = CRD["spec"]["versions"]
    columns = [c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")]
    assert header.split() == ["NAME", *columns]
    cells = dict(zip(header.split(), row.split(), strict=False))
    assert (cells["NAME"], cells["READY"], cells["ACTIVE"], cells["WARM"]) == ("chat", "True", "2", "1")
    assert json.loads(run("get", "eis", "chat", "-o", "json"))["spec"]["engine"]["blockSize"] == 16
    assert re.search(r"^Name:\s+chat$", run("describe", "inferenceservice", "chat"), re.MULTILINE)

    manifest.write_text(yaml.safe_dump(eis("chat", replicas={"min": 1, "max": 4})))
    assert "configured" in run("apply", "-f", str(manifest))
    assert json.loads(run("get", "eis", "chat", "-o", "json"))["metadata"]["generation"] == 2
    assert "deleted" in run("delete", "inferenceservice", "chat")
    assert run("get", "eis") == ""

    server.create(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "p"},
            "spec": {"containers": [{"name": "c", "image": "x"}]},
        }
    )
    header, row = run("get", "pods").splitlines()
    assert header.split() == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert row.split()[:4] == ["p", "0/1", "Pending", "0"]


# -- the command line ----------------------------------------------------------------------------------


def test_the_kubeconfig_is_never_seen_half_written(server: APIServer, tmp_path: Path) -> None:
    """A client waiting for the kubeconfig reads it as soon as the file exists: it is written whole under
    another name and renamed into place. Written in place, a reader found it empty (`yaml.safe_load` gave
    None) in a full test run."""
    path = tmp_path / "kubeconfig"
    seen: list[object] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if path.exists():
                seen.append(yaml.safe_load(path.read_text()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for _ in range(300):
            server.write_kubeconfig(path)
    finally:
        stop.set()
        reader.join()
    assert seen and all(isinstance(config, dict) and config["clusters"] for config in seen)
    assert [p.name for p in tmp_path.iterdir()] == ["kubeconfig"]


def test_cli_serves_until_terminated(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ember_localcluster.apiserver",
            "--port",
            "0",
            "--kubeconfig",
            str(kubeconfig),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for(kubeconfig.exists, what="the kubeconfig to be written", timeout=30)
        url = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
        with urllib.request.urlopen(f"{url}/version", timeout=10) as response:
            assert json.loads(response.read())["major"] == "1"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
