"""What an InferenceService's children should look like: pure builders, no I/O.

Each `desired_*()` returns a plain manifest dict for one child. The handlers create or patch the real objects
to match; these functions are where the layout of the pods, the Service and the policy ConfigMap is decided.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import yaml

from ember_operator import modelsource
from ember_operator.podpatch import apply_pod_template
from ember_operator.podsettings import PRESTOP_SECONDS, PodSettings
from ember_operator.spec import GROUP, KIND, VERSION, InferenceServiceSpec

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
ROLE_LABEL = f"{GROUP}/role"
HASH_LABEL = f"{GROUP}/template-hash"
ACTIVE, WARM = "active", "warm"

ENGINE_PORT = 8000
SERVICE_PORT = 80
POLICY_DIR = "/etc/ember/policy"
POLICY_FILE = "policy.yaml"
ROUTES_FILE = "routes.yaml"  # beside the policy: the routers' model-routing rules
MODELS_DIR = "/models"
SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceService the children belong to."""

    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def instance_labels(name: str) -> dict[str, str]:
    return {NAME_LABEL: "ember", INSTANCE_LABEL: name}


def selector_string(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def active_selector(name: str) -> dict[str, str]:
    return {**instance_labels(name), ROLE_LABEL: ACTIVE}


_POD_SECTIONS = {"model", "api_key", "speculative", "engine", "resources", "pod", "lifecycle", "pod_template"}
# What the template hash covered when it was first computed, with defaults written out.
_FIRST_RELEASE = {
    "model": ("name", "source", "dtype", "volumeClaim"),
    "speculative": ("method", "draftSource", "numTokens"),
    "engine": (
        "maxNumSeqs",
        "maxNumBatchedTokens",
        "blockSize",
        "prefixCaching",
        "maxModelLen",
        "kvCacheMemory",
        "gpuMemoryUtilization",
    ),
    "resources": ("gpus", "cpu", "memory", "nodeSelector", "tolerations", "image", "imagePullPolicy", "env"),
}


def default_shared_memory(spec: InferenceServiceSpec) -> str:
    """/dev/shm's size without resources.sharedMemory: 1Gi per tensor-parallel rank on the pod."""
    return f"{max(1, spec.tensor_parallel_size // spec.resources.nodes)}Gi"


def template_hash(spec: InferenceServiceSpec) -> str:
    """A digest of the fields that change what an engine pod runs; a new value means the pods are rolled.

    Replicas, the warm pool, autoscaling and the policy fields are left out on purpose: changing them must not
    restart a single engine. Pod labels and annotations roll the pods too, as a Deployment's template does.
    """
    # Fields added since the first release count only once set (at their defaults they are left out), so an
    # operator upgrade rolls no pod; the first release's fields keep the form they were hashed in.
    affecting = spec.model_dump(by_alias=True, mode="json", include=_POD_SECTIONS, exclude_defaults=True)
    full = spec.model_dump(by_alias=True, mode="json", include=set(_FIRST_RELEASE))
    for section, names in _FIRST_RELEASE.items():
        first = full[section]
        affecting[section] = first and {**affecting.get(section, {}), **{n: first[n] for n in names}}
    # Env entries were {name, value} then: valueFrom came later.
    affecting["resources"]["env"] = [
        {k: v for k, v in e.items() if v is not None} for e in affecting["resources"]["env"]
    ]
    # /dev/shm counts as the pod gets it: the default's size written out (1Gi for one rank) rolls nothing.
    shm = spec.resources.shared_memory
    if shm is not None and quantity_bytes(shm) == quantity_bytes(default_shared_memory(spec)):
        affecting["resources"].pop("sharedMemory", None)
    # The fallback's key reaches the pods as an environment variable (the rest of the fallback, live).
    if spec.fallback is not None and spec.fallback.api_key is not None:
        affecting["fallbackApiKey"] = spec.fallback.api_key.model_dump(by_alias=True, mode="json")
    # The tensor-parallel size counts as the engine will run it: pods of several GPUs that ran one rank roll.
    affecting["engine"].pop("tensorParallelSize", None)
    if spec.tensor_parallel_size > 1:
        affecting["engine"]["tensorParallelSize"] = spec.tensor_parallel_size
    canonical = json.dumps(affecting, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:10]


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity_bytes(quantity: str) -> int:
    """A Kubernetes quantity ("8Gi", "500M", "1.5Gi") as a whole number of bytes, rounded up as
    resource.Quantity's Value() rounds."""
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([KMGTPE]i|[numkMGTPE]?)", quantity)
    if match is None:
        raise ValueError(f"not a Kubernetes quantity: {quantity!r}")
    number, suffix = match.groups()
    scale = Decimal(_BINARY[suffix]) if suffix.endswith("i") else Decimal(10) ** _DECIMAL[suffix]
    return math.ceil(Decimal(number) * scale)


ENGINE_COMMAND = ["ember", "serve"]


def engine_args(spec: InferenceServiceSpec) -> list[str]:
    """`ember serve`'s options for this spec."""
    e = spec.engine
    args = [
        f"--model={modelsource.model_path(spec)}",
        f"--served-model-name={spec.model.name}",
        f"--dtype={spec.model.dtype}",
        "--host=0.0.0.0",
        f"--port={ENGINE_PORT}",
        f"--policy={POLICY_DIR}/{POLICY_FILE}",
        f"--max-num-seqs={e.max_num_seqs}",
        f"--max-num-batched-tokens={e.max_num_batched_tokens}",
        f"--block-size={e.block_size}",
        "--enable-prefix-caching" if e.prefix_caching else "--no-enable-prefix-caching",
        f"--gpu-memory-utilization={e.gpu_memory_utilization}",
        f"--drain-timeout={spec.lifecycle.drain_seconds}",
    ]
    if e.max_model_len is not None:
        args.append(f"--max-model-len={e.max_model_len}")
    if e.kv_cache_memory is not None:
        args.append(f"--kv-cache-memory={quantity_bytes(e.kv_cache_memory)}")
    if e.kv_cache_dtype != "auto":
        args.append(f"--kv-cache-dtype={e.kv_cache_dtype}")
    if spec.tensor_parallel_size > 1:
        args.append(f"--tensor-parallel-size={spec.tensor_parallel_size}")
    if spec.model.quantization is not None:
        args.append(f"--quantization={spec.model.quantization}")
    if spec.model.adapters:  # one value each; the next option (or the end) ends the list
        args += ["--lora-modules", *modelsource.lora_modules(spec)]
    if spec.speculative is not None:
        s = spec.speculative
        if s.method == "draft":
            assert s.draft_source is not None
            args.append(f"--draft-model={modelsource.engine_path(s.draft_source)}")
        else:
            args.append("--speculative-method=ngram")
        args.append(f"--num-speculative-tokens={s.num_tokens}")
    return [*args, *spec.engine.extra_args]


def _resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    r = spec.resources
    amounts: dict[str, str] = {}
    if r.cpu is not None:
        amounts["cpu"] = r.cpu
    if r.memory is not None:
        amounts["memory"] = r.memory
    limits = dict(amounts)
    if r.gpus:
        limits[r.gpu_resource] = str(r.gpus)  # extended resources: the request defaults to the limit
    out: dict[str, Any] = {}
    if amounts:
        out["requests"] = amounts
    if limits:
        out["limits"] = limits
    return out


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 2,
        "failureThreshold": failures,
    }


