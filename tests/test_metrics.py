"""Prometheus metrics: a real engine's traffic in the exposition, checked against the engine's own counts."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember_engine import SamplingParams
from ember_engine.async_engine import AsyncEngine
from ember_engine.core.config import EngineConfig
from ember_engine.core.llm_engine import EngineStats, LLMEngine
from ember_engine.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from ember_engine.server.metrics import EngineMetrics

MODEL = "tiny-test"


def samples(metrics: EngineMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def value(metrics: EngineMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, frozenset({"model_name": MODEL, **labels}.items()))]


@dataclass
class Traffic:
    engine: AsyncEngine
    metrics: EngineMetrics
    steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    prompt_lengths: list[int] = field(default_factory=list)
    finished_tokens: list[int] = field(default_factory=list)  # generated tokens of each finished request


def _idle(engine: AsyncEngine) -> bool:
    s = engine.stats()
    return s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0.0


async def _generate(traffic: Traffic, prompt: list[int], params: SamplingParams) -> RequestOutput:
    last = None
    async for out in traffic.engine.generate(prompt, params):
        last = out
    assert last is not None and last.finished
    traffic.prompt_lengths.append(len(prompt))
    traffic.finished_tokens.append(len(last.token_ids))
    return last


async def _run(traffic: Traffic) -> None:
    # Aborted first: closing the stream aborts it, and its final output (finish_reason "abort") still
    # reaches the step hooks.
    stream = traffic.engine.generate(
        list(range(10, 60)), SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)
    )
    async for out in stream:
        assert not out.finished
        break
    await stream.aclose()  # type: ignore[attr-defined]

    prompt = list(range(20, 45))
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = await _generate(traffic, prompt, greedy)
    assert base.finish_reason == "length"
    stop_id = base.token_ids[5]
    stopped = await _generate(
        traffic,
        prompt,
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == base.token_ids.index(stop_id) + 1


@pytest.fixture(scope="module")
def traffic(tiny_model: Path) -> Iterator[Traffic]:
    engine = AsyncEngine(EngineConfig(model=str(tiny_model)))
    t = Traffic(engine, EngineMetrics(MODEL))

    def hook(eng: LLMEngine, outputs: list[RequestOutput]) -> None:
        stats = eng.stats()
        t.metrics.record_step(stats, outputs)
        if stats.num_steps > t.steps:  # an abort's output arrives without a step
            t.steps = stats.num_steps
            t.batch_sizes.append(stats.last_batch_size)

    engine.add_step_hook(hook)
    try:
        asyncio.run(_run(t))
        deadline = time.monotonic() + 10
        while not _idle(engine) and time.monotonic() < deadline:
            time.sleep(0.01)
        t.metrics.record_stats(engine.stats())
        yield t
    finally:
        engine.shutdown()


def test_counters_equal_the_engine_totals(traffic: Traffic) -> None:
    stats, m = traffic.engine.stats(), traffic.metrics
    assert stats.prompt_tokens > 0 and stats.generation_tokens > 0 and stats.prefix_cache_hits > 0
    for name, expected in [
        ("vllm:prompt_tokens_total", stats.prompt_tokens),
        ("vllm:generation_tokens_total", stats.generation_tokens),
        ("vllm:prefix_cache_queries_total", stats.prefix_cache_queries),
        ("vllm:prefix_cache_hits_total", stats.prefix_cache_hits),
        ("vllm:num_preemptions_total", stats.num_preemptions),
    ]:
        assert value(m, name) == expected, name


def test_request_success_by_reason(traffic: Traffic) -> None:
    m = traffic.metrics
    counts = {
        r: value(m, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort")
    }
    assert counts == {"stop": 1, "length": 1, "abort": 1}


def test_histogram_counts(traffic: Traffic) -> None:
    m, stats = traffic.metrics, traffic.engine.stats()
    count = {
        name: value(m, f"{name}_count")
        for name in (
            "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:request_time_per_output_token_seconds",
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens",
            "ember:step_seconds",
            "ember:batch_size",
            "ember:batch_tokens",
        )
    }
    assert count["vllm:time_to_first_token_seconds"] == 3  # the aborted request had its first token
    # One token per update (n == 1), so every token after a request's first is one inter-token gap.
    assert count["vllm:inter_token_latency_seconds"] == stats.generation_tokens - 3
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
    ):
        assert count[name] == 3, name  # every request ends with an output, the aborted one too
    aborted_tokens = stats.generation_tokens - sum(traffic.finished_tokens)
    assert aborted_tokens >= 1
    # Time per output token needs two tokens; the aborted request may have stopped after one.
    assert count["vllm:request_time_per_output_token_seconds"] == 2 + (aborted_tokens > 1)
    assert value(m, "vllm:request_prompt_tokens_sum") == sum(traffic.prompt_lengths) + 50
    assert value(m, "vllm:request_generation_tokens_sum") == stats.generation_tokens
    for name in ("ember:step_seconds", "ember:batch_size", "ember:batch_tokens"):
        assert count[name] == traffic.steps, name
    assert value(m, "ember:batch_size_sum") == sum(traffic.batch_sizes)
    assert value(m, "vllm:time_to_first_token_seconds_sum") > 0
    assert value(m, "vllm:e2e_request_latency_seconds_bucket", le="+Inf") == 3
    assert value(m, "vllm:request_params_max_tokens_sum") == 500 + 12 + 12  # as each request asked
    assert value(m, "vllm:request_params_n_sum") == 3
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == stats.generation_tokens  # n == 1
    for name in ("prefill", "decode", "inference"):
        assert value(m, f"vllm:request_{name}_time_seconds_count") == 3, name
    assert value(m, "vllm:iteration_tokens_total_count") == traffic.steps
    assert value(m, "vllm:iteration_tokens_total_sum") == value(m, "ember:batch_tokens_sum")


def test_every_series_is_labelled_and_gauges_read_idle(traffic: Traffic) -> None:
    m = traffic.metrics
    found = samples(m)
    names = {name for name, _ in found}
    assert {"vllm:num_requests_running", "ember:draining", "ember:deadline_aborts_total"} <= names
    assert all(dict(labels).get("model_name") == MODEL for _, labels in found)
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:num_requests_waiting") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0


def test_log_line_after_traffic_then_none_while_idle(traffic: Traffic) -> None:
    line = traffic.metrics.log_line()
    assert line is not None and line.startswith("running: 0 reqs, waiting: 0 reqs, KV cache: 0.0%")
    assert traffic.metrics.log_line() is None


def test_server_side_counters_and_draining() -> None:
    m = EngineMetrics(MODEL)
    m.record_shed("queue_full", "low")
    m.record_shed("queue_full", "low")
    m.record_shed("deadline_unmeetable", "high")
    m.record_fallback("served")
    m.record_fallback("failed")
    m.record_fallback("failed")
    m.record_deadline_abort()
    assert value(m, "ember:draining") == 0
    m.set_draining(True)
    assert value(m, "ember:requests_shed_total", reason="queue_full", priority="low") == 2
    assert value(m, "ember:requests_shed_total", reason="deadline_unmeetable", priority="high") == 1
    assert value(m, "ember:fallback_requests_total", outcome="served") == 1
    assert value(m, "ember:fallback_requests_total", outcome="failed") == 2
    assert value(m, "ember:deadline_aborts_total") == 1
    assert value(m, "ember:draining") == 1
    m.set_draining(False)
    assert value(m, "ember:draining") == 0


def _stats(**changes: float) -> EngineStats:
    base = dict.fromkeys(EngineStats.__dataclass_fields__, 0)
    base.update(spec=None, spec_enabled=False)  # no speculative decoding here
    return EngineStats(**{**base, "num_kv_blocks": 64, **changes})  # type: ignore[arg-type]


def _output(rid: str, t: float, tokens: list[int], reason: str | None = None) -> RequestOutput:
    metrics = RequestMetrics(100.0, 100.5, 101.0, t, 7, len(tokens), 0, 0)
    sample = CompletionOutput(0, token_ids=tokens, delta_token_ids=tokens[-1:], finish_reason=reason)
    return RequestOutput(rid, None, [1] * 7, [sample], finished=reason is not None, metrics=metrics)


def test_timings_from_request_metrics_and_an_abort_output() -> None:
    m = EngineMetrics(MODEL)
    busy = _stats(num_running=1, prompt_tokens=7, generation_tokens=1)
    m.record_step(busy, [_output("a", 101.0, [5])])
    m.record_step(busy, [_output("a", 101.25, [5, 6])])
    m.record_step(busy, [_output("a", 101.75, [5, 6, 7], reason="abort")])
    m.record_step(_stats(prompt_tokens=7, generation_tokens=3), [])  # idle: nothing left to count
    assert value(m, "vllm:time_to_first_token_seconds_sum") == 1.0
    assert value(m, "vllm:inter_token_latency_seconds_count") == 2
    assert value(m, "vllm:inter_token_latency_seconds_sum") == 0.75
    assert value(m, "vllm:request_time_per_output_token_seconds_sum") == 0.375
    assert value(m, "vllm:request_queue_time_seconds_sum") == 0.5
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(m, "vllm:generation_tokens_total") == 3


def test_stale_stats_do_not_count_twice_and_log_line_rates() -> None:
    m = EngineMetrics(MODEL)
    assert m.log_line() is None
    m.record_step(_stats(num_running=2, kv_cache_usage=0.125, prefix_cache_queries=100, num_steps=1), [])
    m.record_stats(_stats(prefix_cache_queries=60))  # older snapshot from another thread
    m.record_step(
        _stats(num_running=3, num_waiting=1, kv_cache_usage=0.125, prefix_cache_queries=200, num_steps=2), []
    )
    m.record_stats(_stats(num_running=3, num_waiting=1, kv_cache_usage=0.125, prefix_cache_queries=200))
    assert value(m, "vllm:prefix_cache_queries_total") == 200
    m.record_step(
        _stats(
            num_running=3,
            num_waiting=1,
            kv_cache_usage=0.125,
            prompt_tokens=850,
            generation_tokens=120,
            prefix_cache_queries=300,
            prefix_cache_hits=63,
            num_steps=3,
        ),
        [],
    )
    line = m.log_line()
    assert line is not None
    match = re.fullmatch(
        r"running: 3 reqs, waiting: 1 reqs, KV cache: 12\.5%, prompt: ([\d.]+) tok/s, "
        r"generation: ([\d.]+) tok/s, prefix cache hit rate: 21\.0%",
        line,
    )
    assert match is not None, line
    assert float(match[1]) > float(match[2]) > 0
    assert m.log_line() is None


def test_two_engines_in_one_process_keep_separate_registries() -> None:
    first, second = EngineMetrics("model-a"), EngineMetrics("model-b")
    first.record_deadline_abort()
    a, b = first.render()[0].decode(), second.render()[0].decode()
    assert 'ember:deadline_aborts_total{model_name="model-a"} 1.0' in a
    assert 'ember:deadline_aborts_total{model_name="model-b"} 0.0' in b
    assert "model-b" not in a and "model-a" not in b


def test_the_server_publishes_its_cache_config_as_vllm_does(tiny_model: Path) -> None:
    """`vllm:cache_config_info`: 1, the KV cache's configuration in its labels (where the Gateway API
    inference extension's scheduler reads a replica's KV capacity, num_gpu_blocks x block_size)."""
    import plainhttp
    from server_util import running_server

    extra = ("--block-size", "32", "--num-kv-blocks", "77", "--kv-cache-dtype", "fp8_e5m2")
    with running_server(tiny_model, *extra, "--no-enable-prefix-caching") as server:
        body = plainhttp.get(f"{server.url}/metrics").text
    info = [
        s
        for family in text_string_to_metric_families(body)
        for s in family.samples
        if s.name == "vllm:cache_config_info"
    ]
    assert len(info) == 1 and info[0].value == 1.0
    labels = info[0].labels
    assert labels["block_size"] == "32" and labels["num_gpu_blocks"] == "77"
    assert labels["cache_dtype"] == "fp8_e5m2" and labels["enable_prefix_caching"] == "False"
    assert labels["gpu_memory_utilization"] == "0.9"


Page = dict[tuple[str, frozenset[tuple[str, str]]], float]
# What admission sheds for: each a reason label of ember:requests_shed_total.
SHED_REASONS = ("queue_full", "queue_wait", "draining", "not_ready", "client_limit")


def _page(body: str) -> Page:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


def _key(name: str, **labels: str) -> tuple[str, frozenset[tuple[str, str]]]:
    return name, frozenset({"model_name": MODEL, **labels}.items())


def _missing_at_0(page: Page, classes: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The shed and wait-limit series of these classes that are not on the page at 0."""
    wanted = [_key("ember:requests_shed_total", reason=r, priority=c) for c in classes for r in SHED_REASONS]
    wanted += [_key("ember:queue_wait_over_limit_total", priority=c) for c in classes]
    return [(name, *sorted(v for _, v in labels)) for name, labels in wanted if page.get((name, labels)) != 0]


