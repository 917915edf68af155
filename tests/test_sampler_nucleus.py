"""Top-p, top-k and min-p sampling against a sort-based reference: the sampled distribution is the truncated
distribution (a chi-square test with the power to tell a neighbouring distribution apart), every drawn token
lies in the truncated set, and seeded rows keep their tokens whatever the rows beside them do."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ember_engine import LLM
from ember_engine.sample import cpu_kernels, nucleus
from ember_engine.sample.nucleus import first_argmax
from ember_engine.sample.sampler import Sampler, SamplingRow, make_generator
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import SamplingState
from ember_engine.sample.seeds import position_seed


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """Large batches of small tensor operations: on a shared machine, more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def reference(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> torch.Tensor:
    """The truncated distribution worked out in float64 with one full sort: top-k, then top-p over what
    top-k kept (keep a token while the mass before it is short of top_p), then min-p."""
    x = logits.double() / temperature
    order = x.argsort(descending=True, stable=True)
    xs = x[order]
    keep = torch.ones_like(xs, dtype=torch.bool)
    if top_k > 0:
        keep[top_k:] = False
    probs = xs.masked_fill(~keep, float("-inf")).softmax(0)
    if top_p < 1.0:
        keep &= probs.cumsum(0) - probs < top_p
    probs = xs.masked_fill(~keep, float("-inf")).softmax(0)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.max()
    out = torch.zeros_like(xs)
    out[order] = xs.masked_fill(~keep, float("-inf")).softmax(0)
    return out


def chi_square(seen: Counter[int], expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom; tokens expected fewer than 5 times share one bin,
    and a token drawn where the expected count is 0 makes the statistic infinite."""
    n = sum(seen.values())
    counts = expected * n
    stat, bins, small_obs, small_exp = 0.0, 0, 0, 0.0
    for token in set(seen) | set(torch.nonzero(counts).flatten().tolist()):
        e, o = float(counts[token]), seen.get(token, 0)
        if e >= 5:
            stat += (o - e) ** 2 / e
            bins += 1
        else:
            small_obs, small_exp = small_obs + o, small_exp + e
    if small_obs and small_exp == 0:
        return math.inf, bins
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp
        bins += 1
    return stat, max(bins - 1, 1)


def bound(df: int) -> float:
    """Far in the chi-square tail (about six standard deviations above the mean)."""
    return df + 6 * math.sqrt(2 * df)


def draw(
    sampler: Sampler, logits: torch.Tensor, params: SamplingParams, n: int, chunk: int = 2000
) -> Counter[int]:
    seen: Counter[int] = Counter()
    for start in range(0, n, chunk):
        rows = min(chunk, n - start)
        batch = logits.expand(rows, -1).contiguous()
        seen.update(sampler(batch, [SamplingRow(params, (), (), None)] * rows).token_ids)
    return seen


# Vocabularies over the top-k path's 256 candidates, so that path takes topk rather than a sort.
CASES = [
    (512, dict(temperature=1.0, top_p=0.9)),
    (512, dict(temperature=0.7, top_p=0.5)),
    (500, dict(temperature=1.3, top_p=0.95)),  # no block width divides the vocabulary
    (512, dict(temperature=1.0, min_p=0.05)),
    (512, dict(temperature=1.0, top_k=20)),
    (512, dict(temperature=0.9, top_k=50, top_p=0.8)),
    (512, dict(temperature=1.0, top_p=0.9, min_p=0.02)),
    (4096, dict(temperature=1.2)),
    (2048, dict(temperature=1.0, top_p=0.9)),  # drawn and judged in 32 strided blocks
]


def _logits(vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2.5


@pytest.mark.parametrize("pivot", [True, False], ids=["pivot", "topk"])
def test_sampled_distribution_is_the_sorted_reference(pivot: bool) -> None:
    sampler = Sampler(pivot=pivot)
    for i, (vocab, fields) in enumerate(CASES):
        torch.manual_seed(100 + i)
        logits = _logits(vocab, i)
        seen = draw(sampler, logits, SamplingParams(**fields), 15000)  # type: ignore[arg-type]
        ref = reference(logits, **fields)  # type: ignore[arg-type]
        assert set(seen) <= set(torch.nonzero(ref).flatten().tolist()), fields
        stat, df = chi_square(seen, ref)
        assert stat < bound(df), (fields, stat, df)
        # The same draws against a slightly hotter distribution: the test can tell them apart.
        hotter = {**fields, "temperature": fields["temperature"] * 1.15}
        stat, df = chi_square(seen, reference(logits, **hotter))  # type: ignore[arg-type]
        assert stat > bound(df), (fields, stat, df)


# Few distinct values, so ties (and ties at the nucleus' edge) are common; -inf for masked tokens.
_values = st.sampled_from([-math.inf, -3.0, -1.0, 0.0, 0.0, 0.5, 1.0, 2.0, 4.0])


@st.composite
def _rows(draw_: st.DrawFn) -> tuple[list[float], dict[str, float]]:
    vocab = draw_(st.integers(2, 160))
    logits = draw_(st.lists(_values, min_size=vocab, max_size=vocab))
    if all(v == -math.inf for v in logits):
        logits[draw_(st.integers(0, vocab - 1))] = 0.0
    fields: dict[str, float] = {"temperature": draw_(st.sampled_from([0.5, 1.0, 2.0]))}
    if draw_(st.booleans()):
        fields["top_p"] = draw_(st.floats(0.01, 1.0))
    if draw_(st.booleans()):
        fields["top_k"] = draw_(st.integers(1, vocab))
    if draw_(st.booleans()):
        fields["min_p"] = draw_(st.floats(0.0, 1.0))
    return logits, fields


@settings(max_examples=150, deadline=None)
@given(_rows(), st.integers(0, 2**31 - 1))
def test_every_drawn_token_is_in_the_truncated_set(
    row: tuple[list[float], dict[str, float]], seed: int
) -> None:
    """Each drawn token is one the reference keeps, or tied with one it keeps (a sort keeps some of a tie at
    the edge and not others); the reference is loosened by 1e-5 in top_p and min_p for float32 rounding."""
    values, fields = row
    logits = torch.tensor(values)
    torch.manual_seed(seed)
    params = SamplingParams(**fields)  # type: ignore[arg-type]
    tokens = draw(Sampler(), logits, params, 64)
    loose = dict(fields)
    loose["top_p"] = min(1.0, fields.get("top_p", 1.0) + 1e-5)
    loose["min_p"] = max(0.0, fields.get("min_p", 0.0) - 1e-5)
    ref = reference(logits, **loose)  # type: ignore[arg-type]
    lowest_kept = float(logits[ref > 0].min())
    for token in tokens:
        assert math.isfinite(values[token]), (token, fields)
        assert values[token] >= lowest_kept, (token, values[token], lowest_kept, fields)


def test_rows_out_of_draws_are_settled_by_a_sort(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no redraws allowed, every rejected row takes the sorted path: the same distribution."""
    monkeypatch.setattr(nucleus, "MAX_ROUNDS", 0)
    torch.manual_seed(7)
    logits = _logits(512, 7)
    fields = dict(temperature=1.0, top_p=0.6, min_p=0.01)
    seen = draw(Sampler(), logits, SamplingParams(**fields), 15000)  # type: ignore[arg-type]
    stat, df = chi_square(seen, reference(logits, **fields))  # type: ignore[arg-type]
    assert stat < bound(df), (stat, df)


def test_unseeded_draws_repeat_under_the_same_global_seed() -> None:
    logits = torch.randn(64, 1024) * 2
    rows = [SamplingRow(SamplingParams(temperature=0.8, top_p=0.7), (), (), None)] * 64
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(Sampler()(logits, rows).token_ids)
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 40), st.sampled_from([64, 100, 256, 1024, 4096]), st.integers(0, 2**31 - 1))
def test_two_level_argmax_is_argmax(rows: int, vocab: int, seed: int) -> None:
    """The first largest, as torch's argmax (two levels past a few rows), with ties, -inf rows and a row of
    NaN among them."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-3, 3, (rows, vocab), generator=gen).float()  # many ties
    x[0] = float("-inf")
    if rows > 2:
        x[1, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
        x[2] = torch.randn(vocab, generator=gen)
    assert torch.equal(first_argmax(x), x.argmax(dim=-1))


def _seeded_token(seed: int, position: int, logits: torch.Tensor, pivot: bool, neighbours: int) -> int:
    """A seeded row's token at `position`, last in a batch of unseeded top-p/min-p/top-k rows."""
    vocab = logits.shape[0]
    state = SamplingState(neighbours + 1, vocab)
    kinds = [dict(top_p=0.3), dict(min_p=0.2), dict(top_k=3), dict(top_p=0.95, temperature=0.7)]
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=seed)
    generator = make_generator(seed)
    view = state.view(
        list(range(neighbours + 1)),
        lambda k: (
            (seeded, generator, (), ())
            if k == neighbours
            else (SamplingParams(**kinds[k % len(kinds)]), None, (), ())  # type: ignore[arg-type]
        ),
    )
    batch = torch.randn(neighbours + 1, vocab) * 3
    batch[neighbours] = logits
    noise = {neighbours: position_seed(seed, position)}
    return Sampler(state, pivot=pivot).sample(batch, state, view, noise_seeds=noise).token_ids[neighbours]


