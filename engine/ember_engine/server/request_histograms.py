"""The histograms observed once per finished request: its latency, each of its phases, its lengths and
the parameters it asked for, under vLLM's names. A prompt with n samples is one request: its phases run
from its first scheduling and its first token to the last token of any sample."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from prometheus_client import Histogram

if TYPE_CHECKING:
    from ember_engine.core.outputs import RequestMetrics, RequestOutput

# From a sub-millisecond GPU decode step up to a slow CPU prefill; whole requests can take minutes. A
# quantile is interpolated within its bucket, so an alert's threshold must be an edge (1.5 and 2 s for
# TTFT objectives: without them every TTFT over 1 s read as a p99 near 2.5 s).
LATENCY = (
    *(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5),
    *(0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0),
)
REQUEST = (*LATENCY, 160.0, 320.0, 640.0, 1280.0)
TOKENS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, 10, ... 500000
SAMPLES = (1, 2, 5, 10, 20)

Factory = Callable[[str, str, Sequence[float]], Histogram]


class FinishedRequests:
    def __init__(self, hist: Factory) -> None:
        """`hist(name, doc, buckets)`: a histogram child of the engine's registry, labelled with its model."""
        self._e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST)
        self._queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST)
        self._prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST)
        self._decode = hist("vllm:request_decode_time_seconds", "First token to last token.", REQUEST)
        self._inference = hist(
            "vllm:request_inference_time_seconds", "First scheduled to last token.", REQUEST
        )
        self._tpot = hist(
            "vllm:request_time_per_output_token_seconds", "Mean decode time per token.", LATENCY
        )
        self._prompt_len = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", TOKENS)
        self._gen_len = hist("vllm:request_generation_tokens", "Generated tokens per request.", TOKENS)
        self._longest = hist(
            "vllm:request_max_num_generation_tokens", "Tokens of a request's longest sample.", TOKENS
        )
        self._n = hist("vllm:request_params_n", "Samples a request asked for (n).", SAMPLES)
        self._max_tokens = hist("vllm:request_params_max_tokens", "max_tokens of a request.", TOKENS)

    def observe(self, out: RequestOutput, m: RequestMetrics, now: float) -> None:
        self._e2e.observe(now - m.arrival_time)
        times = m.sample_token_times or ((m.first_token_time, m.last_token_time),)
        last = max((t for _, t in times if t is not None), default=None)
        if m.first_scheduled_time is not None:
            self._queue.observe(m.first_scheduled_time - m.arrival_time)
            if m.first_token_time is not None:
                self._prefill.observe(m.first_token_time - m.first_scheduled_time)
            if last is not None:
                self._inference.observe(last - m.first_scheduled_time)
        if m.first_token_time is not None and last is not None:
            self._decode.observe(last - m.first_token_time)
        self._prompt_len.observe(m.num_prompt_tokens)
        self._gen_len.observe(m.num_generation_tokens)
        self._longest.observe(max((len(c.token_ids) for c in out.outputs), default=0))
        self._n.observe(len(out.outputs))
        if m.max_tokens is not None:
            self._max_tokens.observe(m.max_tokens)
        # One per request: every sample's decode time over its tokens after the first.
        decode_time, decode_tokens = 0.0, 0
        for c, (first, end) in zip(out.outputs, times, strict=False):
            if len(c.token_ids) > 1 and first is not None and end is not None:
                decode_time += end - first
                decode_tokens += len(c.token_ids) - 1
        if decode_tokens:
            self._tpot.observe(decode_time / decode_tokens)
