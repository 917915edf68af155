"""Verification of speculative drafts: keep a prefix of the proposals and add one token from the target.

The rule (Leviathan et al. 2023; Chen et al. 2023) makes every emitted token follow the target's own
distribution p, whatever the draft distribution q was: draft x at position j is kept with probability
min(1, p_j(x) / q_j(x)); on the first rejection the replacement is drawn from normalize(max(0, p_j - q_j)),
and when all k drafts survive a bonus token is drawn from p_k. Greedy requests instead keep a draft while it
equals the target's argmax, and then emit the argmax at the first position that disagrees (or of the bonus
row).

Random numbers (the batch layout never changes what a request draws):
- greedy requests draw nothing, so a seeded greedy request's generator is left untouched;
- a seeded random request draws from its own generator, in this order: k uniforms (one per draft, in draft
  order), then V exponentials (the noise for its one extra token), the same amounts whatever is accepted;
  requests are visited in batch order, which matters only if two of them share one generator object;
- random requests without a generator share the default generator of the tensors' device: first one
  uniform draw covering all their drafts (batch order), then one exponential draw of [requests, V].
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

_GREEDY, _SHARED, _SEEDED = 0, 1, 2  # a request's kind: how its random numbers (if any) are drawn


@dataclass(slots=True)
class _Seeded:
    request: int
    draft_start: int
    k: int
    generator: torch.Generator


@dataclass(slots=True)
class _Plan:
    """One call's layout. The host loops over requests only; per-draft indices are derived on the device
    from the counts, so the Python cost does not grow with the number of drafts."""

    draft_tokens: torch.Tensor  # [D] the proposed token at each draft position
    kind: torch.Tensor  # [n] _GREEDY, _SHARED or _SEEDED
    draft_count: torch.Tensor  # [n] k_i
    shared_reqs: torch.Tensor  # random requests without a generator
    residual_reqs: torch.Tensor  # random requests with drafts: the only ones that can reject
    seeded: list[_Seeded]
    shared_drafts: int  # how many uniforms the default generator supplies
    has_greedy: bool
    k_max: int
    draft_start: torch.Tensor = field(init=False)  # [n] each request's first draft position
    row_start: torch.Tensor = field(init=False)  # [n] each request's first target row
    draft_req: torch.Tensor = field(init=False)  # [D] the request each draft belongs to
    draft_index: torch.Tensor = field(init=False)  # [D] j, the draft's place within its request
    draft_rows: torch.Tensor = field(init=False)  # [D] the target row holding p_j

    def __post_init__(self) -> None:
        n, drafts, dev = self.kind.numel(), self.draft_tokens.numel(), self.kind.device
        self.draft_start = self.draft_count.cumsum(0) - self.draft_count
        self.row_start = self.draft_start + torch.arange(n, device=dev)
        # output_size keeps repeat_interleave from reading the total back from the device.
        self.draft_req = torch.repeat_interleave(
            torch.arange(n, device=dev), self.draft_count, output_size=drafts
        )
        self.draft_index = torch.arange(drafts, device=dev) - self.draft_start[self.draft_req]
        self.draft_rows = self.row_start[self.draft_req] + self.draft_index


def _check_shapes(
    target_probs: torch.Tensor,
    counts: Sequence[int],
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> None:
    n, drafts = len(counts), sum(counts)
    if len(greedy) != n or len(generators) != n:
        raise ValueError(f"{n} draft lists but {len(greedy)} greedy flags and {len(generators)} generators")
    if target_probs.dim() != 2:
        raise ValueError(f"target_probs must be [rows, vocab], got {tuple(target_probs.shape)}")
    rows, vocab = target_probs.shape
    if rows != drafts + n:
        raise ValueError(f"target_probs has {rows} rows; {n} requests with {drafts} drafts need {drafts + n}")
    if draft_probs is None:
        return
    if tuple(draft_probs.shape) != (drafts, vocab):
        raise ValueError(
            f"draft_probs is {tuple(draft_probs.shape)}; {drafts} drafts need ({drafts}, {vocab})"
        )
    if draft_probs.device != target_probs.device:
        raise ValueError(f"draft_probs is on {draft_probs.device}, target_probs on {target_probs.device}")


def _plan(
    draft_token_ids: Sequence[Sequence[int]],
    counts: Sequence[int],
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
    vocab: int,
    device: torch.device,
) -> _Plan:
    kinds: list[int] = []
    shared: list[int] = []
    residual: list[int] = []
    seeded: list[_Seeded] = []
    shared_drafts = pos = 0
    for i, (k, is_greedy, gen) in enumerate(zip(counts, greedy, generators, strict=True)):
        if is_greedy:
            kinds.append(_GREEDY)
        elif gen is None:
            kinds.append(_SHARED)
            shared.append(i)
            shared_drafts += k
        else:
            kinds.append(_SEEDED)
            seeded.append(_Seeded(i, pos, k, gen))
        if k and not is_greedy:
            residual.append(i)
        pos += k
    flat = [*itertools.chain.from_iterable(draft_token_ids), *kinds, *counts, *shared, *residual]
    # Staged through pinned memory: a plain host->GPU copy would make torch wait for the queued forward pass.
    host = torch.tensor(flat, dtype=torch.long, pin_memory=device.type == "cuda")
    # Checked here, on the host, because an out-of-range index on the GPU is a device assert, not an error.
    if pos and (int(host[:pos].min()) < 0 or int(host[:pos].max()) >= vocab):
        raise ValueError(f"a draft token lies outside the vocabulary of {vocab}")
    tokens, kind, count, shared_t, residual_t = host.to(device, non_blocking=True).split(
        [pos, len(kinds), len(counts), len(shared), len(residual)]
    )
    return _Plan(tokens, kind, count, shared_t, residual_t, seeded, shared_drafts, any(greedy), max(counts))


def _draw(plan: _Plan, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([D] acceptance uniforms, [n, V] exponential noise for each request's extra token).

    Everything is drawn up front, so the amounts never depend on what gets accepted. Greedy requests keep
    uniforms of 0 and noise of 1 (their race is then a plain argmax) and cost no draws.
    """
    drafts, n = plan.draft_tokens.numel(), plan.kind.numel()
    uniforms = torch.zeros(drafts, device=device)
    if plan.shared_drafts:
        # Lay the shared draw out over the shared requests' drafts in order, by rank, without a device sync.
        mask = plan.kind[plan.draft_req] == _SHARED
        rank = (mask.cumsum(0) - 1).clamp_min_(0)
        uniforms = torch.where(mask, torch.rand(plan.shared_drafts, device=device)[rank], uniforms)
    noise = torch.ones(n, vocab, device=device)
    if plan.shared_reqs.numel():
        draw = torch.empty(plan.shared_reqs.numel(), vocab, device=device).exponential_()
        noise.index_copy_(0, plan.shared_reqs, draw)
    for s in plan.seeded:
        if s.k:
            uniforms[s.draft_start : s.draft_start + s.k].uniform_(generator=s.generator)
        noise[s.request].exponential_(generator=s.generator)
    # exponential_ may return an exact 0; 0/0 would be NaN, which argmax prefers over everything.
    return uniforms, noise.clamp_min_(torch.finfo(noise.dtype).tiny)