def test_seeded_rows_keep_their_tokens_beside_pivot_rows() -> None:
    """A seeded row's token depends on its seed, position and logits alone: the same alone, beside rows
    that redraw against a pivot any number of times, and beside the same rows on the top-k path."""
    torch.manual_seed(9)
    logits = torch.randn(1024) * 2
    for position in range(5):
        alone = _seeded_token(3, position, logits, pivot=True, neighbours=0)
        for neighbours in (1, 6):
            assert _seeded_token(3, position, logits, pivot=True, neighbours=neighbours) == alone
            assert _seeded_token(3, position, logits, pivot=False, neighbours=neighbours) == alone
    assert len({_seeded_token(3, p, logits, pivot=True, neighbours=2) for p in range(12)}) > 1


def test_rows_are_drawn_against_a_pivot_on_a_cpu_only() -> None:
    """Each rejection round is checked on the host, a wait per round on an accelerator: a state on another
    device (here the meta device, which allocates nothing) sends every random row to the top-k path."""
    for device, pivot in (("cpu", [0, 1]), ("meta", [])):
        state = SamplingState(2, 64, device)
        view = state.view(["a", "b"], lambda k: (SamplingParams(temperature=0.8, top_p=0.9), None, (), ()))
        assert view.pivot_rows == pivot
        assert view.other_rows == [0, 1][len(pivot) :]


