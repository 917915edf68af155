"""What kube-scheduler's default filters decide, shared by the local scheduler (`scheduler.py`) and the
process kubelet's admission: a pod's resource requests, a node's free resources, taints and tolerations,
node selectors and required node affinity, and the message kube-scheduler writes when no node fits.

* **Requests.** As `resource.PodRequests` computes them: the sum over containers, or the largest init
  container when that is more (restartable init containers, i.e. sidecars, add to the sum), plus
  `spec.overhead`. A container's missing request takes its limit, as core/v1 defaulting
  (`SetDefaults_Pod`) fills it in; so an extended resource such as `nvidia.com/gpu`, which may only be
  given as a limit, requests its limit. cpu counts in millicores and everything else in units, rounded up
  as `resource.Quantity` does.
* **A node's free resources** are its `status.allocatable` minus the requests of the pods bound to it
  that have not ended (phase Succeeded or Failed); a pod being deleted still counts until it is gone, as
  in the scheduler's cache.
* **Filters**, in the default profile's order, a node's first failing filter giving its reasons (the
  framework stops there): NodeUnschedulable (`spec.unschedulable` unless the pod tolerates
  `node.kubernetes.io/unschedulable:NoSchedule`: "node(s) were unschedulable"), TaintToleration (the
  first NoSchedule/NoExecute taint no toleration matches; operators Equal and Exists, an empty key with
  Exists matching every taint and an empty effect every effect: "node(s) had untolerated taint(s)", the
  wording since kubernetes/kubernetes#134740, which stopped printing the taint's key and value),
  NodeAffinity (`nodeSelector` and the required terms of `affinity.nodeAffinity`, with In, NotIn, Exists,
  DoesNotExist, Gt and Lt and matchFields on `metadata.name`: "node(s) didn't match Pod's node
  affinity/selector") and NodeResourcesFit ("Too many pods", "Insufficient cpu", "Insufficient memory",
  "Insufficient ephemeral-storage", "Insufficient <extended resource>").
* **The FitError message**, as kube-scheduler's default profile (v1.34 and later, where the
  DynamicResources plugin runs before DefaultPreemption) writes it into the `PodScheduled` condition:
  `0/N nodes are available: <count> <reason>, ... no new claims to deallocate, preemption: 0/N nodes are
  available: <count> <reason>, ....` with the reasons counted over nodes and sorted as strings; the part
  after `preemption:` is `preemption.py`'s verdict (a node with no pod of lower priority reads "No
  preemption victims found for incoming pod", one whose failure preemption cannot resolve "Preemption is
  not helpful for scheduling"; a pod with `preemptionPolicy: Never` reads "preemption: not eligible due to
  preemptionPolicy=Never."). When preemption found victims, the message ends after the filters' reasons.
* **Scoring**: each plugin's raw score for one node, which `interpod.py` normalises and weighs as the
  default profile does: untolerated PreferNoSchedule taints (TaintToleration), the weights of matching
  preferred node affinity terms (NodeAffinity), and NodeResourcesFit's LeastAllocated score over cpu and
  memory (each container without a request counting kube-scheduler's defaults, 100m and 200Mi).

Not modelled: host ports (NodePorts), volume limits and zones (inter-pod affinity and topology spreading
are in `interpod.py`), dynamic resource allocation (a pod's `resourceClaims` are ignored), pod-level resources,
scheduling gates beyond leaving gated pods alone (priorities and preemption are `preemption.py`'s).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

__all__ = [
    "FitResult",
    "NodeInfo",
    "failure_message",
    "filter_node",
    "is_terminal",
    "least_allocated",
    "matches_node_affinity",
    "pod_requests",
    "prefer_no_schedule",
    "preferred_node_affinity",
    "quantity",
    "untolerated_taint",
]

CPU, MEMORY, PODS, EPHEMERAL = "cpu", "memory", "pods", "ephemeral-storage"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
# kube-scheduler's stand-ins for a container without a cpu or memory request, when it scores.
DEFAULT_MILLI_CPU, DEFAULT_MEMORY = 100, 200 * 1024 * 1024

REASON_UNSCHEDULABLE = "node(s) were unschedulable"
REASON_TAINT = "node(s) had untolerated taint(s)"
REASON_AFFINITY = "node(s) didn't match Pod's node affinity/selector"
REASON_TOO_MANY_PODS = "Too many pods"
NO_NODES = "no nodes available to schedule pods"
NO_CLAIMS = "no new claims to deallocate"
NOT_HELPFUL = "Preemption is not helpful for scheduling"
NO_VICTIMS = "No preemption victims found for incoming pod"
NOT_ELIGIBLE = "not eligible due to preemptionPolicy=Never."

_QUANTITY = re.compile(r"^([+-]?(?:\d+(?:\.\d*)?|\.\d+))(Ki|Mi|Gi|Ti|Pi|Ei|[eE][+-]?\d+|n|u|m|k|M|G|T|P|E)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "64Gi", "1e3", 2) as an exact number; ValueError when it is none."""
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        raise ValueError(f"quantities must match the regular expression {_QUANTITY.pattern!r}: {value!r}")
    number, suffix = Decimal(match.group(1)), match.group(2) or ""
    if suffix in _BINARY:
        return number * Decimal(1024 ** _BINARY[suffix])
    if suffix[:1] in ("e", "E") and len(suffix) > 1:
        return number.scaleb(int(suffix[1:]))
    return number.scaleb(_DECIMAL[suffix])


