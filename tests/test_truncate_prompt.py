"""`truncate_prompt_tokens` (vLLM's extension): a prompt is served as its last k tokens (-1: as many as the
model length), in the Python API and on both endpoints; a k beyond the model length, 0 or below -1 is
refused by name. The field was ignored with a warning before, so a long prompt was refused as too long."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import plainhttp
import pytest
import torch
from server_util import InProcessServer, running_server

from ember_engine import LLM, SamplingParams

MODEL = "tiny"
GREEDY = dict(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompt(n: int) -> list[int]:
    return torch.randint(10, 4000, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def test_a_prompt_is_served_as_its_last_tokens(tiny_model: Path) -> None:
    llm = LLM(str(tiny_model), dtype="float32", max_model_len=64)
    long = _prompt(100)  # longer than the model
    (cut,) = llm.generate([long], SamplingParams(truncate_prompt_tokens=20, **GREEDY))  # type: ignore[arg-type]
    (tail,) = llm.generate([long[-20:]], SamplingParams(**GREEDY))  # type: ignore[arg-type]
    assert cut.error is None and cut.prompt_token_ids == long[-20:]
    assert cut.token_ids == tail.token_ids
    short = _prompt(8)  # already shorter: as it is
    (same,) = llm.generate([short], SamplingParams(truncate_prompt_tokens=20, **GREEDY))  # type: ignore[arg-type]
    assert same.prompt_token_ids == short
    # -1: the model length, which leaves no room to generate; more than the model length is refused
    (whole,) = llm.generate([long], SamplingParams(truncate_prompt_tokens=-1, **GREEDY))  # type: ignore[arg-type]
    assert whole.error == "prompt: 64 tokens leave no room to generate within max_model_len 64"
    (over,) = llm.generate([long], SamplingParams(truncate_prompt_tokens=65, **GREEDY))  # type: ignore[arg-type]
    assert over.error == "truncate_prompt_tokens: 65 exceeds max_model_len 64"


@pytest.mark.parametrize("value", [0, -2, 1.5, True, "3"])
def test_a_bad_value_is_refused_by_name(value: object) -> None:
    with pytest.raises(ValueError, match=r"^truncate_prompt_tokens: must be an integer >= 1, or -1"):
        SamplingParams(truncate_prompt_tokens=value)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", MODEL, "--max-model-len", "64") as s:
        yield s


def test_both_endpoints_serve_the_prompt_s_last_tokens(server: InProcessServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    long = _prompt(100)
    r = client.completions.create(
        model=MODEL, prompt=long, extra_body={"truncate_prompt_tokens": 10, "ignore_eos": True}, max_tokens=4
    )
    assert r.usage is not None and r.usage.prompt_tokens == 10
    plain = client.completions.create(model=MODEL, prompt=long[-10:], max_tokens=4, temperature=0.0)
    cut = client.completions.create(
        model=MODEL, prompt=long, max_tokens=4, temperature=0.0, extra_body={"truncate_prompt_tokens": 10}
    )
    assert cut.choices[0].text == plain.choices[0].text
    # echo gives the prompt as served
    echoed = client.completions.create(
        model=MODEL, prompt="one two three four five six seven", max_tokens=1, echo=True,
        extra_body={"truncate_prompt_tokens": 2},
    )  # fmt: skip
    tokenizer = server.state.engine.tokenizer
    kept = tokenizer.decode(tokenizer.encode("one two three four five six seven")[-2:])
    assert echoed.choices[0].text.startswith(kept) and not echoed.choices[0].text.startswith("one")
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": " ".join(["word"] * 200)}],  # longer than the model
        max_tokens=2,
        extra_body={"truncate_prompt_tokens": 16},
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 16


@pytest.mark.parametrize("value", [65, 0, -2, "3"])
def test_a_bad_value_is_a_400_naming_the_field(server: InProcessServer, value: object) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1, "truncate_prompt_tokens": value}
    r = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "truncate_prompt_tokens", error


def test_a_router_hashes_the_prompt_the_engine_serves(server: InProcessServer, tiny_model: Path) -> None:
    """The router routes by the prompt's block hashes and counts its tokens for routing rules: with
    `truncate_prompt_tokens` both are the last k tokens', the prompt the engine serves (they were the
    whole prompt's, whose blocks no engine holds)."""
    from ember_engine.core.kv_events import prefix_hashes
    from ember_engine.core.tokenizer import Tokenizer
    from ember_router.prompts import request_prompts

    tok = Tokenizer(str(tiny_model))
    long = _prompt(100)
    body = {"model": MODEL, "prompt": long, "max_tokens": 1, "truncate_prompt_tokens": 40}
    served = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=30).json()["usage"]
    routed = request_prompts(tok, body, False, 16)
    assert routed.first_tokens == served["prompt_tokens"] == 40
    assert routed.first_hashes == prefix_hashes(long[-40:], 16, None)
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": " ".join(["word"] * 200)}],
        "max_tokens": 1,
        "truncate_prompt_tokens": 16,
    }
    served = plainhttp.post(f"{server.url}/v1/chat/completions", json=chat, timeout=30).json()["usage"]
    assert request_prompts(tok, chat, True, 16).first_tokens == served["prompt_tokens"] == 16
