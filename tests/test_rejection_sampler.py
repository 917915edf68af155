"""Speculative verification: emitted tokens follow the target, greedy acceptance, seeded RNG use, shapes."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import pytest
import torch

from ember_engine.sample.rejection_sampler import rejection_sample
from ember_engine.sample.sampler import make_generator

V = 6
N = 100_000  # requests per distribution check
P_MIN = 1e-4  # chi-square p-value below which a distribution check fails


def chi2_sf(x: float, df: int) -> float:
    """Chi-square survival function for an integer df, in closed form (no scipy here)."""
    h = x / 2
    if df % 2 == 0:
        return math.exp(-h) * sum(h**i / math.factorial(i) for i in range(df // 2))
    tail = sum(math.exp(-h + (i - 0.5) * math.log(h) - math.lgamma(i + 0.5)) for i in range(1, df // 2 + 1))
    return math.erfc(math.sqrt(h)) + (tail if h > 0 else 0.0)


def test_chi2_sf_matches_known_quantiles() -> None:
    # Upper 5% points of the chi-square distribution for df 1..6.
    for df, q95 in [(1, 3.841), (2, 5.991), (3, 7.815), (4, 9.488), (5, 11.070), (6, 12.592)]:
        assert chi2_sf(q95, df) == pytest.approx(0.05, abs=2e-4)


def goodness_of_fit(samples: torch.Tensor, p: torch.Tensor) -> float:
    """p-value of a chi-square test of samples against p; tokens p gives no mass must never appear."""
    counts = torch.bincount(samples, minlength=V).double()
    p = p.double()
    support = p > 0
    assert counts[~support].sum() == 0, f"tokens outside p's support were emitted: {counts.tolist()}"
    if int(support.sum()) == 1:
        return 1.0
    expected = p[support] / p[support].sum() * counts.sum()
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


def distribution(*weights: float) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


def random_distribution(gen: torch.Generator, zeros: int = 0) -> torch.Tensor:
    w = torch.rand(V, generator=gen) + 0.05
    w[torch.randperm(V, generator=gen)[:zeros]] = 0.0
    return w / w.sum()


def emitted_at(outputs: Sequence[list[int]], position: int) -> torch.Tensor:
    return torch.tensor([o[position] for o in outputs if len(o) > position])


def run_many(p_rows: torch.Tensor, q_rows: torch.Tensor, one_hot_q: bool, seed: int) -> list[list[int]]:
    """N independent requests in one call: alternately k = 1 and k = 2 drafts, draft j drawn from q_j.

    Every request sees the same target rows p_0, p_1, p_2 (its bonus row is p_1 when k = 1), so emitted
    position j must follow p_j whichever k a request had. p_rows: [3, V]; q_rows: [2, V].
    """
    torch.manual_seed(seed)
    ks = [1 + i % 2 for i in range(N)]
    drafts = torch.stack(
        [torch.multinomial(q_rows[j], N, replacement=True) for j in range(2)], dim=1
    ).tolist()
    drafts = [d[:k] for d, k in zip(drafts, ks, strict=True)]
    target = p_rows[[j for k in ks for j in range(k + 1)]]
    draft_probs = None if one_hot_q else q_rows[[j for k in ks for j in range(k)]]
    return rejection_sample(target, drafts, draft_probs, [False] * N, [None] * N)


def _cases() -> list[tuple[str, list[torch.Tensor], list[torch.Tensor], bool]]:
    """(name, [p_0, p_1, p_2], [q_0, q_1], q given as one-hot)."""
    g = torch.Generator().manual_seed(1234)
    rp = [[random_distribution(g, zeros=j % 3) for j in range(3)] for _ in range(3)]
    rq = [[random_distribution(g, zeros=(j + 1) % 2) for j in range(2)] for _ in range(3)]
    low, high = distribution(3, 2, 1, 0, 0, 0), distribution(0, 0, 0, 1, 2, 3)
    one_hot = torch.zeros(V)
    one_hot[2] = 1.0
    return [
        ("random-0", rp[0], rq[0], False),
        ("random-1", rp[1], rq[1], False),
        ("q-equals-p", rp[2], rp[2][:2], False),
        ("disjoint", [low, low, low], [high, high], False),
        ("one-hot-q", rp[0], rq[2], True),
        ("one-hot-q-off-support", [low, low, low], [high, high], True),
        ("one-hot-p", [one_hot, rp[1][1], one_hot], rq[1], False),
    ]


CASES = _cases()


@functools.cache
def outputs_for(name: str) -> list[list[int]]:
    """One vectorized call per case, shared by the checks below."""
    _, p, q, one_hot_q = next(c for c in CASES if c[0] == name)
    return run_many(torch.stack(p), torch.stack(q), one_hot_q, seed=len(name))


@pytest.mark.parametrize(("name", "p", "q", "one_hot_q"), CASES, ids=[c[0] for c in CASES])
def test_every_emitted_token_follows_the_target(
    name: str, p: list[torch.Tensor], q: list[torch.Tensor], one_hot_q: bool
) -> None:
    p_rows = torch.stack(p)
    outputs = outputs_for(name)
    assert all(1 <= len(o) <= 2 + i % 2 for i, o in enumerate(outputs))
    # Position j is reached only when drafts 0..j-1 were accepted; given that, it must still follow p_j.
    checked = 0
    for j in range(3):
        tokens = emitted_at(outputs, j)
        if len(tokens) < 5000:
            continue
        checked += 1
        assert goodness_of_fit(tokens, p_rows[j]) > P_MIN, f"{name}: position {j}"
    assert checked >= 1


@pytest.mark.parametrize(("name", "p", "q", "one_hot_q"), CASES[:2], ids=[c[0] for c in CASES[:2]])
def test_the_check_rejects_the_draft_distribution(
    name: str, p: list[torch.Tensor], q: list[torch.Tensor], one_hot_q: bool
) -> None:
    """The same statistic, against q instead of p, is far past the threshold: the check can fail."""
    outputs = outputs_for(name)
    first = emitted_at(outputs, 0)
    counts = torch.bincount(first, minlength=V).double()
    expected = q[0].double() * counts.sum()
    stat = float(((counts - expected) ** 2 / expected.clamp_min(1e-9)).sum())
    assert chi2_sf(stat, V - 1) < 1e-12


def test_the_check_rejects_resampling_from_p_after_a_rejection() -> None:
    """A plausible wrong rule, drawing the replacement from p instead of the residual, is caught."""
    p, q = CASES[0][1][0], CASES[0][2][0]
    torch.manual_seed(3)
    x = torch.multinomial(q, N, replacement=True)
    keep = torch.rand(N) * q[x] < p[x]
    wrong = torch.where(keep, x, torch.multinomial(p, N, replacement=True))
    assert goodness_of_fit(wrong, p) < 1e-12


def test_one_hot_draft_the_target_rules_out_is_always_rejected() -> None:
    p = distribution(1, 1, 0, 1, 1, 1)
    n = 2000
    out = rejection_sample(p.repeat(2 * n, 1), [[2]] * n, None, [False] * n, [None] * n)
    assert all(len(o) == 1 and o[0] != 2 for o in out)


def test_draft_with_zero_q_is_kept_when_the_target_likes_it() -> None:
    # Cannot happen for a token sampled from q, but u*q < p must not divide by zero or reject it.
    p = torch.stack([distribution(0, 0, 1, 0, 0, 0), distribution(0, 0, 0, 0, 0, 1)])
    q = distribution(1, 1, 0, 1, 1, 1).unsqueeze(0)
    assert rejection_sample(p, [[2]], q, [False], [None]) == [[2, 5]]


def rows_of(weights: torch.Tensor) -> torch.Tensor:
    """Each row normalized to sum 1 (a plain division: tiny parallel ops such as softmax stall on a busy CPU)."""
    return weights / weights.sum(dim=1, keepdim=True)


def greedy_target(argmaxes: Sequence[int]) -> torch.Tensor:
    rows = torch.rand(len(argmaxes), V) * 0.5
    rows[torch.arange(len(argmaxes)), torch.tensor(list(argmaxes))] = 1.0
    return rows / rows.sum(dim=1, keepdim=True)


def test_greedy_stops_at_the_first_mismatch_and_emits_the_argmax() -> None:
    target = greedy_target([1, 2, 3, 4, 5, 0, 0, 1])  # request 0: rows 0..3; request 1: rows 4..7
    drafts = [[1, 2, 0], [5, 4, 1]]
    out = rejection_sample(target, drafts, None, [True, True], [None, None])
    assert out == [[1, 2, 3], [5, 0]]


def test_greedy_all_accepted_adds_the_bonus_argmax_and_empty_drafts_give_one_token() -> None:
    target = greedy_target([1, 2, 3, 4, 0, 3])  # rows 0..3, then one row each for two k=0 requests
    q = torch.full((3, V), 1 / V)
    out = rejection_sample(target, [[1, 2, 3], [], []], q, [True, True, False], [None, None, None])
    assert out[0] == [1, 2, 3, 4] and out[1] == [0]
    assert len(out[2]) == 1


def test_greedy_rows_draw_no_random_numbers() -> None:
    gen = make_generator(11)
    target = greedy_target([1, 2, 3, 4, 5])
    before, default_before = gen.get_state(), torch.get_rng_state()
    out = rejection_sample(target, [[1, 0], [], []], None, [True, True, True], [gen, gen, None])
    assert out == [[1, 2], [4], [5]]
    assert torch.equal(gen.get_state(), before)
    assert torch.equal(torch.get_rng_state(), default_before)


def test_greedy_rows_beside_random_rows_still_take_the_argmax() -> None:
    torch.manual_seed(5)
    for _ in range(20):
        target = rows_of(torch.rand(8, V))
        greedy_out = rejection_sample(target[:4], [[0, 1, 2]], None, [True], [None])
        mixed = rejection_sample(target, [[0, 1, 2], [3, 4, 5]], None, [True, False], [None, None])
        assert mixed[0] == greedy_out[0]


Request = tuple[int, list[int], torch.Generator | None]  # (key for its rows, drafts, generator)


def _seeded_call(batch: Sequence[Request], seed: int) -> list[list[int]]:
    """Each request's p and q rows depend only on its key, never on its place in the batch."""
    torch.manual_seed(seed)
    targets, qs = [], []
    for key, drafts, _ in batch:
        k = len(drafts)
        targets.append(rows_of(torch.rand(k + 1, V, generator=make_generator(2 * key))))
        qs.append(rows_of(torch.rand(k, V, generator=make_generator(2 * key + 1))))
    out = rejection_sample(
        torch.cat(targets),
        [d for _, d, _ in batch],
        torch.cat(qs),
        [False] * len(batch),
        [g for *_, g in batch],
    )
    return out


