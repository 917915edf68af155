"""Sampling without sorting the vocabulary: greedy's argmax in two levels, and top-p, top-k and min-p drawn
by rejection against a rising pivot.

A row draws a token from its whole (temperature-scaled) distribution by inverting its cumulative
distribution in two levels (block sums, then the one block the draw falls in), and keeps the token when it
lies in the row's truncated set: top-p keeps a token while the mass of the tokens more likely than it is
short of top_p, top-k while fewer than k tokens are more likely, min-p while it is at least min_p times as
likely as the likeliest. Each of these sets holds every token more likely than any token it holds, so a
rejected token tells that it and every token no more likely are out: the row draws again from the tokens
more likely than it (the pivot). The proposal is always the distribution restricted to a superset of the
truncated set, so an accepted token is distributed exactly as the truncated distribution; a row's expected
number of draws is small (one with probability at least top_p), and the likeliest token is always kept, so
it ends. A token tied with the least likely kept token is kept too (a sort keeps some of a tie at the edge
and not others, in whatever order it left them).

One row with both top-k and top-p is not drawn here: top-p's mass is then relative to the top-k set, which
a draw cannot know without finding that set."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

# The widths a vocabulary is cut into, widest first; a vocabulary none of them divides is one block.
BLOCK_WIDTHS = (64, 32, 16)
# Draws a row may make before the rows still drawing are settled with a sort (never needed in practice).
MAX_ROUNDS = 32
# Rows at most this many are drawn in one level: fewer tensor operations, each over the whole row.
FEW_ROWS = 8
_ZERO = torch.tensor(0.0)
LOG2E = 1.4426950408889634


class Scratch:
    """Float buffers reused across steps on a CPU, where a fresh tensor of a few megabytes each step pays
    for its page faults (freed large blocks go back to the system). Elsewhere (a GPU's caching
    allocator) it hands out nothing."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, like: torch.Tensor) -> torch.Tensor | None:
        """A buffer shaped as `like`, for float32 on a CPU."""
        buf = self.flat(name, like)
        return None if buf is None else buf[: like.numel()].view(like.shape)

    def flat(self, name: str, like: torch.Tensor, extra: int = 0) -> torch.Tensor | None:
        """A flat buffer of `like`'s size and `extra` elements more, for float32 on a CPU."""
        if like.device.type != "cpu" or like.dtype != torch.float32:
            return None
        size = like.numel() + extra
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < size:
            buf = self._buffers[name] = torch.empty(size, dtype=torch.float32)
        return buf[:size]


