"""The persistent sampling state with the per-request inputs beside it: logit_bias held by the batch view
(fixed per request), and the per-step noise seeds of seeded rows."""

from __future__ import annotations

import torch

from ember_engine.sample.sampler import Sampler, SamplingRow, make_generator
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import SamplingState
from ember_engine.sample.seeds import position_seed

VOCAB = 64


def test_logit_bias_follows_each_request_through_batch_changes() -> None:
    """Each request's bias lands on its own row whatever its position in the batch and whichever slot it
    holds; the result is what the row-by-row sampler picks."""
    torch.manual_seed(0)
    state = SamplingState(2, VOCAB)  # grows
    sampler = Sampler(state)
    # Request n strongly prefers token 10 + n and bans token 1, the logits' favourite.
    params = {n: SamplingParams(temperature=0.0, logit_bias={10 + n: 30.0, 1: -100.0}) for n in range(5)}
    plain = SamplingParams(temperature=0.0)
    batches = [[0, 1, 2], [2, 0, 1], [1, 3], [9, 3, 4, 2], [4, 9, 0]]
    for step, batch in enumerate(batches):
        logits = torch.randn(len(batch), VOCAB)
        logits[:, 1] += 20.0
        view = state.view(batch, lambda n: (params.get(n, plain), None, (), ()))
        ours = sampler.sample(logits, state, view).token_ids
        expected = [1 if n == 9 else 10 + n for n in batch]
        assert ours == expected, f"step {step}"
        rows = [SamplingRow(params.get(n, plain), (), (), None) for n in batch]
        assert ours == Sampler()(logits, rows).token_ids, f"step {step}"
        if step == 2:
            state.release(1)  # its slot goes to request 4


def test_logit_bias_shifts_the_distribution_of_random_rows() -> None:
    logits = torch.zeros(400, VOCAB)
    rows = [SamplingRow(SamplingParams(temperature=1.0, logit_bias={7: 100.0}), (), (), None)] * 400
    assert set(Sampler()(logits, rows).token_ids) == {7}


def _seeded(seed: int, position: int, logits: torch.Tensor, neighbours: int, draws_before: int) -> int:
    """The token a seeded request draws at `position`, as row `neighbours` of a batch of random rows, from a
    generator that has already been used `draws_before` times."""
    state = SamplingState(neighbours + 1, VOCAB)
    generator = make_generator(seed)
    for _ in range(draws_before):
        torch.empty(VOCAB).exponential_(generator=generator)
    params = SamplingParams(temperature=1.0, seed=seed)
    keys = list(range(neighbours + 1))
    view = state.view(
        keys,
        lambda k: (
            (params, generator, (), ())
            if k == neighbours
            else (SamplingParams(temperature=1.0), None, (), ())
        ),
    )
    batch = torch.randn(neighbours + 1, VOCAB)
    batch[neighbours] = logits
    noise = {neighbours: position_seed(seed, position)}
    return Sampler(state).sample(batch, state, view, noise_seeds=noise).token_ids[neighbours]


def test_a_seeded_row_draws_its_positions_noise_whatever_came_before() -> None:
    """The token depends on the seed, the position and the logits only: not on the batch around it nor on
    how many draws its generator made before (a speculative step makes more)."""
    torch.manual_seed(3)
    logits = torch.randn(VOCAB)
    for position in range(6):
        alone = _seeded(11, position, logits, neighbours=0, draws_before=0)
        assert _seeded(11, position, logits, neighbours=3, draws_before=5) == alone
        assert _seeded(11, position, logits, neighbours=1, draws_before=2) == alone
    tokens = [_seeded(11, p, logits, 0, 0) for p in range(12)]
    assert len(set(tokens)) > 1  # the positions' noises differ
