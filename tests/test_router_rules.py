"""Model routing rules (router/ember_router/rules.py) as pure functions, with property tests."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ember_router.rules import Request, Rule, decide, matches, parse_route, requested_max_tokens


def req(prompt: int = 10, max_tokens: int | None = 16, model: str | None = "big", **headers: str) -> Request:
    return Request(prompt, max_tokens, {k.lower(): v for k, v in headers.items()}, model)


RULES = [
    Rule("long-prompts", "big-ctx", min_prompt_tokens=1000),
    Rule("short-answers", "small", max_max_tokens=32),
    Rule("tenant-b", "tenant-b", header="X-Tenant", header_value="b"),
    Rule("by-name", "small", models=("small", "mini")),
]


def test_the_first_matching_rule_wins_in_order() -> None:
    assert decide(RULES, req(prompt=2000, max_tokens=8)) == RULES[0]
    assert decide(RULES, req(prompt=10, max_tokens=8)) == RULES[1]
    assert decide(RULES, req(max_tokens=100, **{"x-tenant": "b"})) == RULES[2]
    assert decide(RULES, req(max_tokens=100, model="mini")) == RULES[3]
    assert decide(RULES, req(max_tokens=100)) is None


def test_a_header_rule_compares_names_case_insensitively_and_values_exactly() -> None:
    rule = Rule("h", "t", header="X-Tenant", header_value="b")
    assert matches(rule, req(**{"x-tenant": "b"}))
    assert not matches(rule, req(**{"x-tenant": "B"}))
    assert not matches(rule, req())
    assert matches(Rule("present", "t", header="x-tenant"), req(**{"x-tenant": "anything"}))


def test_a_request_without_max_tokens_meets_no_max_tokens_bound() -> None:
    assert not matches(Rule("r", "t", max_max_tokens=32), req(max_tokens=None))
    assert matches(Rule("r", "t", min_prompt_tokens=1), req(max_tokens=None))


def test_requested_max_tokens_prefers_max_completion_tokens() -> None:
    assert requested_max_tokens({"max_tokens": 5, "max_completion_tokens": 7}) == 7
    assert requested_max_tokens({"max_tokens": 5}) == 5
    assert requested_max_tokens({"max_tokens": True}) is None
    assert requested_max_tokens(["not", "a", "body"]) is None


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(0, 10_000))
def test_a_prompt_bound_is_an_interval(low: int, width: int, prompt: int) -> None:
    rule = Rule("r", "t", min_prompt_tokens=low, max_prompt_tokens=low + width)
    assert matches(rule, req(prompt=prompt)) == (low <= prompt <= low + width)


@given(
    st.lists(
        st.builds(
            Rule,
            name=st.text(min_size=1, max_size=4),
            target=st.sampled_from(["a", "b", "c"]),
            min_prompt_tokens=st.none() | st.integers(0, 100),
            max_max_tokens=st.none() | st.integers(0, 100),
            models=st.sampled_from([(), ("big",), ("small",)]),
        ),
        max_size=6,
    ),
    st.integers(0, 100),
    st.none() | st.integers(0, 100),
    st.sampled_from(["big", "small"]),
)
def test_decide_returns_a_matching_rule_and_no_earlier_rule_matches(
    rules: list[Rule], prompt: int, max_tokens: int | None, model: str
) -> None:
    request = req(prompt=prompt, max_tokens=max_tokens, model=model)
    chosen = decide(rules, request)
    if chosen is None:
        assert not any(matches(r, request) for r in rules)
    else:
        index = rules.index(chosen)
        assert matches(chosen, request)
        assert not any(matches(r, request) for r in rules[:index])


def test_a_route_parses_from_json_and_a_bad_one_is_refused_by_name() -> None:
    rule, url = parse_route(
        '{"name": "short", "target": "small", "url": "http://small", "maxMaxTokens": 64, "header": "X-Tier",'
        ' "models": ["a"]}'
    )
    assert url == "http://small"
    assert rule == Rule("short", "small", max_max_tokens=64, header="X-Tier", models=("a",))
    for text, message in [
        ('{"name": "r", "target": "t"}', "'url'"),
        ('{"name": "r", "target": "t", "url": "u", "maxTokens": 3}', "unknown route field(s): maxTokens"),
        (
            '{"name": "r", "target": "t", "url": "u", "minPromptTokens": "9"}',
            "minPromptTokens must be an integer",
        ),
        ("[1]", "JSON object"),
        # a negative bound was taken (the CRD's routing refuses it: minimum 0), a rule no request could meet
        (
            '{"name": "r", "target": "t", "url": "u", "maxMaxTokens": -1}',
            "route r: maxMaxTokens must be >= 0, got -1",
        ),
        ('{"name": "r", "target": "t", "url": "u", "minPromptTokens": -5}', "minPromptTokens must be >= 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_route(text)


def test_the_router_imports_no_torch() -> None:
    # Its install extra has no torch: reading tools and response formats must not pull it in.
    code = "import sys, ember_router.main, ember_router.proxy; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
