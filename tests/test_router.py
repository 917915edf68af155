"""`ember router` in front of real `ember serve` engines, through the official `openai` client and raw HTTP:
streaming and not, prefix routing from the engines' own events, retry on an overloaded engine, fleet-level
shedding, and a client that goes away aborting its request in the engine."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai
import plainhttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from server_util import InProcessServer, running_server
from waiting import free_port, wait_for

from ember_engine.core.kv_events import prefix_hashes
from ember_engine.core.tokenizer import Tokenizer
from ember_engine.server.policy import Fallback, Policy
from ember_router import main as router_main
from ember_router.embedded import serving
from ember_router.fallback import from_flags
from ember_router.pool import EnginePool
from ember_router.proxy import ROUTE_REASON, ROUTED_TO, Router, RouterSettings
from ember_router.rules import Rule


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A /metrics page as (sample name, sorted labels without model_name) -> value."""
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@contextmanager
def running_router(
    model: Path, urls: list[str], poll_interval: float = 0.1, settings: RouterSettings | None = None
) -> Iterator[tuple[str, Router]]:
    pool = EnginePool(urls, poll_interval=poll_interval)
    router = Router(pool, Tokenizer(str(model)), settings or RouterSettings())
    with serving(router) as url:
        wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
        wait_for(lambda: all(e.state.ready for e in router.pool.engines.values()), what="every engine polled")
        yield url, router


@pytest.fixture(scope="module")
def engines(tiny_model: Path) -> Iterator[list[InProcessServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(running_server(tiny_model, "--block-size", "16")) for _ in range(2)]


def test_completions_and_chat_stream_and_not_through_the_router(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    with running_router(tiny_model, [e.url for e in engines]) as (url, _router):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="def f(x):", max_tokens=5)
        assert reply.choices[0].text is not None and reply.usage is not None
        chunks = list(
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
            )
        )
        assert len(chunks) >= 2 and chunks[-1].choices[0].finish_reason is not None
        raw = plainhttp.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2})
        assert raw.headers[ROUTED_TO] in {e.url for e in engines} and raw.headers[ROUTE_REASON]
        bad = plainhttp.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": -1})
        assert bad.status_code == 400 and "error" in bad.json()  # the engine's own answer, relayed


def test_a_shared_prefix_goes_where_the_engines_say_it_is_cached(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    tok = Tokenizer(str(tiny_model))
    system = " ".join(f"word{i}" for i in range(150))  # several full blocks
    with running_router(tiny_model, [e.url for e in engines]) as (url, router):
        model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
        # Warm engine 1 directly: only its own events can tell the router.
        prompt = system + " question one"
        assert len(tok.encode(prompt)) > 64
        plainhttp.post(
            f"{engines[1].url}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 1},
            timeout=60,
        )
        hashes = prefix_hashes(tok.encode(prompt), 16)
        wait_for(
            lambda: router.pool.index.matched_blocks(engines[1].url, hashes) >= 4,
            what="engine 1's events announcing the prompt's blocks",
        )
        assert router.pool.index.matched_blocks(engines[0].url, hashes) == 0
        for q in ("question two", "question three", "question four"):
            r = plainhttp.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": f"{system} {q}", "max_tokens": 1},
                timeout=60,
            )
            assert r.status_code == 200
            assert r.headers[ROUTED_TO] == engines[1].url and r.headers[ROUTE_REASON] == "prefix"
        page = plainhttp.get(f"{url}/metrics").text
        assert "ember_router:predicted_prefix_hit_tokens_total" in page
        # A request that collects its prompt's logprobs reads no cached block on any engine: routed by load
        # (it was sent by prefix, and counted as expected cache hits).
        hits = _total(_samples(page), "ember_router:predicted_prefix_hit_tokens_total")
        for extra in ({"prompt_logprobs": 1}, {"echo": True, "logprobs": 1}):
            body = {"model": model, "prompt": f"{system} question five", "max_tokens": 1, **extra}
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200 and r.headers[ROUTE_REASON] == "load", r.headers[ROUTE_REASON]
        after = _samples(plainhttp.get(f"{url}/metrics").text)
        assert _total(after, "ember_router:predicted_prefix_hit_tokens_total") == hits


