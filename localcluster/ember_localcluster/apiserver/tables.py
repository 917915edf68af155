"""Server-side printing: `meta.k8s.io/v1 Table` responses for `kubectl get`.

kubectl asks for `Accept: application/json;as=Table;v=v1;g=meta.k8s.io` and prints whatever columns the
server sends. Custom resources get Name plus their CRD's `additionalPrinterColumns` (or Name and Age when
there are none), each evaluated with the simple JSONPath the CRD API allows: `.a.b`, `.a[0]`, `.a[*].b`
and `.a[?(@.k=="v")].b`. Built-ins get Name, Age and the obvious few columns (`kubectl get pods` shows
Ready, Status, Restarts; `-o wide` adds IP and Node; `kubectl get nodes` shows Status, Roles, Age and
Version as kube-apiserver's node printer does: `Ready`/`NotReady`/`Unknown` from the Ready condition plus
`SchedulingDisabled` when cordoned, roles from `node-role.kubernetes.io/<role>` and `kubernetes.io/role`
labels or `<none>`; `-o wide` adds Internal-IP, External-IP, OS-Image, Kernel-Version and
Container-Runtime). Rows carry the object's metadata (or the whole
object with `includeObject=Object`), which kubectl needs for `--show-labels` and `-A`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from .resources import ResourceType

_TOKEN = re.compile(
    r"""\.(?P<field>[A-Za-z0-9_\-]+)|\[(?P<index>\d+|\*)\]|\[\?\(@\.(?P<key>[A-Za-z0-9_.\-]+)\s*==\s*["'](?P<value>[^"']*)["']\)\]"""
)

_NAME = {
    "name": "Name",
    "type": "string",
    "format": "name",
    "description": "Name must be unique within a namespace.",
    "priority": 0,
}
_AGE = {"name": "Age", "type": "string", "format": "", "description": "Time since creation.", "priority": 0}


def wants_table(accept: str) -> str | None:
    """The Table apiVersion the Accept header asks for, if it asks for one."""
    for option in accept.split(","):
        params = {
            p.split("=", 1)[0].strip(): p.split("=", 1)[1].strip() for p in option.split(";")[1:] if "=" in p
        }
        if params.get("as") == "Table" and params.get("g") == "meta.k8s.io":
            return f"meta.k8s.io/{params.get('v', 'v1')}"
    return None


def jsonpath(obj: Any, path: str) -> list[Any]:
    nodes = [obj]
    path = path.strip().removeprefix("{").removesuffix("}")
    position = 0
    while position < len(path):
        m = _TOKEN.match(path, position)
        if m is None:
            return []
        position = m.end()
        found: list[Any] = []
        for node in nodes:
            if m.group("field") is not None:
                if isinstance(node, dict) and m.group("field") in node:
                    found.append(node[m.group("field")])
            elif m.group("index") is not None:
                if isinstance(node, list):
                    index = m.group("index")
                    found.extend(node if index == "*" else node[int(index) : int(index) + 1])
            elif isinstance(node, list):
                found.extend(item for item in node if _match_filter(item, m.group("key"), m.group("value")))
        nodes = found
    return nodes


def _match_filter(item: Any, key: str, value: str) -> bool:
    results = jsonpath(item, "." + key)
    return bool(results) and str(results[0]) == value


def age(created: str | None) -> str:
    """Kubernetes' `HumanDuration` of the time since `created` (an RFC 3339 timestamp)."""
    if not created:
        return "<unknown>"
    try:
        then = datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return created
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    seconds = int((datetime.now(UTC) - then).total_seconds())
    seconds = max(seconds, 0)
    minutes, hours, days = seconds // 60, seconds // 3600, seconds // 86400
    if seconds < 120:
        return f"{seconds}s"
    if minutes < 10:
        return f"{minutes}m{seconds % 60}s" if seconds % 60 else f"{minutes}m"
    if hours < 3:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if days < 8:
        return f"{days}d{hours % 24}h" if hours % 24 else f"{days}d"
    return f"{days}d"


def _column(name: str, kind: str = "string", priority: int = 0) -> dict[str, Any]:
    return {"name": name, "type": kind, "format": "", "description": name, "priority": priority}


def _age_of(obj: dict[str, Any]) -> str:
    return age(obj["metadata"].get("creationTimestamp"))


