"""`ember serve --lora-modules`: each adapter is a model a client names, through the `openai` client, on a
real server; listed as vLLM lists adapters; its requests reported in `vllm:lora_requests_info`."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import plainhttp
import pytest
from server_util import InProcessServer, running_server
from test_lora import ALL, PROMPTS, build_adapter
from waiting import wait_for

from ember_engine import LLM, SamplingParams

MODEL = "base"
EMBER = [str(Path(sys.executable).parent / "ember")]


@pytest.fixture(scope="module")
def adapters(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "sql": build_adapter(tiny_model, root / "sql", 0, r=8, lora_alpha=16, target_modules=ALL),
        "chat": build_adapter(tiny_model, root / "chat", 1, 0.2, r=4, target_modules=["q_proj", "v_proj"]),
    }


@pytest.fixture(scope="module")
def server(tiny_model: Path, adapters: dict[str, Path]) -> Iterator[InProcessServer]:
    modules = [f"sql={adapters['sql']}", f'{{"name": "chat", "path": "{adapters["chat"]}"}}']
    with running_server(tiny_model, "--served-model-name", MODEL, "--lora-modules", *modules) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_adapters_are_listed_beside_their_model(client: openai.OpenAI, adapters: dict[str, Path]) -> None:
    listed = {m.id: m.model_dump() for m in client.models.list()}
    assert list(listed) == [MODEL, "sql", "chat"]
    for name in ("sql", "chat"):
        assert listed[name]["parent"] == MODEL and listed[name]["root"] == str(adapters[name])
        assert client.models.retrieve(name).model_dump() | {"created": 0} == listed[name] | {"created": 0}
    assert "parent" not in listed[MODEL]


def test_a_request_naming_an_adapter_runs_on_it(
    client: openai.OpenAI, tiny_model: Path, adapters: dict[str, Path]
) -> None:
    offline = LLM(str(tiny_model), lora_modules={n: str(p) for n, p in adapters.items()})
    prompt = PROMPTS[2]
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    texts = {}
    for model in (MODEL, "sql", "chat"):
        answer = client.completions.create(
            model=model, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        assert answer.model == model
        (want,) = offline.generate([prompt], greedy, use_tqdm=False, lora=None if model == MODEL else model)
        assert answer.choices[0].text == want.outputs[0].text
        texts[model] = answer.choices[0].text
    assert len(set(texts.values())) == 3
    chat = client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    response = client.responses.create(model="chat", input="hello", max_output_tokens=4)
    assert response.model == "chat" and response.status in ("completed", "incomplete")


def test_a_model_neither_served_nor_an_adapter_is_404(client: openai.OpenAI, server: InProcessServer) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="sq", prompt="x", max_tokens=1)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found" and body["param"] == "model"
    assert (
        body["message"]
        == "model: 'sq' is not served here; this server serves 'base' and its LoRA adapters 'sql', 'chat'"
    )
    assert plainhttp.get(f"{server.url}/v1/models/sq").status_code == 404
    tokens = plainhttp.post(f"{server.url}/tokenize", json={"model": "sql", "prompt": "hello"})
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


@contextlib.contextmanager
def _running(client: openai.OpenAI, model: str) -> Iterator[None]:
    """A long request on `model`, running (its first token streamed) until the block ends, then closed."""
    stream = client.completions.create(
        model=model,
        prompt=PROMPTS[1],
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        next(iter(stream))
        yield
    finally:
        stream.close()


def _lora_series(url: str) -> list[str]:
    text = plainhttp.get(f"{url}/metrics").text
    return [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]


def test_lora_requests_info_names_the_adapters_running(
    client: openai.OpenAI, server: InProcessServer
) -> None:
    (idle,) = _lora_series(server.url)
    assert re.fullmatch(
        r'vllm:lora_requests_info\{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""\} \S+', idle
    ), idle
    with _running(client, "chat"):
        (busy,) = _lora_series(server.url)
    assert 'running_lora_adapters="chat"' in busy and 'waiting_lora_adapters=""' in busy
    assert float(busy.rsplit(" ", 1)[1]) >= float(idle.rsplit(" ", 1)[1])  # the time it was last seen


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--lora-modules", "sql"], "expected NAME=PATH or"),
        (
            ["--lora-modules", '{"name": "x", "path": "/p", "rank": 4}'],
            "unknown key(s) rank; give name and path",
        ),
        (["--lora-modules", "a=/p", "a=/q"], "--lora-modules: adapter name(s) given twice: a"),
        (
            ["--served-model-name", "m", "--lora-modules", "m=/p"],
            "an adapter is named 'm', the model's own name",
        ),
        (
            ["--allow-runtime-lora-updates", "--tensor-parallel-size", "2"],
            "--allow-runtime-lora-updates: adapters are not loaded while serving under tensor parallelism",
        ),
    ],
)
def test_adapter_options_that_cannot_work_are_refused(
    tiny_model: Path, args: list[str], message: str
) -> None:
    run = subprocess.run(
        [*EMBER, "serve", "--model", str(tiny_model), "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and message in run.stderr, run.stderr


def test_an_adapter_that_cannot_load_stops_the_server_naming_it(tiny_model: Path, tmp_path: Path) -> None:
    run = subprocess.run(
        [*EMBER, "serve", "--model", str(tiny_model), "--port", "0", "--lora-modules", f"x={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last == (
        f"ember serve: fatal: cannot load the model: AdapterError: LoRA adapter 'x': {tmp_path}/adapter_config.json "
        "not found (a PEFT adapter directory has one)"
    )


def test_the_router_keys_an_adapters_blocks_as_the_engine_does(
    server: InProcessServer, tiny_model: Path
) -> None:
    from ember_engine.core.tokenizer import Tokenizer
    from ember_router.prompts import request_prompts

    tokenizer = Tokenizer(str(tiny_model))
    for model in ("sql", MODEL):
        since = plainhttp.get(f"{server.url}/v1/kv_events", params={"since": 0}).json()["seq"]
        body = {"model": model, "prompt": PROMPTS[4][::-1], "max_tokens": 1}  # a prompt no other test sends
        assert plainhttp.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        delta = plainhttp.get(f"{server.url}/v1/kv_events", params={"since": since}).json()
        stored = [h for kind, h in delta["events"] if kind == "stored"]
        predicted = request_prompts(tokenizer, body, False, 16, MODEL).first_hashes
        assert len(stored) == 8 and stored == predicted[:8], model
        # Without the served name the router cannot tell an adapter from the model: the model's keys.
        unaware = request_prompts(tokenizer, body, False, 16).first_hashes
        assert (unaware[:8] == stored) == (model == MODEL)


def test_runtime_updates_are_off_unless_allowed(server: InProcessServer, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "new", "lora_path": str(adapters["sql"])}
    reply = plainhttp.post(f"{server.url}/v1/load_lora_adapter", json=body)
    assert reply.status_code == 404
    assert "ember serve --allow-runtime-lora-updates" in reply.json()["error"]["message"]


@pytest.fixture
def updatable(tiny_model: Path) -> Iterator[InProcessServer]:
    with running_server(tiny_model, "--served-model-name", MODEL, "--allow-runtime-lora-updates") as s:
        yield s


def _load(url: str, name: str, path: Path | str) -> Any:
    # json.dumps writes a lone surrogate as its \u escape, as a client in any language may.
    body = json.dumps({"lora_name": name, "lora_path": str(path)})
    return plainhttp.post(
        f"{url}/v1/load_lora_adapter", content=body, headers={"content-type": "application/json"}
    )


def _unload(url: str, name: str) -> Any:
    return plainhttp.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})


def test_adapters_load_and_unload_while_serving(
    updatable: InProcessServer, adapters: dict[str, Path], tiny_model: Path, tmp_path: Path
) -> None:
    url = updatable.url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    (idle,) = _lora_series(url)
    assert 'max_lora="0"' in idle and [m.id for m in client.models.list()] == [MODEL]
    reply = _load(url, "sql", adapters["sql"])
    assert (reply.status_code, reply.text) == (200, "Success: LoRA adapter 'sql' added successfully.")
    assert [m.id for m in client.models.list()] == [MODEL, "sql"] and 'max_lora="1"' in _lora_series(url)[0]
    offline = LLM(str(tiny_model), lora_modules={n: str(p) for n, p in adapters.items()})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def served(model: str) -> str:
        answer = client.completions.create(
            model=model, prompt=PROMPTS[4], max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
        )
        return answer.choices[0].text

    def wanted(lora: str) -> str:
        return offline.generate([PROMPTS[4]], greedy, use_tqdm=False, lora=lora)[0].outputs[0].text

    assert served("sql") == wanted("sql")
    # Refusals, each naming its field.
    for name, path, status, message in [
        ("sql", adapters["chat"], 400, "lora_name: 'sql' is already loaded"),
        (MODEL, adapters["chat"], 400, "lora_name: 'base' is the model's own name"),
        ("x", tmp_path, 400, "lora_path: LoRA adapter 'x': "),
        ("bad\tname", adapters["chat"], 400, "lora_name: an adapter's name must be printable text"),
        ("x", "/tmp/\ud800", 400, "lora_path: "),  # a lone surrogate (JSON's \ud800)
    ]:
        reply = _load(url, name, path)
        assert reply.status_code == status and reply.json()["error"]["message"].startswith(message), (
            reply.text
        )
    # Not while a request runs on it.
    with _running(client, "sql"):
        busy = _unload(url, "sql")
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "adapter_in_use", busy.text
    wait_for(
        lambda: _unload(url, "sql").status_code == 200, timeout=30, what="sql unloaded once its request ended"
    )
    assert [m.id for m in client.models.list()] == [MODEL]
    with pytest.raises(openai.NotFoundError):
        served("sql")
    assert _unload(url, "sql").status_code == 404
    # Other weights under the same name: none of the first load's cached blocks is read.
    assert _load(url, "sql", adapters["chat"]).status_code == 200
    assert served("sql") == wanted("chat") != wanted("sql")


def test_max_loras_and_max_lora_rank_as_vllms_flags(tiny_model: Path, adapters: dict[str, Path]) -> None:
    """`--max-loras` is the `max_lora` of `vllm:lora_requests_info` (not the adapters loaded), and an
    adapter over `--max-lora-rank` is refused when loaded while serving (a 400) as at start."""
    flags = ["--max-loras", "1", "--max-lora-rank", "4", "--allow-runtime-lora-updates"]
    with running_server(
        tiny_model, "--served-model-name", MODEL, "--lora-modules", f"chat={adapters['chat']}", *flags
    ) as s:
        (idle,) = _lora_series(s.url)
        assert idle.startswith('vllm:lora_requests_info{max_lora="1",'), idle
        refused = plainhttp.post(
            f"{s.url}/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": str(adapters["sql"])}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["message"] == "lora: adapter 'sql' has rank 8, over max_lora_rank 4"
        listed = plainhttp.get(f"{s.url}/v1/models").json()["data"]
        assert [m["id"] for m in listed] == [MODEL, "chat"]
        (still,) = _lora_series(s.url)
        assert still.startswith('vllm:lora_requests_info{max_lora="1",'), still


def test_the_router_sends_an_adapters_requests_where_it_is_loaded(
    tiny_model: Path, adapters: dict[str, Path], server: InProcessServer
) -> None:
    """One engine has `sql` from the start, the other none until it is loaded there while serving: the
    router sends `sql` requests to the first only, then to both; base-model requests go to either."""
    from test_router import running_router

    from ember_router.proxy import ROUTED_TO, RouterSettings

    with running_server(tiny_model, "--served-model-name", MODEL, "--allow-runtime-lora-updates") as bare:
        settings = RouterSettings(served_model_name=MODEL)
        with running_router(tiny_model, [server.url, bare.url], settings=settings) as (url, router):
            wait_for(lambda: router.pool.engines[bare.url].state.adapters == frozenset())

            def engines_of(model: str, n: int = 8) -> set[str]:
                seen = set()
                for i in range(n):
                    body = {"model": model, "prompt": f"{i} hello", "max_tokens": 2}
                    answer = plainhttp.post(f"{url}/v1/completions", json=body, timeout=30)
                    assert answer.status_code == 200 and answer.json()["model"] == model, answer.text
                    seen.add(answer.headers[ROUTED_TO])
                return seen

            assert engines_of("sql") == {server.url}
            assert engines_of(MODEL) == {server.url, bare.url}
            loaded = plainhttp.post(
                f"{bare.url}/v1/load_lora_adapter",
                json={"lora_name": "sql", "lora_path": str(adapters["sql"])},
            )
            assert loaded.status_code == 200, loaded.text
            wait_for(lambda: router.pool.engines[bare.url].state.adapters == frozenset({"sql"}))
            assert engines_of("sql") == {server.url, bare.url}