def test_seeded_request_gives_the_same_tokens_in_any_batch() -> None:
    mine = [0, 1, 2]
    alone = [_seeded_call([(0, mine, make_generator(s))], 0)[0] for s in range(40)]
    assert len({tuple(o) for o in alone}) > 3  # the seed matters
    for s in range(40):
        others: list[Request] = [(1, [3, 4], None), (2, [], make_generator(1000 + s)), (3, [5], None)]
        at = s % 4
        batch = [*others[:at], (0, mine, make_generator(s)), *others[at:]]
        assert _seeded_call(batch, s + 1)[at] == alone[s]


def test_seeded_request_draws_k_uniforms_then_v_exponentials() -> None:
    """The documented order, replayed by hand: a uniform per draft, then the noise for the extra token."""
    up, down, flat = distribution(1, 2, 3, 4, 5, 6), distribution(6, 5, 4, 3, 2, 1), distribution(*[1] * V)
    target = torch.stack([up, down, up, flat])
    q = torch.stack([distribution(6, 1, 1, 1, 1, 1), distribution(1, 1, 1, 1, 1, 6), down])
    drafts = [0, 5, 1]
    outcomes = set()
    for seed in range(30):
        gen, replay = make_generator(seed), make_generator(seed)
        out = rejection_sample(target, [drafts], q, [False], [gen])
        u = torch.empty(len(drafts)).uniform_(generator=replay)
        noise = torch.empty(V).exponential_(generator=replay).clamp_min(torch.finfo(torch.float32).tiny)
        assert torch.equal(gen.get_state(), replay.get_state())
        expected: list[int] = []
        for j, x in enumerate(drafts):
            if u[j] * q[j, x] >= target[j, x]:
                expected.append(int(((target[j] - q[j]).clamp_min(0.0) / noise).argmax()))
                break
            expected.append(x)
        else:
            expected.append(int((target[len(drafts)] / noise).argmax()))
        assert out == [expected]
        outcomes.add(len(expected))
    assert len(outcomes) > 1  # both early rejections and longer runs were replayed


