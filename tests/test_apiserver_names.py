"""Object names as kube-apiserver validates them (ValidateObjectMeta with each kind's name function:
NameIsDNSSubdomain, NameIsDNSLabel for Namespaces, NameIsDNS1035Label for Services, path segment names for
RBAC), labels (ValidateLabels), with its exact 422 messages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ember_localcluster.apiserver import APIError, APIServer
from ember_operator.labels import LABEL_VALUE_MESSAGE, SUBDOMAIN_MESSAGE

DNS_LABEL = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and "
    "end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS_1035 = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic "
    "character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for "
    "validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)


@pytest.fixture(scope="module")
def server() -> Iterator[APIServer]:
    with APIServer() as api:
        yield api


def _refused(server: APIServer, obj: dict[str, Any]) -> APIError:
    with pytest.raises(APIError) as caught:
        server.create(obj)
    assert caught.value.code == 422 and caught.value.reason == "Invalid", caught.value
    return caught.value


def test_subdomain_name_message(server: APIServer) -> None:
    error = _refused(server, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "Bad_Name"}})
    assert (
        error.message
        == f'ConfigMap "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": {SUBDOMAIN_MESSAGE}'
    )


def test_too_long_subdomain_name_gives_both_messages(server: APIServer) -> None:
    name = "a" * 254
    error = _refused(server, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}})
    assert error.message == (
        f'ConfigMap "{name}" is invalid: metadata.name: Invalid value: "{name}": '
        "must be no more than 253 characters"
    )
    name = "A" * 254
    error = _refused(server, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}})
    assert error.message == (
        f'ConfigMap "{name}" is invalid: [metadata.name: Invalid value: "{name}": must be no more than 253 '
        f'characters, metadata.name: Invalid value: "{name}": {SUBDOMAIN_MESSAGE}]'
    )


def test_namespace_name_is_an_rfc_1123_label(server: APIServer) -> None:
    error = _refused(server, {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "a.b"}})
    assert error.message == f'Namespace "a.b" is invalid: metadata.name: Invalid value: "a.b": {DNS_LABEL}'


def test_service_name_is_a_dns_1035_label(server: APIServer) -> None:
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "1svc"},
        "spec": {"ports": [{"port": 80}]},
    }
    error = _refused(server, service)
    assert error.message == f'Service "1svc" is invalid: metadata.name: Invalid value: "1svc": {DNS_1035}'


def test_rbac_names_are_path_segments(server: APIServer) -> None:
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "system:x"}}
    assert server.create(role)["metadata"]["name"] == "system:x"
    error = _refused(server, {**role, "metadata": {"name": "a/b"}})
    assert (
        error.message
        == """Role.rbac.authorization.k8s.io "a/b" is invalid: metadata.name: Invalid value: "a/b": may not contain '/'"""
    )


def test_label_value_with_a_space_is_invalid(server: APIServer) -> None:
    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "l", "labels": {"a": "has space"}}}
    error = _refused(server, cm)
    assert error.message == (
        f'ConfigMap "l" is invalid: metadata.labels: Invalid value: "has space": {LABEL_VALUE_MESSAGE}'
    )


def test_a_v1_crd_needs_a_schema(server: APIServer) -> None:
    crd = {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "noschemas.t.io"},
        "spec": {
            "group": "t.io",
            "scope": "Namespaced",
            "names": {"plural": "noschemas", "kind": "Noschema"},
            "versions": [{"name": "v1", "served": True, "storage": True}],
        },
    }
    error = _refused(server, crd)
    assert error.message == (
        'CustomResourceDefinition.apiextensions.k8s.io "noschemas.t.io" is invalid: '
        "spec.versions[0].schema.openAPIV3Schema: Required value: schemas are required"
    )
