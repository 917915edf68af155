"""Prompt-lookup drafts: propose what followed the most recent earlier copy of the sequence's last n tokens.

No model runs: text that repeats itself (code, quoting the prompt, lists) is predicted from its own history,
and the verification step (rejection_sample with one-hot q) throws away whatever the target disagrees with.

Cost: the search is one compiled backward pass over the sequence (numba; a numpy search took 4-10 µs a
call, most of it in small operations), and a request's ids are mirrored in a numpy buffer that each step
extends by the tokens appended since (`TokenArray`): converting a whole list took longer than the search
(about 6 µs at 200 tokens, 87 µs at 4,096 on the development machine).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
from numba import njit


def _compiled(fn):
    """Compiled at first call, or read from numba's cache where a cache directory can be written. (Not
    `sample.cpu_kernels.compiled`: numba's cache knows a function by its own file's contents, so the
    options it was compiled with belong in that file.)"""
    try:
        return njit(cache=True, nogil=True)(fn)
    except RuntimeError:  # no writable cache location
        return njit(cache=False, nogil=True)(fn)


@_compiled
def _latest_match_end(ids, min_n, max_n):
    """End position of the latest earlier occurrence of the longest matching suffix, n in [min_n, max_n];
    -1 when none.

    Candidates are positions e < len - 1 whose window ids[e - n + 1 : e + 1] equals the last n tokens, so
    the occurrence starts before len - n (it may overlap the suffix, but is never the suffix itself). The
    pass runs from the most recent candidate back, measuring each one's match (up to max_n) and keeping the
    longest: the first found of a length is the most recent of that length, and a full-length match ends
    the search."""
    last = ids.shape[0] - 1
    target = ids[last]
    best, best_end = 0, -1
    for e in range(last - 1, -1, -1):
        if ids[e] != target:
            continue
        m = 1
        while m < max_n and e - m >= 0 and ids[e - m] == ids[last - m]:
            m += 1
        if m >= min_n and m > best:
            best, best_end = m, e
            if m == max_n:
                break
    return best_end


class TokenArray:
    """A request's token ids (a list that only grows) mirrored in a numpy buffer, extended by the tokens
    appended since the last look."""

    __slots__ = ("ids", "size", "source")

    def __init__(self) -> None:
        self.ids: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self.size = 0
        self.source: list[int] | None = None

    def update(self, tokens: list[int]) -> npt.NDArray[np.int64]:
        n = len(tokens)
        if tokens is not self.source or n < self.size:  # another list: start over
            self.source, self.size = tokens, 0
        if n > self.ids.shape[0]:
            grown = np.empty(max(n, 2 * self.ids.shape[0], 256), dtype=np.int64)
            grown[: self.size] = self.ids[: self.size]
            self.ids = grown
        if n > self.size:
            self.ids[self.size : n] = tokens[self.size : n]
            self.size = n
        return self.ids[:n]


def propose_ngram(
    token_ids: Sequence[int] | npt.NDArray[np.integer], k: int, min_n: int, max_n: int
) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the last n tokens.

    n runs from max_n down to min_n and the longest n with a match wins; fewer than k tokens come back when
    the occurrence is close to the end, and [] when no n matches.
    """
    if min_n < 1 or max_n < min_n:
        raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k == 0 or len(token_ids) <= min_n:
        return []
    if isinstance(token_ids, np.ndarray):
        ids = np.ascontiguousarray(token_ids, dtype=np.int64)
    else:  # a little faster than asarray for a list of Python ints
        ids = np.fromiter(token_ids, dtype=np.int64, count=len(token_ids))
    end = _latest_match_end(ids, min_n, max_n)
    if end < 0:
        return []
    return [int(t) for t in ids[end + 1 : end + 1 + k]]
