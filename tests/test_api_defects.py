"""The HTTP API's answers to hostile or odd input, its body limit, its event loop under a huge prompt, its
timing metrics, and streaming with several choices."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import plainhttp
import pytest
from server_util import InProcessServer, running_server
from waiting import wait_for

MODEL = "tiny"
LIMIT = 4 << 20  # the body limit this module's server runs with


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--max-request-body-bytes", str(LIMIT)
    ) as s:
        yield s


def _post_raw(url: str, path: str, content: bytes, **headers: str) -> httpx.Response:
    return plainhttp.post(
        f"{url}{path}", content=content, headers={"content-type": "application/json", **headers}, timeout=60
    )


def _assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text[:300]
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", '{"model": "tiny", "prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/completions", '{"model": "tiny", "prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
        ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "x\\ud83d"}]}'),
        ("/v1/completions", '{"model": "tiny", "prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}'),
    ],
)
def test_lone_surrogate_is_a_400(server: InProcessServer, path: str, raw: str) -> None:
    error = _assert_openai_error(_post_raw(server.url, path, raw.encode()), 400)
    assert "surrogate" in error["message"]


@pytest.mark.parametrize(
    "content",
    [
        b'{"model": "tiny", "prompt": "\xff\xfe"}',  # not UTF-8
        b"[" * 100_000 + b"]" * 100_000,  # nested deeper than any parser's recursion
        b'{"model": "tiny", "prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_001,
        b'{"model": "tiny", "prompt": "x"',  # truncated
    ],
)
def test_unparseable_bodies_answer_in_openai_shape(server: InProcessServer, content: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        _assert_openai_error(_post_raw(server.url, path, content), 400)


def test_body_over_the_limit_is_a_413_before_it_is_read(server: InProcessServer) -> None:
    big = json.dumps({"model": MODEL, "prompt": "x" * (LIMIT + 10)}).encode()
    error = _assert_openai_error(_post_raw(server.url, "/v1/completions", big), 413)
    assert "max-request-body-bytes" in error["message"]
    # Declared too large: answered at once, without waiting for a body that never comes.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {100 * LIMIT}\r\n\r\n".encode()
        )
        head = sock.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413"), head[:200]

    # Chunked (no length given): cut off once the limit is passed.
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(LIMIT // 65536 + 2):
            yield b"y" * 65536
        yield b'"}'

    r = plainhttp.post(f"{server.url}/v1/completions", content=chunks(), timeout=60)
    _assert_openai_error(r, 413)


@pytest.mark.parametrize(
    ("path", "field"), [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")]
)
def test_health_answers_while_a_huge_prompt_is_tokenized(
    server: InProcessServer, path: str, field: str
) -> None:
    """Tokenization and templating run off the event loop: /health answers while they are under way."""
    tok = server.state.engine.tokenizer
    real_encode = tok.encode
    started, answered = threading.Event(), threading.Event()
    events: list[str] = []

    def encode(*args: object, **kwargs: object) -> list[int]:
        started.set()
        # Hold tokenizing until /health has answered: it can only if the event loop is free meanwhile
        # (on the loop itself, this gives up after a while and /health answers last).
        answered.wait(15)
        ids = real_encode(*args, **kwargs)
        events.append("tokenized")
        return ids

    text = "lorem ipsum dolor sit amet " * ((LIMIT - 4096) // 27)
    payload = {"prompt": text} if field == "prompt" else {"messages": [{"role": "user", "content": text}]}
    body = json.dumps({"model": MODEL, "max_tokens": 1, **payload}).encode()
    tok.encode = encode
    try:
        big = threading.Thread(
            target=lambda: events.append(f"big {_post_raw(server.url, path, body).status_code}")
        )
        big.start()
        assert started.wait(60)
        assert plainhttp.get(f"{server.url}/health", timeout=60).status_code == 200
        events.append("health")
        answered.set()
        big.join(60)
    finally:
        tok.encode = real_encode
    # The prompt is far longer than the model's context: a 400, but only after tokenizing it.
    assert events == ["health", "tokenized", "big 400"], events


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "infinity", "-1", "0", "1e999"])
def test_timeout_header_must_be_a_finite_positive_number(server: InProcessServer, value: str) -> None:
    r = plainhttp.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers={"x-ember-timeout": value},
        timeout=30,
    )
    error = _assert_openai_error(r, 400)
    assert error["param"] == "x-ember-timeout"


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_seed_outside_64_bits_is_a_400(server: InProcessServer, seed: int) -> None:
    for path, extra in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = plainhttp.post(
            f"{server.url}{path}", json={"model": MODEL, "seed": seed, "max_tokens": 2, **extra}
        )
        assert _assert_openai_error(r, 400)["param"] == "seed"


def test_seed_edges_of_64_bits_are_served(server: InProcessServer) -> None:
    outs = {}
    for seed in (0, 2**63, 2**64 - 1, -(2**63)):
        r = plainhttp.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "hi", "seed": seed, "max_tokens": 8, "ignore_eos": True},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        outs[seed] = r.json()["choices"][0]["text"]
    # Seeds are not folded onto one another modulo 2**63.
    assert outs[0] != outs[2**63], outs


def test_completions_default_to_16_tokens(server: InProcessServer) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    r = client.completions.create(model=MODEL, prompt="count:", extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 16
    assert r.choices[0].finish_reason == "length"


def _finish_chunks(lines: list[str]) -> Counter[int]:
    finishes: Counter[int] = Counter()
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            if choice["finish_reason"] is not None:
                finishes[choice["index"]] += 1
    return finishes


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_streamed_choice_finishes_exactly_once(server: InProcessServer, path: str) -> None:
    n = 4
    # Sampled text with many stop ids: the choices end at different steps.
    body = {
        "model": MODEL,
        "n": n,
        "stream": True,
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 7,
        "stop_token_ids": list(range(20, 200)),
    }
    body |= (
        {"prompt": "once upon"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "hi"}]}
    )
    with plainhttp.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    finishes = _finish_chunks(lines)
    assert finishes == Counter(range(n)), finishes
    assert lines[-1] == "data: [DONE]"
    # The case that matters: some choice ended while others went on (else there is nothing to repeat).
    counts = [sum(1 for line in lines if f'"index":{i},' in line) for i in range(n)]
    assert len(set(counts)) > 1, counts


def _histogram_sum(metrics: str, name: str) -> float:
    match = re.search(rf"^{name}_sum\{{[^}}]*\}} (\S+)$", metrics, re.M)
    assert match, name
    return float(match.group(1))


def test_server_ttft_and_queue_time_count_from_arrival(server: InProcessServer) -> None:
    """Arrival is when the server receives a request (vLLM's meaning): time spent before the engine takes
    the request in (templating, tokenizing, the inbox) is part of its time to first token and queue time.
    Tokenizing is slowed down by a known delay here, so the lower bound does not depend on machine speed."""
    concurrency, delay = 8, 0.4
    tok = server.state.engine.tokenizer
    real_encode = tok.encode

    def slow_encode(*args: object, **kwargs: object) -> list[int]:
        time.sleep(delay)
        return real_encode(*args, **kwargs)

    before = plainhttp.get(f"{server.url}/metrics").text
    client_ttft: list[float] = []

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 8, "stream": True, "ignore_eos": True}
        start = time.perf_counter()
        first = None
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter() - start
        assert first is not None
        client_ttft.append(first)

    async def run() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(one(client, i) for i in range(concurrency)))

    tok.encode = slow_encode
    try:
        asyncio.run(run())
    finally:
        tok.encode = real_encode
    after = plainhttp.get(f"{server.url}/metrics").text

    def delta(name: str) -> float:
        return _histogram_sum(after, name) - _histogram_sum(before, name)

    ttft, queue = delta("vllm:time_to_first_token_seconds"), delta("vllm:request_queue_time_seconds")
    assert len(client_ttft) == concurrency
    # Every request spent at least `delay` between arriving and reaching the engine ...
    assert ttft >= concurrency * delay, (ttft, client_ttft)
    assert queue >= concurrency * delay, (queue, ttft)
    # ... and the server's clock starts after the client's and stops before the client reads the chunk.
    assert ttft <= sum(client_ttft), (ttft, client_ttft)


def test_seeded_requests_are_reproducible_under_adaptive_speculation(tiny_model: Path) -> None:
    with running_server(tiny_model, "--served-model-name", MODEL, "--draft-model", str(tiny_model)) as s:
        body = {"model": MODEL, "prompt": "the seed", "max_tokens": 40, "temperature": 1.0, "seed": 1234}
        body["ignore_eos"] = True

        async def run() -> list[str]:
            async with httpx.AsyncClient(timeout=120) as client:
                rs = await asyncio.gather(
                    *(client.post(f"{s.url}/v1/completions", json=body) for _ in range(8))
                )
            return [r.json()["choices"][0]["text"] for r in rs]

        texts = asyncio.run(run())
        alone = plainhttp.post(f"{s.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert set(texts) == {alone}, Counter(texts)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_completion_top_logprobs_always_hold_the_sampled_token(server: InProcessServer, n: int) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up to
    logprobs+1 elements"; with `logprobs: 0` they were empty, and a sampled token outside the top N was missing."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 8, "logprobs": n, "seed": 3, "temperature": 1.5}
    lp = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0][
        "logprobs"
    ]
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert top[token] == logprob
        assert n <= len(top) <= n + 1


def test_streamed_text_offsets_run_on_across_chunks(server: InProcessServer) -> None:
    """Each offset is the token's place in the choice's text; every streamed chunk restarted them at 0."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 10, "logprobs": 1, "temperature": 0}
    whole = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    offsets, text = [], ""
    with plainhttp.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                offsets += choice["logprobs"]["text_offset"]
    assert text == whole["text"]
    assert offsets == whole["logprobs"]["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] > 0


@pytest.mark.parametrize(
    ("field", "value"), [("timeout", "Infinity"), ("timeout", "NaN"), ("priority", "true")]
)
def test_body_timeout_and_priority_take_what_their_headers_take(
    server: InProcessServer, field: str, value: str
) -> None:
    """`timeout: Infinity` in the body was taken (the header refuses it) and `priority: true` was read as
    class number 1."""
    content = f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 1, "{field}": {value}}}'
    error = _assert_openai_error(_post_raw(server.url, "/v1/completions", content.encode()), 400)
    assert error["param"] == field


