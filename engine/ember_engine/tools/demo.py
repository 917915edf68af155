"""`ember demo-engine`: start `ember serve` on the packaged trained model pair (a small code model and its
draft, with speculative decoding), stream a code completion token by token, send a burst of concurrent chat
requests, show the server's own metrics, then drain it with SIGTERM.

The pair learned from the Python standard library's sources for a few minutes on a CPU, so its code reads
like Python without meaning much; what the demo shows is the system at work: streaming over the OpenAI
API, speculative decoding, continuous batching, prefix caching, and the numbers behind them. With
`--dir` it serves that checkpoint instead (e.g. a random-weight test model, whose words are noise).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SHOWN_METRICS = (
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)


def default_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "ember" / "demo-tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`ember demo-engine`."""
    p.add_argument(
        "--dir",
        help="serve this checkpoint instead (a tiny test model is built there if it is missing or empty)",
    )


def main(args: argparse.Namespace) -> int:
    from ember_engine.tools.spec_pair import packaged_pair
    from ember_engine.tools.testmodel import make_test_model

    draft: Path | None = None
    if args.dir:
        model_dir = Path(args.dir)
        if not model_dir.exists() or (model_dir.is_dir() and not any(model_dir.iterdir())):
            print(f"building a tiny test checkpoint in {model_dir} ...")
            make_test_model(model_dir, size="tiny")  # else served as it is: nothing of it is overwritten
    else:
        model_dir, draft = packaged_pair()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    ember = Path(sys.executable).with_name("ember")
    cmd = [
        str(ember),
        "serve",
        "--model",
        str(model_dir),
        "--served-model-name",
        "demo",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if draft is not None:
        cmd += ["--draft-model", str(draft), "--dtype", "float32"]
    print(f"$ {' '.join(cmd)}")
    server = subprocess.Popen(cmd)
    try:
        start = time.perf_counter()
        while not _ready(url):
            if server.poll() is not None:
                print("ember serve exited before it was ready", file=sys.stderr)
                return 1
            time.sleep(0.1)
        print(f"ready after {time.perf_counter() - start:.1f} s (model loaded and warmed up)\n")
        _stream_completion(url)
        asyncio.run(_burst(url))
        _show_metrics(url)
    finally:
        if server.poll() is None:
            server.send_signal(signal.SIGTERM)
            code = server.wait(timeout=60)
            print(f"\nSIGTERM: the server drained and exited with status {code}")
    return 0


def _ready(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:  # not listening yet
        return False


SYSTEM = "You are a terse assistant who answers in Python. " * 4  # a shared prefix: several cache blocks


PROMPT = 'def read_config(path):\n    """Read the configuration file at path."""\n'


def _stream_completion(url: str) -> None:
    import httpx

    body = {"model": "demo", "stream": True, "max_tokens": 96, "temperature": 0, "prompt": PROMPT}
    print(f"POST /v1/completions (stream), greedy, prompt:\n{PROMPT}", end="", flush=True)
    sent, first, pieces = time.perf_counter(), None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            text = chunk["choices"][0].get("text", "") if chunk["choices"] else ""
            if text:
                first = first or time.perf_counter()
                pieces += 1
                print(text, end="", flush=True)
    ttft = 1000 * ((first or sent) - sent)
    print(f"\n[{pieces} chunks; first token after {ttft:.0f} ms, all in {time.perf_counter() - sent:.2f} s]")


async def _burst(url: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=120) as client:

        async def one(i: int) -> int:
            body = {
                "model": "demo",
                "max_tokens": 64,
                "ignore_eos": True,
                "temperature": 0.7,
                "messages": [
                    {"role": "system", "content": SYSTEM},
                    {"role": "user", "content": f"Question {i}: what is {i} squared?"},
                ],
            }
            r = await client.post(f"{url}/v1/chat/completions", json=body)
            return int(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(16))))
        elapsed = time.perf_counter() - start
    print(
        f"\nburst: 16 concurrent chat requests, {tokens} tokens in {elapsed:.2f} s = {tokens / elapsed:.0f} tok/s"
    )


def _show_metrics(url: str) -> None:
    import httpx

    print("\nGET /metrics (excerpt):")
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(SHOWN_METRICS):
            print(f"  {line}")