def test_a_server_has_its_shed_and_wait_limit_series_at_0_before_their_first_event(
    tiny_model: Path, tmp_path: Path
) -> None:
    """rate() and increase() count a counter's first event only from an earlier sample of its series: the
    shed and wait-over-limit counters were created by their first event, so a service's first sheds
    counted as none. Each shed reason of each of the policy's priority classes, and each class's waits over
    its limit, are there at 0 from the start; a new policy's new classes from when it takes effect.
    Without speculative decoding the spec_decode counters are 0 and the per-position one, which has no
    positions then, is not there at all (it was a family with no samples)."""
    import json

    import plainhttp
    from server_util import running_server
    from waiting import wait_for

    def classes(*names: str) -> str:
        listed = [{"name": n, "priority": i} for i, n in enumerate(names)]
        return json.dumps({"loadShedding": {"priorityClasses": listed, "defaultPriorityClass": names[0]}})

    policy = tmp_path / "policy.yaml"
    policy.write_text(classes("gold", "bronze"))
    with running_server(tiny_model, "--served-model-name", MODEL, "--policy", str(policy)) as server:
        body = plainhttp.get(f"{server.url}/metrics").text
        page = _page(body)
        assert _missing_at_0(page, ("gold", "bronze")) == []
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            assert page[_key(f"vllm:spec_decode_{name}_total")] == 0
        assert page[_key("ember:spec_decode_enabled")] == 0
        assert "vllm:spec_decode_num_accepted_tokens_per_pos" not in body
        policy.write_text(classes("gold", "silver", "bronze"))

        def silver_missing() -> list[tuple[str, ...]]:
            return _missing_at_0(_page(plainhttp.get(f"{server.url}/metrics").text), ("silver",))

        wait_for(lambda: not silver_missing(), timeout=15, what=lambda: f"at 0: {silver_missing()}")


