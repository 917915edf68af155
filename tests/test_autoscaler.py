"""The autoscaler's decision, replayed over load traces: reacts at once, never flaps, never shrinks blind."""

from __future__ import annotations

import random
from itertools import pairwise

from ember_operator.autoscaler import Decision, History, Observation, PodLoad, decide
from ember_operator.spec import Autoscaling, Replicas

INTERVAL = 15.0
CAPACITY = 8  # requests one pod runs at once; the rest wait


def loads(offered: float, pods: int) -> list[PodLoad]:
    """What `pods` engines report when `offered` requests are in the system, spread evenly."""
    per_pod = offered / pods
    running = min(per_pod, CAPACITY)
    return [
        PodLoad(waiting=max(0.0, per_pod - CAPACITY), running=running, kv_cache=0.6 * running / CAPACITY)
    ] * pods


def replay(
    trace: list[float], policy: Autoscaling, replicas: Replicas, start: int = 1
) -> tuple[list[int], list[Decision]]:
    """Run the autoscaler once per interval over `trace` (offered load per interval); capacity follows the
    decision by the next interval, as it does with a warm pool."""
    history = History()
    current = start
    desired_over_time, decisions = [], []
    for i, offered in enumerate(trace):
        d = decide(policy, replicas, current, Observation(loads(offered, current)), history, i * INTERVAL)
        decisions.append(d)
        current = d.desired
        desired_over_time.append(current)
    return desired_over_time, decisions


def quick_reversals(series: list[int], window: int) -> int:
    """Scale-downs that come within `window` intervals of the previous change: flapping."""
    changes = [i for i in range(1, len(series)) if series[i] != series[i - 1]]
    return sum(series[b] < series[b - 1] and b - a < window for a, b in pairwise(changes))


POLICY = Autoscaling(queueDepthPerReplica=4, kvCacheUtilization=0.8, scaleDownStabilizationSeconds=120)
BOUNDS = Replicas(min=1, max=10)


def test_a_spike_is_answered_in_the_first_interval_that_sees_it() -> None:
    trace = [6.0] * 4 + [60.0] * 6
    desired, decisions = replay(trace, POLICY, BOUNDS)
    assert desired[:4] == [1, 1, 1, 1]
    assert desired[4] > 1, decisions[4].reason  # the first interval under load already scales
    assert "scale up" in decisions[4].reason
    # 60 in flight, 8 run per pod, 4 may wait per pod: 5 pods hold it.
    assert desired[-1] == 5


def test_scale_up_respects_the_step_limit() -> None:
    policy = POLICY.model_copy(update={"scale_up_max_step": 2})
    desired, _ = replay([1.0, 200.0, 200.0, 200.0], policy, BOUNDS)
    assert desired == [1, 3, 5, 7]


def test_a_short_lull_keeps_every_pod_and_a_long_one_scales_down_a_step_at_a_time() -> None:
    busy, idle = [60.0] * 5, [2.0]
    desired, _ = replay(busy + idle * 4 + busy + idle * 30, POLICY, BOUNDS)
    peak = desired[4]
    assert desired[5:10] == [peak] * 5  # 4 idle intervals = 60 s < the 120 s window
    tail = desired[10:]
    assert tail[:9] == [peak] * 9  # the window restarts with the load
    drops = [a - b for a, b in pairwise(tail) if a != b]
    assert drops and all(d == 1 for d in drops)  # scaleDownMaxStep 1
    assert tail[-1] == 1


def test_noise_inside_the_tolerance_never_moves_the_target() -> None:
    rng = random.Random(7)
    # 3 pods with queue 4/pod is exactly on target; +-8 % load noise stays within the 10 % band.
    on_target = 3 * (CAPACITY + 4)
    trace = [on_target * (1 + rng.uniform(-0.08, 0.08)) for _ in range(200)]
    desired, _ = replay(trace, POLICY, BOUNDS, start=3)
    assert set(desired) == {3}