def key_env(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The API keys' environment variables, from their Secrets: the engines' and routers' own key, and
    the one they present to the fallback."""
    env = []
    fallback = spec.fallback.api_key if spec.fallback is not None else None
    for name, key in (("EMBER_API_KEY", spec.api_key), ("EMBER_FALLBACK_API_KEY", fallback)):
        if key is not None:
            env.append({"name": name, "valueFrom": {"secretKeyRef": key.secret_key_ref.to_kube()}})
    return env


def policy_configmap_name(name: str) -> str:
    return f"{name}-policy"


def desired_pod(owner: Owner, spec: InferenceServiceSpec, role: str, pod_hash: str) -> dict[str, Any]:
    """One engine pod. Its name is generated by the API server from `<name>-<hash>-`. Raises
    PodTemplateError when spec.podTemplate cannot be applied."""
    r, life, placement = spec.resources, spec.lifecycle, spec.pod
    # Pod Security "restricted": the engine needs no privilege, no capability and no escalation.
    security = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    if placement.container_security_context is not None:
        security.update(placement.container_security_context.to_kube())
    period = life.readiness_period_seconds
    container: dict[str, Any] = {
        "name": "engine",
        "image": r.image,
        "imagePullPolicy": r.image_pull_policy,
        "command": list(ENGINE_COMMAND),
        "args": engine_args(spec),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "env": [*(e.to_kube() for e in r.env), *key_env(spec)],
        # /health answers while the model loads, so liveness needs no start-up allowance; /ready turns true
        # after warm-up and false as soon as draining starts. The startup probe bounds the load itself.
        "startupProbe": _probe("/ready", period, -(-life.startup_timeout_seconds // period)),
        "readinessProbe": _probe("/ready", period, life.readiness_failure_threshold),
        "livenessProbe": _probe("/health", life.liveness_period_seconds, life.liveness_failure_threshold),
        # Endpoints controllers and proxies stop sending new requests before the engine starts draining.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SECONDS)]}}},
        "volumeMounts": [
            {"name": "policy", "mountPath": POLICY_DIR, "readOnly": True},
            *modelsource.engine_mounts(spec),
        ],
        # A model that fails to load ends the process; its last log lines become the status message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": security,
    }
    if r.env_from:
        container["envFrom"] = [e.to_kube() for e in r.env_from]
    resources = _resources(spec)
    if resources:
        container["resources"] = resources
    pod_security = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    if placement.security_context is not None:
        pod_security.update(placement.security_context.to_kube())
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": life.grace_seconds,
        # The image runs as a numeric non-root user (Dockerfile.engine), so runAsNonRoot holds without a
        # runAsUser (which would fight OpenShift's assigned ranges).
        "securityContext": pod_security,
        # The engine never talks to the Kubernetes API.
        "automountServiceAccountToken": False,
        # A whole-directory mount (not subPath) so that ConfigMap updates reach the running engine.
        "volumes": [
            {"name": "policy", "configMap": {"name": policy_configmap_name(owner.name)}},
            *modelsource.volumes(spec),
        ],
    }
    attach_model(pod_spec, container, spec, security)
    # A container's /dev/shm is 64Mi unless mounted: too small for torch's inter-process buffers and for
    # NCCL between the pod's ranks.
    shm = r.shared_memory or default_shared_memory(spec)
    if shm != "0":
        container["volumeMounts"].append({"name": "dshm", "mountPath": SHM_DIR})
        pod_spec["volumes"].append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}})
    if r.node_selector:
        pod_spec["nodeSelector"] = dict(r.node_selector)
    if r.tolerations:
        pod_spec["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in r.tolerations]
    _place(pod_spec, owner, placement)
    if _spread_by_default(spec):
        pod_spec["topologySpreadConstraints"] = [default_spread(owner.name)]
    labels = {
        **placement.labels,
        **instance_labels(owner.name),
        MANAGED_BY_LABEL: "ember-operator",
        ROLE_LABEL: role,
        HASH_LABEL: pod_hash,
    }
    metadata: dict[str, Any] = {
        "generateName": f"{owner.name}-{pod_hash[:5]}-",
        "namespace": owner.namespace,
        "labels": labels,
        "ownerReferences": [owner.reference()],
    }
    if placement.annotations:
        metadata["annotations"] = dict(placement.annotations)
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}
    template = spec.pod_template
    if template is None:
        return pod
    return apply_pod_template(pod, template.metadata.to_kube(), template.spec)


def _place(pod_spec: dict[str, Any], owner: Owner, placement: PodSettings) -> None:
    """spec.pod's scheduling and identity fields, as the pod spec's own."""
    if placement.affinity is not None:
        pod_spec["affinity"] = placement.affinity.to_kube()
    if placement.topology_spread_constraints:
        constraints = []
        for c in placement.topology_spread_constraints:
            spread = c.to_kube()
            # Without a selector a constraint counts no pods; what is meant is this service's engines.
            spread.setdefault("labelSelector", {"matchLabels": instance_labels(owner.name)})
            constraints.append(spread)
        pod_spec["topologySpreadConstraints"] = constraints
    for field, value in (
        ("priorityClassName", placement.priority_class_name),
        ("serviceAccountName", placement.service_account_name),
        ("runtimeClassName", placement.runtime_class_name),
    ):
        if value is not None:
            pod_spec[field] = value
    if placement.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [s.to_kube() for s in placement.image_pull_secrets]


def default_spread(name: str) -> dict[str, Any]:
    """The soft spreading over nodes that a service's engine pods get unless told otherwise.

    The warm pool stands by to take over from an active pod that is lost, which it can only do from
    another node: a node lost takes every pod on it. A topology spread constraint rather than preferred
    pod anti-affinity: kube-scheduler scores it by how many of the service's pods each node already holds
    (so pods even out over nodes, not only "avoid a node with one"), over the nodes the pod may go to
    (nodeAffinityPolicy Honor), and it costs the scheduler less than anti-affinity, which upstream advises
    against in large clusters; both weigh 2 in the default profile, twice the least-allocated score.
    ScheduleAnyway, so one node, or one node with room, still takes every pod. Hostname only: with a zone
    constraint beside it, nodes without a zone label would not be scored at all. It takes the place of
    kube-scheduler's system default spreading (hostname skew 3, zone skew 5, and only for pods a Service
    or ReplicaSet selects). Not part of the template hash (it is not in the spec), so an operator upgrade
    rolls no pod: running pods keep their spec, and pods made from then on carry it.
    """
    return hostname_spread(instance_labels(name))


def hostname_spread(labels: dict[str, str]) -> dict[str, Any]:
    """A soft spread over nodes (`default_spread` says why this form) of the pods with these labels."""
    return {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": labels},
    }


def _spread_by_default(spec: InferenceServiceSpec) -> bool:
    """Whether the pods get `default_spread`: not when spec.pod or spec.podTemplate's spec sets spread
    constraints or pod affinity or anti-affinity (theirs is the word). Node affinity alone keeps it: it
    says which nodes, not how to spread over them."""
    placement, template = spec.pod, spec.pod_template
    affinity: dict[str, Any] = placement.affinity.to_kube() if placement.affinity is not None else {}
    patch: dict[str, Any] = template.spec if template is not None else {}
    patched: dict[str, Any] = patch["affinity"] if isinstance(patch.get("affinity"), dict) else {}
    return not (
        placement.topology_spread_constraints
        or "topologySpreadConstraints" in patch
        or any(key in found for found in (affinity, patched) for key in ("podAffinity", "podAntiAffinity"))
    )


def _child_meta(owner: Owner, name: str) -> dict[str, Any]:
    """The metadata of a child object other than a pod: its name, labels and owner."""
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**instance_labels(owner.name), MANAGED_BY_LABEL: "ember-operator"},
        "ownerReferences": [owner.reference()],
    }


def desired_service(owner: Owner, selector: dict[str, str] | None = None) -> dict[str, Any]:
    """The Service clients use: it selects the active pods only, so warm pods get no traffic (or, given
    `selector`, the pods it names: the routers in front of them)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _child_meta(owner, owner.name),
        # No `type`: the API server defaults it to ClusterIP, and a type set later (LoadBalancer, NodePort)
        # is the user's to keep.
        "spec": {
            "selector": selector or active_selector(owner.name),
            "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def desired_pdb(owner: Owner, spec: InferenceServiceSpec, desired_active: int) -> dict[str, Any]:
    """A PodDisruptionBudget for voluntary disruptions (node drains, evictions); follows the target as the
    autoscaler moves it.

    With a warm pool it covers the active and the warm pods and keeps the active target of them Ready: a
    drain takes pods only while Ready warm pods stand by, and an active pod it takes is replaced by one of
    them at once (failover), so it costs no serving capacity; two pods on one drained node go one at a time,
    the second once the pool has a Ready pod again. Without one it covers the active pods down to the target
    less `rollout.maxUnavailable`, what a roll may take."""
    if spec.warm_pool.size > 0:
        selector: dict[str, Any] = {
            "matchLabels": instance_labels(owner.name),
            "matchExpressions": [{"key": ROLE_LABEL, "operator": "In", "values": [ACTIVE, WARM]}],
        }
        min_available = desired_active
    else:
        selector = {"matchLabels": active_selector(owner.name)}
        min_available = max(0, desired_active - spec.rollout.max_unavailable)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _child_meta(owner, owner.name),
        "spec": {"minAvailable": min_available, "selector": selector},
    }


