"""The router's parts: the prefix index, the choice of engine (prefix affinity, bounded load), and finding
the engines in Kubernetes."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from waiting import wait_for

from ember_localcluster.apiserver import APIServer
from ember_router.discovery import PodDiscovery
from ember_router.index import PrefixIndex
from ember_router.policy import EngineState, bounded_capacity, choose, lacking, within_bound
from ember_router.pool import read_gauges


def test_the_index_answers_the_longest_leading_run_each_engine_holds() -> None:
    index = PrefixIndex()
    index.reset("a", [1, 2, 3])
    index.stored("b", 1)
    assert index.matched_blocks("a", [1, 2, 3, 4]) == 3
    assert index.matched_blocks("b", [1, 2, 3]) == 1
    index.removed("a", 2)
    assert index.matched_blocks("a", [1, 2, 3]) == 1
    index.assume("c", [7, 8])
    assert index.matched_blocks("c", [7, 8, 9], events_live=False) == 2
    assert index.matched_blocks("c", [7, 8, 9], events_live=True) == 0  # assumptions only stand in for events
    index.reset("c", [7])
    assert index.matched_blocks("c", [7, 8], events_live=False) == 0  # a snapshot replaces assumptions


def test_a_prompt_just_sent_counts_as_held_until_the_engines_events_can_say_so() -> None:
    index = PrefixIndex()
    index.sent("a", [1, 2, 3], now=10.0, hold_for=5.0)
    assert index.matched_blocks("a", [1, 2, 3, 4], now=10.0) == 3  # before any event
    assert index.matched_blocks("a", [1, 2, 3, 4], now=15.0) == 3
    assert index.matched_blocks("a", [1, 2, 3], now=15.1) == 0  # never announced: it no longer counts
    assert index.matched_blocks("a", [1, 2, 3]) == 0  # without `now`, only what the engine reported
    index.sent("a", [1, 2, 3], now=20.0, hold_for=5.0)
    index.stored("a", 1)
    index.removed("a", 2)  # evicted meanwhile: the event wins
    assert index.matched_blocks("a", [1, 2, 3], now=21.0) == 1
    assert index.matched_blocks("a", [1, 2, 3], now=99.0) == 1  # announced, it stays
    index.forget("a")
    assert index.matched_blocks("a", [1, 2, 3], now=21.0) == 0


@settings(max_examples=200, deadline=None)
@given(
    held=st.sets(st.integers(0, 9)),
    sent=st.lists(st.tuples(st.lists(st.integers(0, 9), max_size=6), st.floats(0, 10)), max_size=5),
    prompt=st.lists(st.integers(0, 9), max_size=8),
    now=st.floats(0, 20),
)
def test_a_match_is_the_leading_run_of_blocks_announced_or_sent_and_not_expired(
    held: set[int], sent: list[tuple[list[int], float]], prompt: list[int], now: float
) -> None:
    index = PrefixIndex()
    index.reset("e", held)
    until: dict[int, float] = {}
    for hashes, at in sent:
        index.sent("e", hashes, now=at, hold_for=5.0)
        until.update(dict.fromkeys(hashes, at + 5.0))
    known = held | {h for h, t in until.items() if t >= now}
    expected = next((i for i, h in enumerate(prompt) if h not in known), len(prompt))
    assert index.matched_blocks("e", prompt, now=now) == expected
    assert index.matched_blocks("e", prompt) == next(
        (i for i, h in enumerate(prompt) if h not in held), len(prompt)
    )


def test_the_longest_cached_prefix_wins_at_equal_load() -> None:
    engines = [EngineState("a"), EngineState("b"), EngineState("c")]
    d = choose(engines, {"a": 1, "b": 5, "c": 0}, now=0)
    assert (d.engine, d.reason, d.matched_blocks) == ("b", "prefix", 5)


def test_a_hot_prefix_spreads_once_its_engine_queues_past_the_bound() -> None:
    # Engines that run 4 requests at once and queue the rest (reported at once, as if polled every request).
    engines = {n: EngineState(n) for n in "abcd"}
    placed = Counter()
    for _ in range(40):  # nothing finishes: load accumulates
        loads = [e.load for e in engines.values()]
        d = choose(list(engines.values()), {"a": 10}, now=0, epsilon=0.25)
        assert d.engine is not None
        chosen = engines[d.engine]
        assert within_bound(chosen, bounded_capacity(loads, 0.25))
        chosen.in_flight += 1
        chosen.waiting = max(0, chosen.in_flight - 4)
        placed[d.engine] += 1
    assert placed["a"] >= placed["b"] and set(placed) == set("abcd")
    assert placed["a"] <= 40 * 1.25 / 4 + 2  # queueing, it kept to the bound


def test_an_engine_without_a_queue_keeps_its_prefix_up_to_twice_the_bound() -> None:
    # 3 requests in flight over 4 engines, all on a: the bound is 2, and a runs its 3 without a queue.
    engines = [EngineState("a", in_flight=3), EngineState("b"), EngineState("c"), EngineState("d")]
    assert bounded_capacity([e.load for e in engines], 0.25) == 2
    assert choose(engines, {"a": 10}, now=0).engine == "a"
    engines[0].waiting = 1  # it queues: the bound holds, and the request spills
    d = choose(engines, {"a": 10}, now=0)
    assert d.engine != "a" and d.reason == "spill"
    engines[0].waiting, engines[0].in_flight = 0, 4  # no queue, but past twice the bound
    assert choose(engines, {"a": 10}, now=0).reason == "spill"


@settings(max_examples=300, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20), min_size=2, max_size=6),
    queues=st.lists(st.integers(0, 3), min_size=6, max_size=6),
    matched=st.lists(st.integers(0, 8), min_size=6, max_size=6),
    epsilon=st.sampled_from([0.0, 0.1, 0.25, 1.0]),
)
def test_the_chosen_engine_stays_within_the_bound(
    loads: list[int], queues: list[int], matched: list[int], epsilon: float
) -> None:
    engines = [EngineState(f"e{i}", in_flight=load, waiting=queues[i]) for i, load in enumerate(loads)]
    d = choose(engines, {e.name: matched[i] for i, e in enumerate(engines)}, now=0, epsilon=epsilon)
    chosen = next(e for e in engines if e.name == d.engine)
    cap = bounded_capacity([e.load for e in engines], epsilon)
    eligible = [i for i, e in enumerate(engines) if within_bound(e, cap)]
    if eligible:  # some engine is within the bound: the choice is one of them, the longest prefix among them
        assert d.matched_blocks == max(matched[i] for i in eligible)
        # Within the bound: under it, or no queue and under twice it.
        assert chosen.load + 1 <= cap or (chosen.waiting == 0 and chosen.load + 1 <= 2 * cap)


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 20), min_size=2, max_size=6),
    matched=st.lists(st.integers(0, 8), min_size=6, max_size=6),
)
def test_a_request_spills_exactly_when_an_engine_over_the_bound_holds_more_of_it(
    loads: list[int], matched: list[int]
) -> None:
    engines = [EngineState(f"e{i}", in_flight=load) for i, load in enumerate(loads)]
    held = {e.name: matched[i] for i, e in enumerate(engines)}
    d = choose(engines, held, now=0, epsilon=0.25)
    assert d.engine is not None and d.matched_blocks == held[d.engine]
    assert (d.reason == "spill") == (max(held.values()) > d.matched_blocks)
    if d.reason != "spill":
        assert d.reason == ("prefix" if d.matched_blocks else "load")


@given(
    in_flight=st.integers(0, 30),
    running=st.integers(0, 30),
    waiting=st.integers(0, 30),
)
def test_an_engines_load_counts_each_outstanding_request_once(
    in_flight: int, running: int, waiting: int
) -> None:
    state = EngineState("e", in_flight=in_flight, running=running, waiting=waiting)
    # The engine's own count includes the router's requests: the load is the larger view, never the sum.
    assert state.load == max(in_flight, running + waiting)
    assert state.load >= in_flight and state.load >= running + waiting
    assert state.load <= in_flight + running + waiting


def test_requests_queued_at_an_engine_are_not_counted_twice() -> None:
    # a: the router's 2 requests, both still queued there; b: the router's 3 requests, all running.
    a = EngineState("a", in_flight=2, waiting=2)
    b = EngineState("b", in_flight=3, running=3)
    assert choose([a, b], {}, now=0).engine == "a"


def test_without_prefixes_requests_take_turns() -> None:
    engines = [EngineState(n) for n in "abcd"]
    placed = Counter(
        choose(engines, {}, now=0, turn=t).engine for t in range(400)
    )  # each one finishes at once
    assert set(placed.values()) == {100}


def test_sessions_stick_while_within_the_bound() -> None:
    engines = [EngineState("a", in_flight=1), EngineState("b", in_flight=1)]
    assert choose(engines, {"a": 3}, now=0, session_engine="b").engine == "b"
    engines[1].in_flight, engines[1].waiting = 9, 3  # over the bound and queueing
    assert choose(engines, {}, now=0, session_engine="b").engine == "a"


def test_not_ready_and_recently_overloaded_engines_are_skipped_and_none_left_sheds() -> None:
    engines = [EngineState("a", ready=False), EngineState("b", overloaded_until=10.0), EngineState("c")]
    assert choose(engines, {"a": 9, "b": 9}, now=5.0).engine == "c"
    assert choose(engines, {}, now=5.0, exclude=frozenset({"c"})).reason == "shed"
    assert choose(engines, {"b": 9}, now=11.0, exclude=frozenset({"c"})).engine == "b"


def test_reading_the_engines_gauges() -> None:
    page = (
        "# HELP vllm:num_requests_waiting x\n"
        'vllm:num_requests_waiting{model_name="m"} 3.0\n'
        'vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
        'vllm:num_requests_running{model_name="m"} 7.0\n'
    )
    assert read_gauges(page) == {
        "vllm:num_requests_waiting": 3.0,
        "vllm:kv_cache_usage_perc": 0.25,
        "vllm:num_requests_running": 7.0,
    }


def test_reading_the_engines_gauges_as_the_text_format_writes_them() -> None:
    """A sample may carry a timestamp after its value (read as the value, it made 3 waiting 1.7e12), and
    fields may be apart by more than one space; names that only begin as the router's are not its."""
    page = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="m"} 3 1700000000000\n'
        'vllm:num_requests_waiting{model_name="n", path="a b}"}   2.0\n'
        "vllm:num_requests_running 4\t1700000000000\n"
        'vllm:kv_cache_usage_perc{model_name="m"} 0.5 1700000000000\n'
        'vllm:num_requests_waiting_by_reason{reason="x"} 9\n'
        "vllm:num_requests_running{} not-a-number\n"
    )
    assert read_gauges(page) == {
        "vllm:num_requests_waiting": 5.0,
        "vllm:kv_cache_usage_perc": 0.5,
        "vllm:num_requests_running": 4.0,
    }