def test_load_that_swings_does_not_flap() -> None:
    rng = random.Random(11)
    trace = [(40.0 if (i // 6) % 2 else 15.0) * rng.uniform(0.8, 1.2) for i in range(240)]
    desired, _ = replay(trace, POLICY, BOUNDS)
    # A 3-minute swing between quiet and busy: up at once, and the 2-minute scale-down window holds the
    # busy level through each quiet phase instead of following the swing.
    window = int(POLICY.scale_down_stabilization_seconds / INTERVAL)
    assert quick_reversals(desired, window) == 0
    changes = sum(a != b for a, b in pairwise(desired))
    assert changes <= 6, desired  # an hour of swinging load; each quiet phase alone would be 12 changes
    assert max(desired) <= 5


def test_a_full_kv_cache_scales_up_with_an_empty_queue() -> None:
    seen = Observation([PodLoad(waiting=0, running=8, kv_cache=0.95)] * 2)
    d = decide(POLICY, BOUNDS, 2, seen, History(), 0.0)
    assert d.desired == 3 and "KV cache 95%" in d.reason


def test_the_result_is_clamped_to_the_bounds() -> None:
    seen = Observation([PodLoad(waiting=100, running=8, kv_cache=0.9)] * 3)
    d = decide(POLICY, Replicas(min=1, max=4), 3, seen, History(), 0.0)
    assert d.desired == 4
    d = decide(POLICY, Replicas(min=1, max=4), 4, seen, History(), 15.0)
    assert d.desired == 4 and "at replicas.max" in d.reason
    idle = Observation([PodLoad(0, 0, 0.0)] * 3)
    d = decide(
        POLICY.model_copy(update={"scale_down_stabilization_seconds": 0}),
        Replicas(min=2, max=4),
        3,
        idle,
        History(),
        0.0,
    )
    assert d.desired == 2


def test_no_metrics_holds_the_target_and_says_why() -> None:
    d = decide(POLICY, BOUNDS, 4, Observation([], ["pod-a: ConnectError"]), History(), 0.0)
    assert d.desired == 4 and not d.metrics_ok
    assert "pod-a: ConnectError" in d.metrics_reason and "holding 4" in d.reason
    d = decide(POLICY, BOUNDS, 4, Observation([]), History(), 0.0)
    assert d.desired == 4 and not d.metrics_ok and "no Ready active pod" in d.metrics_reason


def test_partial_metrics_may_scale_up_but_never_down() -> None:
    no_window = POLICY.model_copy(update={"scale_down_stabilization_seconds": 0})
    idle = Observation([PodLoad(0, 0, 0.0)], ["pod-b: timeout"])
    d = decide(no_window, BOUNDS, 3, idle, History(), 0.0)
    assert d.desired == 3 and not d.metrics_ok
    busy = Observation([PodLoad(40, 8, 0.9)], ["pod-b: timeout"])
    d = decide(no_window, BOUNDS, 3, busy, History(), 15.0)
    assert d.desired > 3


def test_metrics_outage_mid_trace_never_scales_down() -> None:
    history, current = History(), 6
    policy = POLICY.model_copy(update={"scale_down_stabilization_seconds": 0})
    for i in range(20):
        d = decide(policy, BOUNDS, current, Observation([], ["all: refused"]), history, i * INTERVAL)
        assert d.desired == 6
        current = d.desired


def test_requests_shed_for_capacity_scale_up_though_the_queue_is_in_band() -> None:
    """An engine that sheds by its wait limit keeps its queue near limit × drain rate, which can sit
    inside the queue ratio's tolerance (64 running, 4 waiting: (4 + 64) / (64 + 4) = 1): the demand
    it turns away showed nowhere the autoscaler looked, and it held at one pod while refusing most
    traffic. Requests shed for capacity since the last scrape propose one pod more than are Ready."""
    busy = [PodLoad(waiting=4, running=64, kv_cache=0.3)]
    wide = Replicas(min=1, max=4)
    calm = decide(POLICY, wide, 1, Observation(busy), History(), 0.0)
    assert calm.desired == 1, calm.reason
    shedding = decide(POLICY, wide, 1, Observation(busy, shed=37), History(), 0.0)
    assert shedding.desired == 2 and "37 shed" in shedding.reason, shedding.reason
    # Pods not yet Ready are already counted: shedding on while a new pod starts proposes no more
    starting = decide(POLICY, wide, 2, Observation(busy, shed=12), History(), 0.0)
    assert starting.desired == 2, starting.reason
    # and shedding never lets the target shrink
    two = [PodLoad(waiting=0, running=1, kv_cache=0.01)] * 2
    assert decide(POLICY, wide, 3, Observation(two, shed=1), History(), 0.0).desired == 3


def test_at_zero_nothing_to_scrape_is_no_metrics_outage() -> None:
    d = decide(Autoscaling(), Replicas(min=0, max=3), 0, Observation([]), History(), 0.0)
    assert d.desired == 0 and d.metrics_ok, d
    assert d.reason.startswith("hold 0: scaled to zero")
    # With a target above zero, no pod to read is still an outage.
    assert not decide(Autoscaling(), Replicas(min=0, max=3), 1, Observation([]), History(), 0.0).metrics_ok
