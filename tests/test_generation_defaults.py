"""The model's generation_config.json as the server's sampling defaults (vLLM's `--generation-config auto`):
fields a request leaves out take the file's values, fields it gives are its own; `none` keeps the API's
defaults; `--override-generation-config` sets some; values a request could not hold are refused at load."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import plainhttp
import pytest
from server_util import running_server

from ember_engine.server import generation_defaults
from ember_engine.server.protocol import ChatCompletionRequest, CompletionRequest

PROMPT = "the quick brown fox"


def _with_generation(tiny_model: Path, tmp_path: Path, **fields: object) -> Path:
    """A copy of the tiny model whose generation_config.json has `fields` besides its own."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    path = model / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return model


def test_the_file_fields_are_read_and_checked(tiny_model: Path, tmp_path: Path) -> None:
    model = _with_generation(
        tiny_model, tmp_path, temperature=0.6, top_p=0.9, max_new_tokens=7, do_sample=True, top_k=None
    )
    assert generation_defaults.read("auto", model, None) == {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_tokens": 7,
    }
    assert (
        generation_defaults.read("none", model, None) == generation_defaults.read("vllm", model, None) == {}
    )
    assert generation_defaults.read("auto", model, {"top_p": 0.5, "min_p": 0.1}) == {
        "temperature": 0.6,
        "top_p": 0.5,
        "min_p": 0.1,
        "max_tokens": 7,
    }
    assert generation_defaults.read("none", model, {"top_k": 3}) == {"top_k": 3}
    assert generation_defaults.read(str(model), tiny_model, None)["temperature"] == 0.6  # another directory's
    assert generation_defaults.read("auto", tiny_model, None) == {}  # the test model recommends nothing
    with pytest.raises(
        ValueError, match=r"^--generation-config: .*/nowhere/generation_config.json not found$"
    ):
        generation_defaults.read(str(tmp_path / "nowhere"), model, None)
    bad = _with_generation(tiny_model, tmp_path / "bad", temperature=5.0)
    with pytest.raises(
        ValueError, match=r"generation_config.json: temperature: Input should be less than or equal to 2"
    ):
        generation_defaults.read("auto", bad, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "must be a JSON object"),
        ('{"temperature": 0.5, "seed": 3}', "seed: not a sampling default"),
    ],
)
def test_overrides_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        generation_defaults.overrides(text)


def test_only_the_fields_a_request_leaves_out_take_the_defaults() -> None:
    defaults = {"temperature": 0.6, "top_k": 5, "max_tokens": 7}
    left_out = generation_defaults.apply(CompletionRequest(model="m", prompt="x"), defaults)
    assert (left_out.temperature, left_out.top_k, left_out.max_tokens) == (0.6, 5, 7)
    given = generation_defaults.apply(
        CompletionRequest(model="m", prompt="x", temperature=1.0, max_tokens=3), defaults
    )
    assert (given.temperature, given.top_k, given.max_tokens) == (1.0, 5, 3)
    # A chat request's max_completion_tokens counts as its max_tokens.
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}
    assert generation_defaults.apply(ChatCompletionRequest.model_validate(chat), defaults).max_tokens is None
    # null is "not given", as OpenAI reads it
    nulled = CompletionRequest.model_validate({"model": "m", "prompt": "x", "temperature": None})
    assert generation_defaults.apply(nulled, defaults).temperature == 0.6


def _complete(url: str, **fields: object) -> dict:  # type: ignore[type-arg]
    body = {"model": "tiny", "prompt": PROMPT, "ignore_eos": True, **fields}
    answer = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


def test_a_served_model_samples_as_its_generation_config_recommends(tiny_model: Path, tmp_path: Path) -> None:
    # top_k 1 makes sampling at any temperature greedy: the defaults are seen in the tokens themselves.
    model = _with_generation(tiny_model, tmp_path, top_k=1, max_new_tokens=5)
    with running_server(model, "--served-model-name", "tiny") as s:
        greedy = _complete(s.url, temperature=0, max_tokens=5)["choices"][0]["text"]
        for seed in range(3):  # left out: top_k 1 and 5 tokens
            answer = _complete(s.url, seed=seed)
            assert answer["choices"][0]["text"] == greedy and answer["usage"]["completion_tokens"] == 5
        given = [_complete(s.url, seed=seed, top_k=-1, max_tokens=12) for seed in range(4)]
        assert all(a["usage"]["completion_tokens"] == 12 for a in given)
        assert len({a["choices"][0]["text"] for a in given}) > 1  # the request's own top_k: sampled
    with running_server(model, "--served-model-name", "tiny", "--generation-config", "none") as s:
        assert _complete(s.url, seed=0)["usage"]["completion_tokens"] == 16  # the API's default
    with running_server(
        model, "--served-model-name", "tiny", "--override-generation-config", '{"max_new_tokens": 3}'
    ) as s:
        assert _complete(s.url, seed=0)["usage"]["completion_tokens"] == 3
