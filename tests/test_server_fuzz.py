"""Fuzz the server with schemathesis against its own OpenAPI schema: no 500s, no hangs."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from server_util import InProcessServer, running_server


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    # Small limits keep every generated request short: a fuzzed max_tokens cannot run for long.
    with running_server(tiny_model, "--served-model-name", "tiny", "--max-model-len", "64") as s:
        yield s


def test_no_server_errors(server: InProcessServer) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    ops = [op.ok() for op in schema.get_all_operations()]
    posts = [op for op in ops if op.method.upper() == "POST"]
    assert {op.path for op in posts} == {"/v1/completions", "/v1/chat/completions"}
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
            response = case.call(base_url=server.url, timeout=30)
            statuses[(op.path, response.status_code)] += 1
            if response.status_code == 504:  # the documented answer to the request's own short deadline
                assert isinstance(case.body, dict) and case.body.get("timeout"), response.text[:300]
                assert response.json()["error"]["code"] == "deadline_exceeded"
                return
            assert response.status_code < 500, (response.status_code, response.text[:300])

        run()

    for op in ops:
        fuzz(op)
    assert len(ops) >= 6
    # The fuzzer reached both the generation path and the validation path of each endpoint.
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert statuses[(path, 200)] > 0 and statuses[(path, 400)] > 0, statuses
