"""Priority preemption as kube-scheduler's default profile does it (the DefaultPreemption PostFilter,
pkg/scheduler/framework/preemption and plugins/defaultpreemption), and the nominated pods its filters count
(`RunFilterPluginsWithNominatedPods`). Pure: every decision is over `fit.NodeInfo`s; `scheduler.py` makes
the API calls.

* **Nominated pods.** A pending pod with `status.nominatedNodeName` holds room on that node: when the
  filters judge a pod on a node, the pods nominated there with at least its priority (not itself) count as
  if bound; a node that passes with them is judged again without them, and both must pass.
* **Eligibility** (`PodEligibleToPreemptOthers`): a pod with `preemptionPolicy: Never` preempts nothing
  ("not eligible due to preemptionPolicy=Never."); nor does one whose nominated node (unless it now fails
  there for a reason preemption cannot resolve) still has a lower-priority pod terminating because the
  scheduler preempted it ("not eligible due to a terminating pod on the nominated node.").
* **Candidate nodes** are those whose filter failure is resolvable (`fit.FitResult.resolvable`; node
  affinity and selectors, taints, cordons, required pod affinity and missing topology labels are
  UnschedulableAndUnresolvable: "Preemption is not helpful for scheduling").
* **Victims on a node** (`SelectVictimsOnNode`): every pod of lower priority is taken off (none: "No
  preemption victims found for incoming pod"); if the pod still does not fit, the filters' reasons are the
  node's; else the pods are put back one by one, those whose PodDisruptionBudget would be broken first,
  then the others, each group most important first (higher priority, then earlier `status.startTime`),
  and a pod stays a victim only when putting it back leaves no room. A budget is broken when the pods it
  selects (in its namespace; an empty or missing selector selects none) that are not already in its
  `status.disruptedPods` outnumber `status.disruptionsAllowed`.
* **The node** (`pickOneNodeForPreemption`): fewest budget violations, then the least important most
  important victim, the smallest sum of victim priorities, the fewest victims, the latest start among the
  most important victims; then the first name (upstream takes the first of a list that starts at a random
  node).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from ember_localcluster import fit, interpod
from ember_localcluster.apiserver.eviction import selector_matches

__all__ = [
    "Candidate",
    "Outcome",
    "filter_nodes",
    "importance",
    "preempt",
    "priority",
    "terminating_by_preemption",
]

NOT_TERMINATED = "not eligible due to a terminating pod on the nominated node."
PREEMPTED_REASON = "PreemptionByScheduler"
_OFFSET = 2**31  # MaxInt32 + 1: every priority counted as non-negative in a sum

Pod = Mapping[str, Any]
Nominated = Mapping[str, Sequence[Pod]]  # node name -> the pending pods nominated to it


def priority(pod: Pod) -> int:
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) else 0


def _uid(pod: Pod) -> str:
    return str((pod.get("metadata") or {}).get("uid") or "")


def start_time(pod: Pod, now: datetime) -> datetime:
    """`GetPodStartTime`: `status.startTime`, or now for a pod not started yet."""
    stamp = (pod.get("status") or {}).get("startTime")
    if isinstance(stamp, str):
        try:
            return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        except ValueError:
            pass
    return now


def importance(now: datetime) -> Any:
    """A sort key putting the more important pod first (`MoreImportantPod`)."""
    return lambda pod: (-priority(pod), start_time(pod, now))


def terminating_by_preemption(pod: Pod) -> bool:
    """Being deleted, with the DisruptionTarget condition that preemption set."""
    if not (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    for condition in (pod.get("status") or {}).get("conditions") or []:
        if condition.get("type") == "DisruptionTarget":
            return condition.get("status") == "True" and condition.get("reason") == PREEMPTED_REASON
    return False


def _with_nominated(
    pod: Pod, infos: Mapping[str, fit.NodeInfo], name: str, nominated: Nominated
) -> dict[str, fit.NodeInfo] | None:
    """`infos` with the pods nominated to `name` that are at least as important as `pod` added there; None
    when there is none."""
    own = priority(pod)
    added = [p for p in nominated.get(name, ()) if priority(p) >= own and _uid(p) != _uid(pod)]
    if not added:
        return None
    out = dict(infos)
    out[name] = fit.NodeInfo(infos[name].node, [*infos[name].pods, *(dict(p) for p in added)])
    return out


def filter_node(
    pod: Pod,
    infos: Mapping[str, fit.NodeInfo],
    name: str,
    nominated: Nominated,
    without: fit.FitResult | None = None,
) -> fit.FitResult:
    """One node's verdict with the nominated pods counted (`without`: the verdict without them, if known)."""
    added = _with_nominated(pod, infos, name, nominated)
    if added is not None:
        result = interpod.filter_node(pod, added, name)
        if not result.fits:
            return result
    return without if without is not None else interpod.filter_node(pod, infos, name)


def filter_nodes(
    pod: Pod, infos: Mapping[str, fit.NodeInfo], nominated: Nominated
) -> dict[str, fit.FitResult]:
    """Every node's verdict through the default profile's filters, nominated pods counted."""
    results = interpod.filter_nodes(pod, infos)
    for name in infos:
        if nominated.get(name):
            results[name] = filter_node(pod, infos, name, nominated, without=results[name])
    return results