def block_width(vocab: int) -> int:
    for width in BLOCK_WIDTHS:
        if vocab % width == 0 and vocab >= 4 * width:
            return width
    return vocab


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """`x.argmax(dim=-1)` for a 2-D `x` (the first largest, as argmax picks). On a CPU torch's argmax is
    several times slower than its max, so the block maxima come first, then the argmax of the one block
    (for more than a few rows: for a few the extra operations cost more than they save)."""
    rows, vocab = x.shape
    width = block_width(vocab)
    if x.device.type != "cpu" or width == vocab or not x.is_contiguous() or rows <= FEW_ROWS:
        return x.argmax(dim=-1)
    block = x.view(rows, vocab // width, width).amax(dim=-1).argmax(dim=-1, keepdim=True)
    cols = block * width + torch.arange(width)
    return cols.gather(1, x.gather(1, cols).argmax(dim=-1, keepdim=True)).squeeze(1)


def draw(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of non-negative `weights` at uniform draws `u` ([rows, 1] in [0, 1)): the first
    whose cumulative weight passes u times the total, found in two levels (the block, then the token in
    it) unless the rows are few. A token of weight 0 is never drawn: each level's target stays strictly
    below that level's total, so some entry passes it, and the first one to pass has weight of its own."""
    rows, vocab = weights.shape
    width = block_width(vocab)
    if rows <= FEW_ROWS or width == vocab:
        cum = weights.cumsum(dim=-1)
        total = cum[:, -1:]
        target = torch.minimum(u * total, total.nextafter(_ZERO))
        return torch.searchsorted(cum, target, right=True).clamp_max_(vocab - 1).squeeze(1)
    # Cumulative block sums after a 0, so that a block's start is the very value the search compared.
    cum = F.pad(weights.view(rows, vocab // width, width).sum(dim=-1), (1, 0)).cumsum_(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(u * total, total.nextafter(_ZERO))
    block = torch.searchsorted(cum, target, right=True).sub_(1).clamp_(0, vocab // width - 1)  # NaN rows
    cols = torch.arange(width, device=weights.device).add(block, alpha=width)
    inner = weights.gather(1, cols).cumsum_(dim=-1)
    rest = torch.minimum(target - cum.gather(1, block), inner[:, -1:].nextafter(_ZERO))
    j = torch.searchsorted(inner, rest, right=True).clamp_max_(width - 1)
    return cols.gather(1, j).squeeze(1)


def _kept(
    vals: torch.Tensor,
    p: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Whether each row's drawn token (of probability `p`, [rows, 1]) is in its truncated set, and, when
    top-k or top-p asked for it, the probabilities of the tokens more likely than it (0 elsewhere): the
    row's next proposal should the token be rejected. `vals`: each row's probabilities, or a part of them
    that holds every token more likely than the drawn one and the likeliest token."""
    keep = None if min_p is None else p.squeeze(1) >= min_p * vals.amax(dim=-1)
    above = None
    if top_k is not None or top_p is not None:
        # Elementwise comparisons are slow on a CPU: sign(p_j - p)+ is 1 exactly where p_j > p.
        above = torch.sub(vals, p, out=out).sign_().clamp_min_(0.0)
        if top_k is not None:
            fewer = above.sum(dim=-1) < top_k  # fewer than k tokens more likely
            keep = fewer if keep is None else keep & fewer
        above.mul_(vals)
        if top_p is not None:
            short = above.sum(dim=-1) < top_p  # their mass short of top_p (a row without top-p has 2)
            keep = short if keep is None else keep & short
    assert keep is not None
    return keep, above


def _draw_in_blocks(
    probs: torch.Tensor, width: int, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draw from each row of `probs` (unnormalised weights) at `u` in two levels over strided blocks (block b holds tokens b,
    b + nb, b + 2nb, ... of nb blocks, so that the reductions run along memory): the tokens ([rows, 1]),
    their probabilities, and each block's mass and largest probability ([rows, nb])."""
    rows, vocab = probs.shape
    nb = vocab // width
    strided = probs.view(rows, width, nb)
    sums, peaks = strided.sum(dim=1), strided.amax(dim=1)
    cum = F.pad(sums, (1, 0)).cumsum_(dim=-1)
    total = cum[:, -1:]
    target = torch.minimum(u * total, total.nextafter(_ZERO))
    block = torch.searchsorted(cum, target, right=True).sub_(1).clamp_(0, nb - 1)  # NaN rows
    cols = torch.arange(0, vocab, nb, device=probs.device).add(block)
    inner = probs.gather(1, cols).cumsum_(dim=-1)
    rest = torch.minimum(target - cum.gather(1, block), inner[:, -1:].nextafter(_ZERO))
    tokens = cols.gather(1, torch.searchsorted(inner, rest, right=True).clamp_max_(width - 1))
    return tokens, probs.gather(1, tokens), sums, peaks


def _bounded(
    p: torch.Tensor,
    sums: torch.Tensor,
    peaks: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The check from the blocks alone (CPU), for tokens of weight `p` ([rows, 1]): whether each is surely
    kept, and whether the blocks cannot tell (then the tokens must be counted). Only a block whose largest
    weight is above p holds tokens more likely than the drawn one: at least that one, at most all of the
    block (its mass, and every one of its tokens)."""
    pv, pk, sm = p.numpy()[:, 0], peaks.numpy(), sums.numpy()
    likelier = pk > pv[:, None]
    kept = np.ones(len(pv), dtype=bool)
    unsure = np.zeros_like(kept)
    if min_p is not None:
        kept &= pv >= min_p.numpy() * pk.max(axis=1)  # exact: the largest peak is the row's maximum
    if top_k is not None:
        fewest, k = likelier.sum(axis=1), top_k.numpy()
        unsure |= fewest * width >= k  # each such block holds at most `width` of them
        kept &= fewest < k
    if top_p is not None:
        least, most, q = (pk * likelier).sum(axis=1), (sm * likelier).sum(axis=1), top_p.numpy()
        kept &= least < q
        unsure |= most >= q
    return torch.from_numpy(kept), torch.from_numpy(unsure & kept)


def _sorted_draw(
    probs: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """The same sets found with a full sort, for rows that used up their draws."""
    values, ids = probs.sort(dim=-1, descending=True)
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(values.shape[1], device=values.device).unsqueeze(0) < top_k.unsqueeze(1)
    if top_p is not None:
        keep &= values.cumsum(dim=-1) - values < top_p.unsqueeze(1)
    if min_p is not None:
        keep &= values >= (min_p * values[:, 0]).unsqueeze(1)
    weights = torch.zeros_like(probs).scatter_(1, ids, values * keep)
    return draw(weights, torch.rand(probs.shape[0], 1, device=probs.device))


def _weights(
    x: torch.Tensor, temperature: torch.Tensor | None, shared: float | None, out: torch.Tensor | None
) -> torch.Tensor:
    """exp((x - max) / temperature) for each row, unnormalised, computed as a power of 2 (on a CPU exp2
    costs half what exp does): with one temperature for every row (`shared`, 1 when None) the shift and
    the scale are one pass."""
    peak = x.amax(dim=-1, keepdim=True)
    if temperature is None:
        scale = LOG2E / (shared or 1.0)
        w = torch.add(peak * -scale, x, alpha=scale, out=out)
    else:
        w = torch.sub(x, peak, out=out).mul_(LOG2E / temperature)
    return w.exp2_()


def sample_truncated(
    x: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
    scratch: Scratch | None = None,
    temperature: torch.Tensor | None = None,
    shared: float | None = None,
) -> torch.Tensor:
    """One token per row of logits `x` at its temperature (`temperature`, [rows, 1], or one `shared` by
    every row; None for 1), from the distribution cut by top-k ([rows] long), top-p and min-p ([rows]
    float); None for a cut no row makes (a row that does not make it: top_k the vocabulary size, top_p 1,
    min_p 0). Draws use the default generator. `scratch`: the buffers to reuse for the full-size
    intermediates (x may be one of them: it is read first).

    Past a few rows on a CPU the rows' weights are left unnormalised (top-p compares with top_p times
    their total), drawn in strided blocks, and judged from the blocks first."""
    scratch = scratch or Scratch()
    rows, vocab = x.shape
    if top_p is not None:
        top_p = top_p.masked_fill(top_p >= 1.0, 2.0)  # no float sum of the rest reaches 2
    u = torch.rand(rows, 1, device=x.device)
    width = block_width(vocab)
    cut = top_k is not None or top_p is not None or min_p is not None
    if cut and rows > FEW_ROWS and width < vocab and x.device.type == "cpu" and x.is_contiguous():
        probs = _weights(x, temperature, shared, scratch.get("probs", x))
        tokens, p, sums, peaks = _draw_in_blocks(probs, width, u)
        tokens = tokens.squeeze(1)
        if top_p is not None:
            top_p = top_p * sums.sum(dim=-1)
        keep, unsure = _bounded(p, sums, peaks, top_k, top_p, min_p, width)
        if bool(unsure.any()):
            at = unsure.nonzero().squeeze(1)
            cuts = [None if c is None else c.index_select(0, at) for c in (top_k, top_p, min_p)]
            counted = _kept(probs.index_select(0, at), p.index_select(0, at), *cuts)[0]
            keep.index_copy_(0, at, counted)
        above = None
    else:
        divisor = temperature if temperature is not None else shared
        if divisor is not None and not (isinstance(divisor, float) and divisor == 1.0):
            x = torch.div(x, divisor, out=scratch.get("scaled", x))
        probs = torch.softmax(x, dim=-1, out=scratch.get("probs", x))
        tokens = draw(probs, u)
        if not cut:
            return tokens
        p = probs.gather(1, tokens.unsqueeze(1))
        keep, above = _kept(probs, p, top_k, top_p, min_p, scratch.get("scaled", x))
    if bool(keep.all()):
        return tokens
    cuts = [top_k, top_p, min_p]
    where = torch.arange(rows, device=probs.device)  # each drawing row's place in `tokens`
    pending = (~keep).nonzero().squeeze(1)  # the rejected among the rows drawing
    vals = probs
    for _ in range(MAX_ROUNDS):
        where, vals, p = (
            where.index_select(0, pending),
            vals.index_select(0, pending),
            p.index_select(0, pending),
        )
        cuts = [None if c is None else c.index_select(0, pending) for c in cuts]
        # Only tokens more likely than the rejected one can be in the set.
        if above is None:
            weights = torch.sub(vals, p).sign_().clamp_min_(0.0).mul_(vals)
        else:
            weights = above.index_select(0, pending)
        redrawn = draw(weights, torch.rand(len(where), 1, device=probs.device))
        tokens.index_copy_(0, where, redrawn)
        p = vals.gather(1, redrawn.unsqueeze(1))
        keep, above = _kept(vals, p, *cuts)
        if bool(keep.all()):
            return tokens
        pending = (~keep).nonzero().squeeze(1)
    where = where[pending]
    cuts = [None if c is None else c[pending] for c in cuts]
    return tokens.index_copy_(0, where, _sorted_draw(probs.index_select(0, where), *cuts))
