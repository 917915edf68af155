"""The operator's side of tensor parallelism: every GPU of a pod serves (`resources.gpus` becomes the
engine's tensor-parallel size), /dev/shm is sized for the ranks, and what the spec alone can refuse is
refused by the schema. The engine's own command line is the oracle for the arguments."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ember_engine.cli import build_parser
from ember_operator.desired import ROLE_LABEL, WARM, Owner, desired_pod
from ember_operator.spec import InferenceServiceSpec

OWNER = Owner("big", "prod", "uid-1")


def make_spec(**changes: Any) -> InferenceServiceSpec:
    doc: dict[str, Any] = {"model": {"name": "big", "source": "/models/big"}}
    doc.update(changes)
    return InferenceServiceSpec.model_validate(doc)


def parsed_args(pod: dict[str, Any]) -> Any:
    (container,) = pod["spec"]["containers"]
    return build_parser().parse_args([*container["command"][1:], *container["args"]])


# Specs the schema refuses, with the message that says why.
REFUSED = [
    ({"gpus": 2}, {"tensorParallelSize": 4}, "at most resources.gpus ranks on each node"),
    ({"gpus": 2, "nodes": 2}, {"tensorParallelSize": 3}, "a multiple of resources.nodes"),
    ({"gpus": 0, "nodes": 2}, {}, "resources.nodes > 1 needs resources.gpus >= 1"),
]


def test_every_gpu_of_the_pod_serves_by_default() -> None:
    pod = desired_pod(OWNER, make_spec(resources={"gpus": 4}), WARM, "abcdef0123")
    assert parsed_args(pod).tensor_parallel_size == 4
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"


@pytest.mark.parametrize(("gpus", "expected"), [(0, 1), (1, 1)])
def test_one_gpu_or_none_runs_unsplit(gpus: int, expected: int) -> None:
    pod = desired_pod(OWNER, make_spec(resources={"gpus": gpus}), WARM, "abcdef0123")
    assert parsed_args(pod).tensor_parallel_size == expected


def test_an_explicit_size_overrides_the_gpu_count() -> None:
    spec = make_spec(resources={"gpus": 4}, engine={"tensorParallelSize": 2})
    assert parsed_args(desired_pod(OWNER, spec, WARM, "abcdef0123")).tensor_parallel_size == 2


def test_a_pod_of_several_ranks_gets_a_memory_backed_dev_shm() -> None:
    def shm(spec: InferenceServiceSpec) -> tuple[Any, Any]:
        pod = desired_pod(OWNER, spec, WARM, "abcdef0123")
        mounts = [m for m in pod["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == "/dev/shm"]
        volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
        return mounts, [volumes[m["name"]] for m in mounts]

    mounts, volumes = shm(make_spec(resources={"gpus": 4}))
    assert mounts == [{"name": "dshm", "mountPath": "/dev/shm"}]
    assert volumes == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}}]
    _, volumes = shm(make_spec(resources={"gpus": 4, "sharedMemory": "16Gi"}))
    assert volumes[0]["emptyDir"]["sizeLimit"] == "16Gi"
    # One rank gets the 1Gi every engine pod has.
    for one_rank in (
        make_spec(resources={"gpus": 1}),
        make_spec(resources={"gpus": 4}, engine={"tensorParallelSize": 1}),
    ):
        assert shm(one_rank)[1][0]["emptyDir"]["sizeLimit"] == "1Gi"


@pytest.mark.parametrize(("resources", "engine", "message"), REFUSED)
def test_what_the_spec_alone_can_refuse_is_refused(
    resources: dict[str, Any], engine: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make_spec(resources=resources, engine=engine)


def test_the_new_fields_at_their_defaults_keep_existing_pods_hash() -> None:
    from ember_operator.desired import template_hash

    # What the operator before these fields computed for one-GPU pods: they run as before, and are not
    # rolled by the upgrade; pods of two GPUs that ran one rank are.
    before = template_hash(make_spec())
    assert before == "bed9b8a368"
    assert before == template_hash(make_spec(resources={"nodes": 1}, engine={"tensorParallelSize": 1}))
    assert template_hash(make_spec(resources={"gpus": 2})) != "73abfec405"
    assert before != template_hash(make_spec(resources={"gpus": 1, "nodes": 2}))
    assert before != template_hash(make_spec(resources={"sharedMemory": "8Gi"}))


@pytest.mark.parametrize(("resources", "engine", "message"), REFUSED)
def test_the_api_server_refuses_the_same_by_the_crds_rules(
    tmp_path: Path, resources: dict[str, Any], engine: dict[str, Any], message: str
) -> None:
    import json

    import kubernetes
    from kubernetes.client import ApiException, CustomObjectsApi

    from ember_localcluster.apiserver import APIServer
    from ember_operator.crd import crd_manifest
    from ember_operator.spec import GROUP, PLURAL, VERSION

    def body(name: str, **spec: Any) -> dict[str, Any]:
        doc = {"model": {"name": "big", "source": "/models/big"}, **spec}
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "InferenceService",
            "metadata": {"name": name},
            "spec": doc,
        }

    with APIServer() as server:
        server.install_crd(crd_manifest())
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(
            config_file=str(server.write_kubeconfig(tmp_path / "kubeconfig")),
            client_configuration=configuration,
        )
        with kubernetes.client.ApiClient(configuration) as client:
            custom = CustomObjectsApi(client)
            with pytest.raises(ApiException) as refused:
                custom.create_namespaced_custom_object(
                    GROUP, VERSION, "default", PLURAL, body("bad", resources=resources, engine=engine)
                )
            assert refused.value.status == 422
            assert message in json.loads(refused.value.body)["message"]
            # Each node's GPUs, all of them serving: accepted.
            custom.create_namespaced_custom_object(
                GROUP, VERSION, "default", PLURAL, body("good", resources={"gpus": 2, "nodes": 2})
            )


# -- multi-node groups ----------------------------------------------------------------------------------


def _group_pods(group: dict[str, Any], ready: bool = True, index: int = 0) -> list[dict[str, Any]]:
    """The pods the local LeaderWorkerSet controller makes of it (group `index`), as their kubelet would
    report them."""
    from ember_localcluster.leaderworkerset import group_pod

    group = {**group, "metadata": {**group["metadata"], "name": "big-x7k2p", "uid": "lws-uid"}}
    leader = group_pod(group, index, 0)
    leader["metadata"]["uid"] = f"leader-uid-{index}"
    pods = [leader] + [
        group_pod(group, index, k, leader) for k in range(1, group["spec"]["leaderWorkerTemplate"]["size"])
    ]
    for p in pods:
        p["metadata"]["creationTimestamp"] = "2026-11-01T12:00:00Z"
        p["status"] = {
            "phase": "Running",
            "conditions": [
                {"type": "Ready", "status": str(ready), "lastTransitionTime": "2026-11-01T12:00:00Z"}
            ],
            "containerStatuses": [
                {"name": "engine", "ready": ready, "restartCount": 0, "state": {"running": {}}}
            ],
        }
    return pods


def _command_line(pod: dict[str, Any]) -> Any:
    """The engine's parse of a pod's command line, after Kubernetes' $(VAR) expansion from its env."""
    from ember_localcluster.kubelet.podenv import expand

    (container,) = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container.get("env") or []}
    words = [expand(w, env) for w in [*container["command"][1:], *container["args"]]]
    return build_parser().parse_args(words)


