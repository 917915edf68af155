"""Per-request sampling settings (the Python-API contract, mirrored by the HTTP server)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ember_engine.sample.grammar import Constraint, Grammar

_GREEDY_EPS = 1e-5


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; 0: the chosen token's; k: also the top k
    prompt_logprobs: int | None = None  # None: off; 0: each prompt token's own; k: also the top k
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens (-1: the model length)
    allowed_token_ids: list[int] | None = None  # sample only among these (vLLM's field)
    bad_words: list[str] | None = None  # words never generated: each one's last token held back (vLLM's)
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Structured output: what the text must match; `grammar` is its compiled form (the engine compiles
    # `constraint` when it is not given, the HTTP server compiles off its event loop and passes both).
    constraint: Constraint | None = None
    grammar: Grammar | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def penalized(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies (they read the tokens so far)."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as served: its last `truncate_prompt_tokens` tokens (-1: as many as the model length),
        as vLLM keeps them; ValueError naming the field when more than the model length are asked for."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        if k > max_model_len:
            raise ValueError(f"truncate_prompt_tokens: {k} exceeds max_model_len {max_model_len}")
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

    def check_vocabulary(self, vocab: int) -> None:
        """ValueError naming the field when a token id it gives is outside the model's vocabulary."""
        for name, ids in (
            ("logit_bias", self.logit_bias or {}),
            ("allowed_token_ids", self.allowed_token_ids),
        ):
            if (bad := next((t for t in ids or () if t >= vocab), None)) is not None:
                raise ValueError(f"{name}: token id {bad} is outside the vocabulary (size {vocab})")

    def validate(self) -> None:
        """Raise ValueError naming the offending field."""

        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not 0 <= self.temperature < math.inf:  # NaN too
            bad("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", f"must be a finite number > 0, got {self.repetition_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a string or a list of non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of non-negative integers")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            bad("logprobs", f"must be an integer in [0, 20], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            type(self.prompt_logprobs) is not int or not 0 <= self.prompt_logprobs <= 20
        ):
            bad("prompt_logprobs", f"must be an integer in [0, 20], got {self.prompt_logprobs!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (type(k) is not int or not (k >= 1 or k == -1)):
            bad("truncate_prompt_tokens", f"must be an integer >= 1, or -1 (the model length), got {k!r}")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list)
            or not allowed
            or not all(type(t) is int and t >= 0 for t in allowed)
        ):
            bad("allowed_token_ids", f"must be a non-empty list of token ids >= 0, got {allowed!r}")
        if allowed is not None and self.constraint is not None:  # the two may leave no token at all
            bad("allowed_token_ids", "not with a structured-output constraint (use one or the other)")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list) or not all(isinstance(w, str) and w.strip() for w in words)
        ):
            bad("bad_words", f"must be a list of words (non-blank strings), got {words!r}")
        for token, value in (self.logit_bias or {}).items():
            if not isinstance(token, int) or token < 0:
                bad("logit_bias", f"keys must be token ids >= 0, got {token!r}")
            if not -100 <= value <= 100:
                bad("logit_bias", f"values must be in [-100, 100], got {value} for token {token}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 64:
            bad("seed", f"must fit in 64 bits (signed or unsigned), got {self.seed}")