def _amount(resource: str, value: Any) -> int:
    """cpu in millicores, the rest in units, rounded up as `Quantity.MilliValue()`/`Value()` round."""
    number = quantity(value) * (1000 if resource == CPU else 1)
    return math.ceil(number)


def _counts(resource: str) -> bool:
    """Whether the scheduler accounts for this resource name (native cpu/memory/storage, or scalar)."""
    if resource in (CPU, MEMORY, EPHEMERAL):
        return True
    if resource.startswith(("hugepages-", "attachable-volumes-")):
        return True
    # Extended resources: a domain-qualified name outside kubernetes.io (e.g. nvidia.com/gpu).
    return "/" in resource and "kubernetes.io/" not in resource and not resource.startswith("requests.")


def _container_requests(container: Mapping[str, Any]) -> dict[str, int]:
    resources = container.get("resources") or {}
    limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
    out: dict[str, int] = {}
    for name in {*limits, *requests}:
        if _counts(name):
            out[name] = _amount(name, requests[name] if name in requests else limits[name])
    return out


def _add(total: dict[str, int], more: Mapping[str, int]) -> None:
    for name, amount in more.items():
        total[name] = total.get(name, 0) + amount


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """What the pod requests (see the module docstring); resources it does not request are absent."""
    spec = pod.get("spec") or {}
    total: dict[str, int] = {}
    for container in spec.get("containers") or []:
        _add(total, _container_requests(container))
    sidecars: dict[str, int] = {}
    largest_init: dict[str, int] = {}
    for container in spec.get("initContainers") or []:
        requests = _container_requests(container)
        if container.get("restartPolicy") == "Always":
            _add(sidecars, requests)
            _add(total, requests)
            continue
        # A regular init container runs beside the sidecars started before it.
        with_sidecars = dict(sidecars)
        _add(with_sidecars, requests)
        for name, amount in with_sidecars.items():
            largest_init[name] = max(largest_init.get(name, 0), amount)
    for name, amount in largest_init.items():
        total[name] = max(total.get(name, 0), amount)
    _add(total, {n: _amount(n, v) for n, v in (spec.get("overhead") or {}).items() if _counts(n)})
    return {name: amount for name, amount in total.items() if amount}


def _nonzero_requests(pod: Mapping[str, Any]) -> tuple[int, int]:
    """(millicores, bytes) as kube-scheduler scores them: unset container requests count its defaults."""
    cpu = memory = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        requests = _container_requests(container)
        cpu += requests.get(CPU, DEFAULT_MILLI_CPU)
        memory += requests.get(MEMORY, DEFAULT_MEMORY)
    return cpu, memory


