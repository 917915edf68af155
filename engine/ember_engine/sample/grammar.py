"""Constrained decoding with llguidance: a request's grammar, its per-token state and the token mask.

`Constraint` (`constraint.py`, which needs no torch, so the router can read requests without it) says what
the output must match (a JSON schema, any JSON object, a regex, one of some strings, or a Lark grammar).
`GrammarCompiler` turns it into a `Grammar` once (the costly part, run off
the server's event loop); each sample of the request then gets its own `GrammarState`, which advances by
every token the request accepts, whether sampled or a verified speculative proposal. Preemption recomputes
KV but keeps a request's tokens, so its state stays as it is.

The mask travels as llguidance's packed bitmask (one bit per token, 32 per int32) and is unpacked on the
logits' device: one upload for the whole batch, only for the rows that have a grammar.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ember_engine.sample.constraint import DEAD_END_ERROR, Constraint, ConstraintKind, GrammarError

__all__ = ["Constraint", "ConstraintKind", "Grammar", "GrammarCompiler", "GrammarError", "GrammarState"]


class Grammar:
    """A compiled constraint; `state()` gives a fresh per-sample state."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)

    def state(self) -> GrammarState:
        return GrammarState(self._matcher.deep_copy(), self.vocab_size, self.eos_token_ids)


class GrammarState:
    """One sample's place in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids

    def fill(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into one packed bitmask row (int32, contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.size * row.itemsize)

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance by tokens the request keeps; False if the grammar refused one (the state is then
        in error and later masks allow only EOS). A state already in error (its mask could not be
        computed) refuses too: such a matcher also says it is stopped."""
        if self.matcher.is_error():
            return False
        if self.matcher.is_stopped():
            return True  # EOS or a token after the end: nothing left to constrain
        return bool(self.matcher.consume_tokens(list(tokens)))

    def try_accept(self, tokens: Sequence[int]) -> int:
        """Advance by the longest allowed prefix of tokens; returns its length (undo with rollback)."""
        return int(self.matcher.try_consume_tokens(list(tokens)))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def finished(self) -> bool:
        return bool(self.matcher.is_stopped())

    @property
    def dead_end(self) -> bool:
        """Whether no text continues the output so far, not even its end: the constraint allows none."""
        return bool(self.matcher.is_error()) and str(self.matcher.get_error()).startswith(DEAD_END_ERROR)

    @property
    def error(self) -> str | None:
        """Why the grammar engine cannot go on (an internal limit met mid-answer), or None."""
        # its first line: the rest is the engine's state and the whole grammar
        return str(self.matcher.get_error()).split("\n", 1)[0] if self.matcher.is_error() else None


class GrammarCompiler:
    """Compiles constraints against one checkpoint's tokenizer.json (thread-safe: no shared state)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        path = str(Path(model_dir) / "tokenizer.json")
        self.tokenizer = LLTokenizer(path, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)

    def compile(self, constraint: Constraint) -> Grammar:
        from llguidance import LLMatcher

        text = constraint.lark()
        matcher = LLMatcher(self.tokenizer, text, log_level=0)
        if not matcher.is_error():
            # The first mask: a constraint no text satisfies allows nothing, not even EOS, and llguidance
            # finds that out only here, as an error. It costs what a step's mask does (20-50 us for the bench
            # schemas at 4k tokens), once per compile; the states copied from it then find llguidance's
            # caches warm, so their first masks cost less.
            first = np.empty(bitmask_words(self.vocab_size), dtype=np.int32)
            matcher.unsafe_compute_mask_ptr(first.ctypes.data, first.nbytes)
        if matcher.is_error():
            error = str(matcher.get_error())
            if error.startswith(DEAD_END_ERROR):
                raise GrammarError("it matches no text")
            raise GrammarError(error)
        return Grammar(matcher, self.vocab_size, self.eos_token_ids)


def allows(row: np.ndarray, token: int) -> bool:
    """Whether a packed mask row allows the token."""
    return bool((int(row[token // 32]) >> (token % 32)) & 1)


def bitmask_words(vocab: int) -> int:
    return (vocab + 31) // 32


def unpack_bitmask(packed: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, words] int32 -> [rows, vocab] bool, on packed's device (token 32w + k is bit k of word w)."""
    shifts = torch.arange(32, device=packed.device, dtype=torch.int32)
    bits = (packed.unsqueeze(-1) >> shifts) & 1
    return bits.view(packed.shape[0], -1)[:, :vocab].bool()


