"""The router in front of an InferenceService's engines, as desired objects: pure builders, no I/O.

With `spec.router.enabled` (the default) the operator runs `<name>-router`, a Deployment of `ember router
--kube-selector <the service's Ready active engine pods>`, whose pods watch those engines through the
ServiceAccount `<name>-router`, bound by a RoleBinding to the `ember-router` ClusterRole (get, list and
watch pods, nothing else; shipped in manifests/). The InferenceService's Service then selects the router
pods; disabled, it selects the engines directly and the router's objects are deleted. The router pods mount
the engines' policy ConfigMap (`--policy`) and re-read it while they run, so what no engine takes goes to
spec.fallback under the same conditions as from the engines, and a new fallback address (the fallback
publishing its endpoint after its user was applied) reaches the routers without a new pod.

A router pod runs the engine image (which carries `ember router`), reads the same checkpoint for its
tokenizer and chat template (the same model volumes and fetch init containers as an engine), drains for as
long as an engine does (`spec.lifecycle`), and takes `spec.pod`'s identity fields (image pull secrets,
pod and container security contexts) but none of its GPU placement (no GPUs, node selector, tolerations,
affinity or spreading of the engines): a node selector and tolerations of their own come from
`spec.router`, in the Deployment's template (a change rolls the routers, not the engines). The routers
spread over nodes (a soft hostname spread), so that a lost node leaves the others' routers serving.
"""

from __future__ import annotations

from typing import Any

from ember_operator import modelsource
from ember_operator.desired import (
    MANAGED_BY_LABEL,
    NAME_LABEL,
    POLICY_DIR,
    POLICY_FILE,
    ROLE_LABEL,
    ROUTES_FILE,
    Owner,
    active_selector,
    attach_model,
    hostname_spread,
    instance_labels,
    key_env,
    policy_configmap_name,
    selector_string,
)
from ember_operator.podsettings import PRESTOP_SECONDS
from ember_operator.spec import GROUP, InferenceServiceSpec
from ember_operator.status import Condition

ROUTER = "router"
ROUTER_LABEL = f"{GROUP}/router"
ROUTER_PORT = 8080
CLUSTER_ROLE = "ember-router"
COMMAND = ("ember", "router")


def router_name(name: str) -> str:
    return f"{name}-router"


def router_selector(name: str) -> dict[str, str]:
    """The router pods' labels. Not the engines' `app.kubernetes.io/instance`: whatever selects an
    InferenceService's engine pods by instance (the operator's own list, dashboards) never sees a router."""
    return {NAME_LABEL: "ember-router", ROUTER_LABEL: name}


def service_selector(name: str, spec: InferenceServiceSpec) -> dict[str, str]:
    """What the InferenceService's Service selects: the routers, or the active engines without them."""
    return router_selector(name) if spec.router.enabled else active_selector(name)


def _meta(owner: Owner) -> dict[str, Any]:
    return {
        "name": router_name(owner.name),
        "namespace": owner.namespace,
        "labels": {**instance_labels(owner.name), MANAGED_BY_LABEL: "ember-operator", ROLE_LABEL: ROUTER},
        "ownerReferences": [owner.reference()],
    }


def desired_service_account(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(owner)}


