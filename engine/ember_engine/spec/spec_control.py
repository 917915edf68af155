"""When speculative decoding pays: measured, not modelled.

Whether verifying K proposals beats decoding one token depends on the acceptance rate, the batch size
(a large batch already fills the hardware, so the extra rows are no longer free) and the proposer's own
cost. Rather than model all of that, the controller keeps, per batch-size bucket, a running mean of the
decode throughput (tokens per second of step time) with speculation on and with it off, runs whichever is
faster, and tries the other one every `explore_every` steps of that bucket, so it notices when the
answer changes (different prompts, different load).

Per request it shrinks K to 1 for a request whose recent acceptance is poor, so one request that does
not speculate well costs little while the others keep their full lookahead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

_SMOOTHING = 0.2  # weight of the newest sample in the running means
_MIN_SAMPLES = 3  # tries of each arm before trusting the means
_POOR_ACCEPTANCE = 0.3  # a request below this recent acceptance gets K = 1
_MIN_DRAFTS_TO_JUDGE = 8


@dataclass(slots=True)
class _Arm:
    samples: int = 0
    tokens_per_s: float = 0.0

    def add(self, value: float) -> None:
        self.samples += 1
        w = 1.0 if self.samples == 1 else _SMOOTHING
        self.tokens_per_s += w * (value - self.tokens_per_s)


@dataclass(slots=True)
class _Bucket:
    off: _Arm = field(default_factory=_Arm)
    on: _Arm = field(default_factory=_Arm)
    steps: int = 0


def bucket_of(num_decoding: int) -> int:
    """Batch sizes 1, 2-3, 4-7, 8-15, ...: throughput changes roughly with the logarithm of the batch."""
    return max(num_decoding, 1).bit_length()


class SpecController:
    def __init__(self, num_speculative_tokens: int, adaptive: bool = True, explore_every: int = 20) -> None:
        self.k = num_speculative_tokens
        self.adaptive = adaptive
        self.explore_every = explore_every
        self.buckets: dict[int, _Bucket] = {}
        self.enabled = True  # the latest decision, for metrics

    def lookahead(self, num_decoding: int) -> int:
        """K for this step (0: speculation off), for a step with `num_decoding` decoding requests."""
        if not self.adaptive:
            self.enabled = True
            return self.k
        b = self.buckets.setdefault(bucket_of(num_decoding), _Bucket())
        b.steps += 1
        if b.on.samples < _MIN_SAMPLES:
            on = True
        elif b.off.samples < _MIN_SAMPLES:
            on = False
        else:
            on = b.on.tokens_per_s >= b.off.tokens_per_s
            if b.steps % self.explore_every == 0:
                on = not on
        self.enabled = on
        return self.k if on else 0

    def record(self, num_decoding: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A step in which every scheduled request was decoding: `tokens` generated in `seconds`."""
        if seconds <= 0 or num_decoding <= 0:
            return
        b = self.buckets.setdefault(bucket_of(num_decoding), _Bucket())
        (b.on if speculated else b.off).add(tokens / seconds)

    def request_lookahead(self, k: int, recent_acceptance: float | None, num_drafted: int) -> int:
        """The request's share of this step's K, from its recent acceptance and how much it has drafted."""
        if k == 0 or recent_acceptance is None or num_drafted < _MIN_DRAFTS_TO_JUDGE:
            return k
        return k if recent_acceptance >= _POOR_ACCEPTANCE else 1


def updated_acceptance(previous: float | None, drafted: int, accepted: int) -> float | None:
    """A request's recent acceptance rate (a running mean) after one verification."""
    if drafted == 0:
        return previous
    rate = accepted / drafted
    return rate if previous is None else previous + _SMOOTHING * (rate - previous)
