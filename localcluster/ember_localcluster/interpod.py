"""The filters and scores of kube-scheduler's default profile that look at other pods, InterPodAffinity and
PodTopologySpread, and the profile's choice of a node (`filter_nodes`, `select`); the local scheduler
(`scheduler.py`) runs them after `fit.py`'s per-node filters. Pure: every decision is over `fit.NodeInfo`s.

* **InterPodAffinity** (filter): a node fails when the pod's required `podAffinity` terms find no matching pod
  in the node's topology domain ("node(s) didn't match pod affinity rules", which preemption cannot help;
  a pod matching its own terms passes when no pod anywhere matches them, as the first of a series), when
  its required `podAntiAffinity` terms find one there ("node(s) didn't match pod anti-affinity rules"),
  or when a pod already in that domain has a required anti-affinity term the incoming pod matches
  ("node(s) didn't satisfy existing pods anti-affinity rules"). A term's pods are those of its
  `namespaces`, or of the pod's own namespace when it sets neither `namespaces` nor `namespaceSelector`;
  an empty `namespaceSelector` takes every namespace, and another is matched against the namespace's
  `kubernetes.io/metadata.name` label only (the scheduler does not watch Namespaces). `matchLabelKeys` and
  `mismatchLabelKeys` add the pod's own values to the selector.
* **PodTopologySpread** (filter): each `whenUnsatisfiable: DoNotSchedule` constraint counts the pods its
  selector matches (in the pod's namespace, not being deleted; `matchLabelKeys` added) per domain of
  `topologyKey`, over the nodes that carry every constraint's key and that pass the pod's required node
  affinity (`nodeAffinityPolicy`, Honor by default) and, with `nodeTaintsPolicy: Honor` (Ignore by
  default), its tolerations. A node without the key fails with "node(s) didn't match pod topology spread
  constraints (missing required label)"; one where the pod would make its domain's count exceed the
  smallest domain's by more than `maxSkew` (the smallest taken as 0 while there are fewer domains than
  `minDomains`) with "node(s) didn't match pod topology spread constraints".
* **Scores**, each plugin's normalised to 0-100 as upstream's NormalizeScore does and summed with the
  default profile's weights: TaintToleration 3 (PreferNoSchedule taints not tolerated, reversed),
  NodeAffinity 2 (preferred node affinity), NodeResourcesFit 1 (least allocated), InterPodAffinity 2
  (the pod's preferred terms, plus and minus each term's weight per matching pod in the node's domain;
  existing pods' preferred terms and, with weight 1, required affinity terms that the pod matches) and
  PodTopologySpread 2 (`ScheduleAnyway` constraints: fewer matching pods in the node's domain score
  higher). The highest sum wins; ties go to the node's name, where kube-scheduler picks at random.

Not modelled: the system default spreading that PodTopologySpread applies to a pod without constraints
(from the Services, ReplicaSets and StatefulSets selecting it), NodeResourcesBalancedAllocation and
ImageLocality scores (preemption is `preemption.py`'s).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ember_localcluster import fit

__all__ = ["POD_REASONS", "filter_node", "filter_nodes", "select"]

REASON_AFFINITY = "node(s) didn't match pod affinity rules"
REASON_ANTI_AFFINITY = "node(s) didn't match pod anti-affinity rules"
REASON_EXISTING_ANTI_AFFINITY = "node(s) didn't satisfy existing pods anti-affinity rules"
REASON_SPREAD = "node(s) didn't match pod topology spread constraints"
REASON_SPREAD_LABEL = f"{REASON_SPREAD} (missing required label)"
# Reasons another pod's arrival or change can lift: a pod refused for one waits on pods, not only on nodes.
POD_REASONS = frozenset((REASON_AFFINITY, REASON_ANTI_AFFINITY, REASON_EXISTING_ANTI_AFFINITY, REASON_SPREAD))
HOSTNAME = "kubernetes.io/hostname"
NAMESPACE_NAME = "kubernetes.io/metadata.name"
MAX_NODE_SCORE = 100
HARD_POD_AFFINITY_WEIGHT = 1  # InterPodAffinityArgs.hardPodAffinityWeight's default
WEIGHTS = {"taints": 3, "node_affinity": 2, "fit": 1, "pod_affinity": 2, "spread": 2}

Requirement = tuple[str, str, frozenset[str]]
Selector = tuple[Requirement, ...] | None  # None matches nothing (a nil LabelSelector); () everything
Pair = tuple[str, str]


def _labels(obj: Mapping[str, Any]) -> dict[str, str]:
    return dict((obj.get("metadata") or {}).get("labels") or {})


def _namespace(pod: Mapping[str, Any]) -> str:
    return str((pod.get("metadata") or {}).get("namespace") or "default")


def _selector(
    selector: Any, pod_labels: Mapping[str, str], match: Iterable[str] = (), mismatch: Iterable[str] = ()
) -> Selector:
    """metav1.LabelSelectorAsSelector, with `matchLabelKeys`/`mismatchLabelKeys` taken from the pod."""
    if selector is None:
        return None
    out: list[Requirement] = [
        (k, "In", frozenset((str(v),))) for k, v in (selector.get("matchLabels") or {}).items()
    ]
    for e in selector.get("matchExpressions") or []:
        out.append((e.get("key", ""), e.get("operator", ""), frozenset(e.get("values") or ())))
    out += [(k, "In", frozenset((pod_labels[k],))) for k in match if k in pod_labels]
    out += [(k, "NotIn", frozenset((pod_labels[k],))) for k in mismatch if k in pod_labels]
    return tuple(out)


def _matches(selector: Selector, labels: Mapping[str, str]) -> bool:
    if selector is None:
        return False
    for key, operator, values in selector:
        present = key in labels
        if operator == "In" and not (present and labels[key] in values):
            return False
        if operator == "NotIn" and present and labels[key] in values:
            return False
        if operator == "Exists" and not present:
            return False
        if operator == "DoesNotExist" and present:
            return False
    return True


@dataclass(frozen=True)
class Term:
    """A pod (anti-)affinity term of one pod, its namespaces resolved against that pod's."""

    selector: Selector
    namespaces: frozenset[str]
    namespace_selector: Selector
    topology_key: str
    weight: int = 1

    def matches(self, pod: Mapping[str, Any]) -> bool:
        namespace = _namespace(pod)
        if namespace not in self.namespaces and not _matches(
            self.namespace_selector, {NAMESPACE_NAME: namespace}
        ):
            return False
        return _matches(self.selector, _labels(pod))