@pytest.mark.parametrize(
    ("target_shape", "drafts", "q_shape", "message"),
    [
        ((4, V), [[1, 2], [3]], None, "rows"),
        ((5, V), [[1], [2, 3]], (2, V), "draft_probs"),
        ((5, V), [[1], [2, 3]], (3, V + 1), "draft_probs"),
        ((V,), [[]], None, "vocab"),
        ((2, V), [[V]], None, "outside"),
    ],
)
def test_shape_mismatches_raise(
    target_shape: tuple[int, ...], drafts: list[list[int]], q_shape: tuple[int, int] | None, message: str
) -> None:
    q = None if q_shape is None else torch.full(q_shape, 1.0 / q_shape[1])
    n = len(drafts)
    with pytest.raises(ValueError, match=message):
        rejection_sample(torch.full(target_shape, 1.0 / V), drafts, q, [False] * n, [None] * n)


def test_flag_counts_must_match_requests() -> None:
    with pytest.raises(ValueError, match="greedy flags"):
        rejection_sample(torch.full((2, V), 1.0 / V), [[1]], None, [False, True], [None])


def test_empty_batch() -> None:
    assert rejection_sample(torch.empty(0, V), [], None, [], []) == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_the_rules() -> None:
    dev = torch.device("cuda")
    target = greedy_target([1, 2, 3, 4, 5]).to(dev)
    gen = make_generator(3, dev)
    before = gen.get_state()
    assert rejection_sample(target, [[1, 0], [], []], None, [True] * 3, [gen, None, None]) == [
        [1, 2],
        [4],
        [5],
    ]
    assert torch.equal(gen.get_state(), before)
    # Seeded random rows on the device: reproducible alone and in a batch.
    t = rows_of(torch.rand(7, V, generator=make_generator(1))).to(dev)
    q = rows_of(torch.rand(4, V, generator=make_generator(2))).to(dev)
    for s in range(10):
        alone = rejection_sample(t[:4], [[0, 1, 2]], q[:3], [False], [make_generator(s, dev)])
        both = rejection_sample(
            t, [[0, 1, 2], [3, 4]], torch.cat([q[:3], q[:2]]), [False] * 2, [make_generator(s, dev), None]
        )
        assert both[0] == alone[0]
    # The distribution check on the device, one-hot q.
    p = distribution(1, 2, 3, 4, 5, 6)
    n = 100_000
    torch.manual_seed(4)
    drafts = torch.randint(0, V, (n, 1))
    out = rejection_sample(p.repeat(2 * n, 1).to(dev), drafts.tolist(), None, [False] * n, [None] * n)
    assert goodness_of_fit(emitted_at(out, 0), p) > P_MIN
