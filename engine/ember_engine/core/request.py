"""A request's state inside the engine: its tokens, how many are computed, its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ember_engine.core.outputs import Logprob
from ember_engine.sample.grammar import GrammarState
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.seeds import position_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_tokens: int = 16  # params.max_tokens resolved against the model length
    priority: int = 0  # lower is more important (vLLM's convention)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    # The LoRA adapter it runs on: its slot (0: the base model), and its key in the prefix cache
    adapter: int = 0
    lora_key: str | None = None
    generator: torch.Generator | None = None
    seed: int | None = None  # with a generator: this sample's seed, which keys each token's noise
    index: int = 0  # n > 1: the samples of one prompt are told apart by index
    grammar: GrammarState | None = None  # structured output: advanced by every token kept
    bad_words: list[list[int]] = field(default_factory=list)  # token sequences of `bad_words`
    # prompt logprobs, collected by a prompt's first sample: None for token 0, then one per token computed
    prompt_logprobs: list[Logprob | None] | None = None

    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(init=False)  # the generated tail of all_token_ids, kept beside it
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    num_prompt_cached_tokens: int = 0  # prefix-cache hit at first admission
    num_preemptions: int = 0
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None  # why it ended unfinished ("abort"): its grammar could not go on
    # speculative decoding
    spec_lookahead: int = 0  # draft slots the engine asks the scheduler for in the next step
    spec_token_ids: list[int] = field(default_factory=list)  # this step's proposals, after the known tokens
    draft_probs: torch.Tensor | None = None  # [len(spec_token_ids), vocab] q for sampled requests' drafts
    num_draft_computed: int = 0  # leading tokens whose KV the draft model has written
    num_draft_tokens: int = 0  # proposals verified so far
    num_accepted_tokens: int = 0  # of those, accepted
    recent_acceptance: float | None = None  # running mean of the per-step acceptance rate
    # n-gram lookup: all_token_ids mirrored in numpy (`spec.ngram_proposer.TokenArray`)
    token_array: Any = None
    # timestamps (monotonic seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self.output_token_ids = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def append_token(self, token: int) -> None:
        """The one way a generated token joins the request (both lists grow together)."""
        self.all_token_ids.append(token)
        self.output_token_ids.append(token)

    @property
    def collecting_prompt_logprobs(self) -> bool:
        """Whether some prompt tokens still lack their logprobs: the prefix cache is then not read."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)

    def sampling_inputs(self) -> tuple[SamplingParams, torch.Generator | None, list[int], list[int]]:
        """What the sampler's persistent state needs of this request when it first samples."""
        return self.params, self.generator, self.prompt_token_ids, self.output_token_ids

    def suppressed_token_ids(self) -> list[int]:
        """Tokens the sampler must not pick next: EOS and stop ids while the output is short of min_tokens,
        and the last token of each bad word whose other tokens the output ends with."""
        p = self.params
        ids = []
        if self.num_output_tokens < p.min_tokens:
            ids = [*p.stop_token_ids, *([] if p.ignore_eos else self.eos_token_ids)]
        out = self.output_token_ids
        for word in self.bad_words:  # as vLLM: the output so far, not the prompt, completes a word
            if len(word) - 1 <= len(out) and (len(word) == 1 or out[1 - len(word) :] == word[:-1]):
                ids.append(word[-1])
        if p.allowed_token_ids is not None and set(p.allowed_token_ids) <= set(ids):
            return []  # they are all allowed_token_ids allows: the set wins, as a grammar does
        return ids

    def noise_seed(self, ahead: int) -> int | None:
        """The noise seed of the output token `ahead` places after those known (proposals count)."""
        return None if self.seed is None else position_seed(self.seed, self.num_output_tokens + ahead)
