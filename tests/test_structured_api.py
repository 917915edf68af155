"""Structured outputs and tool calling through the official `openai` client, against a real server with
speculative decoding on: schema-valid JSON streamed or not, vLLM's guided_* fields, 400s that name the
problem, parsed tool calls (also streamed as deltas), and tool history rendered by the chat template."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import plainhttp
import pytest
from server_util import InProcessServer, running_server

from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.chat import render_chat
from ember_engine.server.protocol import ChatCompletionRequest

MODEL = "tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{2,5}$"}, "maxItems": 2},
    },
    "required": ["city", "unit", "days", "tags"],
    "additionalProperties": False,
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "forecast", "schema": SCHEMA}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
            "required": ["zone"],
            # Closed, as WEATHER is: an open object lets a random model write one extra key forever.
            "additionalProperties": False,
        },
    },
}
# A chat template that shows the model its tools and renders earlier calls and tool answers the way
# ember parses calls (`<tool_call>` blocks).
TOOL_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools:\n{% for t in tools %}{{ t.function | tojson }}\n{% endfor %}<|end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n"
    "{% for c in m.tool_calls %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{% endfor %}<|end|>\n"
    "{% elif m.role == 'tool' %}<|user|>\n<tool_response>\n{{ m.content }}\n</tool_response><|end|>\n"
    "{% else %}{{ '<|' + m.role + '|>\n' + m.content + '<|end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tools") / "tiny-tools"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TOOL_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(tool_model: Path) -> Iterator[InProcessServer]:
    args = ["--served-model-name", MODEL, "--speculative-method", "ngram", "--no-speculative-adaptive"]
    with running_server(tool_model, *args) as s:
        yield s


@pytest.fixture
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _valid(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chat_json_schema_streaming_and_not(client: openai.OpenAI, temperature: float) -> None:
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=RESPONSE_FORMAT,
            max_tokens=120,  # type: ignore[arg-type]
            temperature=temperature,
            seed=seed,
        )
        assert r.choices[0].finish_reason == "stop"
        _valid(r.choices[0].message.content or "")
        stream = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format=RESPONSE_FORMAT,
            max_tokens=120,  # type: ignore[arg-type]
            temperature=temperature,
            seed=seed,
            stream=True,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "stop"
        _valid(text)
        if temperature == 0.0:
            assert text == r.choices[0].message.content


def test_completions_json_object_and_guided_fields(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL, prompt="{", max_tokens=60, temperature=0, extra_body={"response_format": RESPONSE_FORMAT}
    )
    _valid(r.choices[0].text)
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=60, temperature=0, extra_body={"guided_json": SCHEMA}
    )
    _valid(r.choices[0].text)
    r = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=20,
        temperature=1.0,
        seed=1,
        extra_body={"guided_regex": r"[A-Z]{3}-[0-9]{4}"},
    )
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{4}", r.choices[0].text)
    r = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=20,
        temperature=1.0,
        seed=2,
        extra_body={"guided_choice": ["yes", "no"]},
    )
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": 'start: "ab" "c"*'}},
    )
    assert re.fullmatch(r"abc*", r.choices[0].text)
    r = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=80, temperature=0, response_format={"type": "json_object"}
    )
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


def test_logprobs_under_a_constraint_are_json_numbers(server: InProcessServer, client: openai.OpenAI) -> None:
    """Tokens the constraint rules out have no probability: their logprob is sent as -9999.0 (as vLLM
    sends it), never as -Infinity, which is not JSON, streamed or not."""
    choice = {"guided_choice": ["alpha", "beta"]}
    r = client.completions.create(
        model=MODEL, prompt="x = ", max_tokens=3, temperature=0, logprobs=5, extra_body=choice
    )
    assert r.choices[0].text in ("alpha", "beta")
    logprobs = r.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs
    first = logprobs.top_logprobs[0]
    assert len(first) == 5 and -9999.0 in first.values()  # two allowed first tokens, three ruled out
    assert all(lp == -9999.0 or lp > -100 for top in logprobs.top_logprobs for lp in top.values())
    body = {"model": MODEL, "prompt": "x = ", "max_tokens": 3, "temperature": 0, "logprobs": 5, **choice}
    with plainhttp.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        assert s.status_code == 200
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: {")]

    def not_a_number(constant: str) -> None:
        pytest.fail(f"{constant} in a stream event: {events}")

    for event in events:
        json.loads(event, parse_constant=not_a_number)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
    )
    content = chat.choices[0].logprobs and chat.choices[0].logprobs.content
    assert content and any(t.logprob == -9999.0 for item in content for t in item.top_logprobs)


def test_truncated_output_says_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format=RESPONSE_FORMAT,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
    )
    assert r.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            "response_format",
            "foo",
        ),
        ({"guided_regex": "(("}, "guided_regex", "unclosed group"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "only one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "outlines"),
        # A constraint no text satisfies was a 500 "grammar_failed" (llguidance's NoExtensionBias).
        ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "matches no text"),
        ({"guided_regex": "a[^\\s\\S]"}, "guided_regex", "matches no text"),
        ({"structured_outputs": {"regex": "[^\\s\\S]"}}, "structured_outputs", "matches no text"),
        # OpenAI and vLLM both require the schema's name; it was taken without one.
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
            "response_format.json_schema.name",
            "name",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
            "response_format.json_schema.name",
            "a-z",
        ),
    ],
)
def test_bad_constraints_are_400_naming_the_problem(
    server: InProcessServer, extra: dict, param: str, words: str
) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, **extra}
    r = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_required_and_named_tool_calls_parse_against_the_schema(client: openai.OpenAI) -> None:
    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice="required",  # type: ignore[list-item]
            temperature=1.0,
            seed=seed,
            max_tokens=150,
            parallel_tool_calls=False,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.function.name in ("get_weather", "get_time") and call.id
        args = json.loads(call.function.arguments)
        if call.function.name == "get_weather":
            jsonschema.validate(args, schema)
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=[WEATHER, TIME],  # type: ignore[list-item]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=1.0,
            seed=seed,
            max_tokens=150,
        )
        calls = r.choices[0].message.tool_calls
        assert calls and [c.function.name for c in calls] == ["get_weather"]
        jsonschema.validate(json.loads(calls[0].function.arguments), schema)


def test_tool_calls_stream_as_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,  # type: ignore[list-item]
        max_tokens=150,
        stream=True,
        parallel_tool_calls=False,
    )
    chunks = list(stream)
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])  # type: ignore[index]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    full = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=150,  # type: ignore[list-item]
        parallel_tool_calls=False,
    )
    assert (
        full.choices[0].message.tool_calls
        and full.choices[0].message.tool_calls[0].function.arguments == arguments
    )


def test_auto_parses_calls_and_none_leaves_text(client: openai.OpenAI) -> None:
    block = r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|cet)"\}\}\n</tool_call>'
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="auto",
        temperature=0,  # type: ignore[list-item]
        max_tokens=60,
        extra_body={"guided_regex": block},
    )
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    assert json.loads(calls[0].function.arguments)["zone"] in ("utc", "cet")
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[WEATHER, TIME],
        tool_choice="none",
        temperature=0,  # type: ignore[list-item]
        max_tokens=60,
        extra_body={"guided_regex": block},
    )
    assert not r.choices[0].message.tool_calls and "<tool_call>" in (r.choices[0].message.content or "")


def test_tool_history_renders_through_the_template(tool_model: Path, client: openai.OpenAI) -> None:
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = ChatCompletionRequest(model=MODEL, messages=messages, tools=[WEATHER])  # type: ignore[arg-type]
    text = render_chat(Tokenizer(tool_model), body.template_messages(), tools=[WEATHER])
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>'
        in text
    )
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"name": "get_weather"' in text
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=5)  # type: ignore[arg-type, list-item]
    assert r.usage is not None and r.usage.prompt_tokens == len(
        Tokenizer(tool_model).encode(text, add_special_tokens=False)
    )


def test_tools_on_a_template_without_them_is_400(tiny_model: Path) -> None:
    with running_server(tiny_model, "--served-model-name", MODEL) as s:
        body = {"model": MODEL, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 5}
        r = plainhttp.post(f"{s.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400
        assert "does not support tools" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "tools"  # it named messages
        r = plainhttp.post(
            f"{s.url}/tokenize", json={k: body[k] for k in ("model", "messages", "tools")}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools"
        r = plainhttp.post(
            f"{s.url}/v1/chat/completions",
            json={**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            timeout=30,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_openai_parse_helper_gets_a_parsed_model(client: openai.OpenAI) -> None:
    from typing import Literal

    from pydantic import BaseModel, Field

    class Forecast(BaseModel):
        city: str = Field(max_length=8)
        unit: Literal["celsius", "fahrenheit"]
        days: int = Field(ge=1, le=7)

    r = client.chat.completions.parse(
        model=MODEL,
        messages=MESSAGES,
        response_format=Forecast,
        max_tokens=80,
        temperature=0,  # type: ignore[arg-type]
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and 1 <= parsed.days <= 7


def test_the_router_renders_the_prompt_the_engine_serves(tool_model: Path, server: InProcessServer) -> None:
    """The router scores prefixes on the prompt it renders: with tools, template kwargs or a continued final
    message it must be the engine's token for token, or its block hashes match nothing the engines cache."""
    from types import SimpleNamespace

    from ember_engine.server.api_server import _prompt_token_ids
    from ember_engine.server.tools import plan_tools
    from ember_router.prompts import prompt_token_ids

    tok = Tokenizer(tool_model)
    continued = [*MESSAGES, {"role": "assistant", "content": "Let me check"}]
    bodies = [
        {"messages": MESSAGES, "tools": [WEATHER, TIME]},
        {"messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required"},
        {
            "messages": MESSAGES,
            "tools": [TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
        {"messages": continued, "continue_final_message": True, "add_generation_prompt": False},
        {"messages": MESSAGES, "chat_template_kwargs": {"enable_thinking": False}},
    ]
    for extra in bodies:
        body = {"model": MODEL, "max_tokens": 1, **extra}
        routed = prompt_token_ids(tok, body, chat=True)
        request = ChatCompletionRequest.model_validate(body)
        tools = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
        served = _prompt_token_ids(SimpleNamespace(tokenizer=tok), request, tools)[0]  # type: ignore[arg-type]
        assert routed == served, extra
        usage = plainhttp.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        assert usage["prompt_tokens"] == len(routed), extra
        keys = (
            "messages",
            "tools",
            "continue_final_message",
            "add_generation_prompt",
            "chat_template_kwargs",
        )
        shown = {k: v for k, v in body.items() if k in keys}
        assert plainhttp.post(f"{server.url}/tokenize", json=shown).json()["tokens"] == routed, extra


def test_schemas_differing_only_in_key_order_each_keep_their_own_order(client: openai.OpenAI) -> None:
    """Compiled grammars were cached by a key that sorted the schema's keys: whichever of two such schemas
    came first decided the order of the other's output fields ("reasoning" before "answer" is a choice)."""
    props = {
        "answer": {"type": "integer", "minimum": 0, "maximum": 9},
        "reasoning": {"type": "string", "maxLength": 5},
    }
    for order in (["answer", "reasoning"], ["reasoning", "answer"]):
        schema = {
            "type": "object",
            "properties": {k: props[k] for k in order},
            "required": ["answer", "reasoning"],
            "additionalProperties": False,
        }
        r = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=150,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},  # type: ignore[typeddict-item]
        )
        assert r.choices[0].finish_reason == "stop"
        assert list(json.loads(r.choices[0].message.content or "")) == order


