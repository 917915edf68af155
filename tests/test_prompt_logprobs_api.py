"""Prompt logprobs over the API, through the `openai` client: completions' `echo` with `logprobs` (what
lm-evaluation-harness's loglikelihood requests send: the prompt's tokens' logprobs, the first null) and
vLLM's `prompt_logprobs` field on both endpoints, streamed too; each value is transformers' on the same
checkpoint. Both were refused with a 400 before."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import plainhttp
import pytest
import torch
from server_util import InProcessServer, running_server
from transformers import AutoModelForCausalLM

MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog, and then it runs far away"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf(tiny_model: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)


def _reference(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' log-probabilities of each token after the first, given those before it."""
    with torch.inference_mode():
        logprobs = hf(torch.tensor([ids])).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def _ids(server: InProcessServer, text: str) -> list[int]:
    return list(server.state.engine.tokenizer.encode(text))


def test_echo_with_logprobs_gives_the_prompt_s_logprobs_as_loglikelihood_requests_read_them(
    server: InProcessServer, client: openai.OpenAI, hf: Any
) -> None:
    ids = _ids(server, PROMPT)
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1, temperature=0.0
    )
    choice = r.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(ids) + 1  # the prompt's, then the one generated
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    theirs = _reference(hf, ids)
    ours = torch.tensor(lp.token_logprobs[1 : len(ids)])
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    # Each token's top logprobs hold the best token and the token itself (greedy checks read them).
    for token, top, value in zip(lp.tokens[1:], lp.top_logprobs[1:], lp.token_logprobs[1:], strict=True):
        assert top is not None and token in top and top[token] == value
        assert 1 <= len(top) <= 2 and max(top.values()) >= value
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert r.usage is not None and r.usage.prompt_tokens == len(ids)


def test_prompt_logprobs_field_of_completions_and_chat(
    server: InProcessServer, client: openai.OpenAI, hf: Any
) -> None:
    ids = _ids(server, PROMPT)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 3})
    entries = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    theirs = _reference(hf, ids)
    for i, entry in enumerate(entries[1:]):
        own = entry[str(ids[i + 1])]
        assert abs(own["logprob"] - theirs[i].item()) <= 1e-4
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        # the top 3 by rank, and the token itself where it is not among them
        assert {e["rank"] for e in entry.values()} == {1, 2, 3, own["rank"]}
        assert len(entry) == 3 + (own["rank"] > 3)
    assert r.choices[0].logprobs is None  # the generated tokens' were not asked for
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    body = chat.model_dump()
    assert body["usage"]["prompt_tokens"] == len(body["prompt_logprobs"])
    assert body["prompt_logprobs"][0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in body["prompt_logprobs"][1:])


def test_a_stream_sends_the_prompt_s_logprobs_first(server: InProcessServer, client: openai.OpenAI) -> None:
    fields = dict(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=5, temperature=0.0)
    whole = client.completions.create(**fields).choices[0].logprobs  # type: ignore[call-overload]
    tokens, values = [], []
    first = None
    for chunk in client.completions.create(stream=True, **fields):  # type: ignore[call-overload]
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                first = first or choice.logprobs
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
    assert first is not None and first.token_logprobs[0] is None
    assert len(first.tokens) >= len(_ids(server, PROMPT))  # the first chunk holds the whole prompt
    assert whole is not None and tokens == whole.tokens and values == whole.token_logprobs


def test_a_cached_prompt_is_computed_again_for_its_prompt_logprobs(server: InProcessServer) -> None:
    """A cached block holds no logits: a request asking for prompt logprobs reads none, and gets every
    token's; the next request without them reads the cache again."""
    prompt = PROMPT * 4  # several full blocks
    url = f"{server.url}/v1/completions"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    plainhttp.post(url, json=body, timeout=60).raise_for_status()
    r = plainhttp.post(url, json={**body, "prompt_logprobs": 0}, timeout=60).json()
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert len(r["choices"][0]["prompt_logprobs"]) == r["usage"]["prompt_tokens"]
    again = plainhttp.post(url, json=body, timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("value", [21, -1, "2", 1.5, True])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_logprobs_out_of_range_or_of_another_type_is_refused_by_name(
    server: InProcessServer, path: str, value: Any
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 1}
    base.update({"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]})
    r = plainhttp.post(
        f"{server.url}{path}",
        content=json.dumps({**base, "prompt_logprobs": value}),
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt_logprobs" or error["message"].startswith("prompt_logprobs"), error
