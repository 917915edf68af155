"""`--served-model-name NAME ALIAS...` (vLLM's form): a request may name the model by any of them, and the
answer carries the name it gave; `/v1/models` lists each; metrics keep the first; an adapter may take none
of them; the router keys and lists them as the engines do."""

from __future__ import annotations

import argparse
from pathlib import Path

import openai
import plainhttp
import pytest
from server_util import running_server

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server import serve
from ember_router import main as router_main
from ember_router.embedded import serving
from ember_router.prompts import request_prompts


def test_every_name_is_served_and_echoed(tiny_model: Path) -> None:
    with running_server(tiny_model, "--served-model-name", "tiny", "tiny-latest", "org/tiny") as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny", "tiny-latest", "org/tiny"]
        assert client.models.retrieve("org/tiny").id == "org/tiny"
        for name in ("tiny", "tiny-latest", "org/tiny"):
            answer = client.completions.create(model=name, prompt="hello", max_tokens=2)
            assert answer.model == name
            chat = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
            assert chat.model == name
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="other", prompt="hello", max_tokens=2)
        assert "this server serves 'tiny' or 'tiny-latest' or 'org/tiny'" in str(missing.value)
        page = plainhttp.get(f"{s.url}/metrics").text
        assert 'model_name="tiny"' in page and 'model_name="tiny-latest"' not in page


def test_an_adapter_may_take_no_name_of_the_model(tiny_model: Path) -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_model), "--served-model-name", "a", "b", "--lora-modules", "b=/x"]
    )
    assert serve.main(args) == 2


def test_the_router_keys_and_lists_every_name(tiny_model: Path) -> None:
    tok = Tokenizer(tiny_model)
    body = {"model": "alias", "prompt": "x " * 40}
    plain = request_prompts(tok, {**body, "model": "tiny"}, False, 16).first_hashes
    assert request_prompts(tok, body, False, 16, ("tiny", "alias")).first_hashes == plain  # the model itself
    assert request_prompts(tok, body, False, 16, "tiny").first_hashes != plain  # an adapter named "alias"
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    router = router_main.build(
        parser.parse_args(
            [
                "--model",
                str(tiny_model),
                "--endpoint",
                "http://127.0.0.1:1",
                "--served-model-name",
                "tiny",
                "alias",
            ]
        )
    )
    assert (router.settings.served_model_name, router.settings.served_aliases) == ("tiny", ("alias",))
    with serving(router) as url:  # no engine Ready: the names it was told
        assert [m["id"] for m in plainhttp.get(f"{url}/v1/models").json()["data"]] == ["tiny", "alias"]