def _term(pod: Mapping[str, Any], term: Mapping[str, Any], weight: int = 1) -> Term:
    namespaces = frozenset(term.get("namespaces") or ())
    ns_selector = term.get("namespaceSelector")
    if not namespaces and ns_selector is None:
        namespaces = frozenset((_namespace(pod),))
    selector = _selector(
        term.get("labelSelector"),
        _labels(pod),
        term.get("matchLabelKeys") or (),
        term.get("mismatchLabelKeys") or (),
    )
    return Term(selector, namespaces, _selector(ns_selector, {}), str(term.get("topologyKey") or ""), weight)


def terms(pod: Mapping[str, Any], kind: str, required: bool) -> list[Term]:
    """The pod's `podAffinity` or `podAntiAffinity` terms, required or preferred (with their weights)."""
    section = (((pod.get("spec") or {}).get("affinity") or {}).get(kind)) or {}
    if required:
        return [_term(pod, t) for t in section.get("requiredDuringSchedulingIgnoredDuringExecution") or []]
    preferred = section.get("preferredDuringSchedulingIgnoredDuringExecution") or []
    return [_term(pod, t.get("podAffinityTerm") or {}, int(t.get("weight") or 0)) for t in preferred]


@dataclass(frozen=True)
class Constraint:
    """A topology spread constraint of the incoming pod, its selector and policies resolved."""

    max_skew: int
    topology_key: str
    selector: Selector
    min_domains: int
    honor_affinity: bool
    honor_taints: bool

    def counts(self, pods: Iterable[Mapping[str, Any]], namespace: str) -> int:
        """countPodsMatchSelector: an empty selector counts nothing; pods being deleted do not count."""
        if not self.selector:
            return 0
        return sum(
            1
            for p in pods
            if not (p.get("metadata") or {}).get("deletionTimestamp")
            and _namespace(p) == namespace
            and _matches(self.selector, _labels(p))
        )

    def includes(self, pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
        """matchNodeInclusionPolicies."""
        if self.honor_affinity and not fit.matches_node_affinity(pod, node):
            return False
        return not (self.honor_taints and fit.untolerated_taint(pod, node) is not None)


def constraints(pod: Mapping[str, Any], action: str) -> list[Constraint]:
    out = []
    for c in (pod.get("spec") or {}).get("topologySpreadConstraints") or []:
        if c.get("whenUnsatisfiable") != action:
            continue
        selector = _selector(c.get("labelSelector"), _labels(pod), c.get("matchLabelKeys") or ())
        out.append(
            Constraint(
                int(c.get("maxSkew") or 1),
                str(c.get("topologyKey") or ""),
                selector,
                int(c.get("minDomains") or 1),
                (c.get("nodeAffinityPolicy") or "Honor") == "Honor",
                (c.get("nodeTaintsPolicy") or "Ignore") == "Honor",
            )
        )
    return out


def _has_keys(node: Mapping[str, Any], wanted: Iterable[Constraint]) -> bool:
    labels = _labels(node)
    return all(c.topology_key in labels for c in wanted)


class _Cycle:
    """PreFilter's state for one pod over every node: the counts its filters judge nodes by."""

    def __init__(self, pod: Mapping[str, Any], infos: Iterable[fit.NodeInfo]) -> None:
        self.pod, namespace = pod, _namespace(pod)
        self.affinity, self.anti = terms(pod, "podAffinity", True), terms(pod, "podAntiAffinity", True)
        self.affinity_counts: Counter[Pair] = Counter()
        self.anti_counts: Counter[Pair] = Counter()
        self.existing_anti: Counter[Pair] = Counter()
        self.spread = constraints(pod, "DoNotSchedule")
        self.spread_counts: Counter[Pair] = Counter()
        for info in infos:
            labels = _labels(info.node)
            for other in info.pods:
                for term in terms(other, "podAntiAffinity", True):
                    if term.topology_key in labels and term.matches(pod):
                        self.existing_anti[(term.topology_key, labels[term.topology_key])] += 1
                if self.affinity and all(t.matches(other) for t in self.affinity):
                    for t in self.affinity:
                        if t.topology_key in labels:
                            self.affinity_counts[(t.topology_key, labels[t.topology_key])] += 1
                for t in self.anti:
                    if t.topology_key in labels and t.matches(other):
                        self.anti_counts[(t.topology_key, labels[t.topology_key])] += 1
            if self.spread and _has_keys(info.node, self.spread):
                for c in self.spread:
                    if c.includes(pod, info.node):
                        pair = (c.topology_key, labels[c.topology_key])
                        self.spread_counts[pair] += c.counts(info.pods, namespace)

    def _min_match(self, c: Constraint) -> int:
        domains = [n for (key, _), n in self.spread_counts.items() if key == c.topology_key]
        if len(domains) < c.min_domains:
            return 0
        return min(domains, default=2**31 - 1)

    def spread_filter(self, node: Mapping[str, Any]) -> fit.FitResult:
        labels = _labels(node)
        for c in self.spread:
            if c.topology_key not in labels:
                return fit.FitResult((REASON_SPREAD_LABEL,), resolvable=False)
            own = 1 if _matches(c.selector, _labels(self.pod)) else 0
            skew = (
                self.spread_counts.get((c.topology_key, labels[c.topology_key]), 0) + own - self._min_match(c)
            )
            if skew > c.max_skew:
                return fit.FitResult((REASON_SPREAD,))
        return fit.FitResult()

    def affinity_filter(self, node: Mapping[str, Any]) -> fit.FitResult:
        labels = _labels(node)
        found = True
        for t in self.affinity:
            if t.topology_key not in labels:
                return fit.FitResult((REASON_AFFINITY,), resolvable=False)
            if self.affinity_counts[(t.topology_key, labels[t.topology_key])] <= 0:
                found = False
        if not found and not (not self.affinity_counts and all(t.matches(self.pod) for t in self.affinity)):
            return fit.FitResult((REASON_AFFINITY,), resolvable=False)
        for t in self.anti:
            if t.topology_key in labels and self.anti_counts[(t.topology_key, labels[t.topology_key])] > 0:
                return fit.FitResult((REASON_ANTI_AFFINITY,))
        if any(self.existing_anti[pair] > 0 for pair in labels.items()):
            return fit.FitResult((REASON_EXISTING_ANTI_AFFINITY,))
        return fit.FitResult()


def filter_nodes(pod: Mapping[str, Any], infos: Mapping[str, fit.NodeInfo]) -> dict[str, fit.FitResult]:
    """Each node's verdict through the default profile's filters, in its order (the first failing one
    gives the node's reasons): `fit.filter_node`'s, then PodTopologySpread, then InterPodAffinity."""
    cycle = _Cycle(pod, infos.values())
    results = {}
    for name, info in infos.items():
        result = fit.filter_node(pod, info)
        if result.fits:
            result = cycle.spread_filter(info.node)
        if result.fits:
            result = cycle.affinity_filter(info.node)
        results[name] = result
    return results


def filter_node(pod: Mapping[str, Any], infos: Mapping[str, fit.NodeInfo], name: str) -> fit.FitResult:
    """One node's verdict through the same filters, the other pods' state taken from every node in `infos`
    (what preemption and nominated pods need: the filters run again over a changed set of pods)."""
    cycle = _Cycle(pod, infos.values())
    result = fit.filter_node(pod, infos[name])
    if result.fits:
        result = cycle.spread_filter(infos[name].node)
    if result.fits:
        result = cycle.affinity_filter(infos[name].node)
    return result


def _default_normalize(scores: dict[str, int], reverse: bool = False) -> dict[str, int]:
    """helper.DefaultNormalizeScore."""
    top = max(scores.values(), default=0)
    if top == 0:
        return {n: MAX_NODE_SCORE if reverse else 0 for n in scores}
    out = {n: MAX_NODE_SCORE * s // top for n, s in scores.items()}
    return {n: MAX_NODE_SCORE - s for n, s in out.items()} if reverse else out


def _pod_affinity_scores(
    pod: Mapping[str, Any], feasible: list[fit.NodeInfo], infos: Iterable[fit.NodeInfo]
) -> dict[str, int]:
    """InterPodAffinity's Score and NormalizeScore (0 everywhere when no term applies)."""
    preferred = terms(pod, "podAffinity", False)
    anti = terms(pod, "podAntiAffinity", False)
    topology: Counter[Pair] = Counter()

    def add(
        found: Iterable[Term], target: Mapping[str, Any], labels: Mapping[str, str], multiplier: int
    ) -> None:
        for t in found:
            if t.topology_key in labels and t.matches(target):
                topology[(t.topology_key, labels[t.topology_key])] += multiplier * t.weight

    for info in infos:
        labels = _labels(info.node)
        for other in info.pods:
            add(preferred, other, labels, 1)
            add(anti, other, labels, -1)
            add(terms(other, "podAffinity", True), pod, labels, HARD_POD_AFFINITY_WEIGHT)
            add(terms(other, "podAffinity", False), pod, labels, 1)
            add(terms(other, "podAntiAffinity", False), pod, labels, -1)
    if not topology:
        return {i.name: 0 for i in feasible}
    raw = {i.name: sum(topology.get(pair, 0) for pair in _labels(i.node).items()) for i in feasible}
    low, high = min(raw.values()), max(raw.values())
    if high == low:
        return {n: 0 for n in raw}
    return {n: int(MAX_NODE_SCORE * ((s - low) / (high - low))) for n, s in raw.items()}


def _spread_scores(
    pod: Mapping[str, Any], feasible: list[fit.NodeInfo], infos: Iterable[fit.NodeInfo]
) -> dict[str, int]:
    """PodTopologySpread's PreScore, Score and NormalizeScore over the `ScheduleAnyway` constraints."""
    soft = constraints(pod, "ScheduleAnyway")
    if not soft:
        return {i.name: 0 for i in feasible}
    namespace = _namespace(pod)
    ignored = {i.name for i in feasible if not _has_keys(i.node, soft)}
    candidates = [i for i in feasible if i.name not in ignored]
    counts: list[dict[str, int]] = []
    weights = []
    for c in soft:
        values = {_labels(i.node)[c.topology_key]: 0 for i in candidates}
        size = len(candidates) if c.topology_key == HOSTNAME else len(values)
        weights.append(math.log(size + 2))
        counts.append(values)
    for info in infos:
        if not _has_keys(info.node, soft):
            continue
        for c, values in zip(soft, counts, strict=True):
            value = _labels(info.node)[c.topology_key]
            if c.topology_key != HOSTNAME and value in values and c.includes(pod, info.node):
                values[value] += c.counts(info.pods, namespace)
    raw = {}
    for info in candidates:
        score = 0.0
        for c, values, weight in zip(soft, counts, weights, strict=True):
            value = _labels(info.node)[c.topology_key]
            count = c.counts(info.pods, namespace) if c.topology_key == HOSTNAME else values[value]
            score += count * weight + (c.max_skew - 1)
        raw[info.name] = round(score)
    low, high = min(raw.values(), default=0), max(raw.values(), default=0)
    out = {n: 0 for n in ignored}
    for name, s in raw.items():
        out[name] = MAX_NODE_SCORE if high == 0 else MAX_NODE_SCORE * (high + low - s) // high
    return out


def scores(
    pod: Mapping[str, Any], feasible: list[fit.NodeInfo], infos: Iterable[fit.NodeInfo]
) -> dict[str, int]:
    """Each feasible node's weighted sum of the default profile's normalised scores."""
    every = list(infos)
    plugins = {
        "taints": _default_normalize(
            {i.name: fit.prefer_no_schedule(pod, i) for i in feasible}, reverse=True
        ),
        "node_affinity": _default_normalize({i.name: fit.preferred_node_affinity(pod, i) for i in feasible}),
        "fit": {i.name: fit.least_allocated(pod, i) for i in feasible},
        "pod_affinity": _pod_affinity_scores(pod, feasible, every),
        "spread": _spread_scores(pod, feasible, every),
    }
    return {i.name: sum(WEIGHTS[p] * s[i.name] for p, s in plugins.items()) for i in feasible}


def select(
    pod: Mapping[str, Any], feasible: list[fit.NodeInfo], infos: Iterable[fit.NodeInfo]
) -> fit.NodeInfo:
    """The node the pod goes to: the highest total score, then the first name."""
    total = scores(pod, feasible, infos)
    return min(feasible, key=lambda info: (-total[info.name], info.name))
