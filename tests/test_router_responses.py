"""The Responses API (`/v1/responses`) through `ember router` in front of two real engines that keep
responses (`--responses-store`): routed by the prefix of the chat prompt it runs as, whole and streamed,
and a stored response continued, read and deleted on the engine that has it, also by a router that did
not relay it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import openai
import plainhttp
import pytest
from server_util import InProcessServer, running_server
from test_router import running_router
from waiting import wait_for

from ember_engine.core.kv_events import prefix_hashes
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.chat_prompt import chat_prompt_ids
from ember_engine.server.protocol import ChatCompletionRequest
from ember_router.proxy import ROUTE_REASON, ROUTED_TO

MODEL = "tiny"


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[InProcessServer]]:
    args = ("--served-model-name", MODEL, "--block-size", "16", "--responses-store", "16")
    with ExitStack() as stack:
        yield [stack.enter_context(running_server(tiny_model, *args)) for _ in range(2)]


def test_a_response_goes_where_its_prompt_is_cached_whole_or_streamed(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    tok = Tokenizer(str(tiny_model))
    instructions = " ".join(f"rule{i}" for i in range(120))  # several full blocks
    with running_router(tiny_model, [e.url for e in engines]) as (url, router):
        # Warm engine 1 directly: only its own events can tell the router.
        warm = {"model": MODEL, "instructions": instructions, "input": "first", "max_output_tokens": 1}
        assert plainhttp.post(f"{engines[1].url}/v1/responses", json=warm, timeout=60).status_code == 200
        chat = ChatCompletionRequest.model_validate(
            {
                "model": MODEL,
                "messages": [{"role": "system", "content": instructions}, {"role": "user", "content": "x"}],
            }
        )
        hashes = prefix_hashes(chat_prompt_ids(tok, chat, None), 16)
        wait_for(
            lambda: router.pool.index.matched_blocks(engines[1].url, hashes) >= 4,
            what="engine 1's events announcing the instructions' blocks",
        )
        for question in ("second", "third"):
            body = {**warm, "input": question, "max_output_tokens": 3}
            r = plainhttp.post(f"{url}/v1/responses", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["object"] == "response"
            assert r.headers[ROUTED_TO] == engines[1].url and r.headers[ROUTE_REASON] == "prefix"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        whole = client.responses.create(model=MODEL, input="Stream?", temperature=0, max_output_tokens=6)
        with client.responses.stream(
            model=MODEL, input="Stream?", temperature=0, max_output_tokens=6
        ) as stream:
            events = list(stream)
        assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
        assert events[-1].response.output_text == whole.output_text  # type: ignore[union-attr]


def test_a_stored_response_is_continued_read_and_deleted_where_it_is_kept(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    with running_router(tiny_model, [e.url for e in engines]) as (url, _router):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        first = client.responses.with_raw_response.create(model=MODEL, input="Hello.", max_output_tokens=4)
        home, response = first.headers[ROUTED_TO], first.parse()
        for turn in range(3):  # whichever engine the load would choose, the stored one answers
            raw = client.responses.with_raw_response.create(
                model=MODEL, input=f"turn {turn}", previous_response_id=response.id, max_output_tokens=4
            )
            assert raw.headers[ROUTED_TO] == home and raw.headers[ROUTE_REASON] == "stored"
            assert raw.parse().previous_response_id == response.id
        with client.responses.stream(
            model=MODEL, input="streamed", previous_response_id=response.id, max_output_tokens=4
        ) as stream:
            assert list(stream)[-1].type == "response.incomplete"
        assert client.responses.retrieve(response.id).output_text == response.output_text
    # A router that did not relay it (restarted, or another replica) finds it on the engines.
    with running_router(tiny_model, [e.url for e in engines]) as (url, router):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert router.homes.get(response.id) is None
        got = client.responses.with_raw_response.retrieve(response.id)
        assert got.headers[ROUTED_TO] == home and got.parse().id == response.id
        items = client.responses.input_items.list(response.id)
        assert [i.content[0].text for i in items.data] == ["Hello."]  # type: ignore[union-attr]
        client.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(response.id)
        assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):  # routed by load: the engine has no such response
            client.responses.create(model=MODEL, input="x", previous_response_id=response.id)
        # An id is any string: asked of the engines as one path segment (a `..` reached their /metrics,
        # which answered 200, and the router took that engine for its home).
        with pytest.raises(openai.NotFoundError):
            client.responses.create(model=MODEL, input="x", previous_response_id="../../../metrics")
        assert router.homes.get("../../../metrics") is None