def test_an_overloaded_engine_is_skipped_and_a_full_fleet_sheds_at_once(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    with running_router(tiny_model, [e.url for e in engines], poll_interval=3600) as (url, router):
        model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "hello", "max_tokens": 1}
        engines[0].state.draining = True  # answers 503 draining; the router has not polled since
        try:
            for _ in range(3):
                r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
                assert r.status_code == 200 and r.headers[ROUTED_TO] == engines[1].url
            engines[1].state.draining = True
            router.pool.engines[engines[0].url].state.overloaded_until = 0.0  # let both be tried again
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            # both engines tried refused it: the fleet is overloaded (it was the second engine's own 503)
            assert r.status_code == 503 and r.headers["Retry-After"]
            assert r.json()["error"]["code"] == "fleet_overloaded", r.text
            start = time.perf_counter()
            shed = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            elapsed = time.perf_counter() - start
            assert shed.status_code == 503 and shed.headers["Retry-After"]
            assert (
                shed.json()["error"]["code"] == "fleet_overloaded"
                and shed.json()["error"]["type"] == "overloaded"
            )
            assert elapsed < 0.5, f"a shed must be answered at once, took {elapsed:.3f} s"
        finally:
            engines[0].state.draining = engines[1].state.draining = False


def test_a_client_over_its_own_limit_gets_the_engines_429_and_the_engine_stays_in_rotation(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    # A 429 is about the client, not the engine: relayed as it is, neither retried elsewhere (which would
    # lift the client's limit) nor taken as the engine being overloaded for everyone else.
    watcher = engines[0].state.policy
    before = watcher.policy
    shedding = before.load_shedding.model_copy(update={"max_concurrent_per_client": 1})
    watcher.policy = before.model_copy(update={"load_shedding": shedding})
    engines[0].state.client_in_flight["alice"] += 1  # one request of alice's already in flight
    try:
        with running_router(tiny_model, [engines[0].url], poll_interval=3600) as (url, router):
            model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
            body = {"model": model, "prompt": "hello", "max_tokens": 1}
            r = plainhttp.post(
                f"{url}/v1/completions", json=body, headers={"x-ember-client": "alice"}, timeout=60
            )
            assert r.status_code == 429 and r.headers["Retry-After"], r.text
            assert r.json()["error"]["code"] == "client_limit"
            routed = _samples(plainhttp.get(f"{url}/metrics").text)  # refused: no prompt, no first token
            assert routed[("ember_router:prompt_tokens_total", ())] == 0
            assert routed[("ember_router:time_to_first_token_seconds_count", ())] == 0
            assert router.pool.engines[engines[0].url].state.overloaded_until <= time.monotonic()
            r = plainhttp.post(
                f"{url}/v1/completions", json=body, headers={"x-ember-client": "bob"}, timeout=60
            )
            assert r.status_code == 200 and r.headers[ROUTED_TO] == engines[0].url
    finally:
        engines[0].state.client_in_flight["alice"] -= 1
        watcher.policy = before


def _total(page: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str) -> float:
    return sum(v for (n, _), v in page.items() if n == name)


def test_the_router_counts_the_prompt_tokens_the_engine_counts(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """The dashboard sets the router's predicted prefix hits over its prompt tokens beside the engines' hits
    over their queries: every prompt of a batch counts, and a request the engine refuses counts nowhere
    (nor is it a first token at the router)."""
    with running_router(tiny_model, [engines[0].url]) as (url, _router):
        model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]

        def pages() -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], ...]:
            return _samples(plainhttp.get(f"{url}/metrics").text), _samples(
                plainhttp.get(f"{engines[0].url}/metrics").text
            )

        routed0, engine0 = pages()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        batch = client.completions.create(
            model=model, prompt=["alpha beta gamma", "delta epsilon zeta eta", "theta iota"], max_tokens=2
        )
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=2
        )
        assert batch.usage is not None and chat.usage is not None
        routed1, engine1 = pages()
        used = batch.usage.prompt_tokens + chat.usage.prompt_tokens
        assert (
            _total(engine1, "vllm:prompt_tokens_total") - _total(engine0, "vllm:prompt_tokens_total") == used
        )
        assert (
            _total(routed1, "ember_router:prompt_tokens_total")
            - _total(routed0, "ember_router:prompt_tokens_total")
            == used
        )
        for refused in (
            {"model": model, "prompt": "hello there", "max_tokens": 100000},  # over the context
            {"model": model, "prompt": ["one", "two"], "max_tokens": -1},
        ):
            r = plainhttp.post(f"{url}/v1/completions", json=refused, timeout=60)
            assert r.status_code == 400, r.text
        routed2, engine2 = pages()
        assert _total(engine2, "vllm:prompt_tokens_total") == _total(engine1, "vllm:prompt_tokens_total")
        for name in ("ember_router:prompt_tokens_total", "ember_router:time_to_first_token_seconds_count"):
            assert _total(routed2, name) == _total(routed1, name), name


