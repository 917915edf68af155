"""Sampling without sorting the vocabulary: greedy's argmax in two levels, and top-p, top-k and min-p drawn
by rejection against a rising pivot.

A row draws a token from its whole (temperature-scaled) distribution by inverting its cumulative
distribution, and keeps the token when it lies in the row's truncated set: top-p keeps a token while the
mass of the tokens more likely than it is short of top_p, top-k while fewer than k tokens are more likely,
min-p while it is at least min_p times as likely as the likeliest. Each of these sets holds every token
more likely than any token it holds, so a rejected token tells that it and every token no more likely are
out: the row draws again from the tokens more likely than it (the pivot). The proposal is always the
distribution restricted to a superset of the truncated set, so an accepted token is distributed exactly as
the truncated distribution; a row's expected number of draws is small (one with probability at least
top_p), and the likeliest token is always kept, so it ends. A token tied with the least likely kept token
is kept too (a sort keeps some of a tie at the edge and not others, in whatever order it left them).

Every row's weights, draws and checks run in one compiled call (`cpu_kernels`): a tensor operation
per step of the draw costs more than the step's arithmetic.

One row with both top-k and top-p is not drawn here: top-p's mass is then relative to the top-k set, which
a draw cannot know without finding that set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ember_engine.sample.cpu_kernels import truncated_draws
from ember_engine.sample.sampling_params import SamplingParams

# The widths a vocabulary is cut into, widest first; a vocabulary none of them divides is one block.
BLOCK_WIDTHS = (64, 32, 16)
# Draws a row may make after its first before it is settled with a sort (never needed in practice).
MAX_ROUNDS = 32
# Rows at most this many take torch's argmax: fewer tensor operations, each over the whole row.
FEW_ROWS = 8
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


def _sorted_draw(probs: torch.Tensor, cuts: Cuts) -> torch.Tensor:
    """The same sets found with a full sort, for rows that used up their draws (`probs` unnormalised)."""
    values, ids = probs.sort(dim=-1, descending=True)
    vocab = values.shape[1]
    top_k = torch.from_numpy(cuts.top_k).masked_fill(torch.from_numpy(cuts.top_k) <= 0, vocab)
    top_p = torch.from_numpy(cuts.top_p)
    limit = (top_p * values.sum(dim=-1)).masked_fill(top_p >= 1.0, float("inf"))
    keep = torch.arange(vocab).unsqueeze(0) < top_k.unsqueeze(1)
    keep &= values.cumsum(dim=-1) - values < limit.unsqueeze(1)
    keep &= values >= (torch.from_numpy(cuts.min_p) * values[:, 0]).unsqueeze(1)
    cum = (values * keep).cumsum(dim=-1)
    total = cum[:, -1:]
    # Strictly below the total, so that the first entry to pass it has weight of its own.
    target = torch.minimum(torch.rand(probs.shape[0], 1) * total, total.nextafter(torch.zeros(())))
    rank = torch.searchsorted(cum, target, right=True).clamp_max_(vocab - 1)
    return ids.gather(1, rank).squeeze(1)


@dataclass(frozen=True, slots=True)
class Cuts:
    """Rows' cuts as the compiled draws take them, built once per batch: contiguous numpy columns (top_k
    int64, 0 for none; top_p float32, 1 for none; min_p float32, 0 for none; scale, log2(e) over the
    temperature, float32)."""

    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    scale: np.ndarray

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int) -> Cuts:
        return cls(
            top_k=np.array([p.top_k if 0 < p.top_k < vocab else 0 for p in params], dtype=np.int64),
            top_p=np.array([p.top_p for p in params], dtype=np.float32),
            min_p=np.array([p.min_p for p in params], dtype=np.float32),
            scale=np.array([LOG2E / p.temperature for p in params], dtype=np.float32),
        )

    def take(self, rows: np.ndarray) -> Cuts:
        return Cuts(self.top_k[rows], self.top_p[rows], self.min_p[rows], self.scale[rows])


def sample_truncated(x: torch.Tensor, cuts: Cuts, scratch: Scratch | None = None) -> torch.Tensor:
    """One token per row of logits `x` (on a CPU) at its temperature, from its distribution cut by its
    top-k, top-p and min-p (`cuts`). Draws follow torch's default generator. `scratch`: the buffers to
    reuse for the full-size weights."""
    if x.device.type != "cpu":
        raise ValueError(f"rows are drawn against a pivot on a CPU only, not on {x.device}")
    scratch = scratch or Scratch()
    x = x.float().contiguous()
    weights = scratch.get("weights", x)
    assert weights is not None  # float32 on a CPU
    tokens = torch.empty(x.shape[0], dtype=torch.long)
    out = tokens.numpy()
    seed = int(torch.randint(0, 2**32, ()))  # the draws follow torch's default generator
    peaks = x.amax(dim=-1).numpy()
    truncated_draws(
        x.numpy(),
        peaks,
        cuts.scale,
        seed,
        MAX_ROUNDS + 1,
        cuts.top_k,
        cuts.top_p,
        cuts.min_p,
        weights.numpy(),
        out,
    )
    if out.min() < 0:
        left = np.flatnonzero(out < 0)
        at = torch.from_numpy(left)
        tokens.index_copy_(0, at, _sorted_draw(weights.index_select(0, at), cuts.take(left)))
    return tokens


def warm_up() -> None:
    """Compile the draws (or load them from numba's cache) before any request waits on them."""
    params = [SamplingParams(temperature=0.5, top_k=1), SamplingParams(top_p=0.5, min_p=0.1)]
    sample_truncated(torch.zeros(2, 8), Cuts.of(params, 8))