def test_discovery_follows_ready_active_pods_through_a_watch(tmp_path: Path) -> None:
    with APIServer(pod_graceful_deletion=False, bookmark_interval=0.5) as api:
        kubeconfig = str(api.write_kubeconfig(tmp_path / "kubeconfig"))
        seen: list[dict[str, str]] = []
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        selector = "app.kubernetes.io/instance=chat,ember.dev/role=active"
        discovery = PodDiscovery("default", selector, 8000, seen.append, kubeconfig)
        discovery.start(loop)
        try:

            def pod(name: str, role: str) -> None:
                labels = {"app.kubernetes.io/instance": "chat", "ember.dev/role": role}
                spec = {"containers": [{"name": "engine", "image": "x"}]}
                api.create(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {"name": name, "namespace": "default", "labels": labels},
                        "spec": spec,
                    }
                )
                status = {"podIP": f"10.0.0.{len(name)}", "conditions": [{"type": "Ready", "status": "True"}]}
                api.patch("v1", "Pod", "default", name, {"status": status}, subresource="status")

            pod("a", "active")
            pod("bb", "warm")
            wait_for(lambda: seen and seen[-1] == {"a": "http://10.0.0.1:8000"}, what="the active pod found")
            api.patch("v1", "Pod", "default", "bb", {"metadata": {"labels": {"ember.dev/role": "active"}}})
            wait_for(
                lambda: seen[-1] == {"a": "http://10.0.0.1:8000", "bb": "http://10.0.0.2:8000"},
                what="the promoted pod",
            )
            api.patch(
                "v1",
                "Pod",
                "default",
                "a",
                {"status": {"conditions": [{"type": "Ready", "status": "False"}]}},
                subresource="status",
            )
            wait_for(lambda: seen[-1] == {"bb": "http://10.0.0.2:8000"}, what="the unready pod removed")
            api.delete("v1", "Pod", "default", "bb")
            wait_for(lambda: seen[-1] == {}, what="the deleted pod removed")
        finally:
            discovery.stop()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)


def test_an_adapters_requests_are_kept_from_engines_known_not_to_hold_it() -> None:
    a = EngineState("a", adapters=frozenset({"sql"}))
    b = EngineState("b", adapters=frozenset())
    c = EngineState("c")  # reports no adapters (an older engine): it may hold it
    engines = [a, b, c]
    assert lacking(engines, "sql") == frozenset({"b"})
    # The base model's name, a name nobody holds, no name at all: any engine may answer it.
    assert lacking(engines, "base") == lacking(engines, "other") == lacking(engines, None) == frozenset()
    decisions = {choose(engines, {}, 0.0, exclude=lacking(engines, "sql"), turn=t).engine for t in range(6)}
    assert decisions == {"a", "c"}