def _accepted_counts(plan: _Plan, accept: torch.Tensor) -> torch.Tensor:
    """[n] length of each request's run of accepted drafts, counted from its first draft."""
    n = plan.kind.numel()
    if plan.k_max == 0:
        return torch.zeros(n, dtype=torch.long, device=accept.device)
    # A padded [n, k_max] grid whose padding counts as rejection, so no run reaches past its own k drafts.
    grid = torch.zeros(n * plan.k_max, dtype=torch.long, device=accept.device)
    grid.index_copy_(0, plan.draft_req * plan.k_max + plan.draft_index, accept.long())
    return grid.view(n, plan.k_max).cumprod(dim=1).sum(dim=1)


def _residual(
    p: torch.Tensor, q_pos: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None
) -> torch.Tensor:
    """max(0, p - q) at draft positions q_pos, unnormalized (the race is scale-free); p where it is all 0."""
    if draft_probs is None:
        # q is one-hot on the draft x, so p - q is p except at x, where p(x) - 1 <= 0.
        residual = p.scatter(1, draft_tokens[q_pos].unsqueeze(1), 0.0)
    else:
        residual = (p - draft_probs.index_select(0, q_pos)).clamp_min_(0.0)
    # All zero only when p == q, where exact arithmetic never rejects; rounding might, so fall back to p.
    return torch.where((residual.amax(dim=1) > 0).unsqueeze(1), residual, p)


def _extra_distributions(
    target_probs: torch.Tensor, draft_probs: torch.Tensor | None, plan: _Plan, accepted: torch.Tensor
) -> torch.Tensor:
    """[n, V] what each extra token is drawn from: the target row after the accepted run, or for a random
    request that rejected a draft, the residual at that draft."""
    p = target_probs.index_select(0, plan.row_start + accepted)
    req = plan.residual_reqs
    if not req.numel():
        return p
    a, k = accepted[req], plan.draft_count[req]
    q_pos = plan.draft_start[req] + torch.minimum(a, k - 1)
    sub = p.index_select(0, req)
    sub = torch.where((a < k).unsqueeze(1), _residual(sub, q_pos, plan.draft_tokens, draft_probs), sub)
    return p.index_copy(0, req, sub)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    greedy: Sequence[bool],
    generators: Sequence[torch.Generator | None],
) -> list[list[int]]:
    """Per request, its accepted drafts followed by exactly one more token.

    target_probs: [sum(k_i + 1), V]; request i owns k_i + 1 consecutive rows, p at each of its draft
    positions and then the bonus row. draft_probs: [sum(k_i), V], q at each draft position in the same
    order, or None when every q is one-hot on the proposed token (n-gram proposals). Generators (None: the
    default one) must live on the tensors' device. One pass for the whole batch, one transfer at the end.
    """
    counts = [len(d) for d in draft_token_ids]
    _check_shapes(target_probs, counts, draft_probs, greedy, generators)
    if not counts:
        return []
    dev, vocab = target_probs.device, target_probs.shape[1]
    target_probs = target_probs.float()
    draft_probs = None if draft_probs is None else draft_probs.float()
    plan = _plan(draft_token_ids, counts, greedy, generators, vocab, dev)
    uniforms, noise = _draw(plan, vocab, dev)

    tokens, rows = plan.draft_tokens, plan.draft_rows
    # u < min(1, p/q) written as u*q < p: no division, and q = 0 keeps x exactly when p(x) > 0.
    p_x = target_probs[rows, tokens]
    if draft_probs is None:
        accept = uniforms < p_x
    else:
        accept = uniforms * draft_probs[torch.arange(tokens.numel(), device=dev), tokens] < p_x
    if plan.has_greedy:
        greedy_match = tokens == target_probs.argmax(dim=1)[rows]
        accept = torch.where(plan.kind[plan.draft_req] == _GREEDY, greedy_match, accept)
    accepted = _accepted_counts(plan, accept)

    # Greedy rows have noise 1 and never a residual, so for them this is the plain argmax.
    extra = (_extra_distributions(target_probs, draft_probs, plan, accepted) / noise).argmax(dim=1)
    host = torch.stack([accepted, extra]).tolist()
    return [[*d[:a], x] for d, a, x in zip(draft_token_ids, host[0], host[1], strict=True)]