def test_the_routers_time_to_first_token_is_that_of_streams_and_never_a_whole_answers(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """A whole answer's first byte comes with its last: observed as a first token, it made the router's TTFT
    its end-to-end latency. A stream's first event is its first token."""
    with running_router(tiny_model, [engines[0].url]) as (url, _router):
        model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "count", "max_tokens": 40, "ignore_eos": True}

        def counts() -> tuple[float, float]:
            page = _samples(plainhttp.get(f"{url}/metrics").text)
            return (
                page[("ember_router:time_to_first_token_seconds_count", ())],
                page[("ember_router:e2e_request_latency_seconds_count", ())],
            )

        before = counts()
        for _ in range(2):
            assert plainhttp.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
            chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            assert plainhttp.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 200
        after_whole = counts()
        assert after_whole == (before[0], before[1] + 4)
        page = _samples(plainhttp.get(f"{url}/metrics").text)
        ttft_sum = page[("ember_router:time_to_first_token_seconds_sum", ())]
        e2e_sum = page[("ember_router:e2e_request_latency_seconds_sum", ())]
        with plainhttp.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            assert "data: [DONE]" in list(r.iter_lines())
        assert counts() == (after_whole[0] + 1, after_whole[1] + 1)
        page = _samples(plainhttp.get(f"{url}/metrics").text)
        streamed_ttft = page[("ember_router:time_to_first_token_seconds_sum", ())] - ttft_sum
        streamed_e2e = page[("ember_router:e2e_request_latency_seconds_sum", ())] - e2e_sum
        assert streamed_ttft < streamed_e2e  # its first token before its 40th