def test_a_speculating_server_has_each_proposal_position_at_0_while_it_loads(tiny_model: Path) -> None:
    """The per-position acceptance counter's positions 0..K-1 were created with the engine's first
    stats, after the model had loaded; they are there at 0 from the start, like the other spec_decode
    counters. /metrics is read before the model loads (its lifespan, which loads it, is not run)."""
    from fastapi.testclient import TestClient
    from server_util import serve_args

    from ember_engine.server import serve

    extra = ("--served-model-name", MODEL, "--draft-model", str(tiny_model), "--num-speculative-tokens", "3")
    server, state, _ = serve.build_server(serve_args(tiny_model, *extra))
    body = TestClient(server.config.app).get("/metrics").text
    assert state.engine is None
    positions = {
        labels["position"]: value
        for (name, key), value in _page(body).items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        for labels in (dict(key),)
    }
    assert positions == {"0": 0, "1": 0, "2": 0}
    assert _page(body)[_key("vllm:spec_decode_num_drafts_total")] == 0


def test_a_prompt_with_n_samples_counts_its_prompt_tokens_once(tiny_model: Path) -> None:
    """`vllm:prompt_tokens_total` counted the prompt once per sample while `vllm:request_prompt_tokens`
    and `vllm:request_success_total` count the request once, so the two prompt figures disagreed by n."""
    from ember_engine import LLM

    llm = LLM(str(tiny_model))
    metrics = EngineMetrics(MODEL)
    prompt = list(range(30, 35))
    params = SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True)
    engine = llm.engine
    engine.add_request("r", prompt, params)
    while engine.has_unfinished_requests():
        metrics.record_step(engine.stats(), engine.step())
    metrics.record_stats(engine.stats())
    assert value(metrics, "vllm:prompt_tokens_total") == len(prompt)
    assert value(metrics, "vllm:request_prompt_tokens_sum") == len(prompt)
    assert value(metrics, "vllm:request_success_total", finished_reason="length") == 1
    assert value(metrics, "vllm:generation_tokens_total") == 12