def _breaks_budgets(
    pods: Iterable[dict[str, Any]], budgets: Sequence[Pod]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`filterPodsWithPDBViolation`: the pods whose eviction would break a budget, and the others, each in
    the order given."""
    allowed = [int((b.get("status") or {}).get("disruptionsAllowed") or 0) for b in budgets]
    violating: list[dict[str, Any]] = []
    other: list[dict[str, Any]] = []
    for pod in pods:
        meta = pod.get("metadata") or {}
        labels = dict(meta.get("labels") or {})
        broken = False
        for i, budget in enumerate(budgets if labels else ()):
            bmeta = budget.get("metadata") or {}
            if (bmeta.get("namespace") or "") != (meta.get("namespace") or ""):
                continue
            selector = (budget.get("spec") or {}).get("selector")
            empty = not isinstance(selector, dict) or not (
                selector.get("matchLabels") or selector.get("matchExpressions")
            )
            if empty or selector_matches(selector, labels) is not True:
                continue
            if meta.get("name") in ((budget.get("status") or {}).get("disruptedPods") or {}):
                continue
            allowed[i] -= 1
            if allowed[i] < 0:
                broken = True
        (violating if broken else other).append(pod)
    return violating, other


@dataclass(frozen=True)
class Candidate:
    """A node the pod could go to once `victims` (most important first) are gone."""

    node: str
    victims: tuple[dict[str, Any], ...]
    budget_violations: int


def select_victims(
    pod: Pod,
    infos: Mapping[str, fit.NodeInfo],
    name: str,
    nominated: Nominated,
    budgets: Sequence[Pod],
    now: datetime,
) -> Candidate | fit.FitResult:
    """`SelectVictimsOnNode` (see the module docstring): the candidate, or the node's failure."""
    info, own = infos[name], priority(pod)
    potential = [p for p in info.pods if priority(p) < own]
    if not potential:
        return fit.FitResult((fit.NO_VICTIMS,), resolvable=False)
    trial = dict(infos)
    kept = [p for p in info.pods if priority(p) >= own]
    trial[name] = fit.NodeInfo(info.node, kept)
    result = filter_node(pod, trial, name, nominated)
    if not result.fits:
        return result
    key = importance(now)
    potential.sort(key=key)
    violating, other = _breaks_budgets(potential, budgets)
    victims: list[dict[str, Any]] = []
    violations = 0
    for group, breaks in ((violating, 1), (other, 0)):
        for victim in group:
            trial[name] = fit.NodeInfo(info.node, [*kept, victim])
            if filter_node(pod, trial, name, nominated).fits:
                kept.append(victim)
            else:
                victims.append(dict(victim))
                violations += breaks
            trial[name] = fit.NodeInfo(info.node, kept)
    if violating and other:
        victims.sort(key=key)
    return Candidate(name, tuple(victims), violations)


def pick(candidates: Sequence[Candidate], now: datetime) -> Candidate:
    """`pickOneNodeForPreemption` with the default score functions, ties to the node's name."""

    def earliest_top(c: Candidate) -> float:
        top = max(priority(v) for v in c.victims)
        return min(start_time(v, now) for v in c.victims if priority(v) == top).timestamp()

    return min(
        candidates,
        key=lambda c: (
            c.budget_violations,
            priority(c.victims[0]),
            sum(priority(v) + _OFFSET for v in c.victims),
            len(c.victims),
            -earliest_top(c),
            c.node,
        ),
    )


@dataclass(frozen=True)
class Outcome:
    """What the PostFilter decided. `candidate`: the node to nominate and the pods to preempt there (then
    `message` is empty, the FitError carries no preemption part). Otherwise `message` is DefaultPreemption's
    part of the FitError, and `clear_nomination` whether the pod's `nominatedNodeName` is cleared (no
    candidate found) or left as it is (not eligible)."""

    candidate: Candidate | None
    message: str
    clear_nomination: bool = False


def _histogram(reasons: Iterable[str]) -> str:
    return ", ".join(sorted(f"{count} {reason}" for reason, count in Counter(reasons).items()))


def preempt(
    pod: Pod,
    infos: Mapping[str, fit.NodeInfo],
    results: Mapping[str, fit.FitResult],
    nominated: Nominated,
    budgets: Sequence[Pod],
    nominated_node: str | None,
    now: datetime | None = None,
) -> Outcome:
    """DefaultPreemption's PostFilter for `pod`, which fits none of `infos` (`results`: each node's
    verdict); `nominated_node`: the node the pod is nominated to now, if any."""
    now = now or datetime.now(UTC)
    if (pod.get("spec") or {}).get("preemptionPolicy") == "Never":
        return Outcome(None, fit.NOT_ELIGIBLE)
    if nominated_node:
        verdict = results.get(nominated_node)
        info = infos.get(nominated_node)
        if verdict is not None and verdict.resolvable and info is not None:
            own = priority(pod)
            if any(priority(p) < own and terminating_by_preemption(p) for p in info.pods):
                return Outcome(None, NOT_TERMINATED)
    statuses: dict[str, fit.FitResult] = {}
    candidates = []
    for name, verdict in results.items():
        if verdict.fits or not verdict.resolvable:
            continue
        found = select_victims(pod, infos, name, nominated, budgets, now)
        if isinstance(found, Candidate):
            if found.victims:
                candidates.append(found)
        else:
            statuses[name] = found
    if not candidates:
        reasons = (
            r
            for name in results
            for r in (statuses[name].reasons if name in statuses else (fit.NOT_HELPFUL,))
        )
        return Outcome(None, f"0/{len(results)} nodes are available: {_histogram(reasons)}.", True)
    return Outcome(pick(candidates, now), "")


def lower_nominated(pod: Pod, node: str, nominated: Nominated) -> list[Pod]:
    """`getLowerPriorityNominatedPods`: the pods nominated to `node` less important than `pod`."""
    own = priority(pod)
    return [p for p in nominated.get(node, ()) if priority(p) < own]