def test_a_multi_node_replica_is_one_leaderworkerset_whose_pods_form_one_tensor_parallel_group() -> None:
    from ember_operator.groups import desired_group

    spec = make_spec(resources={"gpus": 4, "nodes": 2})
    group = desired_group(OWNER, spec, WARM, "abcdef0123")
    assert group["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and group["kind"] == "LeaderWorkerSet"
    assert group["metadata"]["generateName"] == "big-"
    assert group["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    template = group["spec"]["leaderWorkerTemplate"]
    assert group["spec"]["replicas"] == 1 and template["size"] == 2
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = _group_pods(group)
    lead, work = _command_line(leader), _command_line(worker)
    assert (lead.tensor_parallel_size, lead.nnodes, lead.node_rank) == (8, 2, 0)
    assert (work.tensor_parallel_size, work.nnodes, work.node_rank) == (8, 2, 1)
    assert lead.master_addr == "0.0.0.0"  # the leader listens on its pod address
    assert work.master_addr == "big-x7k2p-0.big-x7k2p.prod"  # its DNS name under the set's headless Service
    assert lead.master_port == work.master_port
    # Only the leader serves HTTP, is probed, and is selected by the Service (instance + role=active).
    assert "readinessProbe" in leader["spec"]["containers"][0]
    # A worker serves no HTTP, so no probe of any kind may ask it: a startup probe that never passes would
    # keep the worker, and so the group, from ever being Ready.
    assert "startupProbe" in leader["spec"]["containers"][0]
    assert not {"ports", "readinessProbe", "livenessProbe", "startupProbe", "lifecycle"} & set(
        worker["spec"]["containers"][0]
    )
    assert leader["metadata"]["labels"][ROLE_LABEL] == WARM and ROLE_LABEL not in worker["metadata"]["labels"]
    # Each pod gets its node's GPUs and /dev/shm for its four ranks.
    for pod in (leader, worker):
        assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "4"
        assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "4Gi"}} in pod["spec"][
            "volumes"
        ]


