"""Run the real `ember serve` server in-process (a thread) or as a process, for tests."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import plainhttp
from waiting import free_port

from ember_engine.server import serve


def serve_args(model: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(
        ["--model", str(model), "--host", "127.0.0.1", "--port", str(free_port()), *extra]
    )


def wait_ready(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if plainhttp.get(f"{url}/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {timeout} s")


@dataclass
class InProcessServer:
    url: str
    state: Any  # ServerState
    server: Any  # DrainingServer


@contextmanager
def running_server(model: Path, *extra: str) -> Iterator[InProcessServer]:
    args = serve_args(model, *extra)
    server, state, failure = serve.build_server(args)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_ready(url)
        yield InProcessServer(url, state, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        if state.engine is not None:
            state.engine.shutdown()
    assert not failure, failure


@contextmanager
def server_process(model: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    port = free_port()
    cmd = [
        os.path.join(os.path.dirname(sys.executable), "ember"),
        "serve",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
