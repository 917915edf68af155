"""The operator's writes and reads through the official `kubernetes` client, as plain dicts.

The client is synchronous; the handlers call these through `asyncio.to_thread`. Objects come back as the
API server sent them (`_preload_content=False`), so the rest of the operator works with the same dicts that
`kubectl get -o json` shows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import kubernetes
from kubernetes.client import (
    ApiClient,
    AppsV1Api,
    CoreV1Api,
    CustomObjectsApi,
    PolicyV1Api,
    RbacAuthorizationV1Api,
)
from kubernetes.client.exceptions import ApiException

from ember_operator import quantity
from ember_operator.groups import LWS_GROUP, LWS_PLURAL, LWS_VERSION
from ember_operator.spec import GROUP, PLURAL, VERSION

Obj = dict[str, Any]


def new_api_client() -> ApiClient:
    """In a pod: the service account; elsewhere: $KUBECONFIG or ~/.kube/config (read now, not at import)."""
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config = kubernetes.client.Configuration()
        kubernetes.config.load_incluster_config(client_configuration=config)
        return ApiClient(config)
    path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or str(Path.home() / ".kube" / "config")
    return kubernetes.config.new_client_from_config(config_file=path)


def _json(response: Any) -> Obj:
    return json.loads(response.data)


def load_balancer_address(service: Obj) -> str | None:
    """`host:port` from a Service's status.loadBalancer, when something outside the cluster published one."""
    service_ports = [p["port"] for p in (service.get("spec") or {}).get("ports") or []]
    for ingress in ((service.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []:
        host = ingress.get("ip") or ingress.get("hostname")
        ports = [p["port"] for p in ingress.get("ports") or [] if "port" in p] or service_ports
        if host and ports:
            return f"{host}:{ports[0]}"
    return None


def is_not_found(e: ApiException) -> bool:
    return e.status == 404


# Maps of resource quantities (a container's or a pod's requests and limits, a pod's overhead) and
# quantity fields: kube-apiserver returns these in resource.Quantity's canonical form (`0.5` as `500m`,
# `1024Mi` as `1Gi`), so they are compared by value.
_QUANTITY_MAPS = ("requests", "limits", "overhead")
_QUANTITY_FIELDS = ("sizeLimit",)
# Label selectors: a key someone added selects other pods (or none), so these are compared whole.
_EXACT_MAPS = ("selector", "matchLabels")


def _same_quantity(desired: Any, actual: Any) -> bool:
    try:
        return quantity.parse(desired) == quantity.parse(actual)
    except ValueError:
        return bool(desired == actual)


def covers(desired: Any, actual: Any, *, quantities: bool = False) -> bool:
    """True when every field set in `desired` has the same value in `actual` (server-added fields are fine);
    resource quantities count as the same when their values are."""
    if isinstance(desired, dict):
        return isinstance(actual, dict) and all(
            _same_quantity(v, actual.get(k))
            if (quantities or k in _QUANTITY_FIELDS) and not isinstance(v, dict | list)
            else covers(v, actual.get(k), quantities=k in _QUANTITY_MAPS and not quantities)
            and not (k in _EXACT_MAPS and _string_map(v) and v != actual.get(k))
            for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(covers(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return bool(desired == actual)


def _string_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


# Pod template fields the operator sets only when the spec asks for them: one the spec no longer asks for is
# still in the object, which `covers` alone does not see.
_OPTIONAL_POD_FIELDS = ("nodeSelector", "tolerations", "imagePullSecrets")


def _left_over(desired: Obj, actual: Obj) -> bool:
    """Whether a Deployment's pod template holds an optional field the desired template leaves out."""
    if desired["kind"] != "Deployment":
        return False
    want = desired["spec"]["template"]["spec"]
    have = ((actual.get("spec") or {}).get("template") or {}).get("spec") or {}
    return any(have.get(k) and k not in want for k in _OPTIONAL_POD_FIELDS)


class NameConflict(Exception):
    """An object the operator would create exists already and belongs to someone else."""

    def __init__(self, kind: str, name: str, owners: list[str]) -> None:
        self.kind, self.name = kind, name
        whose = f"owned by {', '.join(owners)}" if owners else "not created by this InferenceService"
        super().__init__(f"{kind} {name} already exists, {whose}; rename one of them")


class Kube:
    def __init__(self, api: ApiClient) -> None:
        # Typed as Any: the operator passes and receives plain dicts, which the client's stubs do not describe.
        self.core: Any = CoreV1Api(api)
        self.custom: Any = CustomObjectsApi(api)
        self.policy: Any = PolicyV1Api(api)
        self.apps: Any = AppsV1Api(api)
        self.rbac: Any = RbacAuthorizationV1Api(api)

    def create_pod(self, pod: Obj) -> Obj:
        return _json(
            self.core.create_namespaced_pod(pod["metadata"]["namespace"], pod, _preload_content=False)
        )

    def list_pods(self, namespace: str, selector: str) -> list[Obj]:
        listed = _json(
            self.core.list_namespaced_pod(namespace, label_selector=selector, _preload_content=False)
        )
        return list(listed.get("items") or [])

    def relabel_pod(self, namespace: str, name: str, labels: dict[str, str]) -> Obj:
        return _json(
            self.core.patch_namespaced_pod(
                name, namespace, {"metadata": {"labels": labels}}, _preload_content=False
            )
        )

    def delete_pod(self, namespace: str, name: str) -> None:
        try:
            self.core.delete_namespaced_pod(name, namespace, _preload_content=False)
        except ApiException as e:
            if not is_not_found(e):  # already gone is what was asked for
                raise

    def delete_owned(self, kind: str, namespace: str, name: str, owner_uid: str) -> None:
        """Delete the Deployment, RoleBinding or ServiceAccount `name` if `owner_uid` owns it."""
        read, delete = {
            "Deployment": (self.apps.read_namespaced_deployment, self.apps.delete_namespaced_deployment),
            "RoleBinding": (self.rbac.read_namespaced_role_binding, self.rbac.delete_namespaced_role_binding),
            "ServiceAccount": (
                self.core.read_namespaced_service_account,
                self.core.delete_namespaced_service_account,
            ),
        }[kind]
        try:
            actual = _json(read(name, namespace, _preload_content=False))
            if any(r.get("uid") == owner_uid for r in actual["metadata"].get("ownerReferences") or []):
                delete(name, namespace, _preload_content=False)
        except ApiException as e:
            if not is_not_found(e):  # already gone is what was asked for
                raise

    def list_groups(self, namespace: str, selector: str) -> list[Obj] | None:
        """LeaderWorkerSets of a selector; None when the cluster does not serve that API (no CRD)."""
        try:
            listed = _json(
                self.custom.list_namespaced_custom_object(
                    LWS_GROUP,
                    LWS_VERSION,
                    namespace,
                    LWS_PLURAL,
                    label_selector=selector,
                    _preload_content=False,
                )
            )
        except ApiException as e:
            if is_not_found(e):
                return None
            raise
        return list(listed.get("items") or [])

    def create_group(self, group: Obj) -> Obj:
        namespace = group["metadata"]["namespace"]
        return _json(
            self.custom.create_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, group, _preload_content=False
            )
        )

    def relabel_group(self, namespace: str, name: str, labels: dict[str, str]) -> None:
        self._patch_group(namespace, name, {"metadata": {"labels": labels}})

    def scale_group(
        self, namespace: str, name: str, replicas: int, annotations: dict[str, str | None] | None = None
    ) -> None:
        """Its replicas, and with `annotations` those annotations (None removes one), in one patch."""
        body: Obj = {"spec": {"replicas": replicas}}
        if annotations:
            body["metadata"] = {"annotations": annotations}
        self._patch_group(namespace, name, body)

    def _patch_group(self, namespace: str, name: str, body: Obj) -> None:
        self.custom.patch_namespaced_custom_object(
            LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name, body, _preload_content=False
        )

    def delete_group(self, namespace: str, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                LWS_GROUP, LWS_VERSION, namespace, LWS_PLURAL, name, _preload_content=False
            )
        except ApiException as e:
            if not is_not_found(e):
                raise

    def get_inference_service(self, namespace: str, name: str) -> Obj | None:
        try:
            return _json(
                self.custom.get_namespaced_custom_object(
                    GROUP, VERSION, namespace, PLURAL, name, _preload_content=False
                )
            )
        except ApiException as e:
            if is_not_found(e):
                return None
            raise

    def patch_status(self, namespace: str, name: str, status: Obj) -> None:
        self.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, {"status": status}, _preload_content=False
        )

    def ensure(self, desired: Obj, fields: tuple[str, ...]) -> Obj:
        """Create `desired` (a Service, ConfigMap, PodDisruptionBudget, ServiceAccount, RoleBinding or
        Deployment), or put back the `fields` of it that someone changed;
        returns the object as the API server holds it now. An object of that name that this owner does not
        own raises `NameConflict`: it is never adopted.

        The managed fields are put back key by key (a selector key or a port someone added goes); every other
        field, and every key of `spec` the operator does not set (the Service's type, load-balancer
        settings), stays as the user or the cluster left it.
        """
        kind, meta = desired["kind"], desired["metadata"]
        apis: dict[str, tuple[Any, Any, Any]] = {
            "Service": (
                self.core.read_namespaced_service,
                self.core.create_namespaced_service,
                self.core.replace_namespaced_service,
            ),
            "ConfigMap": (
                self.core.read_namespaced_config_map,
                self.core.create_namespaced_config_map,
                self.core.replace_namespaced_config_map,
            ),
            "PodDisruptionBudget": (
                self.policy.read_namespaced_pod_disruption_budget,
                self.policy.create_namespaced_pod_disruption_budget,
                self.policy.replace_namespaced_pod_disruption_budget,
            ),
            "ServiceAccount": (
                self.core.read_namespaced_service_account,
                self.core.create_namespaced_service_account,
                self.core.replace_namespaced_service_account,
            ),
            "RoleBinding": (
                self.rbac.read_namespaced_role_binding,
                self.rbac.create_namespaced_role_binding,
                self.rbac.replace_namespaced_role_binding,
            ),
            "Deployment": (
                self.apps.read_namespaced_deployment,
                self.apps.create_namespaced_deployment,
                self.apps.replace_namespaced_deployment,
            ),
        }
        read, create, replace = apis[kind]
        try:
            actual = _json(read(meta["name"], meta["namespace"], _preload_content=False))
        except ApiException as e:
            if not is_not_found(e):
                raise
            return _json(create(meta["namespace"], desired, _preload_content=False))
        owner_uids = {r.get("uid") for r in meta["ownerReferences"]}
        theirs = actual["metadata"].get("ownerReferences") or []
        if not any(r.get("uid") in owner_uids for r in theirs):
            raise NameConflict(
                kind, meta["name"], [r.get("kind", "") + "/" + r.get("name", "") for r in theirs]
            )
        owned = covers(meta["labels"], actual["metadata"].get("labels") or {})
        if (
            owned
            and all(covers(desired[f], actual.get(f)) for f in fields)
            and not _left_over(desired, actual)
        ):
            return actual
        body = dict(actual)
        body["metadata"] = {
            **actual["metadata"],
            "labels": {**(actual["metadata"].get("labels") or {}), **meta["labels"]},
        }
        for f in fields:
            if isinstance(desired[f], dict) and isinstance(actual.get(f), dict) and f == "spec":
                body[f] = {**actual[f], **desired[f]}  # keep what the server assigned (clusterIP, ...)
            else:
                body[f] = desired[f]
        # The body carries the resourceVersion read above: a concurrent change gives 409 and a retry.
        return _json(replace(meta["name"], meta["namespace"], body, _preload_content=False))
