"""API keys on `ember serve` and `ember router`: with keys given, a request needs `Authorization: Bearer KEY`,
or it is a 401 in OpenAI's shape before its body is read; probes, scrapes and the version stay open; the
router presents its key to its engines; a fallback gets EMBER_FALLBACK_API_KEY's key, never the client's."""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import plainhttp
import pytest
from fake_fallback import fake_fallback
from server_util import InProcessServer, running_server
from test_server_robustness import LONG, MODEL, _hold, metrics, wait_for, write_policy
from waiting import free_port

from ember_engine.server.api_keys import ApiKeys, given_keys, key_problem
from ember_router import main as router_main
from ember_router.embedded import serving
from ember_router.proxy import Router

KEYS = ("sk-first", "sk-second")
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model: Path) -> Iterator[InProcessServer]:
    extra = ["--served-model-name", MODEL, "--max-request-body-bytes", "1000"]
    with running_server(tiny_model, *extra, "--api-key", KEYS[0], "--api-key", KEYS[1]) as s:
        yield s


def _client(server: InProcessServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


def _refused(response: httpx.Response, message: str) -> None:
    assert response.status_code == 401, response.text
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.headers["x-request-id"]
    error = response.json()["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "invalid_api_key",
        None,
    )
    assert error["message"] == message


def test_either_key_is_served_through_the_openai_client(server: InProcessServer) -> None:
    for key in KEYS:
        client = _client(server, key)
        answer = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        chunks = list(
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
            )
        )
        assert chunks and chunks[-1].choices[0].finish_reason == "length"
        assert [m.id for m in client.models.list()] == [MODEL]


def test_a_wrong_key_is_the_openai_clients_authentication_error(server: InProcessServer) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        _client(server, "sk-wrong").completions.create(model=MODEL, prompt="hello", max_tokens=3)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"


@pytest.mark.parametrize(
    ("headers", "message"),
    [
        ([], "no API key: send one as 'Authorization: Bearer KEY'"),
        ([("Authorization", "Bearer sk-first-but-longer")], "incorrect API key"),
        ([("Authorization", "Bearer sk-firs")], "incorrect API key"),
        ([("Authorization", "Basic c2stZmlyc3Q6")], "the Authorization header must be 'Bearer KEY'"),
        ([("Authorization", "Bearer")], "the Authorization header must be 'Bearer KEY'"),
        ([("Authorization", "sk-first")], "the Authorization header must be 'Bearer KEY'"),
        (
            [("Authorization", "Bearer sk-wrong"), ("Authorization", f"Bearer {KEYS[0]}")],
            "more than one Authorization header",
        ),
    ],
)
def test_what_is_not_one_bearer_key_is_refused(
    server: InProcessServer, headers: list[tuple[str, str]], message: str
) -> None:
    _refused(plainhttp.post(f"{server.url}/v1/completions", json=PROMPT, headers=headers), message)


def test_the_scheme_is_case_blind_as_http_says(server: InProcessServer) -> None:
    headers = {"Authorization": f"bearer {KEYS[1]}"}
    assert plainhttp.post(f"{server.url}/v1/completions", json=PROMPT, headers=headers).status_code == 200


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", f"/v1/models/{MODEL}"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/responses"),
        ("GET", "/v1/responses/resp_x"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/load"),
        ("GET", "/v1/kv_events"),
        ("POST", "/v1/load_lora_adapter"),
        ("GET", "/no/such/route"),
    ],
)
def test_every_other_route_needs_a_key(server: InProcessServer, method: str, path: str) -> None:
    response = plainhttp.request(method, f"{server.url}{path}", json={} if method == "POST" else None)
    _refused(response, "no API key: send one as 'Authorization: Bearer KEY'")


@pytest.mark.parametrize("path", ["/health", "/ready", "/metrics", "/version"])
def test_probes_scrapes_and_the_version_stay_open(server: InProcessServer, path: str) -> None:
    assert plainhttp.get(f"{server.url}{path}").status_code == 200


def test_a_refused_requests_body_is_never_read(server: InProcessServer) -> None:
    # Over --max-request-body-bytes (1000): with the key it is a 413, without one the 401 comes first.
    big = {**PROMPT, "prompt": "x" * 2000}
    assert plainhttp.post(f"{server.url}/v1/completions", json=big).status_code == 401
    with_key = {"Authorization": f"Bearer {KEYS[0]}"}
    assert plainhttp.post(f"{server.url}/v1/completions", json=big, headers=with_key).status_code == 413


KEY = {"Authorization": f"Bearer {KEYS[0]}"}


def _busy(s: InProcessServer) -> list[threading.Thread]:
    """With --max-num-seqs 1: one request (with its key) decoding and one queued behind it."""
    started = threading.Event()
    holds = [_hold(s.url, {**LONG, "max_tokens": 300}, started, headers=KEY)]
    assert started.wait(30)
    holds.append(_hold(s.url, {**LONG, "max_tokens": 300}, headers=KEY))
    wait_for(lambda: sum(s.state.queued.values()) == 1)
    return holds