def _compiled(
    x: torch.Tensor, cuts: nucleus.Cuts, seed: int, draws: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled draws' tokens and weights for logits `x`."""
    out = torch.empty(x.shape[0], dtype=torch.long)
    weights = torch.empty_like(x)
    peaks = x.amax(dim=-1).numpy()
    cpu_kernels.truncated_draws(
        x.numpy(),
        peaks,
        cuts.scale,
        seed,
        draws,
        cuts.top_k,
        cuts.top_p,
        cuts.min_p,
        weights.numpy(),
        out.numpy(),
    )
    return out, weights


def _cuts(
    rows: int, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor, temperature: float
) -> nucleus.Cuts:
    scale = np.full(rows, nucleus.LOG2E / temperature, dtype=np.float32)
    return nucleus.Cuts(top_k.numpy(), top_p.numpy(), min_p.numpy(), scale)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([7, 64, 100, 1024]),
    st.floats(0.5, 40.0),
    st.sampled_from([0.3, 1.0, 1.7]),
    st.integers(0, 2**31 - 1),
)
def test_the_compiled_draws_keep_to_the_truncated_set_at_the_edges(
    vocab: int, spread: float, temperature: float, seed: int
) -> None:
    """The compiled draws (`cpu_kernels.truncated_draws`) weigh each token 2^((x - max) log2(e) / T) to
    float32's precision (torch's exp2 the reference; weights under 2^-126 of the likeliest are 0) and take
    tokens of weight in the truncated set, also with masked tokens, ties and one token left. A row
    without weight gets its first largest logit, NaN the largest (as argmax has it): logits all -inf, a
    NaN among them, or +inf."""
    gen = torch.Generator().manual_seed(seed)
    rows = 16
    x = torch.randn(rows, vocab, generator=gen) * spread
    x[:, torch.randint(0, vocab, (vocab // 4,), generator=gen)] = float("-inf")
    x[5:8] = x[5:8].round()  # ties
    x[0] = float("-inf")
    x[0, 3] = 1.0  # one token left
    x[1] = float("-inf")
    x[2, 4:] = 0.0
    x[2, 5] = x[2, 6] = float("nan")
    x[3, 2] = x[3, 4] = float("inf")
    x[4, 1] = 3.0e38  # a finite logit far above the rest
    top_k = torch.randint(0, vocab + 1, (rows,), generator=gen)
    top_p = torch.rand(rows, generator=gen) * 0.9 + 0.05
    top_p[::3] = 1.0
    min_p = torch.rand(rows, generator=gen) * 0.3
    out, weights = _compiled(x, _cuts(rows, top_k, top_p, min_p, temperature), seed, 8)
    assert out[:5].tolist() == [3, 0, 5, 2, 1]
    ok = slice(4, rows)
    reference = torch.exp2(
        (x[ok] - x[ok].amax(dim=-1, keepdim=True)) * np.float32(nucleus.LOG2E / temperature)
    )
    reference = reference.masked_fill(reference < 2.0**-126, 0.0)
    assert torch.allclose(weights[ok], reference, rtol=1e-6, atol=0.0)
    for r in range(4, rows):
        if out[r] < 0:  # out of draws, which only a narrow cut makes likely
            continue
        w = weights[r].double()
        p = w[out[r]]
        heavier = w[w > p]
        assert p > 0, r
        assert top_p[r] >= 1.0 or float(heavier.sum()) < float(top_p[r]) * float(w.sum()) * (1 + 1e-5), r
        assert top_k[r] <= 0 or len(heavier) < int(top_k[r]), r
        assert float(p) >= float(min_p[r]) * float(w.max()) * (1 - 1e-6), r


def test_rows_out_of_draws_get_minus_one() -> None:
    """One draw each, with only the likeliest of 51 nearly equal tokens allowed: most rows miss it."""
    rows = 1000
    x = torch.zeros(rows, 51)
    x[:, 50] = 0.01
    cuts = _cuts(rows, torch.ones(rows, dtype=torch.long), torch.ones(rows), torch.zeros(rows), 1.0)
    out, _ = _compiled(x, cuts, 1, 1)
    assert set(out.tolist()) == {-1, 50}
    assert out.tolist().count(-1) > 900


def test_a_serving_run_with_every_cut_compiles_the_draws_once(tiny_model: Path) -> None:
    """The engine compiles the CPU's draws while starting (or loads them from numba's cache): rows with
    top-p, top-k, min-p and temperatures, at changing batch sizes, add no compiled signature."""
    llm = LLM(str(tiny_model), max_model_len=256, max_num_seqs=8)
    signatures = list(cpu_kernels.truncated_draws.signatures)
    assert signatures  # compiled while starting
    kinds = [
        dict(temperature=0.8, top_p=0.9),
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.3, min_p=0.1),
        dict(temperature=0.7, top_p=0.5, min_p=0.05),
    ]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, **kinds[i % 4]) for i in range(7)]  # type: ignore[arg-type]
    outs = llm.generate([[5 + i, 9, 11] for i in range(7)], params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [6] * 7
    llm.generate([[3, 4]], [SamplingParams(temperature=0.9, top_p=0.8, max_tokens=3)], use_tqdm=False)
    assert list(cpu_kernels.truncated_draws.signatures) == signatures


def test_a_draw_that_rounding_leaves_short_takes_the_last_token_above_the_floor() -> None:
    """At a target equal to the total (a uniform draw of 1 - 2^-53 times a float32 total can round to it)
    no cumulative weight passes it: the draw takes the last token of weight above the floor, never one of
    weight 0 nor one at or below the floor."""
    w = np.zeros(200, dtype=np.float32)
    w[[3, 70, 130, 131, 150]] = [0.5, 0.25, 0.125, 1.0, 0.125]
    masses = np.empty(4, dtype=np.float32)
    for floor, last in ((0.0, 150), (0.2, 131)):
        total = cpu_kernels._block_masses(w, np.float32(floor), masses)
        assert cpu_kernels._draw(w, np.float32(floor), masses, total, 1.0) == last
        assert cpu_kernels._draw(w, np.float32(floor), masses, total, 0.0) == 3  # the first above it