def _terminated_reason(terminated: dict[str, Any], prefix: str = "") -> str:
    if terminated.get("reason"):
        return prefix + terminated["reason"]
    if terminated.get("signal"):
        return f"{prefix}Signal:{terminated['signal']}"
    return f"{prefix}ExitCode:{terminated.get('exitCode', 0)}"


def _pod_cells(pod: dict[str, Any]) -> list[Any]:
    """READY, STATUS, RESTARTS as kube-apiserver's pod printer (`printPod`) computes them: the phase (or the
    pod's reason), then the first init container not done (`Init:N/M`, `Init:Error`,
    `Init:CrashLoopBackOff`), else the containers' waiting or terminated reasons, and Terminating."""
    spec, status = pod.get("spec") or {}, pod.get("status") or {}
    phase = status.get("phase", "Pending")
    reason = status.get("reason") or phase
    restarts = ready = 0
    init_specs = spec.get("initContainers") or []
    initializing = False
    for i, c in enumerate(status.get("initContainerStatuses") or []):
        restarts += int(c.get("restartCount", 0))
        state = c.get("state") or {}
        terminated, waiting = state.get("terminated"), state.get("waiting") or {}
        if terminated is not None and terminated.get("exitCode") == 0:
            continue
        if terminated is not None:
            reason = _terminated_reason(terminated, "Init:")
        elif waiting.get("reason") and waiting["reason"] != "PodInitializing":
            reason = "Init:" + waiting["reason"]
        else:
            reason = f"Init:{i}/{len(init_specs)}"
        initializing = True
        break
    initialized = any(
        c.get("type") == "Initialized" and c.get("status") == "True" for c in status.get("conditions") or []
    )
    if not initializing or initialized:
        restarts, running = 0, False
        for c in reversed(status.get("containerStatuses") or []):
            restarts += int(c.get("restartCount", 0))
            state = c.get("state") or {}
            if (state.get("waiting") or {}).get("reason"):
                reason = state["waiting"]["reason"]
            elif state.get("terminated") is not None:
                reason = _terminated_reason(state["terminated"])
            elif c.get("ready") and "running" in state:
                running = True
                ready += 1
        if reason == "Completed" and running:
            pod_ready = any(
                c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
            )
            reason = "Running" if pod_ready else "NotReady"
    if pod["metadata"].get("deletionTimestamp") and phase not in ("Succeeded", "Failed"):
        reason = "Terminating"
    return [
        f"{ready}/{len(spec.get('containers') or [])}",
        reason,
        restarts,
        _age_of(pod),
        status.get("podIP") or "<none>",
        spec.get("nodeName") or "<none>",
    ]


def _node_cells(node: dict[str, Any]) -> list[Any]:
    status, labels = node.get("status") or {}, node["metadata"].get("labels") or {}
    ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
    state = ["Unknown"] if ready is None else ["Ready" if ready.get("status") == "True" else "NotReady"]
    if (node.get("spec") or {}).get("unschedulable"):
        state.append("SchedulingDisabled")
    roles = {
        k.removeprefix("node-role.kubernetes.io/") for k in labels if k.startswith("node-role.kubernetes.io/")
    }
    if labels.get("kubernetes.io/role"):
        roles.add(labels["kubernetes.io/role"])
    roles.discard("")
    info = status.get("nodeInfo") or {}

    def address(kind: str) -> str:
        return next((a["address"] for a in status.get("addresses") or [] if a.get("type") == kind), "<none>")

    return [
        ",".join(state),
        ",".join(sorted(roles)) or "<none>",
        _age_of(node),
        info.get("kubeletVersion", ""),
        address("InternalIP"),
        address("ExternalIP"),
        info.get("osImage") or "<unknown>",
        info.get("kernelVersion") or "<unknown>",
        info.get("containerRuntimeVersion") or "<unknown>",
    ]


def _format_labels(labels: dict[str, Any] | None) -> str:
    """labels.FormatLabels: `k=v` sorted by key, comma-joined; `<none>` for none."""
    return ",".join(f"{k}={v}" for k, v in sorted((labels or {}).items())) or "<none>"


