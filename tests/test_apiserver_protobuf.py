"""Request bodies in Kubernetes' protobuf encoding, as kubectl's typed `create <kind>` commands send them:
each object made through kubectl against the real server reads back as `--dry-run=client -o json` showed
it, and the wire decoder on hand-built bytes (varints, nested messages, a field number no table knows)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubectl_run
import pytest

from ember_localcluster.apiserver import APIError, APIServer
from ember_localcluster.apiserver.protobuf import MAGIC, decode_body

Run = Callable[..., str]


@pytest.fixture
def server() -> Iterator[APIServer]:
    with APIServer(pod_graceful_deletion=False) as running:
        yield running


@pytest.fixture
def kubectl(server: APIServer, tmp_path: Path) -> Run:
    def run(*args: str) -> str:
        return kubectl_run.kubectl(server, tmp_path, *args).stdout

    return run


def _contains(got: Any, want: Any, path: str = "") -> None:
    """`want` (what kubectl printed for the dry run) is in `got` (what the server stored and answers)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {got!r} is not an object"
        for key, value in want.items():
            assert key in got, f"{path}.{key} is missing from {got!r}"
            _contains(got[key], value, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{path}: {got!r} != {want!r}"
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            _contains(g, w, f"{path}[{index}]")
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


# (arguments of `kubectl create`, the kind and name to read back)
CREATES = [
    (["namespace", "p1"], "namespace", "p1"),
    (["configmap", "c1", "--from-literal=a=1", "--from-literal=b="], "configmap", "c1"),
    (["secret", "generic", "hub-token", "--from-literal=token=hf_abc"], "secret", "hub-token"),
    (
        [
            "secret",
            "docker-registry",
            "regcred",
            "--docker-server=r.example",
            "--docker-username=u",
            "--docker-password=p",
        ],
        "secret",
        "regcred",
    ),
    (["serviceaccount", "sa1"], "serviceaccount", "sa1"),
    (
        ["priorityclass", "high", "--value=1000", "--description=hi", "--preemption-policy=Never"],
        "priorityclass",
        "high",
    ),
    (["priorityclass", "low", "--value=-5"], "priorityclass", "low"),
    (
        ["role", "r1", "--verb=get,list", "--resource=pods,deployments.apps", "--resource-name=x"],
        "role",
        "r1",
    ),
    (["clusterrole", "cr1", "--verb=get", "--non-resource-url=/logs/*"], "clusterrole", "cr1"),
    (["clusterrole", "agg", "--aggregation-rule=a=b"], "clusterrole", "agg"),
    (
        ["rolebinding", "rb1", "--role=r1", "--user=u", "--group=g", "--serviceaccount=default:sa1"],
        "rolebinding",
        "rb1",
    ),
    (["clusterrolebinding", "crb1", "--clusterrole=cr1", "--user=u"], "clusterrolebinding", "crb1"),
    (["quota", "q1", "--hard=cpu=1,memory=1Gi,pods=2", "--scopes=BestEffort"], "resourcequota", "q1"),
    (["deployment", "d1", "--image=nginx", "--replicas=2", "--port=80"], "deployment", "d1"),
    (["deployment", "d2", "--image=engine:1", "--", "ember", "serve"], "deployment", "d2"),
    (["service", "clusterip", "svc1", "--tcp=80:8080", "--tcp=443:https"], "service", "svc1"),
    (["poddisruptionbudget", "pdb1", "--selector=app=x", "--min-available=50%"], "pdb", "pdb1"),
    (["poddisruptionbudget", "pdb2", "--selector=app=y", "--max-unavailable=1"], "pdb", "pdb2"),
]


def test_kubectl_typed_creates_send_protobuf_the_server_reads(kubectl: Run, tmp_path: Path) -> None:
    for args, kind, name in CREATES:
        want = json.loads(kubectl("create", "--dry-run=client", "-o", "json", *args))
        assert "created" in kubectl("create", *args)
        got = json.loads(kubectl("get", kind, name, "-o", "json"))
        want["metadata"].pop("creationTimestamp")  # null in the dry run; the server sets it
        want.pop("status", None)  # the server's to write
        _contains(got, want)


def test_a_secret_from_a_binary_file_keeps_its_bytes(kubectl: Run, tmp_path: Path) -> None:
    blob = bytes(range(256))
    (tmp_path / "blob").write_bytes(blob)
    kubectl("create", "secret", "generic", "bin", f"--from-file=blob={tmp_path / 'blob'}")
    kubectl("create", "configmap", "bin", f"--from-file=blob={tmp_path / 'blob'}")
    secret = json.loads(kubectl("get", "secret", "bin", "-o", "json"))
    configmap = json.loads(kubectl("get", "configmap", "bin", "-o", "json"))
    assert base64.b64decode(secret["data"]["blob"]) == blob
    assert base64.b64decode(configmap["binaryData"]["blob"]) == blob


# -- the wire format on hand-built bytes --------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative numbers go as their 64-bit two's complement, as Go's encoder does
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _envelope(api_version: str, kind: str, raw: bytes) -> bytes:
    type_meta = _field(1, api_version.encode()) + _field(2, kind.encode())
    return MAGIC + _field(1, type_meta) + _field(2, raw) + _field(3, b"") + _field(4, b"")


def _meta(name: str) -> bytes:
    return _field(1, _field(1, name.encode()) + _field(2, b"") + _field(7, 0) + _field(8, b""))


def test_varints_take_several_bytes_and_negatives_are_twos_complement_not_zigzag() -> None:
    assert _varint(300) == b"\xac\x02"
    for value in (300, -5, 2**31 - 1, -(2**31)):
        body = decode_body(_envelope("scheduling.k8s.io/v1", "PriorityClass", _meta("p") + _field(2, value)))
        assert body["value"] == value
    # 9 read as zigzag would be -5: Kubernetes' messages never use zigzag, so it stays 9.
    assert (
        decode_body(_envelope("scheduling.k8s.io/v1", "PriorityClass", _meta("p") + _field(2, 9)))["value"]
        == 9
    )


def test_nested_messages_maps_bytes_and_omitted_zero_values() -> None:
    entry = _field(1, b"k") + _field(2, b"\x00\xff")
    body = decode_body(
        _envelope(
            "v1", "ConfigMap", _meta("c") + _field(2, _field(1, b"a") + _field(2, b"1")) + _field(3, entry)
        )
    )
    # generateName "" and generation 0 are on the wire (Go writes every non-pointer field) but, as in the
    # JSON Go writes, zero values of omitempty fields are left out; the zero time is null.
    assert body == {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "c", "creationTimestamp": None},
        "data": {"a": "1"},
        "binaryData": {"k": base64.b64encode(b"\x00\xff").decode()},
    }


