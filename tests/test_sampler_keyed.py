"""Seeded rows on a CPU: the exponential race with noise computed from the row's seed (SplitMix64 of the
seed and the token's index), checked against the generator written out in Python, against the
distribution it must follow, and beside generator-drawn and unseeded rows in one call."""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from ember_engine.sample import cpu_kernels
from ember_engine.sample.sampler import Sampler, sample_probs
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import SamplingState
from ember_engine.sample.seeds import U64, keyed_race, make_generator, position_seed


def splitmix64(key: int, index: int) -> int:
    """The `index`-th output (from 1) of SplitMix64 started at `key`, as its reference describes it."""
    x = (key + index * 0x9E3779B97F4A7C15) & U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & U64
    return x ^ (x >> 31)


def test_between_two_tokens_of_equal_mass_the_one_with_the_larger_uniform_wins() -> None:
    """With equal masses, argmax p / (-ln u) is the larger u, whose order is that of the top 23 bits of
    the generator's outputs: the kernel's noise is SplitMix64's, token i taking output i + 1."""
    vocab = 50
    checked = 0
    for key in [0, 1, 12345, U64, 0x8000000000000000, *(position_seed(7, p) for p in range(40))]:
        for a, b in [(0, 1), (3, 17), (48, 49), (0, 49), (20, 21)]:
            ua, ub = splitmix64(key, a + 1) >> 41, splitmix64(key, b + 1) >> 41
            if ua == ub:
                continue
            probs = torch.zeros(1, vocab)
            probs[0, [a, b]] = 0.5
            (token,) = keyed_race(probs, [0], [key]).tolist()
            assert token == (a if ua > ub else b), (key, a, b)
            checked += 1
    assert checked > 200


def test_the_noise_is_minus_the_log_of_its_uniform() -> None:
    """`_neg_log` at the kernel's uniforms, (2n + 1) / 2^24: both ends, around the reduction's sqrt(2)
    boundary of each binade, and a spread of others; within 3e-7 of -ln u and never 0 or below."""
    ns = {0, 1, 2, 3, (1 << 23) - 1, (1 << 23) - 2, *range(0, 1 << 23, 997)}
    for b in range(1, 24):  # the n whose u lies just below and above 2^-b * sqrt(2)
        edge = int(math.sqrt(2) * 2 ** (24 - b) / 2)
        ns.update(range(max(0, edge - 2), min(1 << 23, edge + 3)))
    for n in sorted(ns):
        u = (2 * n + 1) / 2**24
        got = float(cpu_kernels._neg_log(np.float32(u)))
        assert got > 0 and abs(got + math.log(u)) <= 3e-7 * -math.log(u), (n, got)


def test_draws_over_many_seeds_follow_the_distribution() -> None:
    probs = torch.tensor([[0.05, 0.0, 0.15, 0.3, 0.0, 0.4, 0.1, 0.0]])
    n = 20000
    rows = probs.expand(n, -1).contiguous()
    tokens = keyed_race(rows, list(range(n)), [position_seed(3, p) for p in range(n)]).tolist()
    seen = Counter(tokens)
    assert not {1, 4, 7} & set(seen)  # no mass, never drawn
    distance = 0.5 * sum(abs(seen[t] / n - float(probs[0, t])) for t in range(8))
    assert distance < 0.02, seen  # sampling error is about 0.005 here


def test_unnormalised_rows_rows_without_mass_and_nan() -> None:
    nan = float("nan")
    rows = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 7.5], [2.0, 2.0, 0.0, 0.0], [0.1, nan, 0.5, nan]]
    )
    tokens = keyed_race(rows, [0, 1, 2, 3], [5, -1, 2**64 - 1, 8]).tolist()
    assert tokens[0] == 0  # as argmax of its zeros
    assert tokens[1] == 3
    assert tokens[2] in (0, 1)
    assert tokens[3] == 1  # as argmax has a NaN
    # A negative seed is its two's complement.
    assert keyed_race(rows[2:], [0], [-1]).tolist() == keyed_race(rows[2:], [0], [U64]).tolist()


def test_a_keyed_row_is_the_same_beside_generator_rows_and_unseeded_rows() -> None:
    torch.manual_seed(0)
    probs = torch.rand(6, 300)
    seed = position_seed(99, 4)
    alone = keyed_race(probs[2:3], [0], [seed]).item()
    gens = [None, make_generator(1), make_generator(2), None, make_generator(3), None]
    # Row 2 keyed; rows 1 and 4 draw from their generators (no seed given); rows 0, 3 and 5 share the default.
    tokens = sample_probs(probs, gens, [None, None, seed, None, None, None])
    assert tokens[2].item() == alone
    again = sample_probs(probs, gens, [None, None, seed, None, None, None])
    assert again[2].item() == alone
    # The generator rows went on through their streams: fresh generators give the first call's tokens.
    fresh = [None, make_generator(1), make_generator(2), None, make_generator(3), None]
    assert (
        sample_probs(probs, fresh, [None, None, seed, None, None, None])[[1, 4]].tolist()
        == tokens[[1, 4]].tolist()
    )


def test_rows_are_taken_in_the_order_given() -> None:
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert keyed_race(probs, [2, 0, 1], [1, 2, 3]).tolist() == [2, 0, 1]
    assert keyed_race(probs, [1, 0], [1, 2]).tolist() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_probabilities_of_any_float_dtype_take_the_race(dtype: torch.dtype) -> None:
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]], dtype=dtype)
    assert sample_probs(probs, [make_generator(0)] * 2, [11, 12]).tolist() == [1, 2]


def test_the_engines_sampler_compiles_the_race_before_serving() -> None:
    Sampler(SamplingState(2, 64))  # what the engine builds on a CPU
    compiled = set(cpu_kernels.keyed_race.signatures)
    assert compiled
    state = SamplingState(3, 64)
    sampler = Sampler(state)
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=4)
    generator = make_generator(4)
    view = state.view([0, 1, 2], lambda k: (params, generator, (), ()))
    seeds = {i: position_seed(4, i) for i in range(3)}
    sampler.sample(torch.randn(3, 64), state, view, noise_seeds=seeds)
    assert set(cpu_kernels.keyed_race.signatures) == compiled