def test_a_client_that_goes_away_aborts_its_request_in_the_engine(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    with running_router(tiny_model, [engines[0].url]) as (url, _router):
        model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "go", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with plainhttp.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        # The engine stops generating within a few steps of the disconnect.
        wait_for(
            lambda: engines[0].state.engine.stats().num_running == 0,
            timeout=10,
            what="the request aborted in the engine",
        )


def test_what_no_engine_can_take_goes_to_the_fallback(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
    settings = RouterSettings(fallback=from_flags(engines[1].url, model, frozenset({"Overloaded"})))
    with running_router(tiny_model, [engines[0].url], poll_interval=3600, settings=settings) as (
        url,
        _router,
    ):
        body = {"model": model, "prompt": "hello", "max_tokens": 1}

        def engine_sheds() -> float:
            page = _samples(plainhttp.get(f"{engines[0].url}/metrics").text)
            return sum(v for (name, _), v in page.items() if name == "ember:requests_shed_total")

        sheds_before = engine_sheds()
        engines[0].state.draining = True
        try:
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.headers["x-ember-served-by"] == "fallback" and r.headers[ROUTED_TO] == engines[1].url
            engines[1].state.draining = True
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded"
            # Each outcome counted once, where the monitoring's alerts read it: the draining engine counted
            # its 503 as a shed, which the router did not pass on (the fallback served that request); the
            # second request the router shed itself after the fallback failed.
            routed = _samples(plainhttp.get(f"{url}/metrics").text)
            assert routed[("ember_router:fallback_requests_total", (("outcome", "served"),))] == 1
            assert routed[("ember_router:fallback_requests_total", (("outcome", "failed"),))] == 1
            assert routed[("ember_router:shed_requests_total", (("reason", "fleet_overloaded"),))] == 1
            assert routed[("ember_router:engine_sheds_retried_total", ())] == 1
            assert engine_sheds() == sheds_before + 1
        finally:
            engines[0].state.draining = engines[1].state.draining = False


def test_when_every_engine_tried_refuses_or_is_gone_the_fallback_takes_the_request(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """With two engines or more, the second engine's refusal was relayed to the client (its own 503, or a
    502 when it could not be reached) and the fallback never tried; `/v1/models` answered 502 when the
    first Ready engine had gone, though another was Ready."""
    model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": "hello", "max_tokens": 1}
    with ExitStack() as stack:
        fallback = stack.enter_context(running_server(tiny_model, "--block-size", "16"))
        settings = RouterSettings(
            fallback=from_flags(fallback.url, model, frozenset({"Overloaded", "Unavailable"}))
        )
        url, _router = stack.enter_context(
            running_router(tiny_model, [e.url for e in engines], poll_interval=3600, settings=settings)
        )
        engines[0].state.draining = engines[1].state.draining = True
        try:
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
        finally:
            engines[0].state.draining = engines[1].state.draining = False
        assert r.status_code == 200, r.text
        assert r.headers["x-ember-served-by"] == "fallback" and r.headers[ROUTED_TO] == fallback.url
    # engines gone between polls: the router saw them Ready, they are unreachable now
    fallback = RouterSettings(fallback=from_flags(engines[0].url, model, frozenset({"Unavailable"})))
    for settings, code in ((RouterSettings(), 503), (fallback, 200)):
        with ExitStack() as stack:
            pair = [stack.enter_context(running_server(tiny_model, "--block-size", "16")) for _ in range(2)]
            url, _router = stack.enter_context(
                running_router(tiny_model, [e.url for e in pair], poll_interval=3600, settings=settings)
            )
            _stop(pair[0])
            listed = plainhttp.get(f"{url}/v1/models", timeout=60)  # from the next Ready engine
            assert listed.status_code == 200 and listed.json()["data"][0]["id"] == model, listed.text
            _router.pool.engines[pair[0].url].state.ready = True  # as if no request had found it gone
            _stop(pair[1])
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == code, r.text
            if code == 503:
                assert r.json()["error"]["code"] == "fleet_overloaded" and r.headers["Retry-After"]
            else:
                assert r.headers["x-ember-served-by"] == "fallback"


def _stop(engine: InProcessServer) -> None:
    engine.server.should_exit = True
    wait_for(lambda: _refused(engine.url), what=f"{engine.url} gone")


def _refused(url: str) -> bool:
    try:
        plainhttp.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.TransportError:  # taken in as the server stopped listening, then closed unanswered
        return False
    return False


def test_a_body_nested_too_deep_for_the_router_to_parse_gets_the_engines_400(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """The router's own parse raised RecursionError: a 500 in plain text."""
    with running_router(tiny_model, [engines[0].url]) as (url, _router):
        deep = "[" * 5000 + "]" * 5000
        r = plainhttp.post(
            f"{url}/v1/completions", content=deep, headers={"content-type": "application/json"}, timeout=60
        )
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_an_engines_fallback_answer_is_counted_by_that_engine_and_not_by_the_router(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """What reads both counters (FallbackActive, the monitoring rules) counts each request once."""
    model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
    watcher = engines[0].state.policy
    kept = watcher.policy
    # The engine hands what it will not serve (it is draining) to the fallback itself.
    watcher.policy = Policy(fallback=Fallback(url=engines[1].url, model=model, when=["Unavailable"]))

    def engine_served() -> float:
        page = _samples(plainhttp.get(f"{engines[0].url}/metrics").text)
        return page[("ember:fallback_requests_total", (("outcome", "served"),))]

    with running_router(tiny_model, [engines[0].url], poll_interval=3600) as (url, _router):
        before = engine_served()
        engines[0].state.draining = True
        try:
            r = plainhttp.post(
                f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}, timeout=60
            )
            assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback"
            assert r.headers[ROUTED_TO] == engines[0].url  # the engine's answer, relayed
            routed = _samples(plainhttp.get(f"{url}/metrics").text)
            assert routed[("ember_router:fallback_requests_total", (("outcome", "served"),))] == 0
            assert engine_served() == before + 1
        finally:
            engines[0].state.draining = False
            watcher.policy = kept


def test_a_fallback_rewritten_in_the_policy_file_takes_effect_while_the_router_runs(
    tiny_model: Path, engines: list[InProcessServer], tmp_path: Path
) -> None:
    """`ember router --policy FILE` reads spec.fallback live, as the engines do: the operator's ConfigMap
    changes, the running router follows (address, model and conditions)."""
    model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
    policy = tmp_path / "policy.yaml"

    def write(fallback: dict[str, object]) -> None:
        # As the kubelet updates a ConfigMap volume: the new file appears whole, by a rename.
        staged = tmp_path / "policy.staged"
        staged.write_text(yaml.safe_dump({"fallback": fallback}))
        staged.replace(policy)

    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    write({"url": nobody, "model": model})
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(tiny_model),
            "--endpoint",
            engines[0].url,
            "--policy",
            str(policy),
            "--poll-interval",
            "3600",
        ]
    )
    router = router_main.build(args)
    body = {"model": model, "prompt": "hello", "max_tokens": 1}
    with serving(router) as url:
        wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
        engines[0].state.draining = True  # it answers 503; no engine takes a request
        try:
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded"
            write({"url": engines[1].url, "model": model, "when": ["Overloaded"]})

            def served_by_the_new_fallback() -> bool:
                r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
                return r.status_code == 200 and r.headers[ROUTED_TO] == engines[1].url

            wait_for(served_by_the_new_fallback, timeout=10, what="the new fallback serving")
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
            assert r.headers["x-ember-served-by"] == "fallback" and r.json()["model"] == model
            # The conditions too: only with no engine Ready; these engines are Ready but refuse.
            write({"url": engines[1].url, "model": model, "when": ["Unavailable"]})

            def shed() -> bool:
                r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
                return r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded"

            wait_for(shed, timeout=10, what="the router shedding, the fallback now for Unavailable only")
        finally:
            engines[0].state.draining = False


def test_the_routers_own_503s_carry_the_policys_retry_after(
    tiny_model: Path, engines: list[InProcessServer], tmp_path: Path
) -> None:
    """`loadShedding.retryAfterSeconds` reached the engines' answers, which the router absorbs, but not the
    router's own: its sheds said `Retry-After: 1` whatever the policy file it reads said."""
    policy = tmp_path / "policy.yaml"

    def write(seconds: int) -> None:
        staged = tmp_path / "policy.staged"  # as the kubelet updates a ConfigMap volume: whole, by a rename
        staged.write_text(yaml.safe_dump({"loadShedding": {"retryAfterSeconds": seconds}}))
        staged.replace(policy)

    write(5)
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    argv = ["--model", str(tiny_model), "--endpoint", engines[0].url, "--policy", str(policy)]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    try:
        with serving(router_main.build(parser.parse_args([*argv, "--poll-interval", "3600"]))) as url:
            wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
            engines[0].state.draining = True  # it answers 503 (its own policy: Retry-After 1)
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "fleet_overloaded", r.text
            assert r.headers["Retry-After"] == "5"
            write(7)

            def says(seconds: str) -> bool:
                r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
                return r.status_code == 503 and r.headers["Retry-After"] == seconds

            wait_for(lambda: says("7"), timeout=10, what="the new retryAfterSeconds in the router's sheds")
        held = parser.parse_args([*argv, "--poll-interval", "0.1", "--hold-seconds", "0.5"])
        with serving(router_main.build(held)) as url:
            wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_ready", r.text
            assert r.headers["Retry-After"] == "7"
            models = plainhttp.get(f"{url}/v1/models", timeout=30)
            assert models.status_code == 503 and models.headers["Retry-After"] == "7", models.text
    finally:
        engines[0].state.draining = False


def test_a_routing_rule_sends_a_request_to_another_service_and_says_so(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    rule = Rule("short", "small-service", max_max_tokens=2)
    settings = RouterSettings(routes=((rule, engines[1].url),))
    with running_router(tiny_model, [engines[0].url], settings=settings) as (url, _router):
        model = plainhttp.get(f"{url}/v1/models").json()["data"][0]["id"]
        short = plainhttp.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}, timeout=60
        )
        assert short.status_code == 200, short.text
        assert short.headers[ROUTED_TO] == "small-service" and short.headers[ROUTE_REASON] == "rule:short"
        long = plainhttp.post(
            f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 3}, timeout=60
        )
        assert long.status_code == 200 and long.headers[ROUTED_TO] == engines[0].url
        page = plainhttp.get(f"{url}/metrics").text
        assert 'ember_router:routed_requests_total{rule="short",target="small-service"} 1.0' in page