def test_int_or_string_quantity_and_time() -> None:
    spec = _field(1, _field(1, 1) + _field(3, b"50%")) + _field(3, _field(1, 0) + _field(2, 2))
    pdb = decode_body(_envelope("policy/v1", "PodDisruptionBudget", _meta("b") + _field(2, spec)))
    assert pdb["spec"] == {"minAvailable": "50%", "maxUnavailable": 2}
    hard = _field(1, _field(1, b"cpu") + _field(2, _field(1, b"500m")))
    quota = decode_body(_envelope("v1", "ResourceQuota", _meta("q") + _field(2, hard)))
    assert quota["spec"] == {"hard": {"cpu": "500m"}}
    created = _field(1, _field(1, b"n") + _field(8, _field(1, 1700000000) + _field(2, 5)))
    assert decode_body(_envelope("v1", "Namespace", created))["metadata"] == {
        "name": "n",
        "creationTimestamp": "2023-11-14T22:13:20Z",
    }


def test_a_field_number_no_table_knows_is_refused_naming_it() -> None:
    with pytest.raises(APIError) as refused:
        decode_body(_envelope("v1", "ConfigMap", _meta("c") + _field(9, b"x")))
    assert refused.value.code == 415
    assert "v1.ConfigMap" in refused.value.message and "field 9" in refused.value.message
    spec = _field(2, _field(2, _field(1, b"c") + _field(10, b"")))  # a liveness probe on a container
    with pytest.raises(APIError) as refused:
        decode_body(_envelope("v1", "Pod", _meta("p") + spec))
    assert refused.value.code == 415 and "v1.Container" in refused.value.message
    assert "field 10" in refused.value.message


def test_kinds_without_tables_and_broken_bodies() -> None:
    with pytest.raises(APIError) as refused:
        decode_body(_envelope("apps/v1", "StatefulSet", _meta("s")))
    assert refused.value.code == 415 and "apps/v1 StatefulSet" in refused.value.message
    assert "v1 Namespace" in refused.value.message  # it says which kinds it reads
    bad_key = _field(
        2, _field(1, b"\xff\xfe") + _field(2, b"1")
    )  # a data key that is no UTF-8 (a 500 before)
    for broken in (
        b"{}",
        MAGIC + b"\x0a\x05ab",
        _envelope("v1", "ConfigMap", b"\x0a\x80"),
        _envelope("v1", "ConfigMap", _meta("c") + bad_key),
    ):
        with pytest.raises(APIError) as refused:
            decode_body(broken)
        assert refused.value.code == 400
