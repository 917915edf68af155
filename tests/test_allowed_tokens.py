"""`allowed_token_ids` (vLLM's extension): every token sampled is one of them, greedy picks the likeliest
of them (transformers' logits restricted to the set), seeded and random sampling, n > 1, a batch mixing
rows with and without the field, and speculative decoding (such a request is sampled plainly); refused by
name when empty, negative or outside the vocabulary. The field was ignored with a warning before."""

from __future__ import annotations

from pathlib import Path

import openai
import plainhttp
import pytest
import torch
from server_util import running_server
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams

ALLOWED = [11, 42, 77, 300, 1234]
PROMPTS = [
    torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 23, 60)
]


def _restricted_greedy(tiny_model: Path, prompt: list[int], steps: int) -> list[int]:
    """transformers' greedy tokens with every token outside ALLOWED ruled out."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1]
            token = ALLOWED[int(logits[ALLOWED].argmax())]
            ids.append(token)
            out.append(token)
    return out


def test_greedy_picks_the_likeliest_allowed_token(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=ALLOWED)
    plain = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # beside requests without the field, in one batch
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [params, plain, params])  # type: ignore[arg-type]
    assert outs[0].token_ids == _restricted_greedy(tiny_model, PROMPTS[0], 8)
    assert outs[2].token_ids == _restricted_greedy(tiny_model, PROMPTS[2], 8)
    assert not set(outs[1].token_ids) <= set(ALLOWED)  # the row without it is not restricted


def test_random_seeded_and_n_samples_stay_within_the_set(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32")
    for params in (
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, allowed_token_ids=ALLOWED, n=3),
        SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=20, allowed_token_ids=ALLOWED[:2]),
        SamplingParams(temperature=1.0, top_k=2, max_tokens=20, ignore_eos=True, allowed_token_ids=[9]),
    ):
        for out in llm.generate(PROMPTS, params):
            for sample in out.outputs:
                assert sample.token_ids and set(sample.token_ids) <= set(params.allowed_token_ids or ())
    (lp,) = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, allowed_token_ids=ALLOWED[:2], logprobs=3))
    for entry in lp.logprobs or []:  # logprobs after the restriction, as after logit_bias: two are left
        assert entry.token_id in ALLOWED[:2]
        assert sum(1 for _, v in entry.top if v > float("-inf")) == 2


def test_a_set_of_ids_min_tokens_holds_back_wins_over_min_tokens(tiny_model: Path) -> None:
    """Allowed only the end-of-sequence id, below min_tokens (which rules it out): the set wins, as a
    grammar does, and the request ends at min_tokens. Every token was ruled out, and token 0 came out."""
    llm = LLM(str(tiny_model), dtype="float32")
    eos = llm.engine.model_config.eos_token_ids[0]
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, max_tokens=6, min_tokens=2, allowed_token_ids=[eos])
        (out,) = llm.generate(PROMPTS[:1], params)
        assert out.token_ids == [eos, eos] and out.finish_reason == "stop", out.token_ids


def test_a_speculating_engine_samples_such_a_request_plainly(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", draft_model=str(tiny_model), speculative_adaptive=False)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, allowed_token_ids=ALLOWED)
    (out,) = llm.generate(PROMPTS[:1], params)
    assert out.token_ids == _restricted_greedy(tiny_model, PROMPTS[0], 8)


@pytest.mark.parametrize("value", [[], [3, -1], [True], (1, 2), [1.0]])
def test_a_bad_set_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"^allowed_token_ids: must be a non-empty list of token ids >= 0"):
        SamplingParams(max_tokens=2, allowed_token_ids=value)  # type: ignore[arg-type]


def test_an_id_outside_the_vocabulary_is_refused_by_name(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32")
    params = SamplingParams(max_tokens=2, allowed_token_ids=[5, 10**7])
    (out,) = llm.generate(["hello"], params)
    assert out.error is not None
    assert out.error.startswith("allowed_token_ids: token id 10000000 is outside the vocabulary (size ")


def test_the_field_over_the_api(tiny_model: Path) -> None:
    with running_server(tiny_model, "--served-model-name", "tiny") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        extra = {"allowed_token_ids": ALLOWED[:3], "return_tokens_as_token_ids": True, "ignore_eos": True}
        r = client.completions.create(
            model="tiny", prompt="hello", max_tokens=10, logprobs=0, extra_body=extra
        )
        tokens = (r.choices[0].logprobs.tokens or []) if r.choices[0].logprobs else []
        assert len(tokens) == 10 and {int(t.split(":")[1]) for t in tokens} <= set(ALLOWED[:3]), tokens
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=6,
            logprobs=True,
            extra_body=extra,
        )
        content = chat.choices[0].logprobs.content if chat.choices[0].logprobs else None
        assert content and {int(c.token.split(":")[1]) for c in content} <= set(ALLOWED[:3])


def test_with_a_structured_output_constraint_it_is_refused_by_name(tiny_model: Path) -> None:
    """The set and a grammar may leave no token at all: `allowed_token_ids: [0]` with `guided_regex: "0"`
    was the server's 500 (`grammar_failed`: the grammar refused the only token left); the pair is refused."""
    from ember_engine.sample.constraint import Constraint

    with pytest.raises(ValueError, match=r"^allowed_token_ids: not with a structured-output constraint"):
        SamplingParams(max_tokens=2, allowed_token_ids=[0], constraint=Constraint("regex", "0"))
    with running_server(tiny_model, "--served-model-name", "tiny") as server:
        for path, body in (
            ("/v1/completions", {"prompt": "0", "guided_regex": "0"}),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "0"}], "guided_choice": ["a"]},
            ),
            ("/v1/completions", {"prompt": "0", "response_format": {"type": "json_object"}, "stream": True}),
        ):
            body = {**body, "model": "tiny", "max_tokens": 2, "allowed_token_ids": [0]}
            r = plainhttp.post(f"{server.url}{path}", json=body, timeout=30)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "allowed_token_ids" and "not with " in error["message"], error
