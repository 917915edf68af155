"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample, and
EngineStats, its counters and gauges as of a step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember_engine.spec.decoder import SpecStats


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    rank: int | None = None  # prompt tokens': 1 + how many tokens the model found likelier


@dataclass(slots=True)
class RequestMetrics:
    """Timestamps (time.monotonic seconds) and counts of one request, first sample; with n > 1 each
    sample's first and last token times too (`sample_token_times`, in the order of the outputs)."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int  # all samples together
    num_cached_tokens: int
    num_preemptions: int
    sample_token_times: list[tuple[float | None, float | None]] | None = None  # n > 1 only
    max_tokens: int | None = None  # the most tokens each sample was allowed


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str = ""  # everything so far
    token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""  # what this update added
    delta_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list[Logprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None  # set when the request was refused, or ended unfinished (its grammar broke)
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: None for the first token, then each prompt token's (vLLM's shape)
    prompt_logprobs: list[Logprob | None] | None = None

    # The common n == 1 case reads like the sample itself.
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else "error"

    @property
    def logprobs(self) -> list[Logprob] | None:
        return self.outputs[0].logprobs if self.outputs else None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    last_step_seconds: float  # wall time of the latest step
    last_batch_size: int  # requests in it
    last_batch_tokens: int  # tokens in it
    num_steps: int  # steps run so far
    spec: SpecStats | None = None  # a copy; None without speculative decoding
    spec_enabled: bool = False  # the adaptive controller's latest decision
    prefix_cache_preempted_queries: int = 0  # re-admitted preempted requests' lookups, not in the above
    prefix_cache_preempted_hits: int = 0
    # LoRA adapters of the requests running and waiting (each named once)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
