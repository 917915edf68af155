"""Penalty state per sampling slot, on the device, touched sparsely.

Each slot keeps its output-token counts and a mark of every token seen (prompt, when the repetition penalty
reads it, and output) as dense rows, plus the list of those distinct tokens and its length. A step reads and
rewrites only the listed logits (O(tokens seen) a row, not O(vocabulary)), and appends its sampled tokens
with a few one-element scatters. Only the list's width is known on the host (an upper bound on its length)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _on(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda").to(
        device, non_blocking=True
    )


class PenaltyState:
    def __init__(self, capacity: int, vocab: int, device: torch.device) -> None:
        self.vocab, self.device = vocab, device
        self.counts = torch.zeros(capacity, vocab, device=device)
        self.seen = torch.zeros(capacity, vocab, dtype=torch.bool, device=device)
        self.ids = torch.zeros(capacity, 16, dtype=torch.long, device=device)
        self.num = torch.zeros(capacity, dtype=torch.long, device=device)
        self.bound = [0] * capacity  # host: at least each list's length

    def grow(self, capacity: int) -> None:
        extra = capacity - self.counts.shape[0]
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.vocab)])
        self.seen = torch.cat([self.seen, self.seen.new_zeros(extra, self.vocab)])
        self.ids = torch.cat([self.ids, self.ids.new_zeros(extra, self.ids.shape[1])])
        self.num = torch.cat([self.num, self.num.new_zeros(extra)])
        self.bound += [0] * extra

    def _widen(self, width: int) -> None:
        if width > self.ids.shape[1]:
            wider = max(width, 2 * self.ids.shape[1])
            self.ids = torch.cat(
                [self.ids, self.ids.new_zeros(self.ids.shape[0], wider - self.ids.shape[1])], 1
            )

    def reset(self, slot: int, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Start a slot over: `prompt` (empty unless repetition-penalized) and the output so far."""
        self.counts[slot].zero_()
        self.seen[slot].zero_()
        if output:
            self.counts[slot].index_add_(
                0, _on(output, self.device), torch.ones(len(output), device=self.device)
            )
        distinct = list(dict.fromkeys([*prompt, *output]))
        self._widen(len(distinct))
        if distinct:
            ids = _on(distinct, self.device)
            self.seen[slot].index_fill_(0, ids, True)
            self.ids[slot, : len(distinct)] = ids
        self.num[slot] = len(distinct)
        self.bound[slot] = len(distinct)

    def record(self, slot_list: Sequence[int], slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append each slot's sampled token: counted, marked seen, listed if new."""
        bound = self.bound
        for s in slot_list:
            bound[s] += 1
        self._widen(max(bound[s] for s in slot_list))
        at = (slots, tokens)
        new = ~self.seen[at]
        pos = (slots, self.num[slots])
        self.ids[pos] = torch.where(new, tokens, self.ids[pos])
        self.num.index_put_((slots,), new.long(), accumulate=True)
        self.counts.index_put_(at, torch.ones(len(slot_list), device=self.device), accumulate=True)
        self.seen[at] = True

    def apply(
        self,
        logits: torch.Tensor,
        slot_list: Sequence[int],
        slots: torch.Tensor,
        rep: torch.Tensor | None,
        freq: torch.Tensor,
        pres: torch.Tensor,
    ) -> torch.Tensor:
        """The penalized logits (a new tensor): repetition over every listed token, frequency and
        presence over the output's; `rep`, `freq`, `pres` are [rows, 1]."""
        width = max(self.bound[s] for s in slot_list)
        if width == 0:
            return logits
        ids = self.ids.index_select(0, slots)[:, :width]
        num = self.num.index_select(0, slots).unsqueeze(1)
        valid = torch.arange(width, device=logits.device).unsqueeze(0) < num
        vals = logits.gather(1, ids)
        flat = ids.add(slots.unsqueeze(1), alpha=self.vocab).view(-1)  # index_select: faster than take
        counts = self.counts.view(-1).index_select(0, flat).view_as(ids)
        new = vals if rep is None else torch.where(vals > 0, vals / rep, vals * rep)
        new = new - freq * counts - pres * (counts > 0).float()
        # Padding repeats the first listed token with its new value (or, in an empty list, token 0's own),
        # so every write to one position carries the same value.
        pad = torch.where(num > 0, new[:, :1], vals[:, :1])
        return logits.scatter(1, torch.where(valid, ids, ids[:, :1]), torch.where(valid, new, pad))
