"""Every field of the request models has an effect or is refused by name; undeclared fields are refused
(the legacy function-calling fields) or ignored with a warning; the endpoints beside generation."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import plainhttp
import pytest
from server_util import InProcessServer, running_server

from ember_engine import __version__
from ember_engine.server.protocol import ChatCompletionRequest, CompletionRequest
from ember_engine.server.unknown_fields import REFUSED

MODEL = "tiny"
COMPLETION = {
    "model": MODEL,
    "prompt": "The quick brown fox",
    "max_tokens": 12,
    "temperature": 1.0,
    "seed": 5,
}
CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a story"}],
    "max_tokens": 12,
    "temperature": 1.0,
    "seed": 5,
}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", MODEL) as s:
        yield s


class Probe:
    def __init__(self, server: InProcessServer, path: str, base: dict[str, Any]) -> None:
        self.server, self.path, self.base = server, path, base
        engine = server.state.engine.engine
        self.eos = engine.model_config.eos_token_ids[0]

    def post(self, **fields: Any) -> httpx.Response:
        body = {**self.base, **fields}
        return plainhttp.post(f"{self.server.url}{self.path}", json=body, timeout=60)

    def ok(self, **fields: Any) -> dict[str, Any]:
        r = self.post(**fields)
        assert r.status_code == 200, r.text[:300]
        if r.headers["content-type"].startswith("text/event-stream"):
            return {"sse": r.text}
        body = r.json()
        body.pop("id"), body.pop("created")
        return body

    def changes(self, base: dict[str, Any], **fields: Any) -> None:
        """Setting `fields` on top of `base` changes the response."""
        assert self.ok(**base) != self.ok(**base, **fields), fields

    def not_found(self, field: str, value: Any) -> None:
        """A model not served here: 404 `model_not_found`, as OpenAI and vLLM answer (it was a 400)."""
        r = self.post(**{field: value})
        assert r.status_code == 404, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == field and error["code"] == "model_not_found", error

    def refused(self, field: str, value: Any) -> None:
        r = self.post(**{field: value})
        assert r.status_code == 400, r.text[:300]
        error = r.json()["error"]
        assert error["param"] == field or error["message"].startswith(f"{field}:"), error


def text(body: dict[str, Any]) -> str:
    c = body["choices"][0]
    return c["text"] if "text" in c else c["message"]["content"]


# Greedy text from a small random model repeats itself: what the penalties act on.
GREEDY = {"temperature": 0.0, "max_tokens": 48, "ignore_eos": True}


def _forced(p: Probe) -> dict[str, Any]:
    # One token pushed far above the rest: the output is that token again and again.
    return {"logit_bias": {"65": 100}, "ignore_eos": True}


COMMON: dict[str, Callable[[Probe], None]] = {
    "model": lambda p: p.not_found("model", "another"),
    "max_tokens": lambda p: p.changes({}, max_tokens=3),
    "temperature": lambda p: p.changes({}, temperature=0.0),
    "top_p": lambda p: p.changes({}, top_p=0.05),
    "n": lambda p: p.changes({}, n=2),
    "stop": lambda p: p.changes(_forced(p), stop=text(p.ok(**_forced(p)))[:1]),
    "seed": lambda p: p.changes({}, seed=6),
    "stream": lambda p: p.changes({}, stream=True),
    "stream_options": lambda p: p.changes({"stream": True}, stream_options={"include_usage": True}),
    "presence_penalty": lambda p: p.changes(GREEDY, presence_penalty=-2.0),
    "frequency_penalty": lambda p: p.changes(GREEDY, frequency_penalty=-2.0),
    "top_k": lambda p: p.changes({}, top_k=1),
    "min_p": lambda p: p.changes({}, min_p=0.9),
    "repetition_penalty": lambda p: p.changes(GREEDY, repetition_penalty=5.0),
    "ignore_eos": lambda p: p.changes({"logit_bias": {str(p.eos): 100}}, ignore_eos=True),
    "min_tokens": lambda p: p.changes({"logit_bias": {str(p.eos): 100}}, min_tokens=4),
    "stop_token_ids": lambda p: p.changes(_forced(p), stop_token_ids=[65]),
    "include_stop_str_in_output": lambda p: p.changes(
        {**_forced(p), "stop": text(p.ok(**_forced(p)))[:1]}, include_stop_str_in_output=True
    ),
    "skip_special_tokens": lambda p: p.changes(
        {"logit_bias": {str(p.eos): 100}, "ignore_eos": True}, skip_special_tokens=False
    ),
    "priority": lambda p: p.refused("priority", "no-such-class"),
    "timeout": lambda p: _assert_status(
        p.post(timeout=1e-6, max_tokens=2000, ignore_eos=True, logit_bias=None), 504
    ),
    "cache_salt": lambda p: _cache_salt(p),
    "logit_bias": lambda p: (p.changes({}, logit_bias={"65": 100}), p.refused("logit_bias", {"x": 1})),
    "return_tokens_as_token_ids": lambda p: _token_ids_as_text(p),
    "prompt_logprobs": lambda p: (p.changes({}, prompt_logprobs=1), p.refused("prompt_logprobs", 21)),
    "allowed_token_ids": lambda p: (
        p.changes({}, allowed_token_ids=[65, 66]),
        p.refused("allowed_token_ids", []),
        p.refused("allowed_token_ids", [10**8]),
    ),
    "bad_words": lambda p: (
        p.changes(GREEDY, bad_words=[text(p.ok(**GREEDY)).split()[0]]),
        p.refused("bad_words", [""]),
    ),
    "truncate_prompt_tokens": lambda p: (
        p.changes({}, truncate_prompt_tokens=1),
        p.refused("truncate_prompt_tokens", 0),
    ),
    "logprobs": lambda p: p.changes({}, logprobs=1 if "prompt" in p.base else True),
    "response_format": lambda p: (
        p.changes({}, response_format={"type": "json_object"}),
        p.refused("response_format", {"type": "bogus"}),
    ),
    "structured_outputs": lambda p: _one_of(
        p, {"structured_outputs": {"choice": ["yes", "no"]}}, ["yes", "no"]
    ),
    "guided_json": lambda p: (p.changes({}, guided_json={"type": "object"}), p.refused("guided_json", "{")),
    "guided_regex": lambda p: _assert_match(text(p.ok(guided_regex="[0-9]{3}")), "[0-9]{3}"),
    "guided_choice": lambda p: _one_of(p, {"guided_choice": ["red", "green"]}, ["red", "green"]),
    "guided_grammar": lambda p: _one_of(p, {"guided_grammar": 'start: "up" | "down"'}, ["up", "down"]),
    "guided_decoding_backend": lambda p: p.refused("guided_decoding_backend", "another-backend"),
}
COMPLETION_ONLY: dict[str, Callable[[Probe], None]] = {
    "prompt": lambda p: p.changes({}, prompt="Something else entirely"),
    "echo": lambda p: _assert_startswith(text(p.ok(echo=True)), p.base["prompt"]),
    "suffix": lambda p: p.refused("suffix", "the end"),
    "best_of": lambda p: p.refused("best_of", 3),
}
CHAT_ONLY: dict[str, Callable[[Probe], None]] = {
    "messages": lambda p: p.changes({}, messages=[{"role": "user", "content": "Another request"}]),
    "max_completion_tokens": lambda p: p.changes({}, max_completion_tokens=3),
    "top_logprobs": lambda p: (p.changes({"logprobs": True}, top_logprobs=3), p.refused("top_logprobs", 2)),
    "add_generation_prompt": lambda p: _prompt_tokens_change(p, {}, {"add_generation_prompt": False}),
    "continue_final_message": lambda p: _continue_final(p),
    "chat_template_kwargs": lambda p: (
        _prompt_tokens_change(p, {}, {"chat_template_kwargs": {"add_generation_prompt": False}}),
        p.refused("chat_template_kwargs", {"messages": []}),
    ),
    # The tiny model's template does not read `tools`: a 400 saying so (tests/test_structured_api.py serves
    # tools with a template that does).
    "tools": lambda p: _tools_refused(p),
    "tool_choice": lambda p: p.refused("tool_choice", "required"),
    "parallel_tool_calls": lambda p: p.refused("parallel_tool_calls", False),
}


def _one_of(p: Probe, fields: dict[str, Any], choices: list[str]) -> None:
    assert text(p.ok(**fields)) in choices and text(p.ok()) not in choices


def _assert_match(value: str, pattern: str) -> None:
    assert re.fullmatch(pattern, value), value


def _tools_refused(p: Probe) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = p.post(tools=[tool])
    assert r.status_code == 400 and "does not support tools" in r.json()["error"]["message"], r.text[:300]


def _assert_status(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text[:300]


def _assert_startswith(value: str, prefix: str) -> None:
    assert value.startswith(prefix) and len(value) > len(prefix), (value, prefix)


def _cache_salt(p: Probe) -> None:
    long = {"max_tokens": 1}
    if "prompt" in p.base:
        long["prompt"] = "a shared prefix that spans several blocks of the cache " * 8  # type: ignore[assignment]
    else:
        long["messages"] = [{"role": "user", "content": "a shared prefix of several blocks " * 8}]  # type: ignore[assignment]
    p.ok(**long, cache_salt="one")

    def cached(salt: str) -> int:
        return p.ok(**long, cache_salt=salt)["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("one") > 0 and cached("two") == 0


def _token_ids_as_text(p: Probe) -> None:
    lp = {"logprobs": 1} if "prompt" in p.base else {"logprobs": True}
    body = p.ok(**lp, return_tokens_as_token_ids=True)
    logprobs = body["choices"][0]["logprobs"]
    tokens = logprobs["tokens"] if "tokens" in logprobs else [c["token"] for c in logprobs["content"]]
    assert tokens and all(t.startswith("token_id:") for t in tokens), tokens


def _prompt_tokens_change(p: Probe, base: dict[str, Any], fields: dict[str, Any]) -> None:
    assert p.ok(**base)["usage"]["prompt_tokens"] != p.ok(**base, **fields)["usage"]["prompt_tokens"]


def _continue_final(p: Probe) -> None:
    messages = [*p.base["messages"], {"role": "assistant", "content": "Once upon"}]
    plain = {"messages": messages, "add_generation_prompt": False}
    _prompt_tokens_change(p, plain, {"continue_final_message": True})  # no end-of-turn after "Once upon"
    p.refused("continue_final_message", True)  # with add_generation_prompt (the default): contradictory


@pytest.mark.parametrize(
    ("path", "model", "base", "cases"),
    [
        ("/v1/completions", CompletionRequest, COMPLETION, COMMON | COMPLETION_ONLY),
        ("/v1/chat/completions", ChatCompletionRequest, CHAT, COMMON | CHAT_ONLY),
    ],
    ids=["completions", "chat"],
)
def test_every_field_has_an_effect_or_is_refused(
    server: InProcessServer,
    path: str,
    model: type,
    base: dict[str, Any],
    cases: dict[str, Callable[[Probe], None]],
) -> None:
    # A field added to a request model without a case here fails this line.
    assert set(model.model_fields) == set(cases)
    probe = Probe(server, path, base)
    for name, check in cases.items():
        try:
            check(probe)
        except AssertionError as exc:
            raise AssertionError(f"field {name!r}: {exc}") from exc


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_legacy_function_calling_fields_are_refused_by_name(server: InProcessServer, field: str) -> None:
    value: Any = [{"name": "f"}] if field == "functions" else "auto"
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = plainhttp.post(f"{server.url}{path}", json={**base, field: value}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]


def test_unknown_fields_are_ignored_with_a_warning(server: InProcessServer) -> None:
    r = plainhttp.post(
        f"{server.url}/v1/completions", json={**COMPLETION, "frobnicate": 1, "user": "u"}, timeout=30
    )
    assert r.status_code == 200
    assert "frobnicate" in r.headers["warning"] and "user" in r.headers["warning"]
    plain = plainhttp.post(f"{server.url}/v1/completions", json=COMPLETION, timeout=30)
    assert "warning" not in plain.headers
    assert plain.json()["choices"] == r.json()["choices"]


def test_continuous_usage_stats(server: InProcessServer) -> None:
    body = {
        **COMPLETION,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(**body, extra_body={"ignore_eos": True})  # type: ignore[call-overload]
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert len(counts) == len([c for c in chunks if c.choices]), "a chunk without usage"
    assert counts == sorted(counts) and counts[-1] == 12 and len(set(counts)) > 1, counts
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # The prompt again, now cached: each chunk's usage says so (it said 0 cached until the last chunk).
    long_prompt = {**body, "prompt": "The quick brown fox jumps over the lazy dog. " * 8}
    first = list(client.completions.create(**long_prompt, extra_body={"ignore_eos": True}))  # type: ignore[call-overload]
    again = list(client.completions.create(**long_prompt, extra_body={"ignore_eos": True}))  # type: ignore[call-overload]
    assert first[-1].usage is not None and again[-1].usage is not None
    details = again[-1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens
    cached = {
        c.usage.prompt_tokens_details.cached_tokens
        for c in again
        if c.usage and c.usage.prompt_tokens_details
    }
    assert cached == {details.cached_tokens}


def test_tokenize_detokenize_models_and_version(server: InProcessServer) -> None:
    url = server.url
    tok = plainhttp.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = plainhttp.post(f"{url}/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}).json()
    assert "hello world" in back["prompt"]
    chat = plainhttp.post(f"{url}/tokenize", json={"messages": CHAT["messages"]}).json()
    completion = plainhttp.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 1}).json()
    assert chat["count"] == completion["usage"]["prompt_tokens"]
    bad = plainhttp.post(f"{url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("another")
    assert plainhttp.get(f"{url}/version").json() == {"version": __version__}
    missing = plainhttp.get(f"{url}/no/such/route")
    assert missing.status_code == 404 and set(missing.json()) == {"error"}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        # fields that take one of several types: the error named the union's member, "priority.str"
        ("priority", 1.5, "priority: Input should be a valid string, or a valid integer"),
        ("stop", 3, "stop: Input should be a valid string, or a valid list"),
        ("prompt", 3.5, "prompt: Input should be a valid string, or a valid list"),
    ],
)
def test_a_wrong_type_for_a_field_of_several_types_names_the_field(
    server: InProcessServer, field: str, value: object, message: str
) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    r = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == field and error["message"] == message, error


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "max_tokens", True),
        ("/v1/completions", "max_tokens", "3"),
        ("/v1/completions", "n", True),
        ("/v1/completions", "logprobs", True),  # chat's spelling: it was read as 1
        ("/v1/completions", "echo", "yes"),
        ("/v1/completions", "temperature", "0.5"),
        ("/v1/completions", "stream", "yes"),
        ("/v1/chat/completions", "logprobs", 1),
        ("/v1/chat/completions", "max_completion_tokens", True),
        ("/v1/chat/completions", "top_logprobs", 2.0),
        ("/v1/chat/completions", "stream_options", {"include_usage": "true"}),
    ],
)
def test_a_value_of_another_json_type_is_refused_not_converted(
    server: InProcessServer, path: str, field: str, value: object
) -> None:
    """As OpenAI refuses them: `max_tokens: true` ran 1 token, completions' `logprobs: true` gave one top
    logprob, `stream: "yes"` streamed."""
    base = CHAT if path.endswith("chat/completions") else COMPLETION
    body = {**base, field: value}
    if field == "stream_options":
        body["stream"] = True
    if field == "top_logprobs":
        body["logprobs"] = True
    r = plainhttp.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"].split(".")[0] == field, r.json()


@pytest.mark.parametrize(
    ("path", "base"),
    [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)],
    ids=["completions", "chat"],
)
def test_null_means_the_default_for_every_optional_field(
    server: InProcessServer, path: str, base: dict
) -> None:  # type: ignore[type-arg]
    """OpenAI marks its fields nullable and its clients send null for "not given": each such field was a
    400 ("temperature: Input should be a valid number"). A required field stays required."""
    model = ChatCompletionRequest if path.endswith("chat/completions") else CompletionRequest
    optional = [name for name, f in model.model_fields.items() if not f.is_required()]
    body = {**base, **{name: None for name in optional}, "max_tokens": 3}
    r = plainhttp.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3
    default = plainhttp.post(
        f"{server.url}{path}", json={**base, "max_tokens": 3, "temperature": 0}, timeout=60
    )
    nulled = plainhttp.post(
        f"{server.url}{path}",
        json={**base, "max_tokens": 3, "temperature": 0, "seed": None, "top_p": None, "n": None},
        timeout=60,
    )
    assert nulled.json()["choices"] == default.json()["choices"]
    required = "messages" if path.endswith("chat/completions") else "prompt"
    missing = plainhttp.post(f"{server.url}{path}", json={**base, required: None}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == required


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "file", "file": {"file_id": "f"}},
    ],
    ids=lambda p: p["type"],
)
def test_a_content_part_other_than_text_is_refused_naming_its_type(
    server: InProcessServer, part: dict
) -> None:  # type: ignore[type-arg]
    """It was "messages.0.content: Input should be a valid string", naming no part and no reason."""
    content = [{"type": "text", "text": "what is this?"}, part]
    body = {**CHAT, "messages": [{"role": "user", "content": content}]}
    r = plainhttp.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages.0.content.1"
    assert (
        f"content part of type {part['type']!r} is not supported" in err["message"]
        and "text only" in err["message"]
    )


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": None}], "messages.0.content"),
        ([{"role": "system"}, {"role": "user", "content": "hi"}], "messages.0.content"),
        ([{"role": "user", "content": "hi"}, {"role": "developer"}], "messages.1.content"),
    ],
)
def test_a_message_without_content_is_refused(
    server: InProcessServer, messages: list[dict[str, Any]], param: str
) -> None:
    """As OpenAI refuses it (only an assistant's content may be absent): it was rendered as an empty
    turn. /tokenize renders messages as chat does, and refuses it too."""
    r = plainhttp.post(f"{server.url}/v1/chat/completions", json={**CHAT, "messages": messages}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == param, r.json()
    r = plainhttp.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": messages}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    assistant = [{"role": "user", "content": "hi"}, {"role": "assistant"}]
    body = {**CHAT, "messages": assistant, "add_generation_prompt": False}
    assert plainhttp.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).status_code == 200


ASK = {"role": "user", "content": "weather in Oslo?"}
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}


def _asked(*calls: Any) -> list[dict[str, Any]]:
    return [ASK, {"role": "assistant", "tool_calls": list(calls)}]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (_asked({**CALL, "function": "weather"}), "messages.1.tool_calls.0.function"),
        (_asked(CALL, {**CALL, "function": 5}), "messages.1.tool_calls.1.function"),
        (_asked("weather"), "messages.1.tool_calls.0"),
        (_asked({"type": "function", "function": CALL["function"]}), "messages.1.tool_calls.0.id"),
        (_asked({**CALL, "type": "retrieval"}), "messages.1.tool_calls.0.type"),
        (_asked({**CALL, "function": {"name": "weather"}}), "messages.1.tool_calls.0.function.arguments"),
        (
            _asked({**CALL, "function": {"name": "weather", "arguments": {}}}),
            "messages.1.tool_calls.0.function.arguments",
        ),
        ([*_asked(CALL), {"role": "tool", "content": "sunny"}], "messages.2.tool_call_id"),
    ],
)
def test_a_malformed_tool_call_or_answer_is_refused(
    server: InProcessServer, messages: list[dict[str, Any]], param: str
) -> None:
    """As OpenAI refuses them: an assistant's earlier call needs an id, type "function" and a function of a
    name and arguments as JSON text, and a tool message the id of the call it answers. A function that was
    not an object was a 500 (rendering the prompt failed); a missing id or name was rendered as nothing.
    /tokenize renders messages as chat does, and refuses them too."""
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"model": MODEL})):
        r = plainhttp.post(f"{server.url}{path}", json={**body, "messages": messages}, timeout=60)
        assert r.status_code == 400, (path, r.text[:300])
        assert r.json()["error"]["param"] == param, (path, r.json())
    answered = [*_asked(CALL), {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = plainhttp.post(f"{server.url}/v1/chat/completions", json={**CHAT, "messages": answered}, timeout=60)
    assert r.status_code == 200, r.text[:300]


def test_stream_options_without_stream_is_refused(server: InProcessServer) -> None:
    """As OpenAI and vLLM refuse it; it was taken and ignored."""
    for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = plainhttp.post(
            f"{server.url}{path}", json={**base, "stream_options": {"include_usage": True}}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        ok = plainhttp.post(
            f"{server.url}{path}", json={**base, "stream": True, "stream_options": None}, timeout=60
        )
        assert ok.status_code == 200


def test_model_cards_carry_a_creation_time(server: InProcessServer) -> None:
    before = int(time.time())
    card = plainhttp.get(f"{server.url}/v1/models").json()["data"][0]
    assert before <= card["created"] <= int(time.time())


def test_chat_logprob_bytes_rebuild_characters_split_across_tokens(server: InProcessServer) -> None:
    """`bytes` is there so that a character spread over tokens can be put together again: each token's bytes
    were those of U+FFFD, the text a lone piece of a character decodes to."""
    body = {**CHAT, "max_tokens": 12, "logprobs": True, "top_logprobs": 2, "guided_choice": ["日本語"]}
    choice = plainhttp.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["message"]["content"] == "日本語"
    items = choice["logprobs"]["content"]
    assert len(items) > 3  # the tiny tokenizer spells these characters in byte pieces
    joined = bytes(
        b for item in items if item["token"] != "<|end|>" for b in item["bytes"]
    )  # (the end token's)
    assert joined == "日本語".encode()
    assert all(t["bytes"] != list("\ufffd".encode()) for item in items for t in item["top_logprobs"])