def apply_bitmask(logits: torch.Tensor, rows: Sequence[int], packed: np.ndarray) -> torch.Tensor:
    """logits with every token a row's grammar forbids set to -inf; `packed[i]` is rows[i]'s mask."""
    if not rows:
        return logits
    dev, vocab = logits.device, logits.shape[1]
    if dev.type == "cpu":
        # numpy unpacks bits in one C pass; the same in torch ops is three orders of magnitude slower.
        bits = np.unpackbits(packed.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        allowed = torch.from_numpy(bits.view(np.bool_))
    else:
        host = torch.from_numpy(packed)
        if dev.type == "cuda":
            host = host.pin_memory()
        allowed = unpack_bitmask(host.to(dev, non_blocking=True), vocab)
    if len(rows) == logits.shape[0] and list(rows) == list(range(len(rows))):
        return logits.masked_fill(~allowed, float("-inf"))
    index = torch.tensor(rows, dtype=torch.long).to(dev, non_blocking=True)
    sub = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, index, sub)


@dataclass(slots=True)
class StepMasks:
    """One step's grammar masks: `packed[k]` is logits row `rows[k]`'s allowed tokens."""

    rows: list[int]
    packed: np.ndarray  # [len(rows), words] int32

    def allows_only(self, k: int, token_ids: Sequence[int]) -> bool:
        """Whether every token row rows[k]'s grammar allows is among token_ids (say, it allows only EOS)."""
        rest = self.packed[k].view(np.uint32).copy()
        for t in token_ids:
            if 0 <= t < 32 * rest.size:
                rest[t // 32] &= np.uint32(0xFFFFFFFF ^ (1 << (t % 32)))
        return not rest.any()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_bitmask(logits, self.rows, self.packed)


def compute_masks(states: Sequence[GrammarState | None]) -> StepMasks | None:
    """The masks of the rows whose request has a grammar, by each one's current state; None if none has."""
    rows = [i for i, s in enumerate(states) if s is not None]
    if not rows:
        return None
    first = states[rows[0]]
    assert first is not None
    packed = np.full((len(rows), bitmask_words(first.vocab_size)), -1, dtype=np.int32)
    for k, i in enumerate(rows):
        state = states[i]
        assert state is not None
        state.fill(packed[k])
    return StepMasks(rows, packed)


def mask_rows(logits: torch.Tensor, states: Sequence[GrammarState | None]) -> torch.Tensor:
    """Mask each row whose request has a grammar by its current state."""
    masks = compute_masks(states)
    return logits if masks is None else masks.apply(logits)


def draft_block(state: GrammarState, proposal: Sequence[int]) -> np.ndarray:
    """Verification's masks for one request: 1 + len(proposal) rows, the state before each proposal and
    after the last. The state walks the proposals and is rolled back, so nothing is kept yet; rows past the
    first proposal the mask refuses keep that refusal's mask (the proposal there is rejected, since its
    probability is 0, and the rows after it are never read)."""
    n = 1 + len(proposal)
    block = np.full((n, bitmask_words(state.vocab_size)), -1, dtype=np.int32)
    walked = 0
    for j in range(n):
        state.fill(block[j])
        if j == len(proposal):
            break
        if not allows(block[j], proposal[j]) or state.try_accept([proposal[j]]) != 1:
            block[j + 1 :] = block[j]
            break
        walked += 1
    state.rollback(walked)
    return block


def mask_draft_rows(
    logits: torch.Tensor, states: Sequence[GrammarState | None], drafts: Sequence[Sequence[int]]
) -> torch.Tensor:
    """Verification's masks: request i owns 1 + len(drafts[i]) rows (`draft_block`)."""
    masks = draft_masks(states, drafts, lambda i: None)
    return logits if masks is None else masks.apply(logits)


def draft_masks(
    states: Sequence[GrammarState | None],
    drafts: Sequence[Sequence[int]],
    computed: Callable[[int], np.ndarray | None],
) -> StepMasks | None:
    """The masks of every constrained request's 1 + k rows; `computed(i)` gives request i's block when it
    was computed already (else None: it is walked here)."""
    rows: list[int] = []
    blocks: list[np.ndarray] = []
    base = 0
    for i, (state, proposal) in enumerate(zip(states, drafts, strict=True)):
        n = 1 + len(proposal)
        if state is not None:
            block = computed(i)
            blocks.append(draft_block(state, proposal) if block is None else block)
            rows.extend(range(base, base + n))
        base += n
    return StepMasks(rows, np.concatenate(blocks)) if rows else None