def test_the_fallback_gets_its_own_key_not_the_clients(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_server(tiny_model, "--served-model-name", "fb", "--api-key", "sk-fallback") as fb:
        policy = write_policy(
            tmp_path / "policy.yaml", {"loadShedding": {"maxQueueDepth": 1}, "fallback": {"url": fb.url}}
        )
        monkeypatch.setenv("EMBER_FALLBACK_API_KEY", "sk-fallback")
        extra = ["--served-model-name", MODEL, "--max-num-seqs", "1", "--policy", str(policy)]
        with running_server(tiny_model, *extra, "--api-key", KEYS[0]) as s:
            holds = _busy(s)
            # One request runs, one waits, and the queue holds one: this one overflows to the fallback.
            answer = plainhttp.post(f"{s.url}/v1/completions", json=PROMPT, headers=KEY, timeout=30)
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-ember-served-by"] == "fallback" and answer.json()["model"] == "fb"
            monkeypatch.setenv("EMBER_FALLBACK_API_KEY", "sk-other")
        # Without the fallback's key (here: a wrong one) the fallback refuses, and the client gets the
        # engine's own overload answer, not the fallback's 401.
        with running_server(tiny_model, *extra, "--api-key", KEYS[0]) as s:
            holds += _busy(s)
            answer = plainhttp.post(f"{s.url}/v1/completions", json=PROMPT, headers=KEY, timeout=30)
            assert answer.status_code in (429, 503) and answer.headers["retry-after"], answer.text
            assert answer.json()["error"]["message"].startswith("queue full")
            assert metrics(s.url)[("ember:fallback_requests_total", (("outcome", "failed"),))] == 1
        for hold in holds:
            hold.join(60)
        wait_for(lambda: fb.state.engine is not None and fb.state.engine.stats().num_running == 0)


def test_keys_come_from_the_flags_else_the_environment() -> None:
    assert given_keys(["a", "b"], {"EMBER_API_KEY": "c"}) == ["a", "b"]
    assert given_keys(None, {"EMBER_API_KEY": "c"}) == ["c"]
    assert given_keys(None, {"EMBER_API_KEY": ""}) == given_keys(None, {}) == []
    assert key_problem(["ok", ""]) == "--api-key: an empty key"
    assert key_problem(["has space"]) == "--api-key: a key may hold only printable ASCII without spaces"
    assert key_problem(["sk-é"]) is not None and key_problem(["sk-1", "sk-2"]) is None
    assert not ApiKeys([]) and ApiKeys([]).refusal("/v1/completions", []) is None


def test_ember_serve_refuses_a_key_it_cannot_check_before_loading(tiny_model: Path) -> None:
    ember = str(Path(sys.executable).parent / "ember")
    run = subprocess.run(
        [ember, "serve", "--model", str(tiny_model), "--api-key", "two words"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 2
    assert run.stderr.strip().endswith(
        "ember serve: --api-key: a key may hold only printable ASCII without spaces"
    )


# -- through `ember router` --------------------------------------------------------------------------------


def _router(*argv: str) -> Router:
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    return router_main.build(parser.parse_args([*argv, "--poll-interval", "0.1"]))


def test_the_router_checks_the_key_and_presents_it_to_its_engines(
    tiny_model: Path, server: InProcessServer
) -> None:
    router = _router("--model", str(tiny_model), "--endpoint", server.url, "--api-key", KEYS[1])
    with serving(router) as url:
        # Its own requests to the engine (/v1/load, /v1/kv_events) carry its key: the engine is Ready there
        # and its prefix-cache events reach the router.
        engine = router.pool.engines[server.url]
        wait_for(lambda: engine.state.ready and engine.events_live, timeout=10)
        for path in ("/health", "/ready", "/metrics"):
            assert plainhttp.get(f"{url}{path}").status_code == 200, path
        requests_before = _served(server)
        _refused(
            plainhttp.post(f"{url}/v1/completions", json=PROMPT),
            "no API key: send one as 'Authorization: Bearer KEY'",
        )
        _refused(
            plainhttp.get(f"{url}/v1/models", headers=KEY), "incorrect API key"
        )  # the engine's, not the router's
        assert _served(server) == requests_before  # refused by the router: the engine saw nothing
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEYS[1], max_retries=0)
        assert [m.id for m in client.models.list()] == [MODEL]  # asked of the engine with the router's key
        answer = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0)
        assert answer.usage is not None and answer.usage.completion_tokens == 3
        assert _served(server) == requests_before + 1


def _served(server: InProcessServer) -> float:
    return sum(v for (name, _), v in metrics(server.url).items() if name == "vllm:request_success_total")


def test_the_routers_fallback_gets_its_own_key_not_the_clients(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBER_FALLBACK_API_KEY", "sk-fallback")
    monkeypatch.setenv("EMBER_API_KEY", "sk-router")
    nowhere = f"http://127.0.0.1:{free_port()}"  # no engine is ever Ready: everything goes to the fallback
    with fake_fallback() as fallback:
        router = _router("--model", str(tiny_model), "--endpoint", nowhere, "--fallback-url", fallback.url)
        with serving(router) as url:
            assert plainhttp.post(f"{url}/v1/completions", json=PROMPT).status_code == 401
            answer = plainhttp.post(
                f"{url}/v1/completions",
                json=PROMPT,
                headers={"Authorization": "Bearer sk-router"},
                timeout=30,
            )
            assert answer.status_code == 200 and answer.headers["x-ember-served-by"] == "fallback", (
                answer.text
            )
    assert [seen.getall("Authorization") for seen in fallback.seen] == [["Bearer sk-fallback"]]


def test_ember_router_refuses_a_key_it_cannot_check(tiny_model: Path) -> None:
    with pytest.raises(SystemExit, match=r"^ember router: --api-key: an empty key$"):
        _router("--model", str(tiny_model), "--endpoint", "http://127.0.0.1:1", "--api-key", "")
