"""The built-in resource types the local control plane needs.

Enough for kopf (namespaces, events and CRDs are its discovery "backbone"; leases for leader
election elsewhere), for the operator's children (pods, services, configmaps, secrets,
deployments and their replicasets, service accounts and RBAC bindings, pod disruption budgets), resource quotas,
the PriorityClasses and RuntimeClasses pods name, and for kubectl's everyday commands. Built-ins are stored without schema validation: the server
keeps whatever the client sends, as a real server would keep every field it knows.
"""

from __future__ import annotations

from .resources import ResourceType, ScalePaths

BUILTIN_TYPES: tuple[ResourceType, ...] = (
    ResourceType("", "v1", "Namespace", "namespaces", namespaced=False, short_names=("ns",), has_status=True),
    ResourceType(
        "", "v1", "Pod", "pods", namespaced=True, short_names=("po",), categories=("all",), has_status=True
    ),
    ResourceType(
        "",
        "v1",
        "Service",
        "services",
        namespaced=True,
        short_names=("svc",),
        categories=("all",),
        has_status=True,
    ),
    ResourceType("", "v1", "Node", "nodes", namespaced=False, short_names=("no",), has_status=True),
    ResourceType("", "v1", "ConfigMap", "configmaps", namespaced=True, short_names=("cm",)),
    ResourceType("", "v1", "ResourceQuota", "resourcequotas", namespaced=True, short_names=("quota",)),
    ResourceType("", "v1", "Secret", "secrets", namespaced=True),
    ResourceType("", "v1", "Event", "events", namespaced=True, short_names=("ev",)),
    ResourceType("", "v1", "Endpoints", "endpoints", namespaced=True, short_names=("ep",)),
    ResourceType("", "v1", "ServiceAccount", "serviceaccounts", namespaced=True, short_names=("sa",)),
    ResourceType(
        "apps",
        "v1",
        "Deployment",
        "deployments",
        namespaced=True,
        short_names=("deploy",),
        categories=("all",),
        has_status=True,
        # A Deployment's selector is a LabelSelector object; /scale renders it as a string.
        scale=ScalePaths(".spec.replicas", ".status.replicas", ".spec.selector"),
    ),
    ResourceType(
        "apps",
        "v1",
        "ReplicaSet",
        "replicasets",
        namespaced=True,
        short_names=("rs",),
        categories=("all",),
        has_status=True,
        scale=ScalePaths(".spec.replicas", ".status.replicas", ".spec.selector"),
    ),
    ResourceType("rbac.authorization.k8s.io", "v1", "ClusterRole", "clusterroles", namespaced=False),
    ResourceType(
        "rbac.authorization.k8s.io", "v1", "ClusterRoleBinding", "clusterrolebindings", namespaced=False
    ),
    ResourceType("rbac.authorization.k8s.io", "v1", "Role", "roles", namespaced=True),
    ResourceType("rbac.authorization.k8s.io", "v1", "RoleBinding", "rolebindings", namespaced=True),
    ResourceType("coordination.k8s.io", "v1", "Lease", "leases", namespaced=True),
    ResourceType(
        "policy",
        "v1",
        "PodDisruptionBudget",
        "poddisruptionbudgets",
        namespaced=True,
        short_names=("pdb",),
        has_status=True,
    ),
    ResourceType(
        "scheduling.k8s.io", "v1", "PriorityClass", "priorityclasses", namespaced=False, short_names=("pc",)
    ),
    ResourceType("node.k8s.io", "v1", "RuntimeClass", "runtimeclasses", namespaced=False),
    ResourceType(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        namespaced=False,
        short_names=("crd", "crds"),
        has_status=True,
    ),
    # Stored apart from v1 events (a real server shares one storage); kopf and kubectl use v1.
    ResourceType("events.k8s.io", "v1", "Event", "events", namespaced=True, short_names=("ev",)),
)

INITIAL_NAMESPACES = ("default", "kube-node-lease", "kube-system")

# The PriorityClasses kube-apiserver creates at start (pkg/apis/scheduling/v1: SystemPriorityClasses).
SYSTEM_PRIORITY_CLASSES: tuple[dict[str, object], ...] = (
    {
        "metadata": {"name": "system-node-critical"},
        "value": 2000001000,
        "description": "Used for system critical pods that must not be moved from their current node.",
    },
    {
        "metadata": {"name": "system-cluster-critical"},
        "value": 2000000000,
        "description": "Used for system critical pods that must run in the cluster, but can be moved to another "
        "node if necessary.",
    },
)
