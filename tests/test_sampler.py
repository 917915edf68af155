"""Sampler semantics on CPU: greedy, seeded batch invariance, truncation, distribution, penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from ember_engine.sample.sampler import Sampler, SamplerOutput, SamplingRow, make_generator
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import SamplingState

VOCAB = 64


def make_row(
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    suppress: Sequence[int] = (),
    generator: torch.Generator | None = None,
    **params: Any,
) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), list(prompt), list(output), generator, list(suppress))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    return Sampler()(logits, rows)


def support(logits: torch.Tensor, n: int, **params: Any) -> Counter[int]:
    """Tokens drawn from n identical rows in one batch (default RNG)."""
    out = sample(logits.expand(n, -1).contiguous(), [make_row(**params) for _ in range(n)])
    return Counter(out.token_ids)


def test_greedy_is_argmax_even_beside_random_rows() -> None:
    torch.manual_seed(0)
    for _ in range(5):
        logits = torch.randn(7, VOCAB) * 3
        rows = [
            make_row(temperature=0.0) if i % 2 == 0 else make_row(temperature=1.3, top_p=0.9)
            for i in range(7)
        ]
        out = sample(logits, rows)
        expected = logits.argmax(dim=-1).tolist()
        assert [out.token_ids[i] for i in range(0, 7, 2)] == [expected[i] for i in range(0, 7, 2)]
        assert out.logprobs is None and out.top_logprobs is None


def test_caller_logits_are_not_modified() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    rows = [
        make_row(prompt=[1, 2], output=[3], suppress=[4], repetition_penalty=1.5, presence_penalty=1.0)
    ] * 2
    sample(logits, rows)
    assert torch.equal(logits, before)


def _seeded_run(seed: int, steps: list[torch.Tensor], batch_size: int, position: int) -> list[int]:
    """Sample the seeded target row at `position` among other seeded and unseeded rows, step after step."""
    generator = make_generator(seed)
    neighbours = [make_generator(1000 + j) for j in range(batch_size)]
    tokens = []
    for step, target_logits in enumerate(steps):
        rows, logits = [], []
        for j in range(batch_size):
            if j == position:
                rows.append(make_row(generator=generator, seed=seed, temperature=0.8, top_p=0.95, top_k=40))
                logits.append(target_logits)
            elif j % 2:
                rows.append(make_row(generator=neighbours[j], seed=1000 + j, min_p=0.05))
                logits.append(torch.randn(VOCAB))
            else:
                rows.append(make_row(temperature=1.5 if step % 2 else 0.0, top_k=5))
                logits.append(torch.randn(VOCAB))
        tokens.append(sample(torch.stack(logits), rows).token_ids[position])
    return tokens


def test_seeded_row_is_reproducible_alone_and_in_any_batch() -> None:
    torch.manual_seed(2)
    steps = [torch.randn(VOCAB) for _ in range(8)]
    alone = _seeded_run(42, steps, batch_size=1, position=0)
    assert alone == _seeded_run(42, steps, batch_size=1, position=0)
    for batch_size, position in [(2, 0), (2, 1), (4, 2), (5, 4), (6, 3)]:
        torch.manual_seed(batch_size * 10 + position)  # neighbours' logits and the shared RNG differ per run
        assert _seeded_run(42, steps, batch_size, position) == alone
    assert _seeded_run(43, steps, batch_size=1, position=0) != alone


def test_different_seeds_give_different_tokens() -> None:
    logits = torch.zeros(1, 1000)
    runs = []
    for seed in (1, 2):
        generator = make_generator(seed)
        runs.append(
            [sample(logits, [make_row(generator=generator, seed=seed)]).token_ids[0] for _ in range(5)]
        )
    assert runs[0] != runs[1]


def test_top_k_one_is_greedy() -> None:
    torch.manual_seed(3)
    logits = torch.randn(32, VOCAB)
    out = sample(logits, [make_row(temperature=2.0, top_k=1) for _ in range(32)])
    assert out.token_ids == logits.argmax(dim=-1).tolist()


def test_top_k_restricts_support() -> None:
    torch.manual_seed(4)
    logits = torch.randn(VOCAB) * 0.5
    seen = support(logits, 4000, top_k=5)
    assert set(seen) == set(logits.topk(5).indices.tolist())


def _shuffled_logits(probs: list[float], vocab: int = 16) -> tuple[torch.Tensor, list[int]]:
    """Logits with the given probabilities (rest ~0) placed at scattered ids, so order is not trivial."""
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(5))[: len(probs)].tolist()
    logits = torch.full((vocab,), -30.0)
    logits[ids] = torch.tensor(probs).log()
    return logits, ids


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.4, 1), (0.7, 2), (0.9, 3), (1.0, 4)])
def test_top_p_restricts_support_to_nucleus(top_p: float, nucleus: int) -> None:
    torch.manual_seed(6)
    logits, ids = _shuffled_logits([0.5, 0.3, 0.15, 0.05])
    seen = support(logits, 4000, top_p=top_p)
    assert set(seen) == set(ids[:nucleus])


@pytest.mark.parametrize(("min_p", "kept"), [(0.1, 4), (0.6, 2), (0.9, 1)])
def test_min_p_drops_unlikely_tokens(min_p: float, kept: int) -> None:
    torch.manual_seed(7)
    logits, ids = _shuffled_logits([0.4, 0.3, 0.2, 0.08, 0.02])
    seen = support(logits, 4000, min_p=min_p)
    assert set(seen) == set(ids[:kept])


def _total_variation(seen: Counter[int], expected: torch.Tensor) -> float:
    n = sum(seen.values())
    return 0.5 * sum(abs(seen[t] / n - float(p)) for t, p in enumerate(expected))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_empirical_distribution_matches_softmax_over_temperature(temperature: float) -> None:
    torch.manual_seed(8)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -0.5])
    seen = support(logits, 20000, temperature=temperature)
    # Sampling error here is about 0.01 in total variation; 0.03 leaves room and still separates the temperatures.
    assert _total_variation(seen, (logits / temperature).softmax(-1)) < 0.03
    other = 1.0 if temperature != 1.0 else 0.5
    assert _total_variation(seen, (logits / other).softmax(-1)) > 0.06


def test_seeded_generator_draws_follow_the_distribution() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    generator = make_generator(9)
    seen = Counter(sample(logits, [make_row(generator=generator, seed=9)]).token_ids[0] for _ in range(3000))
    assert _total_variation(seen, logits[0].softmax(-1)) < 0.04


def test_top_k_renormalises_over_the_kept_tokens() -> None:
    torch.manual_seed(10)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5, -0.5])
    seen = support(logits, 20000, top_k=3, temperature=0.8)
    kept = torch.full_like(logits, float("-inf"))
    kept[[0, 3, 4]] = logits[[0, 3, 4]] / 0.8
    assert _total_variation(seen, kept.softmax(-1)) < 0.03


BASE = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0, 1.0, -2.0]
PROMPT, OUTPUT = [0, 1, 5], [2, 3, 3, 1]


def _penalised(rep: float, freq: float, pres: float) -> list[float]:
    """The penalties worked out by hand, token by token."""
    counts = Counter(OUTPUT)
    expected = []
    for token, value in enumerate(BASE):
        if token in PROMPT or token in counts:
            value = value / rep if value > 0 else value * rep
        value -= freq * counts[token] + pres * (counts[token] > 0)
        expected.append(value)
    return expected


def _full_logprobs(out: SamplerOutput, row: int) -> torch.Tensor:
    assert out.top_logprobs is not None
    table = dict(out.top_logprobs[row])
    assert len(table) == len(BASE)
    return torch.tensor([table[t] for t in range(len(BASE))])


@pytest.mark.parametrize(
    ("rep", "freq", "pres"),
    [(2.0, 0.0, 0.0), (0.5, 0.0, 0.0), (1.0, 0.5, 0.0), (1.0, 0.0, 0.75), (1.3, -0.4, 0.6)],
)
def test_penalties_change_exactly_the_right_logits(rep: float, freq: float, pres: float) -> None:
    logits = torch.tensor([BASE, BASE])
    rows = [
        make_row(
            PROMPT, OUTPUT, repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres, logprobs=8
        ),
        make_row(PROMPT, OUTPUT, temperature=0.0, logprobs=8),  # no penalties: must stay untouched
    ]
    out = sample(logits, rows)
    expected = torch.tensor(_penalised(rep, freq, pres)).log_softmax(-1)
    torch.testing.assert_close(_full_logprobs(out, 0), expected)
    torch.testing.assert_close(_full_logprobs(out, 1), torch.tensor(BASE).log_softmax(-1))


def test_frequency_penalty_flips_greedy_choice() -> None:
    logits = torch.tensor([[1.0, 1.5, 0.0]])
    assert sample(logits, [make_row(output=[1], temperature=0.0)]).token_ids == [1]
    assert sample(logits, [make_row(output=[1], temperature=0.0, frequency_penalty=1.0)]).token_ids == [0]
    assert sample(logits, [make_row(prompt=[1], temperature=0.0, repetition_penalty=2.0)]).token_ids == [0]


def test_suppressed_tokens_are_never_sampled() -> None:
    torch.manual_seed(11)
    logits = torch.randn(VOCAB) * 0.1
    logits[7] = 10.0
    banned = [7, 3, 12]
    rows = [make_row(suppress=banned, temperature=2.0, logprobs=0) for _ in range(3000)]
    rows.append(make_row(suppress=banned, temperature=0.0))
    out = sample(logits.expand(len(rows), -1).contiguous(), rows)
    assert not set(out.token_ids) & set(banned)
    masked = logits.clone()
    masked[banned] = float("-inf")
    assert out.token_ids[-1] == int(masked.argmax())
    assert out.logprobs is not None and all(math.isfinite(lp) for lp in out.logprobs[:-1])
    assert out.logprobs[-1] is None  # the last row did not ask


def test_logprobs_are_taken_before_temperature_and_truncation() -> None:
    torch.manual_seed(12)
    logits = torch.randn(5, VOCAB) * 2
    wants = [None, 0, 3, 5, 20]
    rows = [
        make_row(temperature=0.0, logprobs=wants[0]),
        make_row(temperature=0.7, top_k=10, logprobs=wants[1]),
        make_row(temperature=1.5, top_p=0.8, logprobs=wants[2]),
        make_row(temperature=0.0, logprobs=wants[3]),
        make_row(temperature=1.0, min_p=0.2, logprobs=wants[4]),
    ]
    out = sample(logits, rows)
    reference = logits.log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i, k in enumerate(wants):
        if k is None:  # computed only for the rows that ask
            assert out.logprobs[i] is None and out.top_logprobs[i] == []
            continue
        assert out.logprobs[i] == pytest.approx(float(reference[i, out.token_ids[i]]), abs=1e-6)
        top = out.top_logprobs[i]
        assert len(top) == (k or 0)
        if k:
            values, ids = reference[i].topk(k)
            assert [t for t, _ in top] == ids.tolist()
            torch.testing.assert_close(torch.tensor([v for _, v in top]), values)


def test_no_logprobs_when_no_row_asks() -> None:
    out = sample(torch.randn(3, VOCAB), [make_row(), make_row(temperature=0.0), make_row(top_k=3)])
    assert out.logprobs is None and out.top_logprobs is None
    assert len(out.token_ids) == 3 and all(0 <= t < VOCAB for t in out.token_ids)


def test_empty_batch_and_shape_mismatch() -> None:
    assert sample(torch.empty(0, VOCAB), []) == SamplerOutput([], None, None)
    with pytest.raises(ValueError, match="rows"):
        sample(torch.randn(2, VOCAB), [make_row()])


def test_persistent_state_matches_recounting_the_tokens_every_step() -> None:
    """The engine's state keeps penalty counts on the device, scattering each step's tokens; it must pick
    what recounting every prompt and output token each step picks, through batch changes and slot reuse."""
    torch.manual_seed(5)
    state = SamplingState(2, VOCAB)  # fewer slots than requests: it grows
    sampler = Sampler(state)
    kinds = [
        dict(temperature=0.0, repetition_penalty=1.4),
        dict(temperature=0.0, frequency_penalty=0.7, presence_penalty=0.3),
        dict(temperature=0.0),
        dict(temperature=0.0, repetition_penalty=0.8, frequency_penalty=-0.2),
    ]
    prompts = {name: [name * 3 % VOCAB, (name * 7 + 1) % VOCAB] for name in range(6)}
    outputs: dict[int, list[int]] = {name: [] for name in prompts}
    params = {name: SamplingParams(**kinds[name % len(kinds)]) for name in prompts}  # type: ignore[arg-type]
    batches = [[0, 1, 2], [0, 1, 2], [1, 2, 3, 4], [4, 3, 2, 1], [5, 4, 3], [5, 4, 3], [3, 5]]
    for step, batch in enumerate(batches):
        logits = torch.randn(len(batch), VOCAB) * 0.5
        logits[:, 1] += 3.0  # a favourite, so repeats happen and the penalties have work to do
        view = state.view(batch, lambda name: (params[name], None, prompts[name], outputs[name]))
        ours = sampler.sample(logits, state, view).token_ids
        rows = [SamplingRow(params[n], prompts[n], list(outputs[n]), None) for n in batch]
        assert ours == sample(logits, rows).token_ids, f"step {step}"
        for name, token in zip(batch, ours, strict=True):
            outputs[name].append(token)
        if step == 4:
            state.release(0)  # finished: its slot goes to whoever comes next
    assert all(len(set(o)) < len(o) for o in outputs.values() if len(o) > 2)  # repeats were penalized
