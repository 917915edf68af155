"""Prompt-lookup proposals: longest suffix first, most recent earlier occurrence, argument checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ember_engine.spec.ngram_proposer import TokenArray, propose_ngram


def oracle(ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule spelled out with plain loops: slow, but obviously right."""
    ids = list(ids)
    for n in range(max_n, min_n - 1, -1):
        if n >= len(ids):
            continue
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):  # starts before len - n, latest first
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_one() -> None:
    ids = [2, 3, 10, 11, 5, 3, 20, 21, 2, 3]
    assert propose_ngram(ids, 2, 1, 2) == [10, 11]  # [2, 3] at 0 beats the later [3] at 5
    assert propose_ngram(ids, 2, 1, 1) == [20, 21]


def test_most_recent_occurrence_wins() -> None:
    assert propose_ngram([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]


def test_fewer_than_k_near_the_end_and_overlap_with_the_suffix() -> None:
    assert propose_ngram([4, 5, 6, 4, 5], 5, 2, 2) == [6, 4, 5]
    assert propose_ngram([7, 7, 7], 3, 2, 2) == [7]  # [7, 7] at 0 overlaps the suffix at 1


def test_no_match() -> None:
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []
    assert propose_ngram([], 3, 1, 3) == []
    assert propose_ngram([5], 3, 1, 3) == []


def test_the_suffix_itself_is_not_an_occurrence() -> None:
    assert propose_ngram([1, 2, 3], 2, 3, 3) == []
    # For n = 2 the only [7, 7] is the suffix; n = 1 still finds the first 7.
    assert propose_ngram([7, 7], 2, 1, 2) == [7]
    assert propose_ngram([7, 7], 2, 2, 2) == []


def test_min_n_excludes_shorter_matches() -> None:
    assert propose_ngram([9, 1, 8, 2, 1], 2, 1, 3) == [8, 2]
    assert propose_ngram([9, 1, 8, 2, 1], 2, 2, 3) == []


def test_k_zero_proposes_nothing() -> None:
    assert propose_ngram([1, 2, 1, 2], 0, 1, 2) == []


def test_numpy_input_gives_python_ints() -> None:
    out = propose_ngram(np.array([3, 4, 5, 3, 4], dtype=np.int32), 2, 1, 2)
    assert out == [5, 3] and all(type(t) is int for t in out)


@pytest.mark.parametrize(("k", "min_n", "max_n"), [(1, 0, 2), (1, 3, 2), (-1, 1, 2), (1, -1, 1)])
def test_bad_arguments_raise(k: int, min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError):
        propose_ngram([1, 2, 1, 2], k, min_n, max_n)


@settings(max_examples=400, deadline=None)
@given(
    ids=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(0, 6),
    min_n=st.integers(1, 4),
    extra=st.integers(0, 3),
)
def test_proposal_continues_an_earlier_occurrence(ids: list[int], k: int, min_n: int, extra: int) -> None:
    max_n = min_n + extra
    out = propose_ngram(ids, k, min_n, max_n)
    assert out == oracle(ids, k, min_n, max_n)
    assert len(out) <= k
    if out:
        # Some n in range has an occurrence, starting before the suffix, that the proposal continues.
        assert any(
            ids[s : s + n] == ids[-n:] and ids[s + n : s + n + len(out)] == out
            for n in range(min_n, min(max_n, len(ids) - 1) + 1)
            for s in range(len(ids) - n)
        )


def test_a_token_array_follows_its_list_as_it_grows() -> None:
    """The mirror takes only the tokens appended since its last look, across its buffer's growth, and
    starts over for another list."""
    tokens = [5, 6, 7]
    mirror = TokenArray()
    assert mirror.update(tokens).tolist() == [5, 6, 7]
    for t in range(300):  # past the first buffer of 256
        tokens.append(t)
        assert mirror.update(tokens).tolist() == tokens
    other = [1, 2]
    assert mirror.update(other).tolist() == [1, 2]
    assert propose_ngram(mirror.update(tokens), 3, 1, 2) == oracle(tokens, 3, 1, 2)
