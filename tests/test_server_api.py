"""OpenAI fidelity, through the official `openai` client (sync and async, streaming and not) and raw HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import plainhttp
import pytest
from openai.types import Completion
from server_util import InProcessServer, running_server

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", MODEL) as s:
        yield s


@pytest.fixture
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_health_ready(server: InProcessServer, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert plainhttp.get(f"{server.url}/health").json() == {"status": "ok"}
    assert plainhttp.get(f"{server.url}/ready").status_code == 200


def test_completion_non_streaming(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=7, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 7 and r.usage.prompt_tokens > 0
    again = client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=7, temperature=0)
    assert again.choices[0].text == r.choices[0].text  # greedy is deterministic


def test_chat_streaming_with_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_completion_tokens=9,  # type: ignore[arg-type]
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)  # type: ignore[arg-type]
    assert full.choices[0].message.content == text and full.object == "chat.completion"


def test_raw_sse_ends_with_done(server: InProcessServer) -> None:
    body = {"model": MODEL, "prompt": "import", "max_tokens": 5, "stream": True}
    with plainhttp.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        json.loads(line[len("data: ") :])


def test_n_stop_seed_and_extensions(client: openai.OpenAI) -> None:
    extensions = {"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1, "ignore_eos": True, "min_tokens": 12}

    def sample(**extra: object) -> Completion:
        return client.completions.create(
            model=MODEL,
            prompt="x = ",
            max_tokens=12,
            n=3,
            temperature=1.0,
            seed=5,
            extra_body={**extensions, **extra},
        )

    r = sample(priority="standard")
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 3
    assert r.usage is not None and r.usage.completion_tokens == 36
    again = sample()
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == [
        c.text for c in sorted(r.choices, key=lambda c: c.index)
    ]
    base = client.completions.create(
        model=MODEL, prompt="def f():", max_tokens=16, temperature=0, extra_body={"ignore_eos": True}
    )
    stop = base.choices[0].text[4:7]
    stopped = client.completions.create(
        model=MODEL,
        prompt="def f():",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == base.choices[0].text[: base.choices[0].text.find(stop)]


def test_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="for i in", max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens or []) == 4 and len(lp.top_logprobs or []) == 4
    assert all(len(t) <= 3 for t in lp.top_logprobs or [])
    assert "".join(lp.tokens or []) == r.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)  # greedy picks the top one


def test_async_client_concurrent_streams(server: InProcessServer) -> None:
    async def main() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        async def one(i: int) -> str:
            stream = await client.completions.create(
                model=MODEL, prompt=f"item_{i} = ", max_tokens=8, temperature=0, stream=True
            )
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await client.close()

    texts = asyncio.run(main())
    sync = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    alone = [
        sync.completions.create(model=MODEL, prompt=f"item_{i} = ", max_tokens=8, temperature=0)
        .choices[0]
        .text
        for i in range(6)
    ]
    assert texts == alone


def test_batch_prompts(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["a = 1", "b = 2"], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    first = client.completions.create(model=MODEL, prompt="b = 2", max_tokens=3, temperature=0)
    assert {c.index: c.text for c in r.choices}[2] == first.choices[0].text


BAD = [
    ("{not json", "body"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"model": "", "prompt": "x"}, "model"),  # (a model not served here is a 404: test_api_fields.py)
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": []}, "prompt"),
    ({"model": MODEL, "prompt": "x " * 3000, "max_tokens": 4}, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 2048}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "n": 1000}, "n"),
    ({"model": MODEL, "prompt": "x", "temperature": -0.5}, "temperature"),
    ({"model": MODEL, "prompt": "x", "stop": 5}, "stop"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop"),
    ({"model": MODEL, "prompt": "x", "priority": "vip"}, "priority"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL}, "prompt"),
]


@pytest.mark.parametrize(("body", "field"), BAD, ids=[f for _, f in BAD])
def test_bad_input_is_a_400_naming_the_field(server: InProcessServer, body: object, field: str) -> None:
    content = body if isinstance(body, str) else json.dumps(body)
    r = plainhttp.post(
        f"{server.url}/v1/completions", content=content, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field) or error.get("param") == field, error


def test_bad_chat_input(server: InProcessServer) -> None:
    r = plainhttp.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = plainhttp.post(
        f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "wizard"}]}
    )
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