@pytest.mark.parametrize(
    ("field", "value"),
    [("priority", "²"), ("priority", "--1"), ("logit_bias", {"²": 1}), ("logit_bias", {"--5": 1})],
)
def test_numbers_spelled_oddly_are_a_400_naming_the_field(
    server: InProcessServer, field: str, value: object
) -> None:
    """A priority such as "²" or "--1" passed the digits check and failed int(): a 500; as a logit_bias
    key, a 400 whose param was Python's message."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1, field: value}
    r = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=60)
    error = _assert_openai_error(r, 400)
    assert error["param"] == field, error
    header = plainhttp.post(
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers={"x-ember-priority": "²".encode("latin-1")},
        timeout=60,
    )
    assert _assert_openai_error(header, 400)["param"] == "priority"


def test_while_the_model_loads_tokenize_answers_as_completions_do(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While loading, /tokenize, /detokenize and a router's /v1/kv_events refuse as the completions endpoints
    do: a 503 with Retry-After, `type: "overloaded"`, `code: "not_ready"` (they answered `type: "unavailable"`
    without Retry-After)."""
    from server_util import serve_args, wait_ready

    from ember_engine.core import llm_engine
    from ember_engine.server import serve

    release = threading.Event()

    class HeldEngine(llm_engine.LLMEngine):
        def __init__(self, config: Any) -> None:
            release.wait(30)  # the model "loads" until the test has asked
            super().__init__(config)

    monkeypatch.setattr(llm_engine, "LLMEngine", HeldEngine)
    args = serve_args(tiny_model, "--served-model-name", MODEL)
    server, state, failure = serve.build_server(args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_for(lambda: _up(url))
        requests = {
            "/v1/completions": {"model": MODEL, "prompt": "hi"},
            "/tokenize": {"model": MODEL, "prompt": "hi"},
            "/detokenize": {"model": MODEL, "tokens": [1, 2]},
        }
        answers = {path: plainhttp.post(f"{url}{path}", json=body) for path, body in requests.items()}
        answers["/v1/kv_events"] = plainhttp.get(f"{url}/v1/kv_events")
        for path, r in answers.items():
            assert r.status_code == 503 and r.headers.get("retry-after") == "1", (path, r.headers)
            assert (r.json()["error"]["type"], r.json()["error"]["code"]) == ("overloaded", "not_ready"), path
    finally:
        release.set()
        wait_ready(url)
        server.should_exit = True
        thread.join(timeout=30)
        if state.engine is not None:
            state.engine.shutdown()
    assert not failure, failure


def _up(url: str) -> bool:
    try:
        return plainhttp.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