def _format_selector(selector: dict[str, Any] | None) -> str:
    """metav1.FormatLabelSelector: matchLabels then matchExpressions as `key in (a,b)`, `!key`, ..."""
    if not selector:
        return "<none>"
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr.get("key", ""), expr.get("operator", ""), ",".join(expr.get("values") or ())
        parts.append(
            {"In": f"{key} in ({values})", "NotIn": f"{key} notin ({values})", "Exists": key}.get(
                op, f"!{key}"
            )
        )
    return ",".join(parts) or "<none>"


def _external_ip(svc: dict[str, Any]) -> str:
    """getServiceExternalIP, as the server prints it (wide: a load balancer's addresses are not clipped)."""
    spec = svc.get("spec") or {}
    kind, external = spec.get("type", "ClusterIP"), list(spec.get("externalIPs") or ())
    if kind in ("ClusterIP", "NodePort"):
        return ",".join(external) or "<none>"
    if kind == "ExternalName":
        return str(spec.get("externalName", ""))
    if kind != "LoadBalancer":
        return "<unknown>"
    ingress = ((svc.get("status") or {}).get("loadBalancer") or {}).get("ingress") or ()
    balanced = sorted({i.get("ip") or i.get("hostname") for i in ingress if i.get("ip") or i.get("hostname")})
    return ",".join([*balanced, *external]) or "<pending>"


def _service_cells(svc: dict[str, Any]) -> list[Any]:
    spec = svc.get("spec") or {}
    ports = ",".join(
        f"{p.get('port')}:{p['nodePort']}/{p.get('protocol', 'TCP')}"
        if p.get("nodePort")
        else f"{p.get('port')}/{p.get('protocol', 'TCP')}"
        for p in spec.get("ports") or ()
    )
    cluster_ip = (spec.get("clusterIPs") or [spec.get("clusterIP")])[0] or "<none>"
    return [
        spec.get("type", "ClusterIP"),
        cluster_ip,
        _external_ip(svc),
        ports or "<none>",
        _age_of(svc),
        _format_labels(spec.get("selector")),
    ]


def _containers(template: dict[str, Any] | None) -> list[Any]:
    """layoutContainerCells: the template's container names and images, each comma-joined."""
    containers = ((template or {}).get("spec") or {}).get("containers") or ()
    return [",".join(c.get("name", "") for c in containers), ",".join(c.get("image", "") for c in containers)]


def _deployment_cells(deploy: dict[str, Any]) -> list[Any]:
    spec, status = deploy.get("spec") or {}, deploy.get("status") or {}
    ready = f"{status.get('readyReplicas', 0)}/{spec.get('replicas', 1)}"
    return [
        ready,
        status.get("updatedReplicas", 0),
        status.get("availableReplicas", 0),
        _age_of(deploy),
        *_containers(spec.get("template")),
        _format_selector(spec.get("selector")),
    ]


def _replicaset_cells(rs: dict[str, Any]) -> list[Any]:
    spec, status = rs.get("spec") or {}, rs.get("status") or {}
    return [
        spec.get("replicas", 1),
        status.get("replicas", 0),
        status.get("readyReplicas", 0),
        _age_of(rs),
        *_containers(spec.get("template")),
        _format_selector(spec.get("selector")),
    ]


def _pdb_cells(pdb: dict[str, Any]) -> list[Any]:
    spec = pdb.get("spec") or {}
    bounds = [str(spec[k]) if spec.get(k) is not None else "N/A" for k in ("minAvailable", "maxUnavailable")]
    return [*bounds, (pdb.get("status") or {}).get("disruptionsAllowed", 0), _age_of(pdb)]


def _event_cells(event: dict[str, Any]) -> list[Any]:
    involved = event.get("involvedObject") or event.get("regarding") or {}
    target = f"{(involved.get('kind') or '').lower()}/{involved.get('name', '')}"
    return [
        event.get("type", ""),
        event.get("reason", ""),
        target,
        event.get("message") or event.get("note", ""),
        _age_of(event),
    ]


# The `-o wide` columns of the workload kinds.
_WORKLOAD = [
    _column("Containers", priority=1),
    _column("Images", priority=1),
    _column("Selector", priority=1),
]

