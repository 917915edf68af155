"""OpenAI's Responses API (`/v1/responses`) through the official `openai` client against a real server:
each answer is the chat endpoint's answer to the same conversation (the oracle: the same prompt tokens, the
same greedy text), streamed as the events the client's own stream helper assembles into the same response;
function calls and their outputs, `text.format`, logprobs, the response store, and refusals by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import plainhttp
import pytest
from server_util import InProcessServer, running_server, serve_args
from test_structured_api import SCHEMA, TOOL_TEMPLATE, WEATHER

from ember_engine.server.responses_api import ResponseStore, Stored
from ember_engine.server.responses_request import ResponsesBody

MODEL = "tiny"
TOOL = {"type": "function", **WEATHER["function"]}  # type: ignore[dict-item]  # the Responses spelling


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessServer]:
    path = tmp_path_factory.mktemp("responses") / "tiny-tools"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    store = ("--responses-store", "3", "--responses-store-bytes", "1000000")
    with running_server(path, "--served-model-name", MODEL, *store) as s:
        yield s


@pytest.fixture
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client: openai.OpenAI, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)  # type: ignore[arg-type]


def test_an_answer_is_the_chat_answer_to_the_same_conversation(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        instructions="Answer briefly.",
        input="Where is Paris?",
        temperature=0,
        max_output_tokens=12,
    )
    chat = _chat(
        client,
        [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where is Paris?"}],
        max_tokens=12,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens) == (
        chat.usage.prompt_tokens,
        chat.usage.completion_tokens,
    )
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    # 12 tokens and no end: cut by max_output_tokens, as OpenAI reports it
    assert chat.choices[0].finish_reason == "length"
    assert (
        r.status == "incomplete"
        and r.incomplete_details
        and r.incomplete_details.reason == "max_output_tokens"
    )
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 12 and r.store is True
    # ember's extensions pass through: a choice ends the answer, which is then complete
    done = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=50, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert (
        done.status == "completed" and done.incomplete_details is None and done.output_text in ("yes", "no")
    )


def test_input_items_are_the_chat_messages_they_name(client: openai.OpenAI) -> None:
    call = {"city": "Paris", "days": 1}
    items: list[Any] = [
        {"role": "developer", "content": "Be exact."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather "},
                {"type": "input_text", "text": "in Paris?"},
            ],
        },
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": json.dumps(call)},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "It is sunny."}],
        },
        {"role": "user", "content": "And tomorrow?"},
    ]
    messages = [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(call)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        {"role": "assistant", "content": "It is sunny."},
        {"role": "user", "content": "And tomorrow?"},
    ]
    r = client.responses.create(
        model=MODEL, input=items, tools=[TOOL], tool_choice="none", temperature=0, max_output_tokens=8
    )  # type: ignore[list-item, arg-type]
    chat = _chat(client, messages, tools=[WEATHER], tool_choice="none", max_tokens=8)
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


def test_a_stream_is_the_events_of_the_same_response(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "Tell me a story.",
        "temperature": 0,
        "max_output_tokens": 20,
    }
    whole = client.responses.create(**kw, top_logprobs=2)
    # The client's stream helper assembles the response from the events (and refuses events out of order).
    with client.responses.stream(**kw, top_logprobs=2) as stream:
        events = list(stream)
    # cut by max_output_tokens: the last event is `response.incomplete`, with the whole response
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.id != whole.id
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert final.usage == whole.usage and final.status == "incomplete"
    # logprobs: one a generated token, each with its two alternatives, as unstreamed
    streamed = [lp for e in deltas for lp in e.logprobs]
    part = whole.output[0].content[0]  # type: ignore[union-attr]
    assert whole.usage is not None and len(streamed) == len(part.logprobs or []) == whole.usage.output_tokens
    assert [(lp.token, round(lp.logprob, 4)) for lp in streamed] == [
        (lp.token, round(lp.logprob, 4)) for lp in part.logprobs or []
    ]
    assert all(len(lp.top_logprobs or []) == 2 for lp in streamed)
    plain = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]  # not asked for


def test_function_calls_are_output_items_whole_and_streamed(client: openai.OpenAI) -> None:
    schema = TOOL["parameters"]
    kw: dict[str, Any] = {
        "model": MODEL,
        "input": "What is the weather in Paris?",
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 150,
    }
    r = client.responses.create(**kw)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), schema)
    with client.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == call.arguments
    assert final.output[0].type == "function_call" and final.output[0].arguments == call.arguments  # type: ignore[union-attr]
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "get_weather"}})
    assert [o.name for o in named.output] == ["get_weather"]  # type: ignore[union-attr]
    # The call and its output sent back: the conversation goes on from them.
    back = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
        ],
        tools=[TOOL],  # type: ignore[list-item]
        max_output_tokens=5,
    )
    assert back.usage is not None and back.usage.input_tokens > r.usage.input_tokens  # type: ignore[union-attr]


def test_text_format_constrains_the_output(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "name": "forecast", "schema": SCHEMA, "strict": True}
    r = client.responses.create(
        model=MODEL, input="Forecast?", text={"format": fmt}, temperature=0, max_output_tokens=200
    )  # type: ignore[typeddict-item]
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text is not None and r.text.format.type == "json_schema"
    # json_object: the chat endpoint's answer with response_format json_object (a random model's object
    # may not close within the tokens given)
    r = client.responses.create(
        model=MODEL,
        input="JSON?",
        text={"format": {"type": "json_object"}},
        temperature=0,
        max_output_tokens=30,
    )
    chat = _chat(
        client, [{"role": "user", "content": "JSON?"}], max_tokens=30, response_format={"type": "json_object"}
    )
    assert r.output_text == chat.choices[0].message.content and r.output_text.startswith("{")


def test_the_store_continues_retrieves_and_deletes_responses(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, instructions="Be kind.", input="Hello.", temperature=0, max_output_tokens=6
    )
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, input="And then?", temperature=0, max_output_tokens=6
    )
    # The conversation so far, without the first request's instructions (OpenAI carries them over only
    # when sent again).
    messages = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    chat = _chat(client, messages, max_tokens=6)
    assert second.previous_response_id == first.id
    assert second.usage is not None and chat.usage is not None
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    choice = {"guided_choice": ["yes", "no"]}  # an answer that ends: `response.completed`
    with client.responses.stream(
        model=MODEL, input="Streamed.", max_output_tokens=4, extra_body=choice
    ) as stream:
        streamed = stream.get_final_response()
    assert client.responses.retrieve(streamed.id).output_text == streamed.output_text
    unkept = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    # the items a response was asked with (its own input, not the conversation before it), with ids
    chained = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ],
        max_output_tokens=2,
    )
    listed = client.responses.input_items.list(chained.id, order="asc")
    texts = [(i.role, i.content[0].text) for i in listed.data]  # type: ignore[union-attr]
    assert texts == [("user", "a"), ("assistant", "b"), ("user", "c")] and all(i.id for i in listed.data)
    newest = client.responses.input_items.list(chained.id, limit=2)  # newest first, as OpenAI lists them
    assert [i.id for i in newest.data] == [i.id for i in listed.data][::-1][:2] and newest.has_more
    rest = client.responses.input_items.list(chained.id, limit=2, after=newest.data[-1].id)
    assert [i.id for i in rest.data] == [listed.data[0].id] and not rest.has_more
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(chained.id, limit=101)
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.retrieve(second.id)
    assert missing.value.body["code"] == "response_not_found"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, previous_response_id=second.id, input="x")
    # --responses-store 3: the oldest go first
    for _ in range(3):
        client.responses.create(model=MODEL, input="y", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(streamed.id)


def test_without_a_store_keeping_or_continuing_is_refused(
    server: InProcessServer, client: openai.OpenAI
) -> None:
    kept, server.state.responses = server.state.responses, None  # as `ember serve` without --responses-store
    try:
        r = client.responses.create(model=MODEL, input="x", max_output_tokens=2)
        assert r.store is False
        for field, value in (("store", True), ("previous_response_id", "resp_1")):
            with pytest.raises(openai.BadRequestError) as e:
                client.responses.create(model=MODEL, input="x", **{field: value})  # type: ignore[arg-type]
            assert e.value.body["param"] == field and "--responses-store" in e.value.body["message"]  # type: ignore[index]
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(r.id)
    finally:
        server.state.responses = kept
    with pytest.raises(SystemExit):
        serve_args(Path("m"), "--responses-store", "-1")


def test_the_store_keeps_fewer_where_they_would_pass_its_bytes(
    server: InProcessServer, client: openai.OpenAI
) -> None:
    """`--responses-store-bytes`: the oldest go first while the kept responses, as JSON text, pass it (each
    keeps its whole conversation); the newest is kept whatever its size."""
    assert server.state.responses.max_bytes == 1_000_000  # the module's server, from its option
    kept, server.state.responses = server.state.responses, ResponseStore(10, 1_000_000)
    try:
        store = server.state.responses
        long = "word " * 400  # 2 KB of input in the response's conversation and in its input items
        first = client.responses.create(model=MODEL, input=long, max_output_tokens=2)
        second = client.responses.create(model=MODEL, input="short", max_output_tokens=2)
        sizes = {r.id: store.get(r.id).nbytes for r in (first, second)}
        assert sizes[first.id] - sizes[second.id] > 1.9 * len(long)  # in its conversation and its items
        assert store.nbytes == sum(sizes.values())
        store.max_bytes = sum(sizes.values()) + 1000  # room for a short one more, not a long one
        third = client.responses.create(model=MODEL, input=long, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(first.id)
        for r in (second, third):
            assert client.responses.retrieve(r.id).id == r.id
        assert store.nbytes <= store.max_bytes and store.nbytes == sum(
            s.nbytes for s in store._items.values()
        )
        client.responses.delete(third.id)
        assert store.nbytes == sizes[second.id]
    finally:
        server.state.responses = kept
    one = ResponseStore(10, 10)
    one.put(Stored({"id": "resp_a"}, [{"role": "user", "content": "x" * 100}], []))
    assert one.get("resp_a") is not None and one.nbytes > 10  # the newest stays, over the budget
    one.put(Stored({"id": "resp_b"}, [], []))
    assert one.get("resp_a") is None and one.get("resp_b") is not None
    with pytest.raises(SystemExit):
        serve_args(Path("m"), "--responses-store-bytes", "0")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"reasoning": {"effort": "low", "summary": None}}, "reasoning"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages"),
        ({"max_tokens": 5}, "max_tokens"),
        ({"n": 2}, "n"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": 3}, "temperature"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.type"),
        ({"input": []}, "input"),
        ({"stream_options": {"include_obfuscation": True}}, "stream_options"),
    ],
)
def test_what_is_not_served_is_refused_by_name(
    server: InProcessServer, extra: dict[str, Any], param: str
) -> None:
    body = {"model": MODEL, "input": "x", **extra}
    r = plainhttp.post(f"{server.url}/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def test_the_fields_echoed_and_those_that_shape_sampling(client: openai.OpenAI) -> None:
    echoed: dict[str, Any] = {
        "metadata": {"team": "search"},
        "user": "u1",
        "safety_identifier": "s1",
        "prompt_cache_key": "k1",
        "service_tier": "auto",
        "truncation": "disabled",
        "parallel_tool_calls": False,
    }
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=2, **echoed)
    assert (r.metadata, r.user, r.safety_identifier, r.prompt_cache_key) == (
        {"team": "search"},
        "u1",
        "s1",
        "k1",
    )
    assert (r.service_tier, r.truncation, r.parallel_tool_calls) == ("default", "disabled", False)
    greedy = client.responses.create(model=MODEL, input="Tell me", temperature=0, max_output_tokens=10)
    narrow = client.responses.create(
        model=MODEL, input="Tell me", temperature=1.0, top_p=1e-6, max_output_tokens=10
    )
    assert narrow.output_text == greedy.output_text and narrow.top_p == 1e-6  # the likeliest token alone
    # include alone: each token's logprob, no alternatives
    lp = client.responses.create(
        model=MODEL, input="x", max_output_tokens=3, include=["message.output_text.logprobs"]
    )
    logprobs = lp.output[0].content[0].logprobs  # type: ignore[union-attr]
    assert logprobs and len(logprobs) == 3 and all(not e.top_logprobs for e in logprobs)


def test_what_asks_for_nothing_is_taken(client: openai.OpenAI) -> None:
    """The values a client sends for "none" of a feature ember does not have are not refusals."""
    none: dict[str, Any] = {"background": False, "reasoning": {"effort": None, "summary": None}}
    r = client.responses.create(
        model=MODEL, input="x", max_output_tokens=2, text={"verbosity": "medium"}, **none
    )
    assert r.status == "incomplete" and r.background is False and r.reasoning is None


def test_a_refused_field_nested_as_deep_as_the_parser_allows_is_a_400(server: InProcessServer) -> None:
    """Whether `reasoning` asks for anything was judged by recursing into it: 900 levels were a 500
    (RecursionError); one level decides it."""
    nested = "null"
    for _ in range(900):
        nested = '{"a": ' + nested + "}"
    raw = ('{"model": "tiny", "input": "x", "reasoning": ' + nested + "}").encode()
    headers = {"content-type": "application/json"}
    r = plainhttp.post(f"{server.url}/v1/responses", content=raw, headers=headers, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning", r.text[:300]


def test_null_means_not_given_for_every_optional_field(server: InProcessServer) -> None:
    optional = [name for name, f in ResponsesBody.model_fields.items() if not f.is_required()]
    body = {"model": MODEL, "input": "x", **{name: None for name in optional}}
    r = plainhttp.post(f"{server.url}/v1/responses", json={**body, "max_output_tokens": 3}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["output_tokens"] <= 3
    missing = plainhttp.post(f"{server.url}/v1/responses", json={**body, "input": None}, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"


def test_a_wrong_model_is_404_and_a_malformed_body_400(server: InProcessServer) -> None:
    r = plainhttp.post(f"{server.url}/v1/responses", json={"model": "other", "input": "x"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    headers = {"content-type": "application/json"}
    r = plainhttp.post(f"{server.url}/v1/responses", content=b"{not json", headers=headers, timeout=30)
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    # a lone surrogate (which no UTF-8 answer can quote back) is refused where it is, as chat refuses it
    # (a metadata key's was the server's 500: its error named the key)
    for fields in (b'"input": "\\ud800"', b'"input": "x", "metadata": {"\\ud800": "v"}'):
        raw = b'{"model": "tiny", ' + fields + b"}"  # JSON escapes: no encoder writes the lone half
        r = plainhttp.post(f"{server.url}/v1/responses", content=raw, headers=headers, timeout=30)
        assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"], r.text


def _events(server: InProcessServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    blocks = [b for b in text.split("\n\n") if b.strip()]
    events = []
    for block in blocks:
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == kind.removeprefix("event: ")
        events.append(event)
    return events


def test_obfuscation_pads_the_deltas_when_asked(server: InProcessServer) -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 4, "stream": True}
    plain = _events(server, body)
    padded = _events(server, {**body, "stream_options": {"include_obfuscation": True}})
    assert not any("obfuscation" in e for e in plain)
    deltas = [e for e in padded if e["type"].endswith(".delta")]
    assert deltas and all(isinstance(e["obfuscation"], str) and e["obfuscation"] for e in deltas)


def test_a_stream_cut_by_its_deadline_ends_failed(server: InProcessServer) -> None:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    events = _events(server, {**body, "timeout": 0.05})
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == [
        "error",
        "response.failed",
    ]
    assert events[-2]["code"] == "deadline_exceeded"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "deadline_exceeded"