def test_each_of_n_samples_has_its_own_inter_token_gaps(tiny_model: Path) -> None:
    """The token timestamps in a request's metrics were the first sample's only, so every update from
    the other samples measured its gap against the first sample's latest token: once that sample had
    ended, each such gap read 0 s. Each sample's tokens are one stream of inter-token gaps (vLLM measures
    each of the n samples as a request of its own); time per output token covers every sample's decode."""
    from ember_engine import LLM

    engine = LLM(str(tiny_model)).engine
    metrics = EngineMetrics(MODEL)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    engine.add_request("r", list(range(30, 35)), params)
    requests = [s.request for s in engine.outputs.groups["r"].samples]
    while engine.has_unfinished_requests():
        metrics.record_step(engine.stats(), engine.step())
    # One token per sample per step without speculation: a sample's gaps are its tokens after the first.
    gaps = sum(len(r.output_token_ids) - 1 for r in requests)
    spans = [r.last_token_time - r.first_token_time for r in requests]  # type: ignore[operator]
    assert gaps == 15 and min(spans) > 0
    assert value(metrics, "vllm:inter_token_latency_seconds_count") == gaps
    assert value(metrics, "vllm:inter_token_latency_seconds_sum") == pytest.approx(sum(spans))
    assert value(metrics, "vllm:inter_token_latency_seconds_bucket", le="0.0005") < gaps  # no run of 0 s
    # The prompt is still one request to the per-request histograms.
    assert value(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert value(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(metrics, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(metrics, "vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        sum(spans) / gaps
    )
    assert requests[0].first_token_time is not None
    assert value(metrics, "vllm:time_to_first_token_seconds_sum") == pytest.approx(
        requests[0].first_token_time - requests[0].arrival_time
    )


PREEMPTED_PROMPTS = [[10 + (i * 37 + j * 11) % 200 for j in range(30)] for i in range(6)]  # no shared block


def _preempting_run(tiny_model: Path, prefix_caching: bool) -> tuple[EngineStats, EngineMetrics]:
    """Six prompts sharing no block, on a cache too small for all of them: requests are preempted and
    admitted again."""
    config = EngineConfig(
        model=str(tiny_model),
        num_kv_blocks=16,
        block_size=16,
        max_model_len=256,
        max_num_seqs=8,
        enable_prefix_caching=prefix_caching,
    )
    engine = LLMEngine(config)
    metrics = EngineMetrics(MODEL)
    for i, prompt in enumerate(PREEMPTED_PROMPTS):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
    while engine.has_unfinished_requests():
        metrics.record_step(engine.stats(), engine.step())
    stats = engine.stats()
    metrics.record_stats(stats)
    assert stats.num_preemptions > 0
    return stats, metrics


def test_a_preempted_requests_readmission_is_no_prefix_cache_query(tiny_model: Path) -> None:
    """A preempted request looks its tokens up again when it is re-admitted; those lookups were added to
    `vllm:prefix_cache_queries` and `_hits`, so prompts sharing nothing showed hits (vLLM keeps them apart,
    as its preempted_queries and preempted_hits). Only a request's first admission counts there; the
    re-admissions have ember's counters."""
    stats, metrics = _preempting_run(tiny_model, prefix_caching=True)
    prompted = sum(map(len, PREEMPTED_PROMPTS))
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (prompted, 0)
    assert value(metrics, "vllm:prefix_cache_queries_total") == prompted
    assert value(metrics, "vllm:prefix_cache_hits_total") == 0
    # Each re-admission looked up the prompt and the tokens generated before it was preempted.
    assert stats.prefix_cache_preempted_queries > stats.num_preemptions * 30
    assert (
        value(metrics, "ember:prefix_cache_preempted_queries_total") == stats.prefix_cache_preempted_queries
    )
    assert value(metrics, "ember:prefix_cache_preempted_hits_total") == stats.prefix_cache_preempted_hits


def test_no_prefix_cache_counts_nothing_while_it_is_off(tiny_model: Path) -> None:
    """With prefix caching off every admission still counted its tokens as queries (and no hits), so a
    dashboard read a 0% hit rate where vLLM, which records no prefix-cache stats then, shows none. Neither
    first admissions nor re-admissions after a preemption count."""
    stats, metrics = _preempting_run(tiny_model, prefix_caching=False)
    assert stats.prompt_tokens >= sum(map(len, PREEMPTED_PROMPTS))
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (0, 0)
    assert (stats.prefix_cache_preempted_queries, stats.prefix_cache_preempted_hits) == (0, 0)
    for name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert value(metrics, f"{name}_total") == 0
    for name in ("ember:prefix_cache_preempted_queries", "ember:prefix_cache_preempted_hits"):
        assert value(metrics, f"{name}_total") == 0


@pytest.mark.parametrize("n", [1, 3])
def test_a_prompt_aborted_while_queued_is_one_finished_request(tiny_model: Path, n: int) -> None:
    """A prompt aborted before it was scheduled (its deadline, or its client gone) ends as one request with
    finish_reason "abort", whatever its n: the samples waiting for the first one's prefill end too."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model), max_num_seqs=1))
    metrics = EngineMetrics(MODEL)
    engine.add_request("running", [10] * 20, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    metrics.record_step(engine.stats(), engine.step())
    engine.add_request("queued", [11] * 20, SamplingParams(temperature=1, max_tokens=50, n=n))
    metrics.record_step(engine.stats(), engine.step())
    assert engine.stats().num_waiting == 1  # the seat is taken
    out = engine.abort_request("queued")
    assert out is not None
    metrics.record_step(engine.stats(), [out])
    assert out.finished and [c.finish_reason for c in out.outputs] == ["abort"] * n
    assert value(metrics, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(metrics, "vllm:e2e_request_latency_seconds_count") == 1
    engine.abort_request("running")
    assert not engine.has_unfinished_requests()
    engine.shutdown()


def test_each_phase_of_a_request_and_its_parameters_as_vllm_counts_them() -> None:
    """vLLM's per-request phase histograms (prefill: first scheduled to first token; decode: first token to
    last; inference: first scheduled to last) and its parameter histograms (`n`, `max_tokens`, and the
    tokens of the sample that generated the most), one observation per finished request."""
    m = EngineMetrics(MODEL)
    timing = RequestMetrics(100.0, 100.5, 101.0, 104.0, 7, 9, 0, 0, [(101.0, 104.0), (101.0, 102.0)], 20)
    pair = [CompletionOutput(0, token_ids=[5] * 6, finish_reason="length"), CompletionOutput(1, [5] * 3)]
    pair[1].finish_reason = "stop"
    m.record_step(_stats(), [RequestOutput("n2", None, [1] * 7, pair, finished=True, metrics=timing)])
    m.record_step(_stats(), [_output("a", 101.75, [5, 6, 7], reason="length")])  # max_tokens unknown
    assert value(m, "vllm:request_prefill_time_seconds_sum") == 0.5 + 0.5
    assert value(m, "vllm:request_decode_time_seconds_sum") == 3.0 + 0.75
    assert value(m, "vllm:request_inference_time_seconds_sum") == 3.5 + 1.25
    assert value(m, "vllm:request_params_n_sum") == 2 + 1
    assert value(m, "vllm:request_params_n_count") == 2
    assert value(m, "vllm:request_params_max_tokens_sum") == 20
    assert value(m, "vllm:request_params_max_tokens_count") == 1  # not observed where it is unknown
    assert value(m, "vllm:request_max_num_generation_tokens_sum") == 6 + 3
    assert value(m, "vllm:iteration_tokens_total_count") == 0  # these were no engine steps
