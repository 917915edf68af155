"""The engine's persistent penalty state against penalties worked out by hand from the token lists, step by
step: lists that outgrow their first width, rows with and without each penalty in one batch, slots freed
and taken again by requests with other penalties, and masked (-inf) logits."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from ember_engine.sample import penalty_state
from ember_engine.sample.sampler import Sampler
from ember_engine.sample.sampling_params import SamplingParams
from ember_engine.sample.sampling_state import SamplingState

VOCAB = 48


def _by_hand(base: list[float], params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    counts = Counter(output)
    rep = params.repetition_penalty
    listed = set(output) | (set(prompt) if rep != 1.0 else set())
    values = []
    for token, value in enumerate(base):
        if token in listed:
            value = value / rep if value > 0 else value * rep
        value -= params.frequency_penalty * counts[token] + params.presence_penalty * (counts[token] > 0)
        values.append(value)
    return torch.tensor(values).log_softmax(-1)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "torch"])
def test_penalized_logits_follow_the_token_lists_through_many_steps(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU the state's steps are compiled loops; the torch operations a GPU runs are checked too."""
    monkeypatch.setattr(penalty_state, "COMPILED", compiled)
    rng = random.Random(3)
    torch.manual_seed(3)
    kinds = [
        dict(repetition_penalty=1.5),
        dict(frequency_penalty=0.3, presence_penalty=0.7),
        dict(repetition_penalty=0.7, frequency_penalty=-0.2, presence_penalty=0.1),
        dict(),  # no penalty: its row is left alone
        dict(presence_penalty=-0.4),
    ]
    state = SamplingState(2, VOCAB)  # fewer slots than requests: it grows
    sampler = Sampler(state)
    params: dict[int, SamplingParams] = {}
    prompts: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    running: list[int] = []
    next_name = 0
    for step in range(90):
        while len(running) < 4:
            name, next_name = next_name, next_name + 1
            fields = kinds[name % len(kinds)]
            params[name] = SamplingParams(temperature=1.0, logprobs=20, **fields)  # type: ignore[arg-type]
            params[name].logprobs = VOCAB  # past the API's limit (checked there): the whole penalized row
            prompts[name] = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20))]
            outputs[name] = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 3))]
            running.append(name)
        rng.shuffle(running)
        logits = torch.randn(len(running), VOCAB) * 2
        logits[0, rng.randrange(VOCAB)] = float("-inf")
        view = state.view(running, lambda n: (params[n], None, prompts[n], outputs[n]))
        out = sampler.sample(logits, state, view)
        assert out.top_logprobs is not None
        for row, name in enumerate(running):
            table = dict(out.top_logprobs[row])
            got = torch.tensor([table[t] for t in range(VOCAB)])
            want = _by_hand(logits[row].tolist(), params[name], prompts[name], outputs[name])
            torch.testing.assert_close(got, want, msg=f"step {step}, request {name}")
            outputs[name].append(out.token_ids[row])
        if step % 11 == 10:
            done = running.pop(rng.randrange(len(running)))
            state.release(done)
    assert max(len(set(o)) for o in outputs.values()) > 32  # lists outgrew two widths


def test_the_compiled_loops_give_torch_s_logits_to_the_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's compiled rewrite against the torch operations, bit for bit, with masked logits and a
    repetition penalty so small that float32 holds it as 0 (a division by zero is an infinity in both)."""
    torch.manual_seed(4)
    logits = torch.randn(3, VOCAB) * 3
    logits[1, :5] = float("-inf")
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1e-46),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, presence_penalty=-0.6),
    ]
    prompts = [[1, 2, 3, 3], [4, 9, 2], [7]]
    outputs = [[5, 5, 6], [0, 1, 2, 2], [7, 8]]
    got = []
    for compiled in (True, False):
        monkeypatch.setattr(penalty_state, "COMPILED", compiled)
        state = SamplingState(3, VOCAB)
        view = state.view([0, 1, 2], lambda n: (params[n], None, prompts[n], outputs[n]))
        assert state.penalties is not None and view.penalized_slots is not None
        rep = state.params.index_select(0, view.penalized_slots)[:, 4:5]
        got.append(state.penalties.apply(logits, view.penalized_slot_list, view.penalized_slots, rep).clone())
    assert torch.isinf(got[0][0]).any()
    assert torch.equal(got[0].nan_to_num(), got[1].nan_to_num())
