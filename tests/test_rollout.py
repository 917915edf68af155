"""The pod plan, driven step by step against a simulated set of pods that take time to become Ready."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from ember_operator.desired import ACTIVE, HASH_LABEL, ROLE_LABEL, WARM
from ember_operator.rollout import PodPlan, PodView, Releases, plan_pods
from ember_operator.status import Assessment

T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class SimPod:
    name: str
    role: str
    template_hash: str
    created: int
    starts_in: int | None  # steps until Ready; None: never (a broken template)

    def view(self) -> PodView:
        ready = self.starts_in is not None and self.starts_in <= 0
        return PodView(self.name, self.role, self.template_hash, ready, T0 + timedelta(seconds=self.created))


class Cluster:
    """Applies plans the way the operator does and advances start-up by one step per pass."""

    def __init__(self, startup: int, broken: frozenset[str] = frozenset()) -> None:
        self.pods: dict[str, SimPod] = {}
        self.startup = startup
        self.broken = broken
        self.clock = 0
        self.names = (f"pod-{i}" for i in itertools.count())

    def add(self, role: str, template_hash: str, ready: bool) -> None:
        name = next(self.names)
        self.pods[name] = SimPod(name, role, template_hash, self.clock, 0 if ready else self.startup)

    def views(self) -> list[PodView]:
        return [p.view() for p in self.pods.values()]

    def ready_active(self) -> int:
        return sum(v.ready and v.role == ACTIVE for v in self.views())

    def step(self, template_hash: str, active: int, warm: int):
        plan = plan_pods(self.views(), template_hash, active, warm)
        touched = plan.promote + plan.demote + plan.delete
        assert len(touched) == len(set(touched)), f"a pod acted on twice: {plan}"
        for name in plan.promote:
            assert self.pods[name].role == WARM and self.pods[name].view().ready
            self.pods[name].role = ACTIVE
        for name in plan.demote:
            self.pods[name].role = WARM
        for name in plan.delete:
            del self.pods[name]
        for _ in range(plan.create_warm):
            name = next(self.names)
            starts = None if template_hash in self.broken else self.startup
            self.pods[name] = SimPod(name, WARM, template_hash, self.clock, starts)
        self.clock += 1
        for p in self.pods.values():
            if p.starts_in is not None:
                p.starts_in -= 1
        return plan

    def settle(self, template_hash: str, active: int, warm: int, steps: int = 50) -> None:
        for _ in range(steps):
            settled = all(v.ready for v in self.views())  # as the plan saw them
            if self.step(template_hash, active, warm).empty() and settled:
                return
        raise AssertionError(f"no convergence: {self.views()}")

    def shape(self) -> tuple[int, int]:
        views = self.views()
        return sum(v.role == ACTIVE for v in views), sum(v.role == WARM for v in views)


def test_from_nothing_pods_start_warm_and_are_promoted_when_ready() -> None:
    c = Cluster(startup=3)
    first = c.step("h1", active=2, warm=1)
    assert first.create_warm == 3 and not first.promote
    assert c.shape() == (0, 3)  # nothing cold is ever behind the Service
    c.settle("h1", 2, 1)
    assert c.shape() == (2, 1) and c.ready_active() == 2


def test_scale_up_with_a_ready_pool_promotes_at_once_and_refills_in_the_background() -> None:
    c = Cluster(startup=5)
    c.settle("h1", 1, 2)
    plan = c.step("h1", active=3, warm=2)
    assert len(plan.promote) == 2 and plan.create_warm == 2
    assert c.ready_active() == 3  # capacity added in the same pass, no cold start
    c.settle("h1", 3, 2)
    assert c.shape() == (3, 2)


def test_scale_down_demotes_into_a_short_pool_and_deletes_the_rest() -> None:
    c = Cluster(startup=1)
    c.settle("h1", 4, 0)
    plan = c.step("h1", active=1, warm=1)
    assert len(plan.demote) == 1 and len(plan.delete) == 2
    assert c.shape() == (1, 1)


def test_not_ready_pods_are_retired_before_ready_ones() -> None:
    views = [
        PodView("ready-old", ACTIVE, "h1", True, T0),
        PodView("ready-young", ACTIVE, "h1", True, T0 + timedelta(seconds=5)),
        PodView("starting", ACTIVE, "h1", False, T0 + timedelta(seconds=1)),
    ]
    plan = plan_pods(views, "h1", active=1, warm=0)
    assert plan.delete == ["starting", "ready-young"]


def test_failed_pods_are_replaced_and_deleting_ones_ignored() -> None:
    views = [
        PodView("dead", ACTIVE, "h1", False, T0, phase="Failed"),
        PodView("going", ACTIVE, "h1", True, T0, deleting=True),
    ]
    plan = plan_pods(views, "h1", active=1, warm=0)
    assert plan.delete == ["dead"] and plan.create_warm == 1


@settings(max_examples=60, deadline=None)
@given(
    active=st.integers(1, 4),
    warm=st.integers(0, 2),
    startup=st.integers(1, 4),
    old_warm=st.integers(0, 2),
)
def test_a_roll_never_lowers_ready_capacity_and_ends_on_the_new_template(
    active: int, warm: int, startup: int, old_warm: int
) -> None:
    c = Cluster(startup=startup)
    c.settle("old", active, old_warm)
    for _ in range(60):
        settled = all(v.ready for v in c.views())
        plan = c.step("new", active, warm)
        assert c.ready_active() >= active, f"capacity dipped to {c.ready_active()} < {active}"
        if plan.empty() and settled:
            break
    assert {v.template_hash for v in c.views()} == {"new"}
    assert c.shape() == (active, warm)


def test_a_broken_template_never_replaces_working_pods_and_a_fix_rolls_on() -> None:
    c = Cluster(startup=2, broken=frozenset({"bad"}))
    c.settle("good", 2, 1)
    for _ in range(20):
        c.step("bad", 2, 1)
        assert c.ready_active() == 2
    assert sum(v.template_hash == "good" and v.role == ACTIVE for v in c.views()) == 2
    c.settle("fixed", 2, 1)  # the not-Ready pods of the broken template are cleared away
    assert {v.template_hash for v in c.views()} == {"fixed"} and c.shape() == (2, 1)


@settings(max_examples=60, deadline=None)
@given(targets=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=6))
def test_any_sequence_of_targets_converges_to_the_last(targets: list[tuple[int, int]]) -> None:
    c = Cluster(startup=2)
    for active, warm in targets:
        for _ in range(3):  # targets change before the previous one is reached
            c.step("h", active, warm)
    active, warm = targets[-1]
    c.settle("h", active, warm)
    assert c.shape() == (active, warm)
    assert all(v.ready for v in c.views())


# -- failover: a failed active pod is replaced by a Ready warm pod ------------------------------------

NOW = T0 + timedelta(minutes=10)


def test_a_down_active_pod_is_replaced_by_the_ready_warm_pod_in_one_pass() -> None:
    views = [
        PodView("crashed", ACTIVE, "h1", False, T0, unready_since=NOW, container_down=True),
        PodView("standby", WARM, "h1", True, T0 + timedelta(seconds=1)),
    ]
    plan = plan_pods(views, "h1", active=1, warm=1, now=NOW, failover_after=5.0)
    assert plan.promote == ["standby"] and plan.delete == ["crashed"]
    assert plan.failovers == [("crashed", "standby")]
    assert plan.create_warm == 1  # the pool is refilled


def test_an_unready_but_running_active_pod_gets_a_grace_before_failover() -> None:
    def plan_at(seconds_unready: float):
        views = [
            PodView("flaky", ACTIVE, "h1", False, T0, unready_since=NOW - timedelta(seconds=seconds_unready)),
            PodView("standby", WARM, "h1", True, T0),
        ]
        return plan_pods(views, "h1", active=1, warm=1, now=NOW, failover_after=5.0)

    assert plan_at(2.0).empty()
    late = plan_at(6.0)
    assert late.failovers == [("flaky", "standby")] and late.delete == ["flaky"]


def test_without_a_ready_warm_pod_a_failed_active_pod_is_left_to_restart() -> None:
    views = [
        PodView("crashed", ACTIVE, "h1", False, T0, unready_since=NOW, container_down=True),
        PodView("loading", WARM, "h1", False, T0 + timedelta(seconds=1)),
    ]
    plan = plan_pods(views, "h1", active=1, warm=1, now=NOW, failover_after=5.0)
    assert plan.empty()


@settings(max_examples=40, deadline=None)
@given(active=st.integers(1, 4), warm=st.integers(1, 3), failures=st.integers(1, 4))
def test_failures_are_covered_from_the_pool_as_far_as_it_goes(active: int, warm: int, failures: int) -> None:
    c = Cluster(startup=3)
    c.settle("h", active, warm)
    actives = [p for p in c.pods.values() if p.role == ACTIVE][:failures]
    for p in actives:
        p.starts_in = None  # never Ready again
    views = []
    for v in c.views():
        down = v.name in {p.name for p in actives}
        views.append(
            PodView(
                v.name,
                v.role,
                v.template_hash,
                not down and v.ready,
                v.created,
                unready_since=NOW if down else None,
                container_down=down,
            )
        )
    plan = plan_pods(views, "h", active, warm, now=NOW, failover_after=5.0)
    covered = min(len(actives), warm)
    assert len(plan.failovers) == covered
    ready_active = sum(v.ready and v.role == ACTIVE for v in views)
    assert ready_active + len(plan.promote) == active - len(actives) + covered


# -- rolls on a full pool: maxSurge / maxUnavailable --------------------------------------------------


class FullPool(Cluster):
    """A cluster with room for `capacity` pods: the others stay Pending (Unschedulable) and do not start
    until a pod is gone; a deleted pod terminates for one pass, holding its slot. The scheduler places a
    waiting pod `lag` passes after a slot frees (kube-scheduler retries an unschedulable pod after a
    back-off, and its binding reaches the operator through a watch); until then the pod still shows
    Unschedulable."""

    def __init__(self, startup: int, capacity: int, lag: int = 0) -> None:
        super().__init__(startup)
        self.capacity = capacity
        self.lag = lag
        self.dying: dict[str, SimPod] = {}
        self.freed: list[int] = []  # the clock when each slot was freed
        self.releases = Releases()

    def placed(self) -> set[str]:
        settling = sum(self.clock - t < self.lag for t in self.freed)
        room = self.capacity - len(self.dying) - settling
        return {p.name for p in sorted(self.pods.values(), key=lambda p: p.created)[: max(0, room)]}

    def views(self) -> list[PodView]:
        placed = self.placed()
        out = []
        for p in self.pods.values():
            v = p.view()
            ok = p.name in placed
            out.append(
                PodView(v.name, v.role, v.template_hash, v.ready and ok, v.created, unschedulable=not ok)
            )
        for p in self.dying.values():
            v = p.view()
            out.append(PodView(v.name, v.role, v.template_hash, False, v.created, deleting=True))
        return out

    def roll_step(self, template_hash: str, active: int, warm: int, surge: int, unavailable: int) -> PodPlan:
        placed = self.placed()
        views = self.views()
        rescheduling = self.releases.observe([v.name for v in views], float(self.clock))
        plan = plan_pods(
            views,
            template_hash,
            active,
            warm,
            max_surge=surge,
            max_unavailable=unavailable,
            rescheduling=rescheduling,
        )
        for name in plan.promote:
            self.pods[name].role = ACTIVE
        for name in plan.demote:
            self.pods[name].role = WARM
        self.freed += [self.clock] * len(self.dying)
        self.dying = {name: self.pods.pop(name) for name in plan.delete}
        for _ in range(plan.create_warm):
            name = next(self.names)
            self.pods[name] = SimPod(name, WARM, template_hash, self.clock, self.startup)
        self.clock += 1
        for p in self.pods.values():
            if p.starts_in is not None and p.name in placed:
                p.starts_in -= 1
        return plan

    def ready_active(self) -> int:
        return sum(v.ready and v.role == ACTIVE for v in self.views())


@settings(max_examples=80, deadline=None)
@given(
    active=st.integers(1, 4),
    warm=st.integers(0, 2),
    startup=st.integers(1, 3),
    surge=st.integers(0, 2),
    unavailable=st.integers(0, 2),
    lag=st.integers(0, 3),
)
def test_a_roll_completes_on_a_pool_with_no_spare_gpu(
    active: int, warm: int, startup: int, surge: int, unavailable: int, lag: int
) -> None:
    assume(surge > 0 or unavailable > 0)  # the CRD refuses both 0
    # With neither a pool nor room to go below the target, a full pool cannot roll: by design it waits
    # (WaitingForCapacity, then Stalled), as a Deployment with maxUnavailable 0 would.
    assume(warm > 0 or unavailable > 0)
    c = FullPool(startup, capacity=active + warm, lag=lag)  # exactly full
    c.settle("old", active, warm)
    floor = active if warm > 0 or unavailable == 0 else active - unavailable
    for _ in range(200):
        plan = c.roll_step("new", active, warm, surge, unavailable)
        assert c.ready_active() >= min(floor, active), f"Ready active {c.ready_active()} < {floor}: {plan}"
        views = c.views()
        if (
            {v.template_hash for v in views} == {"new"}
            and all(v.ready for v in views)
            and c.shape() == (active, warm)
        ):
            break
    else:
        raise AssertionError(f"the roll did not complete: {c.views()}")


def test_with_room_a_roll_surges_and_never_dips() -> None:
    c = FullPool(startup=2, capacity=10)
    c.settle("old", 3, 0)
    for _ in range(60):
        c.roll_step("new", 3, 0, surge=1, unavailable=1)
        assert c.ready_active() >= 3
        assert len(c.pods) <= 4  # within the surge
    assert {v.template_hash for v in c.views()} == {"new"} and c.shape() == (3, 0)


def _pending(name: str, since: datetime) -> dict:  # type: ignore[type-arg]
    stamp = since.strftime("%Y-%m-%dT%H:%M:%SZ")
    unschedulable = {
        "type": "PodScheduled",
        "status": "False",
        "reason": "Unschedulable",
        "message": "0/1 nodes are available: 1 Insufficient nvidia.com/gpu.",
        "lastTransitionTime": stamp,
    }
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "conditions": [unschedulable]}}


def test_a_pod_waiting_on_a_roll_that_frees_room_is_not_counted_as_waiting_for_capacity() -> None:
    """On a full node a roll's new pod waits until an old one is retired, which waits until the pod before
    it has loaded (up to startupTimeoutSeconds, 30 min): the wait was timed from the pod's creation, so a
    healthy roll of a large model went Stalled (PodsUnschedulable) mid-way after capacityWaitSeconds."""
    from ember_operator.pods import trouble, waiting_for_capacity
    from ember_operator.rollout import roll_frees_room

    now = datetime(2026, 1, 1, tzinfo=UTC)
    long_ago = now - timedelta(minutes=10)

    def view(name: str, template: str, **state: object) -> PodView:
        return PodView(name, ACTIVE, template, created=long_ago, **state)  # type: ignore[arg-type]

    loading = [
        view("old-1", "a", ready=True),
        view("new-1", "b", ready=False),
        view("new-2", "b", ready=False, unschedulable=True),
    ]
    assert roll_frees_room(loading, "b")  # new-1 loads on old-0's room; once Ready, old-1 retires
    assert roll_frees_room(
        [view("old-1", "a", ready=True, deleting=True), view("new-2", "b", ready=False, unschedulable=True)],
        "b",
    )
    # no old pod left to retire, or nothing under way that frees room: a real wait for capacity
    assert not roll_frees_room(
        [view("new-1", "b", ready=True), view("new-2", "b", ready=False, unschedulable=True)], "b"
    )
    assert not roll_frees_room(
        [view("old-1", "a", ready=True), view("new-2", "b", ready=False, unschedulable=True)], "b"
    )
    pod = _pending("new-2", long_ago)
    assert trouble(pod, now, 300).reason == "PodsUnschedulable"  # type: ignore[union-attr]
    assert trouble(pod, now, 300, since=now) is None
    assert waiting_for_capacity(pod, now, 300, since=now) is not None  # WaitingForCapacity meanwhile
    assert Releases().at(now) is None


def test_a_pod_stranded_on_a_lost_node_frees_no_room_to_wait_for() -> None:
    """A pod deleted on a node that was lost stays Terminating (no kubelet confirms it) and frees nothing:
    it counted as room under way for good, so a new pod no node could take never became a
    PodsUnschedulable trouble, and a roll with no room never retired an old pod (maxUnavailable)."""
    from ember_operator.pods import view as pod_view
    from ember_operator.rollout import roll_frees_room

    now = datetime.now(UTC)
    stranded = PodView("lost", ACTIVE, "b", False, T0, deleting=True, stranded=True)
    waiting = PodView("new-1", WARM, "b", False, T0, unschedulable=True)
    assert not roll_frees_room([stranded, waiting], "b")
    assert roll_frees_room([replace(stranded, stranded=False), waiting], "b")
    # A roll on full nodes with maxUnavailable 1: the old pod is retired for the waiting new one.
    old = [PodView(f"old-{i}", ACTIVE, "a", True, T0) for i in range(2)]
    plan = plan_pods([*old, waiting, stranded], "b", 2, 0, T0, max_surge=0, max_unavailable=1)
    assert plan.delete == ["old-0"]
    plan = plan_pods(
        [*old, waiting, replace(stranded, stranded=False)], "b", 2, 0, T0, max_surge=0, max_unavailable=1
    )
    assert plan.delete == []

    def deleted(seconds_ago: float) -> dict[str, object]:
        stamp = (now - timedelta(seconds=seconds_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
        return {"metadata": {"name": "p", "deletionTimestamp": stamp}, "status": {}}

    assert pod_view(deleted(60)).stranded and not pod_view(deleted(5)).stranded


def test_a_warm_pod_on_a_lost_node_is_replaced_after_the_failover_time() -> None:
    """A node that stops reporting has its pods marked not Ready by the node lifecycle controller, their
    containers still recorded ready (MarkPodsNotReady changes only the Ready condition). A warm pod there
    stands by for nothing: it is deleted and the pool refilled once it has been so for `failover_after`,
    not left counted in the pool until the taint eviction (300 s by default). A warm pod still loading is
    not such a pod."""
    from ember_operator.pods import view as pod_view

    def stamp(t: datetime) -> str:
        return t.strftime("%Y-%m-%dT%H:%M:%SZ")

    def warm(ready: str, containers_ready: str, since: datetime) -> dict[str, object]:
        return {
            "metadata": {
                "name": "w",
                "labels": {ROLE_LABEL: WARM, HASH_LABEL: "b"},
                "creationTimestamp": stamp(since - timedelta(seconds=60)),
            },
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "Ready", "status": ready, "lastTransitionTime": stamp(since)},
                    {"type": "ContainersReady", "status": containers_ready, "lastTransitionTime": stamp(since)},
                ],
                "containerStatuses": [{"name": "engine", "ready": containers_ready == "True", "restartCount": 0,
                                       "state": {"running": {}}}],
            },
        }  # fmt: skip

    now = datetime.now(UTC)
    active = PodView("a", ACTIVE, "b", True, T0)
    lost = pod_view(warm("False", "True", now - timedelta(seconds=10)))
    assert lost.node_lost
    plan = plan_pods([active, lost], "b", 1, 1, now, failover_after=5.0)
    assert plan.delete == ["w"] and plan.create_warm == 1
    # Within the failover time, kept (a node may come back); and a loading warm pod is left to load.
    just_lost = pod_view(warm("False", "True", now - timedelta(seconds=2)))
    assert plan_pods([active, just_lost], "b", 1, 1, now, failover_after=5.0).delete == []
    loading = pod_view(warm("False", "False", now - timedelta(seconds=60)))
    assert not loading.node_lost
    assert plan_pods([active, loading], "b", 1, 1, now, failover_after=5.0).delete == []
    # The kubelet's own Ready False with ContainersReady True: a readiness gate not yet met.
    gated = warm("False", "True", now - timedelta(seconds=60))
    gated["status"]["conditions"][0]["reason"] = "ReadinessGatesNotReady"  # type: ignore[index]
    assert not pod_view(gated).node_lost


def test_an_active_pod_on_a_lost_node_with_no_ready_warm_pod_is_replaced() -> None:
    """With no Ready warm pod to promote, a pod is made in its place after the failover time; once Ready it
    is promoted and the lost one retired (it would otherwise wait for the taint eviction, 300 s)."""
    now = T0 + timedelta(seconds=100)
    serving = PodView("a1", ACTIVE, "b", True, T0)
    lost = PodView("a2", ACTIVE, "b", False, T0, unready_since=now - timedelta(seconds=10), node_lost=True)
    plan = plan_pods([serving, lost], "b", 2, 0, now, failover_after=5.0)
    assert plan.create_warm == 1 and plan.delete == [] and plan.replacing == ["a2"]
    # Not before the failover time, as for a warm pod.
    just_lost = replace(lost, unready_since=now - timedelta(seconds=2))
    assert plan_pods([serving, just_lost], "b", 2, 0, now, failover_after=5.0).create_warm == 0
    # The replacement starting: nothing more is made, and the lost pod stays until it is Ready.
    starting = PodView("w1", WARM, "b", False, now)
    plan = plan_pods([serving, lost, starting], "b", 2, 0, now, failover_after=5.0)
    assert (plan.create_warm, plan.delete, plan.replacing) == (0, [], ["a2"])
    reconciling = next(
        c
        for c in Assessment("b", 2, 0, 2, [serving, lost, starting], plan).conditions()
        if c.type == "Reconciling"
    )
    assert (reconciling.status, reconciling.reason) == (True, "ReplacingLostPods")
    assert reconciling.message.endswith("replacing active pods on nodes that stopped reporting: a2")
    # Ready: promoted in the lost pod's place, which is retired.
    plan = plan_pods([serving, lost, replace(starting, ready=True)], "b", 2, 0, now, failover_after=5.0)
    assert (plan.promote, plan.delete, plan.failovers) == (["w1"], ["a2"], [("a2", "w1")])
    assert plan.create_warm == 0


def test_a_lost_active_pod_deleted_by_a_scale_down_is_not_replaced() -> None:
    now = T0 + timedelta(seconds=60)
    lost = PodView("lost", ACTIVE, "h", False, T0, unready_since=T0, node_lost=True)
    ok = PodView("ok", ACTIVE, "h", True, T0 - timedelta(seconds=1))
    plan = plan_pods([lost, ok], "h", 1, 0, now)
    assert plan.delete == ["lost"]
    assert plan.replacing == [] and plan.create_warm == 0, plan
