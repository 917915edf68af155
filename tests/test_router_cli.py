"""`ember router`'s command line: a value it cannot run with is refused by name before it serves; what a
router process loads."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import httpx
import plainhttp
import pytest
from waiting import free_port, wait_for

from ember_router import main as router_main


@pytest.mark.parametrize(
    ("flag", "value", "error"),
    [
        # inf passed, then every request with two engines or more was a 500 (OverflowError in the bound)
        ("--epsilon", "inf", r"--epsilon must be a finite number >= 0, got inf"),
        ("--epsilon", "nan", r"--epsilon must be a finite number >= 0, got nan"),
        ("--epsilon", "-0.5", r"--epsilon must be a finite number >= 0, got -0.5"),
        # 0 or less polled the engines in a tight loop
        ("--poll-interval", "0", r"--poll-interval must be a finite number > 0, got 0"),
        ("--poll-interval", "-1", r"--poll-interval must be a finite number > 0, got -1"),
        ("--poll-interval", "inf", r"--poll-interval must be a finite number > 0, got inf"),
        # a negative hold was taken as none, nan as none too
        ("--hold-seconds", "-1", r"--hold-seconds must be a finite number >= 0, got -1"),
        ("--hold-seconds", "nan", r"--hold-seconds must be a finite number >= 0, got nan"),
        ("--drain-timeout", "-1", r"--drain-timeout must be a finite number >= 0, got -1"),
        ("--upstream-timeout", "0", r"--upstream-timeout must be a finite number > 0, got 0"),
        ("--fallback-timeout", "0", r"--fallback-timeout must be a finite number > 0, got 0"),
        ("--stream-idle-timeout", "-1", r"--stream-idle-timeout must be a finite number >= 0, got -1"),
        ("--stream-idle-timeout", "inf", r"--stream-idle-timeout must be a finite number >= 0, got inf"),
        ("--fallback-timeout", "inf", r"--fallback-timeout must be a finite number > 0, got inf"),
    ],
)
def test_a_number_the_router_cannot_run_with_is_refused_by_name(
    flag: str, value: str, error: str, tiny_model: Path
) -> None:
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tiny_model), "--endpoint", "http://127.0.0.1:9", f"{flag}={value}"]
    )
    with pytest.raises(SystemExit, match=rf"^ember router: {error}$"):
        router_main.build(args)


def _build(tiny_model: Path, *argv: str) -> None:
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    router_main.build(parser.parse_args(["--model", str(tiny_model), *argv]))


def test_a_kube_selector_without_a_usable_kubeconfig_is_refused_at_start(
    tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The discovery thread died on the bad configuration and the router served 503 for ever."""
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    missing = tmp_path / "nonexistent"
    with pytest.raises(SystemExit, match=rf"^ember router: --kubeconfig {missing}: cannot read it: "):
        _build(tiny_model, "--kube-selector", "a=b", "--kubeconfig", str(missing))
    with pytest.raises(
        SystemExit, match=r"^ember router: --kube-selector: no Kubernetes configuration \(not in a pod, "
    ):
        _build(tiny_model, "--kube-selector", "a=b")


def test_endpoints_and_a_kube_selector_together_are_refused(tiny_model: Path) -> None:
    """The endpoints were silently ignored."""
    with pytest.raises(SystemExit, match=r"^ember router: give --endpoint or --kube-selector, not both$"):
        _build(tiny_model, "--kube-selector", "a=b", "--endpoint", "http://127.0.0.1:9")


def test_the_stream_idle_timeout_is_300_s_unless_set_and_0_is_none(tiny_model: Path) -> None:
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    argv = ["--model", str(tiny_model), "--endpoint", "http://127.0.0.1:9"]
    for extra, seconds in (
        ([], 300.0),
        (["--stream-idle-timeout=5"], 5.0),
        (["--stream-idle-timeout=0"], None),
    ):
        assert router_main.build(parser.parse_args([*argv, *extra])).settings.stream_idle_timeout == seconds


def test_a_router_process_serves_without_loading_torch(tiny_model: Path) -> None:
    """A router tokenizes and relays; it loaded torch (1.8 CPU-seconds at every start, and 190 MB of its
    255 MB resident) only to ask whether its model was a GGUF file, through the GGUF reader's package."""
    port = free_port()
    ember = os.path.join(os.path.dirname(sys.executable), "ember")
    command = [ember, "router", "--model", str(tiny_model), "--endpoint", "http://127.0.0.1:9"]
    proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stderr=subprocess.PIPE)

    def answers() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"the router exited: {proc.stderr and proc.stderr.read()}")
        try:
            return plainhttp.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(answers, timeout=60, what="the router answering /health")
        libraries = {line.split()[-1] for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines()}
        assert not [path for path in libraries if "libtorch" in path]
    finally:
        proc.kill()
        proc.wait(timeout=30)
