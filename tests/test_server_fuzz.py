"""Fuzz the server with schemathesis against its own OpenAPI schema: no 500s, no hangs."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hypothesis
import hypothesis.strategies as st
import plainhttp
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from server_util import InProcessServer, running_server


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    # Small limits keep every generated request short: a fuzzed max_tokens cannot run for long.
    # Runtime LoRA updates on, so their endpoints are fuzzed past the refusal of a server without them.
    args = ("--served-model-name", "tiny", "--max-model-len", "64", "--allow-runtime-lora-updates")
    with running_server(tiny_model, *args) as s:
        yield s


def test_no_server_errors(server: InProcessServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    ops = [op.ok() for op in schema.get_all_operations()]
    posts = [op for op in ops if op.method.upper() == "POST"]
    assert {op.path for op in posts} == {
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
        "/v1/responses",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
    }
    statuses: Counter[tuple[str, int]] = Counter()

    def fuzz(op: schemathesis.APIOperation) -> None:
        @settings(
            max_examples=60,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        @hypothesis.given(case=op.as_strategy())
        def run(case: schemathesis.Case) -> None:
            if isinstance(case.body, dict):
                case.body["model"] = "tiny"  # past the model check, into validation and generation
            # A refusal names its field: the body goes again without it, so a fuzzed body with one bad field
            # among many still reaches generation with the rest. (A body of some 40 fields drawn at random
            # is seldom valid whole, and which bodies come depends on the strings hypothesis draws from the
            # modules a process has imported: in a whole run's worker no chat body was once, and with eight
            # rounds no chat body came through once more modules were imported. So: a round per field.)
            for _ in range(len(case.body) + 1 if isinstance(case.body, dict) else 1):
                response = case.call(base_url=server.url, timeout=30)
                _check(op.path, case, response, statuses)
                param = response.json().get("error", {}).get("param") if response.status_code == 400 else None
                field = param.split(".")[0] if isinstance(param, str) else None
                if not isinstance(case.body, dict) or field not in case.body or field == "model":
                    return
                del case.body[field]

        run()

    for op in ops:
        fuzz(op)
    assert len(ops) >= 10
    # The fuzzer reached both the generation path and the validation path of each endpoint.
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
        assert statuses[(path, 200)] > 0 and statuses[(path, 400)] > 0, str(sorted(statuses.items()))


def _check(path: str, case: schemathesis.Case, response: Any, statuses: Counter[tuple[str, int]]) -> None:
    statuses[(path, response.status_code)] += 1
    if response.status_code == 504:  # the documented answer to the request's own short deadline
        assert isinstance(case.body, dict) and case.body.get("timeout"), response.text[:300]
        assert response.json()["error"]["code"] == "deadline_exceeded"
        return
    assert response.status_code < 500, (response.status_code, response.text[:300])


def _with_surrogates(value: object, draw: st.DrawFn) -> object:
    """`value` with a lone surrogate spliced into some of its strings (JSON's "\\ud800" escapes parse into
    such strings, which no UTF-8 text can hold)."""
    if isinstance(value, str) and draw(st.booleans()):
        at = draw(st.integers(0, len(value)))
        return value[:at] + chr(draw(st.integers(0xD800, 0xDFFF))) + value[at:]
    if isinstance(value, dict):
        return {k: v if k == "model" else _with_surrogates(v, draw) for k, v in value.items()}
    if isinstance(value, list):
        return [_with_surrogates(v, draw) for v in value]
    return value


def test_lone_surrogates_anywhere_are_400s(server: InProcessServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    posts = [op.ok() for op in schema.get_all_operations() if op.ok().method.upper() == "POST"]
    statuses: Counter[int] = Counter()

    def fuzz(path: str, strategy: st.SearchStrategy[schemathesis.Case]) -> None:
        @settings(
            max_examples=40,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            derandomize=True,
        )
        @hypothesis.given(case=strategy, data=st.data())
        def run(case: schemathesis.Case, data: st.DataObject) -> None:
            if not isinstance(case.body, dict):
                return
            body = _with_surrogates({**case.body, "model": "tiny"}, data.draw)
            # json.dumps writes a lone surrogate as its \\u escape, as a client in any language may.
            response = plainhttp.post(
                f"{server.url}{path}",
                content=json.dumps(body),
                headers={"content-type": "application/json"},
                timeout=30,
            )
            statuses[response.status_code] += 1
            if response.status_code == 504:
                assert body.get("timeout"), response.text[:300]
                return
            assert response.status_code < 500, (response.status_code, response.text[:300])
            if response.status_code >= 400:
                assert set(response.json()) == {"error"}, response.text[:300]
            elif _has_surrogate(body):
                raise AssertionError(f"a body holding a lone surrogate was served: {response.text[:300]}")

        run()

    for op in posts:
        fuzz(op.path, op.as_strategy())
    assert statuses[400] > 0, statuses


def _has_surrogate(value: object) -> bool:
    if isinstance(value, str):
        return any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(_has_surrogate(k) or _has_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_has_surrogate(v) for v in value)
    return False