NESTED = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {  # as pydantic writes a model holding another: the inner one under $defs
            "$defs": {
                "Loc": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 8}},
                    "required": ["city"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {
                "where": {"$ref": "#/$defs/Loc"},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["where", "days"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_required_call_whose_schema_refers_to_its_own_defs(client: openai.OpenAI, choice: object) -> None:
    """The call's grammar nested the parameters inside a schema of its own, so their `#/$defs/...` pointed
    nowhere: a 400 "cannot compile the grammar" for every nested pydantic model."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[NESTED],
        tool_choice=choice,
        max_tokens=150,
        temperature=0,  # type: ignore[arg-type, list-item]
    )
    calls = r.choices[0].message.tool_calls or []
    assert len(calls) == 1 and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    parameters = NESTED["function"]["parameters"]  # type: ignore[index]
    jsonschema.validate(json.loads(calls[0].function.arguments), parameters)  # type: ignore[union-attr]


def test_templates_render_as_transformers_renders_them(tool_model: Path) -> None:
    """`tojson` was Jinja's own (HTML-escaped, keys sorted, non-ASCII escaped), where transformers (and so
    vLLM) write the text as it is, keys in their order; `{% break %}` and `strftime_now` were unknown."""
    from transformers import AutoTokenizer

    template = TOOL_TEMPLATE.replace(
        "{{ bos_token }}",
        "{{ bos_token }}{{ strftime_now('%Y') | length }}{% for m in messages %}{% if loop.index > 1 %}{% break %}"
        "{% endif %}{{ m.role }}{% endfor %}",
    )
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The user's weather <city> & météo",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}, "city": {"type": "string"}},
            },
        },
    }
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"zone": "l\'île", "city": "Zürich"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = ChatCompletionRequest(model=MODEL, messages=messages, tools=[tool])  # type: ignore[arg-type]
    tokenizer = Tokenizer(tool_model)
    tokenizer.chat_template = template
    ours = render_chat(tokenizer, body.template_messages(), tools=[tool])
    theirs = AutoTokenizer.from_pretrained(str(tool_model)).apply_chat_template(
        body.template_messages(),
        tools=[tool],
        chat_template=template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ours == theirs
    assert "The user's weather <city> & météo" in ours and '"zone": "l\'île", "city": "Zürich"' in ours


def test_a_grammar_that_fails_mid_answer_is_an_error_not_a_stop(server: InProcessServer) -> None:
    """llguidance compiles this pattern but gives up once the answer begins ("too many expressions"): the
    answer ended at once with `finish_reason: "stop"`, as if the constraint were met, its text breaking
    it ('"' for a string schema, '' for the regex)."""
    pattern = {"type": "string", "pattern": "^(a{1000}){1000}$"}
    for extra in ({"guided_json": pattern}, {"guided_regex": "(a{1000}){1000}"}):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 30, "seed": 3, **extra}
        r = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "grammar_failed" and "too many expressions" in error["message"], error
        with plainhttp.stream(
            "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as s:
            events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "grammar_failed", events
        finished = [json.loads(e)["choices"][0].get("finish_reason") for e in events[:-2]]
        assert "stop" not in finished


def test_a_grammar_with_no_way_on_is_the_clients_error_naming_the_field(server: InProcessServer) -> None:
    """A grammar whose first token is allowed but that then admits nothing (its second terminal matches no
    text) was a 500 internal_server_error "grammar_failed", "NoExtensionBias"; streamed, "a" and then that
    error. llguidance cannot tell before the answer begins; it is still the constraint that is at fault."""
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "guided_grammar": 'start: "a" /[^\\s\\S]/'}
    r = plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "guided_grammar", error
    assert "admits no continuation" in error["message"] and "'a'" in error["message"], error
    with plainhttp.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as s:
        events = [line[len("data: ") :] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"] == error, events


def test_streamed_content_with_a_call_adds_up_to_the_whole_answers(client: openai.OpenAI) -> None:
    """Leading whitespace before text and a call: the whole answer's content was stripped ("Hi"), the
    stream's was not ("  Hi"). Both keep it now, as vLLM's Hermes parser keeps the text before a call."""
    text = '  Hi <tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    kwargs: dict = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": [TIME],
        "temperature": 0,
        "max_tokens": 60,
        "extra_body": {"guided_regex": re.escape(text)},
    }
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].message.content == "  Hi" and whole.choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "  Hi"


@pytest.mark.parametrize(
    ("tools", "param", "words"),
    [
        (
            [{**TIME, "function": {**TIME["function"], "name": "bad name!" + "x" * 80}}],
            "tools[0].function.name",
            "a-z",
        ),
        ([{**TIME, "function": {**TIME["function"], "name": "f" * 65}}], "tools[0].function.name", "64"),
        ([{**TIME, "function": {**TIME["function"], "name": "f"}}] * 2, "tools[1].function.name", "tools[0]"),
    ],
)
def test_tool_names_are_checked_as_openai_checks_them(
    server: InProcessServer, tools: list, param: str, words: str
) -> None:
    """A name OpenAI refuses, or two tools of one name (the prompt then showed only the second), were 200s."""
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "tools": tools}
    r = plainhttp.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