def desired_role_binding(owner: Owner) -> dict[str, Any]:
    """Binds the routers' ServiceAccount, in this namespace only, to the `ember-router` ClusterRole."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _meta(owner),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": CLUSTER_ROLE},
        "subjects": [
            {"kind": "ServiceAccount", "name": router_name(owner.name), "namespace": owner.namespace}
        ],
    }


def routes_document(spec: InferenceServiceSpec, urls: dict[str, str]) -> list[dict[str, Any]]:
    """The routers' routes file (`ember router --routes`, in the policy ConfigMap): the rules of
    spec.routing whose target has an address in `urls` (by InferenceService name), in order."""
    out = []
    for rule in spec.routing:
        if rule.service not in urls:
            continue
        doc = rule.model_dump(by_alias=True, exclude_none=True, exclude={"service"})
        if not doc.get("models"):
            doc.pop("models", None)
        doc.update(target=rule.service, url=urls[rule.service])
        out.append(doc)
    return out


def router_args(owner: Owner, spec: InferenceServiceSpec) -> list[str]:
    # What changes with other objects (the fallback's and the routing targets' addresses) is in files the
    # router re-reads, not here: a change to these arguments rolls the routers.
    routes = [f"--routes={POLICY_DIR}/{ROUTES_FILE}"] if spec.routing else []
    # Unset, left out: the router's own default, and the arguments of routers made before it stay as they were.
    idle = spec.router.stream_idle_timeout_seconds
    stream_idle = [f"--stream-idle-timeout={idle}"] if idle is not None else []
    return [
        f"--model={modelsource.model_path(spec)}",
        f"--served-model-name={spec.model.name}",  # /v1/models answers with it at zero engines
        f"--kube-selector={selector_string(active_selector(owner.name))}",
        "--kube-namespace=$(POD_NAMESPACE)",
        "--host=0.0.0.0",
        f"--port={ROUTER_PORT}",
        f"--epsilon={spec.router.epsilon}",
        f"--hold-seconds={spec.router.hold_seconds}",
        f"--drain-timeout={spec.lifecycle.drain_seconds}",
        f"--policy={POLICY_DIR}/{POLICY_FILE}",
        *stream_idle,
        *routes,
        *chat_template_args(spec.engine.extra_args),
    ]


def chat_template_args(engine_args: list[str]) -> list[str]:
    """The engines' `--chat-template` (from `engine.extraArgs`), for the routers too: the prompts they hash
    for prefix-aware routing are then rendered as the engines render them."""
    for i, arg in enumerate(engine_args):
        if arg.startswith("--chat-template="):
            return [arg]
        if arg == "--chat-template" and i + 1 < len(engine_args):
            return [arg, engine_args[i + 1]]
    return []


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def desired_router_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    r, life, placement = spec.resources, spec.lifecycle, spec.pod
    period = life.readiness_period_seconds
    security = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if placement.container_security_context is not None:
        security.update(placement.container_security_context.to_kube())
    container: dict[str, Any] = {
        "name": ROUTER,
        "image": r.image,
        "imagePullPolicy": r.image_pull_policy,
        "command": list(COMMAND),
        "args": router_args(owner, spec),
        "env": [
            {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            *key_env(spec),
        ],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        # A router listens once its tokenizer is loaded: until /health answers, neither liveness nor
        # readiness is probed, for as long as an engine's start may take.
        "startupProbe": _probe("/health", period, -(-life.startup_timeout_seconds // period)),
        "readinessProbe": _probe("/ready", period, life.readiness_failure_threshold),
        "livenessProbe": _probe("/health", life.liveness_period_seconds, life.liveness_failure_threshold),
        # The Service's endpoints drop the pod before the router stops taking requests.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "volumeMounts": [
            {"name": "policy", "mountPath": POLICY_DIR, "readOnly": True},
            *modelsource.engine_mounts(spec),
        ],
        "securityContext": security,
    }
    amounts = {k: v for k, v in (("cpu", spec.router.cpu), ("memory", spec.router.memory)) if v}
    if amounts:
        limits = {"memory": amounts["memory"]} if "memory" in amounts else {}
        container["resources"] = {"requests": amounts, **({"limits": limits} if limits else {})}
    pod_security = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if placement.security_context is not None:
        pod_security.update(placement.security_context.to_kube())
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "serviceAccountName": router_name(owner.name),
        "terminationGracePeriodSeconds": life.grace_seconds,
        "securityContext": pod_security,
        # The engines' policy ConfigMap, the whole directory (a subPath mount would never see an update).
        "volumes": [
            {"name": "policy", "configMap": {"name": policy_configmap_name(owner.name)}},
            *modelsource.volumes(spec),
        ],
    }
    attach_model(pod_spec, container, spec, security)
    # One node lost must not take every router, and the Service's every endpoint, with it.
    # A roll's new pods spread among themselves (`pod-template-hash`).
    spread = {**hostname_spread(router_selector(owner.name)), "matchLabelKeys": ["pod-template-hash"]}
    pod_spec["topologySpreadConstraints"] = [spread]
    if placement.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_kube() for s in placement.image_pull_secrets]
    if spec.router.node_selector:
        pod_spec["nodeSelector"] = dict(spec.router.node_selector)
    if spec.router.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in spec.router.tolerations
        ]
    labels = {**placement.labels, **router_selector(owner.name), MANAGED_BY_LABEL: "ember-operator"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(owner),
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": router_selector(owner.name)},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }


# What `Kube.ensure` keeps as the operator set it, by kind.
ENSURED_FIELDS: dict[str, tuple[str, ...]] = {
    "ServiceAccount": (),
    "RoleBinding": ("roleRef", "subjects"),
    "Deployment": ("spec",),
}
# Deleted, in this order, when the router is turned off.
KINDS = ("Deployment", "RoleBinding", "ServiceAccount")


def desired_objects(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The router's objects, in the order they are made (the Deployment's pods need the ServiceAccount)."""
    if not spec.router.enabled:
        return []
    return [
        desired_service_account(owner),
        desired_role_binding(owner),
        desired_router_deployment(owner, spec),
    ]