def test_with_no_engine_ready_a_request_is_held_counted_and_then_served(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    settings = RouterSettings(hold_seconds=30)
    engines[0].state.draining = True  # its /ready answers 503
    try:
        pool = EnginePool([engines[0].url], poll_interval=0.1)
        router = Router(pool, Tokenizer(str(tiny_model)), settings)
        with serving(router) as url:
            # Holding, the router is ready to take requests with no engine Ready.
            wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
            with ThreadPoolExecutor(1) as pool_:
                held = pool_.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=60)
                wait_for(
                    lambda: "ember_router:pending_requests 1.0" in plainhttp.get(f"{url}/metrics").text,
                    what="one request held",
                )
                assert not held.done()
                engines[0].state.draining = False
                r = held.result(timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers[ROUTED_TO] == engines[0].url
            assert "ember_router:pending_requests 0.0" in plainhttp.get(f"{url}/metrics").text
    finally:
        engines[0].state.draining = False


def test_a_hold_that_runs_out_answers_503_naming_it(tiny_model: Path, engines: list[InProcessServer]) -> None:
    engines[0].state.draining = True
    try:
        pool = EnginePool([engines[0].url], poll_interval=0.1)
        router = Router(pool, Tokenizer(str(tiny_model)), RouterSettings(hold_seconds=0.5))
        with serving(router) as url:
            wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
            r = plainhttp.post(
                f"{url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=30
            )
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_engine_ready"
            assert "Retry-After" in r.headers
        # With a fallback for Unavailable the held request goes there once the hold runs out (it was the 503).
        model = plainhttp.get(f"{engines[1].url}/v1/models").json()["data"][0]["id"]
        settings = RouterSettings(
            hold_seconds=0.5, fallback=from_flags(engines[1].url, model, frozenset({"Unavailable"}))
        )
        router = Router(EnginePool([engines[0].url], poll_interval=0.1), Tokenizer(str(tiny_model)), settings)
        with serving(router) as url:
            wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
            body = {"model": model, "prompt": "x", "max_tokens": 1}
            r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200 and r.headers["x-ember-served-by"] == "fallback", r.text
    finally:
        engines[0].state.draining = False


def test_routes_rewritten_in_the_routes_file_take_effect_while_the_router_runs(
    tiny_model: Path, engines: list[InProcessServer], tmp_path: Path
) -> None:
    """`ember router --routes FILE` (the operator's ConfigMap): rules and their targets' addresses change
    while the router runs; an unreadable file keeps the last good rules; a bad one at start is refused."""
    routes = tmp_path / "routes.yaml"

    def write(text: str) -> None:
        staged = tmp_path / "routes.staged"  # as the kubelet updates a ConfigMap volume: whole, by a rename
        staged.write_text(text)
        staged.replace(routes)

    write(yaml.safe_dump([{"name": "short", "target": "first", "url": engines[1].url, "maxMaxTokens": 2}]))
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    argv = ["--model", str(tiny_model), "--endpoint", engines[0].url, "--poll-interval", "3600"]
    router = router_main.build(parser.parse_args([*argv, "--routes", str(routes)]))
    model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]

    def routed_to(max_tokens: int) -> str:
        body = {"model": model, "prompt": "x", "max_tokens": max_tokens}
        r = plainhttp.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return str(r.headers[ROUTED_TO])

    with serving(router) as url:
        wait_for(lambda: plainhttp.get(f"{url}/ready").status_code == 200, what="the router ready")
        assert routed_to(2) == "first" and routed_to(3) == engines[0].url
        write(
            yaml.safe_dump([{"name": "tight", "target": "second", "url": engines[1].url, "maxMaxTokens": 1}])
        )
        wait_for(lambda: routed_to(2) == engines[0].url, timeout=10, what="the new rules in effect")
        assert routed_to(1) == "second"
        write("- {name: broken")  # not YAML: the last good rules stay
        time.sleep(2.5)
        assert routed_to(1) == "second"
    write(yaml.safe_dump([{"name": "a", "target": "t", "url": engines[1].url, "minTokens": 1}]))
    with pytest.raises(SystemExit, match=r"--routes .*routes.yaml.*unknown route field\(s\): minTokens"):
        router_main.build(parser.parse_args([*argv, "--routes", str(routes)]))
    route = '--route={"name": "a", "target": "t", "url": "http://x"}'
    with pytest.raises(SystemExit, match="give --routes or --route, not both"):
        router_main.build(parser.parse_args([*argv, "--routes", str(routes), route]))