def test_the_longest_name_leaves_group_pod_names_valid_hostnames() -> None:
    from ember_operator.groups import desired_group

    owner = Owner("n" * 52, "prod", "uid-1")
    group = desired_group(owner, make_spec(resources={"gpus": 1, "nodes": 64}), WARM, "abcdef0123")
    generated = group["metadata"]["generateName"] + "x" * 5  # the API server appends five characters
    assert len(f"{generated}-0-63") <= 63


def test_a_group_reads_as_one_unit_ready_only_when_all_its_pods_are() -> None:
    from ember_operator.groups import desired_group, group_view

    group = desired_group(OWNER, make_spec(resources={"gpus": 1, "nodes": 3}), WARM, "abcdef0123")
    group["metadata"].update(name="big-x7k2p", uid="lws-uid", creationTimestamp="2026-11-01T12:00:00Z")
    group["metadata"]["labels"][ROLE_LABEL] = "active"
    pods = _group_pods(group)
    v = group_view(group, pods)
    assert (v.name, v.role, v.ready, v.container_down) == ("big-x7k2p", "active", True, False)
    v = group_view(group, pods[:2])  # a worker missing (being recreated)
    assert not v.ready and v.container_down
    v = group_view(group, _group_pods(group, ready=False))
    assert not v.ready and not v.container_down  # still loading


def test_a_second_group_of_a_scaled_set_leaves_the_first_one_ready() -> None:
    # Someone scaled the set to 2 (`kubectl scale lws`): group 1's pods, still starting, carry the set's
    # name too. The operator's group is group 0, whole and Ready.
    from ember_operator.groups import desired_group, group_view, members

    group = desired_group(OWNER, make_spec(resources={"gpus": 1, "nodes": 3}), WARM, "abcdef0123")
    group["metadata"].update(name="big-x7k2p", uid="lws-uid", creationTimestamp="2026-11-01T12:00:00Z")
    first, second = _group_pods(group), _group_pods(group, ready=False, index=1)
    leader, workers = members(group, second + first)
    assert leader is not None and leader["metadata"]["name"] == "big-x7k2p-0"
    assert sorted(w["metadata"]["name"] for w in workers) == ["big-x7k2p-0-1", "big-x7k2p-0-2"]
    v = group_view(group, second + first)
    assert v.ready and not v.container_down
