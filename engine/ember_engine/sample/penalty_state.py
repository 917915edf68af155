"""Penalty state per sampling slot, on the device, touched sparsely.

Each slot keeps the list of distinct tokens it has seen (prompt, when the repetition penalty reads it, and
output) and, beside each listed token, what frequency and presence take off its logit so far (`off`) and
what its next occurrence in the output takes off on top (`pend`: frequency, plus presence for the first).
A dense map from token to its place in the list (-1: not listed) lets a step find a sampled token's entry
with one gather. A step reads and rewrites only the listed logits, O(tokens seen) a row whatever the
vocabulary, with arithmetic alone (no comparisons, which are slow on a CPU): entries past a list's end
hold an id that lands on one spare element after the logits. Only the lists' width is known on the host
(an upper bound on their lengths). On a CPU the two steps are compiled loops over the same arrays
(`cpu_kernels`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ember_engine.sample.cpu_kernels import count, penalize

# On a CPU, the compiled loops (False: the torch operations a GPU runs, there too).
COMPILED = True
# Token id of the entries past a list's end: far past any flat position, clamped onto the spare element.
_PAST = 1 << 40


def _on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda").to(
        device, non_blocking=True
    )


class PenaltyState:
    def __init__(self, capacity: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.where = torch.full((capacity, vocab), -1, dtype=torch.int32, device=device)
        self.ids = torch.full((capacity, 16), _PAST, dtype=torch.long, device=device)
        self.off = torch.zeros(capacity, 16, device=device)
        self.pend = torch.zeros(capacity, 16, device=device)
        self.num = torch.zeros(capacity, dtype=torch.long, device=device)
        self.freq = torch.zeros(capacity, device=device)
        self.pres = torch.zeros(capacity, device=device)
        self.bound = [0] * capacity  # host: at least each list's length
        self._base = torch.zeros(0, 1, dtype=torch.long, device=device)  # row r: r * vocab

    def grow(self, capacity: int) -> None:
        extra = capacity - self.num.shape[0]
        self.where = torch.cat([self.where, self.where.new_full((extra, self.vocab), -1)])
        width = self.ids.shape[1]
        self.ids = torch.cat([self.ids, self.ids.new_full((extra, width), _PAST)])
        self.off = torch.cat([self.off, self.off.new_zeros(extra, width)])
        self.pend = torch.cat([self.pend, self.pend.new_zeros(extra, width)])
        self.num = torch.cat([self.num, self.num.new_zeros(extra)])
        self.freq = torch.cat([self.freq, self.freq.new_zeros(extra)])
        self.pres = torch.cat([self.pres, self.pres.new_zeros(extra)])
        self.bound += [0] * extra

    def _widen(self, width: int) -> None:
        old = self.ids.shape[1]
        if width > old:
            extra = max(width, 2 * old) - old
            rows = self.ids.shape[0]
            self.ids = torch.cat([self.ids, self.ids.new_full((rows, extra), _PAST)], 1)
            self.off = torch.cat([self.off, self.off.new_zeros(rows, extra)], 1)
            # An entry not yet listed takes presence with its first occurrence.
            self.pend = torch.cat([self.pend, (self.freq + self.pres).unsqueeze(1).expand(rows, extra)], 1)

    def reset(
        self,
        slot: int,
        prompt: Sequence[int],
        output: Sequence[int],
        frequency: float,
        presence: float,
    ) -> None:
        """Start a slot over: `prompt` (empty unless repetition-penalized) and the output so far."""
        counts: dict[int, int] = dict.fromkeys(prompt, 0)
        for t in output:
            counts[t] = counts.get(t, 0) + 1
        n = len(counts)
        self._widen(n)
        self.where[slot].fill_(-1)
        self.ids[slot].fill_(_PAST)
        self.off[slot].zero_()
        self.pend[slot].fill_(frequency + presence)
        self.freq[slot], self.pres[slot] = frequency, presence
        if n:
            ids = _on(list(counts), self.device)
            self.where[slot].index_copy_(0, ids, torch.arange(n, dtype=torch.int32, device=self.device))
            self.ids[slot, :n] = ids
            seen = [float(c) for c in counts.values()]
            self.off[slot, :n] = torch.tensor([frequency * c + presence * (c > 0) for c in seen])
            self.pend[slot, :n] = torch.tensor([frequency + presence * (c == 0) for c in seen])
        self.num[slot] = n
        self.bound[slot] = n

    def record(self, slot_list: Sequence[int], slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count each slot's sampled token, listing it first if new."""
        bound = self.bound
        for s in slot_list:
            bound[s] += 1
        self._widen(max(bound[s] for s in slot_list))
        if COMPILED and self.device.type == "cpu":
            arrays = (self.where, self.ids, self.off, self.pend, self.num, self.freq, slots, tokens)
            count(*(a.numpy() for a in arrays))
            return
        flat = slots * self.vocab + tokens
        at = self.where.view(-1).index_select(0, flat).long()
        fresh = at < 0
        at = torch.where(fresh, self.num.index_select(0, slots), at)
        self.where.view(-1).index_copy_(0, flat, at.int())
        self.num.index_add_(0, slots, fresh.long())
        entry = at.add_(slots, alpha=self.ids.shape[1])  # flat positions in the [capacity, width] lists
        self.ids.view(-1).index_copy_(0, entry, tokens)
        self.off.view(-1).index_add_(0, entry, self.pend.view(-1).index_select(0, entry))
        self.pend.view(-1).index_copy_(0, entry, self.freq.index_select(0, slots))

    def apply(
        self,
        logits: torch.Tensor,
        slot_list: Sequence[int],
        slots: torch.Tensor,
        rep: torch.Tensor | None,
        out: torch.Tensor | None = None,
        span: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """The penalized logits: repetition (`rep`, [rows, 1]) over every listed token, frequency and
        presence over the output's. Written into `out` (one element longer than `logits` has, flat) when
        given, else into a new tensor; `logits` itself is left as it was. `span`: (first, end) when the
        slots are consecutive (their rows are then read as a slice)."""
        rows, vocab = logits.shape
        size = rows * vocab
        out = torch.empty(size + 1, device=logits.device) if out is None else out
        penalized = out[:size].view(rows, vocab)
        penalized.copy_(logits)  # torch's copy vectorises; one beside the scattered updates would not
        width = max(self.bound[s] for s in slot_list)
        if width == 0:
            return penalized
        if COMPILED and self.device.type == "cpu":
            scale = (
                np.ones(rows, dtype=np.float32) if rep is None else np.ascontiguousarray(rep.numpy()[:, 0])
            )
            penalize(slots.numpy(), self.ids.numpy(), self.off.numpy(), width, scale, penalized.numpy())
            return penalized
        if self._base.numel() < rows:
            self._base = torch.arange(0, rows * vocab, vocab, device=logits.device).unsqueeze(1)
        ids, off = self.ids[:, :width], self.off[:, :width]
        if span is None:
            ids, off = ids.index_select(0, slots), off.index_select(0, slots)
        else:
            ids, off = ids[span[0] : span[1]], off[span[0] : span[1]]
        flat = torch.add(ids, self._base[:rows]).clamp_max_(size).view(-1)
        vals = out.index_select(0, flat).view(rows, width)
        new = vals if rep is None else vals.clamp_min(0.0).div_(rep).add_(vals.clamp_max(0.0).mul_(rep))
        new = new - off
        out.scatter_(0, flat, new.view(-1))
        return penalized


def warm_up() -> None:
    """Compile the CPU's loops (or load them from numba's cache) before any request waits on them."""
    state = PenaltyState(1, 8, torch.device("cpu"))
    state.reset(0, [1], [2], 0.5, 0.5)
    slots = torch.zeros(1, dtype=torch.long)
    state.apply(torch.zeros(1, 8), [0], slots, torch.ones(1, 1))
    state.record([0], slots, torch.ones(1, dtype=torch.long))