def test_models_list_the_served_name_at_zero_engines_and_the_names_routed_elsewhere(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """With no engine Ready (a service at zero replicas, whose router holds requests) `/v1/models` was a
    503, so a client that lists the models before it asks (a chat UI) never asked; with `--served-model-name`
    the router lists that name. Model names a routing rule sends elsewhere were never listed: they are
    now, after the engines' own (as their engine gives them)."""
    gone = f"http://127.0.0.1:{free_port()}"  # nobody listens: the pool has no Ready engine
    with serving(
        Router(EnginePool([gone]), Tokenizer(str(tiny_model)), RouterSettings(hold_seconds=5))
    ) as url:
        r = plainhttp.get(f"{url}/v1/models", timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready", r.text  # no name to give
    settings = RouterSettings(hold_seconds=5, served_model_name="tiny")
    with serving(Router(EnginePool([gone]), Tokenizer(str(tiny_model)), settings)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        assert client.models.retrieve("tiny").id == "tiny"
        missing = plainhttp.get(f"{url}/v1/models/other", timeout=30)
        assert missing.status_code == 404, missing.text
        assert (missing.json()["error"]["code"], missing.json()["error"]["param"]) == (
            "model_not_found",
            "model",
        )
    model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]
    rules = (
        (Rule("big", "chat-big", models=("big", model["id"])), "http://chat-big.default.svc"),
        (Rule("huge", "chat-huge", models=("huge", "big")), "http://chat-huge.default.svc"),
    )
    settings = RouterSettings(routes=rules, served_model_name=model["id"])
    with running_router(tiny_model, [e.url for e in engines], settings=settings) as (url, _router):
        listed = plainhttp.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == [model["id"], "big", "huge"]
        assert listed[0]["max_model_len"] == model["max_model_len"]  # the engine's own entry
        assert all(m["object"] == "model" and m["owned_by"] == "ember" for m in listed)
        assert plainhttp.get(f"{url}/v1/models/huge", timeout=30).json()["id"] == "huge"


def test_tokenize_detokenize_and_version_are_answered_by_an_engine(
    tiny_model: Path, engines: list[InProcessServer]
) -> None:
    """A client of the service (the router) counts tokens as it would on one engine; they were a 404."""
    with running_router(tiny_model, [e.url for e in engines]) as (url, _router):
        model = plainhttp.get(f"{engines[0].url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "messages": [{"role": "user", "content": "hi there"}]}
        counted = plainhttp.post(f"{url}/tokenize", json=body)
        assert counted.status_code == 200 and counted.headers[ROUTED_TO] in {e.url for e in engines}
        assert counted.json() == plainhttp.post(f"{engines[1].url}/tokenize", json=body).json()
        back = plainhttp.post(f"{url}/detokenize", json={"model": model, "tokens": counted.json()["tokens"]})
        assert "hi there" in back.json()["prompt"]
        bad = plainhttp.post(f"{url}/detokenize", json={"tokens": [10**9]})  # the engine's own 400, relayed
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
        assert plainhttp.get(f"{url}/version").json() == plainhttp.get(f"{engines[0].url}/version").json()
    # No engine Ready (the one named has nothing listening): a 503 to come back, not a 404.
    pool = EnginePool([f"http://127.0.0.1:{free_port()}"], poll_interval=0.1)
    with serving(Router(pool, Tokenizer(str(tiny_model)))) as url:
        wait_for(lambda: plainhttp.get(f"{url}/health").status_code == 200, what="the router up")
        none = plainhttp.post(f"{url}/tokenize", json=body)
        assert none.status_code == 503 and none.json()["error"]["code"] == "not_ready"
        assert none.headers["Retry-After"]
