"""Field tables of the Kubernetes protobuf messages the API server reads (see `protobuf.py`).

Field numbers are those of the generated.proto files of k8s.io/api (core/v1, apps/v1, batch/v1, rbac/v1,
scheduling/v1, policy/v1) and k8s.io/apimachinery (meta/v1, runtime, api/resource, util/intstr); names are
the JSON names. A kind is `string`, `bytes` (base64 in JSON), `bool`, `int32`, `int64`, `Time`
(metav1.Time), `Quantity` (resource.Quantity, a message of one string), `IntOrString` (type = 1,
intVal = 2, strVal = 3) or a message of these tables; `[]K` is a repeated field, `map[string]K` a map
(entries key = 1, value = 2).

A mode says how Go's JSON encoder writes the field of the decoded struct: OMIT (`omitempty`, not a
pointer: a zero value is left out), PTR (a pointer: written whenever it was sent, zero or not), ALWAYS
(no `omitempty`: written always, its zero value or null when not sent) or INLINE (a struct embedded
with `json:",inline"`: its fields join the parent's). Messages hold the fields `kubectl create` sets and
the scalar and simple fields around them; a field not listed is refused, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

OMIT, PTR, ALWAYS, INLINE = "omit", "ptr", "always", "inline"


@dataclass(frozen=True, slots=True)
class Field:
    name: str
    kind: str  # the element kind for repeated fields, the value kind for maps
    mode: str = OMIT
    repeated: bool = False
    map_of: str = ""  # the value kind of a map<string, ...>


def f(name: str, kind: str, mode: str = OMIT) -> Field:
    if kind.startswith("[]"):
        return Field(name, kind[2:], mode, repeated=True)
    if kind.startswith("map[string]"):
        value = kind.removeprefix("map[string]")
        return Field(name, value, mode, map_of=value)
    return Field(name, kind, mode)


def table(*entries: tuple[int, Field]) -> dict[int, Field]:
    return dict(entries)


MESSAGES: dict[str, dict[int, Field]] = {
    # k8s.io/apimachinery
    "runtime.Unknown": table(
        (1, f("typeMeta", "runtime.TypeMeta")),
        (2, f("raw", "bytes")),
        (3, f("contentEncoding", "string")),
        (4, f("contentType", "string")),
    ),
    "runtime.TypeMeta": table((1, f("apiVersion", "string")), (2, f("kind", "string"))),
    "resource.Quantity": table((1, f("string", "string", ALWAYS))),
    "intstr.IntOrString": table(
        (1, f("type", "int64", ALWAYS)), (2, f("intVal", "int32", ALWAYS)), (3, f("strVal", "string", ALWAYS))
    ),
    "meta.Timestamp": table((1, f("seconds", "int64", ALWAYS)), (2, f("nanos", "int32", ALWAYS))),
    "ObjectMeta": table(
        (1, f("name", "string")),
        (2, f("generateName", "string")),
        (3, f("namespace", "string")),
        (4, f("selfLink", "string")),
        (5, f("uid", "string")),
        (6, f("resourceVersion", "string")),
        (7, f("generation", "int64")),
        (8, f("creationTimestamp", "Time")),
        (9, f("deletionTimestamp", "Time", PTR)),
        (10, f("deletionGracePeriodSeconds", "int64", PTR)),
        (11, f("labels", "map[string]string")),
        (12, f("annotations", "map[string]string")),
        (13, f("ownerReferences", "[]OwnerReference")),
        (14, f("finalizers", "[]string")),
    ),
    "OwnerReference": table(
        (5, f("apiVersion", "string", ALWAYS)),
        (1, f("kind", "string", ALWAYS)),
        (3, f("name", "string", ALWAYS)),
        (4, f("uid", "string", ALWAYS)),
        (6, f("controller", "bool", PTR)),
        (7, f("blockOwnerDeletion", "bool", PTR)),
    ),
    "LabelSelector": table(
        (1, f("matchLabels", "map[string]string")), (2, f("matchExpressions", "[]LabelSelectorRequirement"))
    ),
    "LabelSelectorRequirement": table(
        (1, f("key", "string", ALWAYS)), (2, f("operator", "string", ALWAYS)), (3, f("values", "[]string"))
    ),
    # core/v1
    "Namespace": table(
        (1, f("metadata", "ObjectMeta")), (2, f("spec", "NamespaceSpec")), (3, f("status", "NamespaceStatus"))
    ),
    "NamespaceSpec": table((1, f("finalizers", "[]string"))),
    "NamespaceStatus": table((1, f("phase", "string")), (2, f("conditions", "[]NamespaceCondition"))),
    "NamespaceCondition": table(
        (1, f("type", "string", ALWAYS)),
        (2, f("status", "string", ALWAYS)),
        (4, f("lastTransitionTime", "Time")),
        (5, f("reason", "string")),
        (6, f("message", "string")),
    ),
    "ConfigMap": table(
        (1, f("metadata", "ObjectMeta")),
        (4, f("immutable", "bool", PTR)),
        (2, f("data", "map[string]string")),
        (3, f("binaryData", "map[string]bytes")),
    ),
    "Secret": table(
        (1, f("metadata", "ObjectMeta")),
        (5, f("immutable", "bool", PTR)),
        (2, f("data", "map[string]bytes")),
        (4, f("stringData", "map[string]string")),
        (3, f("type", "string")),
    ),
    "ServiceAccount": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("secrets", "[]ObjectReference")),
        (3, f("imagePullSecrets", "[]LocalObjectReference")),
        (4, f("automountServiceAccountToken", "bool", PTR)),
    ),
    "ObjectReference": table(
        (1, f("kind", "string")),
        (2, f("namespace", "string")),
        (3, f("name", "string")),
        (4, f("uid", "string")),
        (5, f("apiVersion", "string")),
        (6, f("resourceVersion", "string")),
        (7, f("fieldPath", "string")),
    ),
    "LocalObjectReference": table((1, f("name", "string"))),
    "ResourceQuota": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("spec", "ResourceQuotaSpec")),
        (3, f("status", "ResourceQuotaStatus")),
    ),
    "ResourceQuotaSpec": table(
        (1, f("hard", "map[string]Quantity")),
        (2, f("scopes", "[]string")),
        (3, f("scopeSelector", "ScopeSelector", PTR)),
    ),
    "ScopeSelector": table((1, f("matchExpressions", "[]ScopedResourceSelectorRequirement"))),
    "ScopedResourceSelectorRequirement": table(
        (1, f("scopeName", "string", ALWAYS)),
        (2, f("operator", "string", ALWAYS)),
        (3, f("values", "[]string")),
    ),
    "ResourceQuotaStatus": table(
        (1, f("hard", "map[string]Quantity")), (2, f("used", "map[string]Quantity"))
    ),
    "Service": table(
        (1, f("metadata", "ObjectMeta")), (2, f("spec", "ServiceSpec")), (3, f("status", "ServiceStatus"))
    ),
    "ServiceSpec": table(
        (1, f("ports", "[]ServicePort")),
        (2, f("selector", "map[string]string")),
        (3, f("clusterIP", "string")),
        (18, f("clusterIPs", "[]string")),
        (4, f("type", "string")),
        (5, f("externalIPs", "[]string")),
        (7, f("sessionAffinity", "string")),
        (8, f("loadBalancerIP", "string")),
        (9, f("loadBalancerSourceRanges", "[]string")),
        (10, f("externalName", "string")),
        (11, f("externalTrafficPolicy", "string")),
        (12, f("healthCheckNodePort", "int32")),
        (13, f("publishNotReadyAddresses", "bool")),
        (14, f("sessionAffinityConfig", "SessionAffinityConfig", PTR)),
        (19, f("ipFamilies", "[]string")),
        (17, f("ipFamilyPolicy", "string", PTR)),
        (20, f("allocateLoadBalancerNodePorts", "bool", PTR)),
        (21, f("loadBalancerClass", "string", PTR)),
        (22, f("internalTrafficPolicy", "string", PTR)),
        (23, f("trafficDistribution", "string", PTR)),
    ),
    "SessionAffinityConfig": table((1, f("clientIP", "ClientIPConfig", PTR))),
    "ClientIPConfig": table((1, f("timeoutSeconds", "int32", PTR))),
    "ServicePort": table(
        (1, f("name", "string")),
        (2, f("protocol", "string")),
        (6, f("appProtocol", "string", PTR)),
        (3, f("port", "int32", ALWAYS)),
        (4, f("targetPort", "IntOrString")),
        (5, f("nodePort", "int32")),
    ),
    "ServiceStatus": table((1, f("loadBalancer", "LoadBalancerStatus"))),
    "LoadBalancerStatus": table((1, f("ingress", "[]LoadBalancerIngress"))),
    "LoadBalancerIngress": table(
        (1, f("ip", "string")),
        (2, f("hostname", "string")),
        (3, f("ipMode", "string", PTR)),
        (4, f("ports", "[]PortStatus")),
    ),
    "PortStatus": table(
        (1, f("port", "int32", ALWAYS)), (2, f("protocol", "string", ALWAYS)), (3, f("error", "string", PTR))
    ),
    "Pod": table((1, f("metadata", "ObjectMeta")), (2, f("spec", "PodSpec")), (3, f("status", "PodStatus"))),
    "PodStatus": table(
        (17, f("observedGeneration", "int64")),
        (1, f("phase", "string")),
        (3, f("message", "string")),
        (4, f("reason", "string")),
        (11, f("nominatedNodeName", "string")),
        (5, f("hostIP", "string")),
        (6, f("podIP", "string")),
        (7, f("startTime", "Time", PTR)),
        (9, f("qosClass", "string")),
        (14, f("resize", "string")),
    ),
    "PodTemplateSpec": table((1, f("metadata", "ObjectMeta")), (2, f("spec", "PodSpec"))),
    "PodSpec": table(
        (20, f("initContainers", "[]Container")),
        (2, f("containers", "[]Container", ALWAYS)),
        (3, f("restartPolicy", "string")),
        (4, f("terminationGracePeriodSeconds", "int64", PTR)),
        (5, f("activeDeadlineSeconds", "int64", PTR)),
        (6, f("dnsPolicy", "string")),
        (7, f("nodeSelector", "map[string]string")),
        (8, f("serviceAccountName", "string")),
        (9, f("serviceAccount", "string")),
        (21, f("automountServiceAccountToken", "bool", PTR)),
        (10, f("nodeName", "string")),
        (11, f("hostNetwork", "bool")),
        (12, f("hostPID", "bool")),
        (13, f("hostIPC", "bool")),
        (27, f("shareProcessNamespace", "bool", PTR)),
        (15, f("imagePullSecrets", "[]LocalObjectReference")),
        (16, f("hostname", "string")),
        (17, f("subdomain", "string")),
        (19, f("schedulerName", "string")),
        (22, f("tolerations", "[]Toleration")),
        (24, f("priorityClassName", "string")),
        (25, f("priority", "int32", PTR)),
        (29, f("runtimeClassName", "string", PTR)),
        (30, f("enableServiceLinks", "bool", PTR)),
        (31, f("preemptionPolicy", "string", PTR)),
        (32, f("overhead", "map[string]Quantity")),
        (35, f("setHostnameAsFQDN", "bool", PTR)),
        (37, f("hostUsers", "bool", PTR)),
        (40, f("resources", "ResourceRequirements", PTR)),
        (41, f("hostnameOverride", "string", PTR)),
    ),
    "Toleration": table(
        (1, f("key", "string")),
        (2, f("operator", "string")),
        (3, f("value", "string")),
        (4, f("effect", "string")),
        (5, f("tolerationSeconds", "int64", PTR)),
    ),
    "Container": table(
        (1, f("name", "string", ALWAYS)),
        (2, f("image", "string")),
        (3, f("command", "[]string")),
        (4, f("args", "[]string")),
        (5, f("workingDir", "string")),
        (6, f("ports", "[]ContainerPort")),
        (19, f("envFrom", "[]EnvFromSource")),
        (7, f("env", "[]EnvVar")),
        (8, f("resources", "ResourceRequirements")),
        (23, f("resizePolicy", "[]ContainerResizePolicy")),
        (24, f("restartPolicy", "string", PTR)),
        (9, f("volumeMounts", "[]VolumeMount")),
        (13, f("terminationMessagePath", "string")),
        (20, f("terminationMessagePolicy", "string")),
        (14, f("imagePullPolicy", "string")),
        (16, f("stdin", "bool")),
        (17, f("stdinOnce", "bool")),
        (18, f("tty", "bool")),
    ),
    "ContainerPort": table(
        (1, f("name", "string")),
        (2, f("hostPort", "int32")),
        (3, f("containerPort", "int32", ALWAYS)),
        (4, f("protocol", "string")),
        (5, f("hostIP", "string")),
    ),
    "ContainerResizePolicy": table(
        (1, f("resourceName", "string", ALWAYS)), (2, f("restartPolicy", "string", ALWAYS))
    ),
    "ResourceRequirements": table(
        (1, f("limits", "map[string]Quantity")),
        (2, f("requests", "map[string]Quantity")),
        (3, f("claims", "[]ResourceClaim")),
    ),
    "ResourceClaim": table((1, f("name", "string", ALWAYS)), (2, f("request", "string"))),
    "EnvVar": table(
        (1, f("name", "string", ALWAYS)), (2, f("value", "string")), (3, f("valueFrom", "EnvVarSource", PTR))
    ),
    "EnvVarSource": table(
        (1, f("fieldRef", "ObjectFieldSelector", PTR)),
        (2, f("resourceFieldRef", "ResourceFieldSelector", PTR)),
        (3, f("configMapKeyRef", "ConfigMapKeySelector", PTR)),
        (4, f("secretKeyRef", "SecretKeySelector", PTR)),
    ),
    "ObjectFieldSelector": table((1, f("apiVersion", "string")), (2, f("fieldPath", "string", ALWAYS))),
    "ResourceFieldSelector": table(
        (1, f("containerName", "string")), (2, f("resource", "string", ALWAYS)), (3, f("divisor", "Quantity"))
    ),
    "ConfigMapKeySelector": table(
        (1, f("", "LocalObjectReference", INLINE)),
        (2, f("key", "string", ALWAYS)),
        (3, f("optional", "bool", PTR)),
    ),
    "SecretKeySelector": table(
        (1, f("", "LocalObjectReference", INLINE)),
        (2, f("key", "string", ALWAYS)),
        (3, f("optional", "bool", PTR)),
    ),
    "EnvFromSource": table(
        (1, f("prefix", "string")),
        (2, f("configMapRef", "ConfigMapEnvSource", PTR)),
        (3, f("secretRef", "SecretEnvSource", PTR)),
    ),
    "ConfigMapEnvSource": table((1, f("", "LocalObjectReference", INLINE)), (2, f("optional", "bool", PTR))),
    "SecretEnvSource": table((1, f("", "LocalObjectReference", INLINE)), (2, f("optional", "bool", PTR))),
    "VolumeMount": table(
        (1, f("name", "string", ALWAYS)),
        (2, f("readOnly", "bool")),
        (7, f("recursiveReadOnly", "string", PTR)),
        (3, f("mountPath", "string", ALWAYS)),
        (4, f("subPath", "string")),
        (5, f("mountPropagation", "string", PTR)),
        (6, f("subPathExpr", "string")),
    ),
    # scheduling/v1
    "PriorityClass": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("value", "int32", ALWAYS)),
        (3, f("globalDefault", "bool")),
        (4, f("description", "string")),
        (5, f("preemptionPolicy", "string", PTR)),
    ),
    # rbac/v1
    "Role": table((1, f("metadata", "ObjectMeta")), (2, f("rules", "[]PolicyRule", ALWAYS))),
    "ClusterRole": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("rules", "[]PolicyRule", ALWAYS)),
        (3, f("aggregationRule", "AggregationRule", PTR)),
    ),
    "AggregationRule": table((1, f("clusterRoleSelectors", "[]LabelSelector"))),
    "PolicyRule": table(
        (1, f("verbs", "[]string", ALWAYS)),
        (2, f("apiGroups", "[]string")),
        (3, f("resources", "[]string")),
        (4, f("resourceNames", "[]string")),
        (5, f("nonResourceURLs", "[]string")),
    ),
    "RoleBinding": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("subjects", "[]Subject")),
        (3, f("roleRef", "RoleRef", ALWAYS)),
    ),
    "ClusterRoleBinding": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("subjects", "[]Subject")),
        (3, f("roleRef", "RoleRef", ALWAYS)),
    ),
    "Subject": table(
        (1, f("kind", "string", ALWAYS)),
        (2, f("apiGroup", "string")),
        (3, f("name", "string", ALWAYS)),
        (4, f("namespace", "string")),
    ),
    "RoleRef": table(
        (1, f("apiGroup", "string", ALWAYS)),
        (2, f("kind", "string", ALWAYS)),
        (3, f("name", "string", ALWAYS)),
    ),
    # policy/v1
    "PodDisruptionBudget": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("spec", "PodDisruptionBudgetSpec")),
        (3, f("status", "PodDisruptionBudgetStatus")),
    ),
    "PodDisruptionBudgetSpec": table(
        (1, f("minAvailable", "IntOrString", PTR)),
        (2, f("selector", "LabelSelector", PTR)),
        (3, f("maxUnavailable", "IntOrString", PTR)),
    ),
    "PodDisruptionBudgetStatus": table(
        (1, f("observedGeneration", "int64")),
        (2, f("disruptedPods", "map[string]Time")),
        (3, f("disruptionsAllowed", "int32", ALWAYS)),
        (4, f("currentHealthy", "int32", ALWAYS)),
        (5, f("desiredHealthy", "int32", ALWAYS)),
        (6, f("expectedPods", "int32", ALWAYS)),
    ),
    # apps/v1
    "Deployment": table(
        (1, f("metadata", "ObjectMeta")),
        (2, f("spec", "DeploymentSpec")),
        (3, f("status", "DeploymentStatus")),
    ),
    "DeploymentSpec": table(
        (1, f("replicas", "int32", PTR)),
        (2, f("selector", "LabelSelector", PTR)),
        (3, f("template", "PodTemplateSpec", ALWAYS)),
        (4, f("strategy", "DeploymentStrategy")),
        (5, f("minReadySeconds", "int32")),
        (6, f("revisionHistoryLimit", "int32", PTR)),
        (7, f("paused", "bool")),
        (9, f("progressDeadlineSeconds", "int32", PTR)),
    ),
    "DeploymentStrategy": table(
        (1, f("type", "string")), (2, f("rollingUpdate", "RollingUpdateDeployment", PTR))
    ),
    "RollingUpdateDeployment": table(
        (1, f("maxUnavailable", "IntOrString", PTR)), (2, f("maxSurge", "IntOrString", PTR))
    ),
    "DeploymentStatus": table(
        (1, f("observedGeneration", "int64")),
        (2, f("replicas", "int32")),
        (3, f("updatedReplicas", "int32")),
        (7, f("readyReplicas", "int32")),
        (4, f("availableReplicas", "int32")),
        (5, f("unavailableReplicas", "int32")),
        (9, f("terminatingReplicas", "int32", PTR)),
        (8, f("collisionCount", "int32", PTR)),
    ),
    # batch/v1
    "Job": table((1, f("metadata", "ObjectMeta")), (2, f("spec", "JobSpec")), (3, f("status", "JobStatus"))),
    "JobSpec": table(
        (1, f("parallelism", "int32", PTR)),
        (2, f("completions", "int32", PTR)),
        (3, f("activeDeadlineSeconds", "int64", PTR)),
        (7, f("backoffLimit", "int32", PTR)),
        (12, f("backoffLimitPerIndex", "int32", PTR)),
        (13, f("maxFailedIndexes", "int32", PTR)),
        (4, f("selector", "LabelSelector", PTR)),
        (5, f("manualSelector", "bool", PTR)),
        (6, f("template", "PodTemplateSpec", ALWAYS)),
        (8, f("ttlSecondsAfterFinished", "int32", PTR)),
        (9, f("completionMode", "string", PTR)),
        (10, f("suspend", "bool", PTR)),
        (14, f("podReplacementPolicy", "string", PTR)),
        (15, f("managedBy", "string", PTR)),
    ),
    "JobStatus": table(
        (2, f("startTime", "Time", PTR)),
        (3, f("completionTime", "Time", PTR)),
        (4, f("active", "int32")),
        (5, f("succeeded", "int32")),
        (6, f("failed", "int32")),
        (11, f("terminating", "int32", PTR)),
        (7, f("completedIndexes", "string")),
        (10, f("failedIndexes", "string", PTR)),
        (9, f("ready", "int32", PTR)),
    ),
    "CronJob": table(
        (1, f("metadata", "ObjectMeta")), (2, f("spec", "CronJobSpec")), (3, f("status", "CronJobStatus"))
    ),
    "CronJobSpec": table(
        (1, f("schedule", "string", ALWAYS)),
        (8, f("timeZone", "string", PTR)),
        (2, f("startingDeadlineSeconds", "int64", PTR)),
        (3, f("concurrencyPolicy", "string")),
        (4, f("suspend", "bool", PTR)),
        (5, f("jobTemplate", "JobTemplateSpec", ALWAYS)),
        (6, f("successfulJobsHistoryLimit", "int32", PTR)),
        (7, f("failedJobsHistoryLimit", "int32", PTR)),
    ),
    "CronJobStatus": table(
        (1, f("active", "[]ObjectReference")),
        (4, f("lastScheduleTime", "Time", PTR)),
        (5, f("lastSuccessfulTime", "Time", PTR)),
    ),
    "JobTemplateSpec": table((1, f("metadata", "ObjectMeta")), (2, f("spec", "JobSpec"))),
}

# (apiVersion, kind) -> the message of the object in `runtime.Unknown.raw`
KINDS: dict[tuple[str, str], str] = {
    ("v1", "Namespace"): "Namespace",
    ("v1", "ConfigMap"): "ConfigMap",
    ("v1", "Secret"): "Secret",
    ("v1", "ServiceAccount"): "ServiceAccount",
    ("v1", "Service"): "Service",
    ("v1", "ResourceQuota"): "ResourceQuota",
    ("v1", "Pod"): "Pod",
    ("scheduling.k8s.io/v1", "PriorityClass"): "PriorityClass",
    ("rbac.authorization.k8s.io/v1", "Role"): "Role",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"): "ClusterRole",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "RoleBinding",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"): "ClusterRoleBinding",
    ("policy/v1", "PodDisruptionBudget"): "PodDisruptionBudget",
    ("apps/v1", "Deployment"): "Deployment",
    ("batch/v1", "Job"): "Job",
    ("batch/v1", "CronJob"): "CronJob",
}

# What a 415 names for a message: its package-qualified Go name.
PACKAGES = {
    **dict.fromkeys(("ObjectMeta", "OwnerReference", "LabelSelector", "LabelSelectorRequirement"), "meta/v1"),
    **dict.fromkeys(("PriorityClass",), "scheduling/v1"),
    **dict.fromkeys(
        (
            "Role",
            "ClusterRole",
            "AggregationRule",
            "PolicyRule",
            "RoleBinding",
            "ClusterRoleBinding",
            "Subject",
            "RoleRef",
        ),
        "rbac/v1",
    ),
    **dict.fromkeys(
        ("PodDisruptionBudget", "PodDisruptionBudgetSpec", "PodDisruptionBudgetStatus"), "policy/v1"
    ),
    **dict.fromkeys(
        ("Deployment", "DeploymentSpec", "DeploymentStrategy", "RollingUpdateDeployment", "DeploymentStatus"),
        "apps/v1",
    ),
    **dict.fromkeys(
        ("Job", "JobSpec", "JobStatus", "CronJob", "CronJobSpec", "CronJobStatus", "JobTemplateSpec"),
        "batch/v1",
    ),
}


def qualified(message: str) -> str:
    """`v1.Container`, `apps/v1.DeploymentSpec`, `runtime.Unknown`: the message a 415 names."""
    if "." in message:
        return message
    return f"{PACKAGES.get(message, 'v1')}.{message}"