# Kind → (columns after Name, a function giving their cells); other kinds show Name and Age.
_BUILTIN_COLUMNS: dict[str, tuple[list[dict[str, Any]], Callable[[dict[str, Any]], list[Any]]]] = {
    "Pod": (
        [
            _column("Ready"),
            _column("Status"),
            _column("Restarts", "integer"),
            _AGE,
            _column("IP", priority=1),
            _column("Node", priority=1),
        ],
        _pod_cells,
    ),
    "Service": (
        [
            _column("Type"),
            _column("Cluster-IP"),
            _column("External-IP"),
            _column("Port(s)"),
            _AGE,
            _column("Selector", priority=1),
        ],
        _service_cells,
    ),
    "Node": (
        [
            _column("Status"),
            _column("Roles"),
            _AGE,
            _column("Version"),
            _column("Internal-IP", priority=1),
            _column("External-IP", priority=1),
            _column("OS-Image", priority=1),
            _column("Kernel-Version", priority=1),
            _column("Container-Runtime", priority=1),
        ],
        _node_cells,
    ),
    "Deployment": (
        [
            _column("Ready"),
            _column("Up-to-date", "integer"),
            _column("Available", "integer"),
            _AGE,
            *_WORKLOAD,
        ],
        _deployment_cells,
    ),
    "ReplicaSet": (
        [
            _column("Desired", "integer"),
            _column("Current", "integer"),
            _column("Ready", "integer"),
            _AGE,
            *_WORKLOAD,
        ],
        _replicaset_cells,
    ),
    "PodDisruptionBudget": (
        [
            _column("Min Available"),
            _column("Max Unavailable"),
            _column("Allowed Disruptions", "integer"),
            _AGE,
        ],
        _pdb_cells,
    ),
    "ConfigMap": (
        [_column("Data", "integer"), _AGE],
        lambda cm: [len(cm.get("data") or {}) + len(cm.get("binaryData") or {}), _age_of(cm)],
    ),
    "Secret": (
        [_column("Type"), _column("Data", "integer"), _AGE],
        lambda s: [s.get("type", "Opaque"), len(s.get("data") or {}), _age_of(s)],
    ),
    "Namespace": (
        [_column("Status"), _AGE],
        lambda ns: [(ns.get("status") or {}).get("phase", "Active"), _age_of(ns)],
    ),
    "Event": (
        [_column("Type"), _column("Reason"), _column("Object"), _column("Message"), _AGE],
        _event_cells,
    ),
}


def _custom_cell(obj: dict[str, Any], column: dict[str, Any]) -> Any:
    values = jsonpath(obj, column.get("jsonPath", ""))
    if not values:
        return None
    if column.get("type") == "date":
        return age(str(values[0]))
    if len(values) > 1 or column.get("type") == "string":
        return ",".join(str(v) for v in values)
    return values[0]


Columns = tuple[list[dict[str, Any]], Callable[[dict[str, Any]], list[Any]]]


def _custom_columns(rtype: ResourceType) -> Columns:
    printer = list(rtype.printer_columns) or [
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}
    ]
    columns = [
        {
            "name": c["name"],
            # Dates are rendered here as ages, so kubectl gets them as strings.
            "type": "string" if c.get("type") == "date" else c.get("type", "string"),
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in printer
    ]
    return [_NAME, *columns], lambda obj: [_custom_cell(obj, c) for c in printer]


def _builtin_columns(rtype: ResourceType) -> Columns:
    extra, cells = _BUILTIN_COLUMNS.get(rtype.kind, ([_AGE], lambda obj: [_age_of(obj)]))
    return [_NAME, *extra], cells


def to_table(
    rtype: ResourceType,
    objects: list[dict[str, Any]],
    api_version: str,
    include_object: str,
    list_meta: dict[str, Any],
) -> dict[str, Any]:
    columns, cells = _custom_columns(rtype) if rtype.custom else _builtin_columns(rtype)
    rows = []
    for obj in objects:
        try:
            values = cells(obj)
        except (AttributeError, TypeError, ValueError):
            # Built-ins are stored unvalidated; a malformed one still lists, with unknown cells.
            values = ["<unknown>"] * (len(columns) - 1)
        row: dict[str, Any] = {"cells": [obj["metadata"]["name"], *values]}
        if include_object == "Object":
            row["object"] = obj
        elif include_object != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": api_version,
        "metadata": list_meta,
        "columnDefinitions": columns,
        "rows": rows,
    }
