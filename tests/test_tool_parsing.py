"""Tool-call blocks in model text: whole responses and streams fed in arbitrary pieces agree."""

from __future__ import annotations

import json

import pytest

from ember_engine.server.protocol import APIError
from ember_engine.server.tools import ToolStream, parse_tool_calls, plan_tools

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
TEXT = f"Let me look.\n{CALL}\n{CALL.replace('f', 'g')}"


def test_parse_whole_text() -> None:
    content, calls = parse_tool_calls(TEXT)
    assert content == "Let me look." and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].arguments) == {"x": 1} and calls[0].id != calls[1].id
    content, calls = parse_tool_calls(TEXT, parallel=False)
    assert [c.name for c in calls] == ["f"] and "<tool_call>" in content
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])
    assert parse_tool_calls("<tool_c") == ("<tool_c", [])


@pytest.mark.parametrize("size", [1, 2, 5, 11, 1000])
def test_stream_in_pieces_matches_whole(size: int) -> None:
    stream = ToolStream()
    content, names = "", []
    for start in range(0, len(TEXT), size):
        piece = TEXT[start : start + size]
        text, calls = stream.feed(piece, final=start + size >= len(TEXT))
        assert "<tool" not in text  # a block's start is held back until decided
        content += text
        names += [c.name for c in calls]
    assert content.strip() == "Let me look." and names == ["f", "g"]


def test_stream_releases_held_text_that_was_no_call() -> None:
    stream = ToolStream()
    assert stream.feed("a <tool") == ("a", [])  # the space held until it is known not to end the answer
    assert stream.feed("box> b", final=True) == (" <toolbox> b", [])


def test_plan_refuses_bad_tools_by_name() -> None:
    with pytest.raises(APIError, match=r"tools\[0\]"):
        plan_tools([{"type": "retrieval"}], None, None)
    with pytest.raises(APIError, match="tool_choice: requires tools"):
        plan_tools(None, "required", None)
    fn = {"type": "function", "function": {"name": "f"}}
    plan = plan_tools([fn], {"type": "function", "function": {"name": "f"}}, None)
    assert plan is not None and plan.constraint is not None and not plan.parallel
    none = plan_tools([fn], "none", None)
    assert none is not None and not none.parse and none.constraint is None


@pytest.mark.parametrize(
    "text",
    [
        f"Sure. {CALL}\n{CALL} done",  # whitespace between calls was dropped: "Sure.  done"
        f"Hi {CALL} there  ",
        f"Let me look.\n{CALL}\n\n",
        f"{CALL}\n  and {CALL}\n",
        f"A {CALL} b {CALL.replace('{', '{{')} c",  # a block that is no call stays text
        f"  Hi {CALL}",  # the whole answer's content was "Hi", the stream's "  Hi"
        f"\n{CALL} after",
    ],
)
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_content_is_the_whole_texts_content(text: str, parallel: bool, size: int) -> None:
    """What a stream's content deltas add up to is the content of the whole answer, whitespace and all."""
    whole, calls = parse_tool_calls(text, parallel=parallel)
    stream = ToolStream(parallel=parallel)
    content, names = "", []
    for start in range(0, len(text), size):
        piece, new = stream.feed(text[start : start + size], final=start + size >= len(text))
        content += piece
        names += [c.name for c in new]
    assert content == whole and names == [c.name for c in calls]


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "g"}}])
def test_a_tool_whose_parameters_are_no_json_schema_is_refused_by_name(choice: object) -> None:
    """Under "required" or a named call the error was the grammar engine's, naming tool_choice and listing
    ember's own grammar; under "auto" the tool reached the model unchecked. OpenAI refuses such a schema."""
    good = {"type": "function", "function": {"name": "f"}}
    bad = {
        "type": "function",
        "function": {
            "name": "g",
            "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}},
        },
    }
    with pytest.raises(APIError) as refused:
        plan_tools([good, bad], choice, None)
    assert refused.value.param == "tools"
    assert str(refused.value).startswith(
        "tools[1].function.parameters: not a JSON schema: 'nonsense' is not valid"
    )


def test_the_text_before_a_call_keeps_its_leading_whitespace() -> None:
    """As vLLM's Hermes parser keeps the text before a call as written: a stream cannot know, while it
    sends "  Hi", that a call will follow, so the whole answer keeps it too. Whitespace at the end goes."""
    assert parse_tool_calls(f"  Hi \n{CALL}\n")[0] == "  Hi"
    assert parse_tool_calls(f"\n{CALL}\n")[0] == ""


def test_tool_names_are_refused_as_openai_refuses_them() -> None:
    fn = {"type": "function", "function": {"name": "f"}}
    for name, words in (("bad name!", "a-z"), ("x" * 65, "64"), ("", "a-z"), (3, "a-z")):
        with pytest.raises(APIError, match=words) as refused:
            plan_tools([fn, {"type": "function", "function": {"name": name}}], None, None)
        assert refused.value.param == "tools[1].function.name"
    with pytest.raises(APIError, match=r"tools\[2\].function.name: 'f' is also tools\[0\]'s name") as refused:
        plan_tools([fn, {"type": "function", "function": {"name": "g"}}, fn], None, None)
    assert refused.value.param == "tools[2].function.name"
    assert plan_tools([{"type": "function", "function": {"name": "a-Z_09" + "x" * 58}}], None, None)
