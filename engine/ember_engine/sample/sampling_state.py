"""Per-request sampling state kept on the device between steps.

Each request that samples holds a slot. A slot's parameters (temperature, top-k, top-p, min-p, the three
penalties) live in one persistent parameter tensor, written when the request takes the slot, uploaded
only when some slot changed. With penalties, the slot also owns its penalty state on the device
(`PenaltyState`: the distinct tokens seen and what the penalties take off each), updated by scattering each step's sampled tokens,
so a step never re-reads a request's token lists. A request's logit_bias is fixed too: the view holds the
batch's (row * vocab + token, bias) pairs on the device, built with the view. `view` describes one step's rows; it is rebuilt only when
the batch's slots differ from the previous step's."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

from ember_engine.sample.nucleus import Cuts
from ember_engine.sample.penalty_state import PenaltyState
from ember_engine.sample.sampling_params import SamplingParams

K = TypeVar("K", bound=Hashable)

# Columns of the parameter tensor.
TEMPERATURE, TOP_K, TOP_P, MIN_P, REPETITION, FREQUENCY, PRESENCE = range(7)


@dataclass(slots=True)
class SlotInfo:
    params: SamplingParams
    generator: torch.Generator | None


@dataclass(slots=True)
class BatchView:
    """One step's rows, in batch order, and what their parameters ask for (host-side flags decided once
    per batch composition)."""

    slots: list[int]
    slot_index: torch.Tensor  # [rows] long on the device
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    all_greedy: bool
    random_rows: list[int]
    random_index: torch.Tensor | None  # the random rows, on the device
    penalized_rows: list[int]
    penalized_index: torch.Tensor | None  # the penalized rows, on the device
    penalized_slots: torch.Tensor | None
    penalized_all: bool  # every row is penalized
    penalized_slot_list: list[int]
    penalized_span: tuple[int, int] | None  # (first, end) when the penalized slots are first, first + 1, ...
    repetition: bool  # some penalized row has a repetition penalty
    truncating: bool  # some random row has top-k or top-p
    max_top_k: int  # the largest top-k among truncating rows (0 when some row truncates by top-p alone)
    min_p: bool
    logprob_rows: list[int]  # rows that asked for logprobs
    suppress_rows: list[int]  # rows that may hold tokens back: min_tokens > 0, or bad_words
    grammar_rows: list[int]  # structured-output rows (their grammar states come with each step)
    seeded_rows: list[int]  # random rows with their own generator (their noise seeds come with each step)
    # Random rows drawn by rejection against a pivot (`nucleus.sample_truncated`): on a CPU, unseeded, not
    # both top-k and top-p. Positions among the random rows; the index tensors are None when all or none are.
    pivot_rows: list[int]
    pivot_index: torch.Tensor | None
    other_rows: list[int]  # the random rows that are not
    other_index: torch.Tensor | None
    pivot: Cuts  # the pivot rows' cuts and temperatures
    bias_index: torch.Tensor | None  # logit_bias: flat (row * vocab + token) positions, on the device
    bias_values: torch.Tensor | None  # and the biases added there
    # allowed_token_ids: the rows that have them, and the flat positions of the tokens they allow
    allowed: tuple[torch.Tensor, torch.Tensor] | None


def _upload(
    values: Sequence[float] | Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    # From pinned memory the copy queues behind the forward instead of waiting for it.
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def upload_ids(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """Row indices on the device, without making the host wait for the queued work."""
    return _upload(values, torch.long, device)


class SamplingState:
    def __init__(self, capacity: int, vocab: int, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.vocab = vocab
        self.capacity = max(1, capacity)
        # Pinned on a GPU, so the (rare) upload after a change queues behind the forward pass.
        self.host_params = torch.zeros(
            self.capacity, 7, dtype=torch.float32, pin_memory=self.device.type == "cuda"
        )
        self.params = self.host_params.to(self.device)
        self.slot_of: dict[Hashable, int] = {}
        self.info: list[SlotInfo | None] = [None] * self.capacity
        self.free = list(range(self.capacity - 1, -1, -1))
        self.penalties: PenaltyState | None = None  # made when a penalized request first comes
        self._dirty = False
        self._view: BatchView | None = None

    # -- slots ----------------------------------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        return key in self.slot_of

    def add(
        self,
        key: Hashable,
        params: SamplingParams,
        generator: torch.Generator | None,
        prompt_token_ids: Sequence[int],
        output_token_ids: Sequence[int] = (),
    ) -> int:
        """Give `key` a slot holding its parameters (and, with penalties, counts of the output so far)."""
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.slot_of[key] = slot
        self.info[slot] = SlotInfo(params, generator)
        self._view = None  # a slot's rows may now mean another request
        p = params
        top_k = min(p.top_k, self.vocab) if p.top_k > 0 else self.vocab
        row = [p.temperature if p.temperature > 0 else 1.0, top_k, p.top_p, p.min_p]
        self.host_params[slot] = torch.tensor(
            [*row, p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
        )
        self._dirty = True
        if p.penalized:
            if self.penalties is None:
                self.penalties = PenaltyState(self.capacity, self.vocab, self.device)
            self.penalties.reset(
                slot,
                prompt_token_ids if p.repetition_penalty != 1.0 else (),
                output_token_ids,
                p.frequency_penalty,
                p.presence_penalty,
            )
        return slot

    def release(self, key: Hashable) -> None:
        slot = self.slot_of.pop(key, None)
        if slot is not None:
            self.info[slot] = None
            self.free.append(slot)
            self._view = None

    def _grow(self) -> None:
        old = self.capacity
        self.capacity = old * 2
        grown = torch.cat([self.host_params, torch.zeros_like(self.host_params)])
        self.host_params = grown.pin_memory() if self.device.type == "cuda" else grown
        self.info += [None] * old
        self.free = list(range(self.capacity - 1, old - 1, -1))
        if self.penalties is not None:
            self.penalties.grow(self.capacity)
        self._dirty = True

    # -- a step ---------------------------------------------------------------------------------------

    def view(
        self,
        keys: Sequence[K],
        describe: Callable[[K], tuple[SamplingParams, torch.Generator | None, Sequence[int], Sequence[int]]],
    ) -> BatchView:
        """The step's rows for `keys` (in order); a key without a slot gets one from `describe(key)`:
        (params, generator, prompt token ids, output token ids so far)."""
        slot_of = self.slot_of
        for key in keys:
            if key not in slot_of:
                self.add(key, *describe(key))
        slots = [slot_of[k] for k in keys]
        if self._dirty:
            self.params = self.host_params.to(self.device, non_blocking=True)
            self._dirty = False
        view = self._view
        if view is None or view.slots != slots:
            view = self._view = self._describe(slots)
        return view

    def _describe(self, slots: list[int]) -> BatchView:
        infos = [self.info[s] for s in slots]
        params = [i.params for i in infos if i is not None]
        dev = self.device
        random_rows = [r for r, p in enumerate(params) if not p.greedy]
        penalized = [r for r, p in enumerate(params) if p.penalized]
        pen_slots = [slots[r] for r in penalized]
        trunc = [params[r] for r in random_rows if params[r].top_k > 0 or params[r].top_p < 1.0]
        max_k = 0 if any(p.top_k <= 0 for p in trunc) else max((p.top_k for p in trunc), default=0)
        generators = [i.generator for i in infos if i is not None]
        # Each rejection round is checked on the host: on an accelerator a wait for the device per round, so
        # there no row is drawn that way (the top-k candidates need no sync).
        on_cpu = dev.type == "cpu"
        drawn_by_pivot = [
            on_cpu and generators[r] is None and not (params[r].top_k > 0 and params[r].top_p < 1.0)
            for r in random_rows
        ]
        pivot = [j for j, yes in enumerate(drawn_by_pivot) if yes]
        other = [j for j, yes in enumerate(drawn_by_pivot) if not yes]
        split = bool(pivot) and bool(other)
        drawn = [params[random_rows[j]] for j in pivot]
        vocab = self.vocab
        bias = [(r * vocab + t, b) for r, p in enumerate(params) for t, b in (p.logit_bias or {}).items()]
        allowed = [r for r, p in enumerate(params) if p.allowed_token_ids is not None]
        kept = [r * vocab + t for r in allowed for t in params[r].allowed_token_ids or ()]
        return BatchView(
            slots=slots,
            slot_index=_upload(slots, torch.long, dev),
            params=params,
            generators=generators,
            all_greedy=not random_rows,
            random_rows=random_rows,
            random_index=_upload(random_rows, torch.long, dev) if random_rows else None,
            penalized_rows=penalized,
            penalized_index=_upload(penalized, torch.long, dev) if penalized else None,
            penalized_slots=_upload(pen_slots, torch.long, dev) if penalized else None,
            penalized_all=len(penalized) == len(slots),
            penalized_slot_list=pen_slots,
            penalized_span=(
                (pen_slots[0], pen_slots[0] + len(pen_slots))
                if pen_slots and pen_slots == list(range(pen_slots[0], pen_slots[0] + len(pen_slots)))
                else None
            ),
            repetition=any(params[r].repetition_penalty != 1.0 for r in penalized),
            truncating=bool(trunc),
            max_top_k=min(max_k, self.vocab),
            min_p=any(params[r].min_p > 0.0 for r in random_rows),
            logprob_rows=[r for r, p in enumerate(params) if p.logprobs is not None],
            suppress_rows=[r for r, p in enumerate(params) if p.min_tokens > 0 or p.bad_words],
            grammar_rows=[r for r, p in enumerate(params) if p.grammar is not None],
            seeded_rows=[r for r in random_rows if generators[r] is not None],
            pivot_rows=pivot,
            pivot_index=_upload(pivot, torch.long, dev) if split else None,
            other_rows=other,
            other_index=_upload(other, torch.long, dev) if split else None,
            pivot=Cuts.of(drawn, vocab),
            bias_index=_upload([k for k, _ in bias], torch.long, dev) if bias else None,
            bias_values=_upload([b for _, b in bias], torch.float32, dev) if bias else None,
            allowed=(_upload(allowed, torch.long, dev), _upload(kept, torch.long, dev)) if allowed else None,
        )

    def record(self, view: BatchView, tokens: torch.Tensor) -> None:
        """Append the step's sampled tokens to the penalized rows' state (a few one-element scatters)."""
        if view.penalized_index is None or view.penalized_slots is None or self.penalties is None:
            return
        picked = tokens if view.penalized_all else tokens.index_select(0, view.penalized_index)
        self.penalties.record(view.penalized_slot_list, view.penalized_slots, picked)