def routing_problem(spec: InferenceServiceSpec, owner: Owner, found: dict[str, bool]) -> str | None:
    """Why spec.routing cannot be followed (RoutingInvalid), or None. `found`: whether each InferenceService
    the rules name exists."""
    if spec.routing and not spec.router.enabled:
        return "spec.routing needs the router: spec.router.enabled is false"
    missing = [r for r in spec.routing if r.service == owner.name or not found.get(r.service)]
    if not missing:
        return None
    return "; ".join(
        f"spec.routing rule {r.name!r}: "
        + (
            "names this InferenceService itself"
            if r.service == owner.name
            else f"no InferenceService {r.service!r} in {owner.namespace}"
        )
        for r in missing
    )


def router_status(spec: InferenceServiceSpec, deployment: dict[str, Any] | None) -> dict[str, Any] | None:
    """status.router: Ready router pods of the wanted number (None when the router is off)."""
    if not spec.router.enabled:
        return None
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    desired = spec.router.replicas
    return {"ready": ready, "desired": desired, "summary": f"{ready}/{desired}"}


def router_condition(spec: InferenceServiceSpec, status: dict[str, Any] | None) -> Condition:
    if status is None:
        return Condition("RouterReady", True, "RouterDisabled", "the Service selects the engines directly")
    message = f"{status['ready']}/{status['desired']} router pods Ready"
    if status["ready"] >= 1:
        return Condition("RouterReady", True, "RouterAvailable", message)
    return Condition("RouterReady", False, "RouterUnavailable", message)


def router_metrics_targets(pods: list[dict[str, Any]]) -> dict[str, str]:
    """The /metrics of the Ready router pods among `pods`, by pod name."""
    urls = {}
    for p in pods:
        status = p.get("status") or {}
        ready = any(
            c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
        )
        if ready and status.get("podIP") and not p["metadata"].get("deletionTimestamp"):
            urls[p["metadata"]["name"]] = f"http://{status['podIP']}:{ROUTER_PORT}/metrics"
    return urls


def asleep(spec: InferenceServiceSpec, desired: int) -> bool:
    """Whether requests held at the routers would wake the service (see `wakes`): worth reading them."""
    return (
        spec.router.enabled and spec.autoscaling.mode == "Builtin" and desired == 0 and spec.replicas.max >= 1
    )


def wakes(spec: InferenceServiceSpec, desired: int, pending: float) -> bool:
    """Scale from zero: requests held at the routers while the target is 0 raise it to 1. In Builtin mode
    only: in External mode the count is the external scaler's (spec.replicas.desired, which the operator
    never writes), and a target the operator raised would be put back to it on the next pass."""
    return asleep(spec, desired) and pending > 0