def policy_document(spec: InferenceServiceSpec, fallback_url: str | None) -> dict[str, Any]:
    """The engine's policy file. `fallback_url` is the fallback target resolved by the operator (None: none)."""
    doc: dict[str, Any] = {
        "loadShedding": spec.load_shedding.model_dump(by_alias=True, mode="json"),
        "requestTimeoutSeconds": spec.request_timeout_seconds,
    }
    if spec.fallback is not None and fallback_url is not None:
        f = spec.fallback
        doc["fallback"] = {
            "url": fallback_url,
            "model": f.model,
            "when": list(f.when),
            "timeoutSeconds": f.timeout_seconds,
        }
    return doc


def desired_policy_configmap(
    owner: Owner,
    spec: InferenceServiceSpec,
    fallback_url: str | None,
    routes: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The policy file the engines and routers read live, and with spec.routing the routers' routes file
    (`routes`: its rules, with their targets' addresses)."""
    data = {POLICY_FILE: yaml.safe_dump(policy_document(spec, fallback_url), sort_keys=True)}
    if spec.routing:
        data[ROUTES_FILE] = yaml.safe_dump(routes or [], sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _child_meta(owner, policy_configmap_name(owner.name)),
        "data": data,
    }


def service_endpoint(name: str, namespace: str, cluster_domain: str) -> str:
    return f"http://{name}.{namespace}.svc.{cluster_domain}"


def attach_model(
    pod_spec: dict[str, Any], container: dict[str, Any], spec: InferenceServiceSpec, security: dict[str, Any]
) -> None:
    """The model's way into a pod: the init containers that fetch it, and the claim holding a path source
    mounted read-only at /models. Engine and router pods read the same checkpoint."""
    fetch = modelsource.init_containers(spec, security)
    if fetch:
        pod_spec["initContainers"] = fetch
    if spec.model.volume_claim is not None:
        container["volumeMounts"].append({"name": "models", "mountPath": MODELS_DIR, "readOnly": True})
        pod_spec["volumes"].append(
            {
                "name": "models",
                "persistentVolumeClaim": {"claimName": spec.model.volume_claim, "readOnly": True},
            }
        )