def is_terminal(pod: Mapping[str, Any]) -> bool:
    return (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")


@dataclass
class NodeInfo:
    """A node and the pods bound to it that have not ended."""

    node: dict[str, Any]
    pods: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return str(self.node["metadata"]["name"])

    def allocatable(self) -> dict[str, int]:
        amounts = (self.node.get("status") or {}).get("allocatable") or {}
        out = {}
        for name, value in amounts.items():
            try:
                out[name] = _amount(name, value)
            except ValueError:
                continue
        return out

    def requested(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for pod in self.pods:
            _add(total, pod_requests(pod))
        return total


@dataclass(frozen=True)
class FitResult:
    """One node's verdict: no reasons means the pod fits; `resolvable` is kube-scheduler's Unschedulable
    (False: UnschedulableAndUnresolvable, which preemption cannot help)."""

    reasons: tuple[str, ...] = ()
    resolvable: bool = True

    @property
    def fits(self) -> bool:
        return not self.reasons


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """`Toleration.ToleratesTaint`: effect, key, then the operator (empty means Equal)."""
    effect, key = toleration.get("effect") or "", toleration.get("key") or ""
    if effect and effect != taint.get("effect"):
        return False
    if key and key != taint.get("key"):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Exists":
        return True
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def _tolerated(pod: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    return any(tolerates(t, taint) for t in (pod.get("spec") or {}).get("tolerations") or [])


def untolerated_taint(
    pod: Mapping[str, Any], node: Mapping[str, Any], effects: Iterable[str] = ("NoSchedule", "NoExecute")
) -> dict[str, Any] | None:
    """The node's first taint with one of `effects` that the pod does not tolerate."""
    wanted = set(effects)
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in wanted and not _tolerated(pod, taint):
            return dict(taint)
    return None


def _expression_matches(expression: Mapping[str, Any], values_of: Mapping[str, str]) -> bool:
    key, operator = expression.get("key", ""), expression.get("operator", "")
    values = list(expression.get("values") or [])
    present = key in values_of
    if operator == "In":
        return present and values_of[key] in values
    if operator == "NotIn":
        return not present or values_of[key] not in values
    if operator == "Exists":
        return present
    if operator == "DoesNotExist":
        return not present
    if operator in ("Gt", "Lt") and present and len(values) == 1:
        try:
            have, bound = int(values_of[key]), int(values[0])
        except ValueError:
            return False
        return have > bound if operator == "Gt" else have < bound
    return False


def _term_matches(term: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False  # an empty term matches no node
    labels = (node.get("metadata") or {}).get("labels") or {}
    name = {"metadata.name": (node.get("metadata") or {}).get("name", "")}
    return all(_expression_matches(e, labels) for e in expressions) and all(
        _expression_matches(f, name) for f in fields
    )


def matches_node_affinity(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """`nodeSelector` and the required node affinity terms (ORed; their requirements ANDed)."""
    spec = pod.get("spec") or {}
    labels = (node.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = ((spec.get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    if required is None:
        return True
    return any(_term_matches(term, node) for term in required.get("nodeSelectorTerms") or [])


def _resource_order(name: str) -> tuple[int, str]:
    return ({CPU: 0, MEMORY: 1, EPHEMERAL: 2}.get(name, 3), name)


def insufficient(pod: Mapping[str, Any], info: NodeInfo) -> list[tuple[str, int, int, int]]:
    """NodeResourcesFit's `fitsRequest`: (resource, requested, used, allocatable) for each shortfall."""
    allocatable, used = info.allocatable(), info.requested()
    count = len(info.pods)
    short = []
    if count + 1 > allocatable.get(PODS, 0):
        short.append((PODS, 1, count, allocatable.get(PODS, 0)))
    for name, amount in sorted(pod_requests(pod).items(), key=lambda item: _resource_order(item[0])):
        if amount > allocatable.get(name, 0) - used.get(name, 0):
            short.append((name, amount, used.get(name, 0), allocatable.get(name, 0)))
    return short


def filter_node(pod: Mapping[str, Any], info: NodeInfo) -> FitResult:
    """The default profile's filters on one node, stopping at the first that fails."""
    node = info.node
    if (node.get("spec") or {}).get("unschedulable") and not _tolerated(
        pod, {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}
    ):
        return FitResult((REASON_UNSCHEDULABLE,), resolvable=False)
    if untolerated_taint(pod, node) is not None:
        return FitResult((REASON_TAINT,), resolvable=False)
    if not matches_node_affinity(pod, node):
        return FitResult((REASON_AFFINITY,), resolvable=False)
    short = insufficient(pod, info)
    reasons = tuple(REASON_TOO_MANY_PODS if name == PODS else f"Insufficient {name}" for name, *_ in short)
    return FitResult(reasons)


def _histogram(reasons: Iterable[str]) -> str:
    return ", ".join(sorted(f"{count} {reason}" for reason, count in Counter(reasons).items()))


def failure_message(results: Mapping[str, FitResult], preemption: str) -> str:
    """kube-scheduler's FitError text for a pod that fits none of the nodes in `results` (one per node);
    `preemption` is DefaultPreemption's verdict (`preemption.py`), empty when it found victims."""
    total = len(results)
    if not total:
        return NO_NODES
    head = f"0/{total} nodes are available: {_histogram(r for res in results.values() for r in res.reasons)}."
    if not preemption:
        return head  # the PostFilter succeeded: its message, and the ones before it, are dropped
    return f"{head} {NO_CLAIMS}, preemption: {preemption}"


def prefer_no_schedule(pod: Mapping[str, Any], info: NodeInfo) -> int:
    """TaintToleration's raw score: the node's PreferNoSchedule taints the pod does not tolerate."""
    return sum(
        1
        for taint in (info.node.get("spec") or {}).get("taints") or []
        if taint.get("effect") == "PreferNoSchedule" and not _tolerated(pod, taint)
    )


def preferred_node_affinity(pod: Mapping[str, Any], info: NodeInfo) -> int:
    """NodeAffinity's raw score: the weights of the preferred node affinity terms the node matches."""
    preferred = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    terms = preferred.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    return sum(
        int(t.get("weight") or 0) for t in terms if _term_matches(t.get("preference") or {}, info.node)
    )


def least_allocated(pod: Mapping[str, Any], info: NodeInfo) -> int:
    """NodeResourcesFit's LeastAllocated score (0-100) over cpu and memory, each weighted 1."""
    allocatable = info.allocatable()
    cpu, memory = _nonzero_requests(pod)
    for other in info.pods:
        more_cpu, more_memory = _nonzero_requests(other)
        cpu, memory = cpu + more_cpu, memory + more_memory
    scores = []
    for requested, capacity in ((cpu, allocatable.get(CPU, 0)), (memory, allocatable.get(MEMORY, 0))):
        scores.append(
            0 if capacity == 0 or requested > capacity else (capacity - requested) * 100 // capacity
        )
    return sum(scores) // len(scores)
