"""Nodes of one multi-node group must be started alike (README "Tensor parallelism"): at the rendezvous
every node's engine options and checkpoint are compared with node 0's, and a difference is refused on
every node by name, before any model loads, never a hang or a group serving mismatched ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import plainhttp
import pytest
from waiting import free_port


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random llama 256 wide: w4a16's groups of 128 fall within a rank's columns."""
    from ember_engine.tools import testmodel

    out = tmp_path_factory.mktemp("wide") / "model"
    return testmodel.make_test_model(out, testmodel.ModelSize(256, 512, 2, 4, 2, 2048), seed=3)


@contextmanager
def two_nodes(
    model0: Path, model1: Path, extra0: Sequence[str], extra1: Sequence[str]
) -> Iterator[tuple[str, list[subprocess.Popen[str]]]]:
    ember = os.path.join(os.path.dirname(sys.executable), "ember")
    master, port = free_port(), free_port()
    procs = []
    for rank, model, extra in ((0, model0, extra0), (1, model1, extra1)):
        cmd = [ember, "serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port + rank)]
        cmd += [
            "--tensor-parallel-size",
            "2",
            "--dtype",
            "float32",
            "--nnodes",
            "2",
            "--node-rank",
            str(rank),
        ]
        cmd += ["--master-addr", "127.0.0.1", "--master-port", str(master), *extra]
        procs.append(
            subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
        )
    try:
        yield f"http://127.0.0.1:{port}", procs
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def refused_on_both(url: str, procs: list[subprocess.Popen[str]], timeout: float = 60.0) -> list[str]:
    """Both nodes' last lines, once both have exited non-zero; fails if node 0 becomes ready or they do
    not exit within `timeout`."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        try:
            ready = plainhttp.get(f"{url}/ready", timeout=1).status_code == 200
        except httpx.HTTPError:
            ready = False
        assert not ready, "node 0 became ready, serving with a node started otherwise"
        assert time.monotonic() < deadline, (
            f"the nodes did not exit within {timeout:g} s (exit codes {[p.poll() for p in procs]})"
        )
        time.sleep(0.2)
    lasts = []
    for p in procs:
        assert p.returncode == 1
        output = p.stdout.read() if p.stdout else ""
        lasts.append(output.strip().splitlines()[-1])
    return lasts


def test_a_node_with_another_kv_cache_dtype_is_refused_on_both_not_a_hang(wide_model: Path) -> None:
    with two_nodes(wide_model, wide_model, [], ["--kv-cache-dtype", "fp8"]) as (url, procs):
        last0, last1 = refused_on_both(url, procs)
    expected = "kv_cache_dtype: node 0 has 'auto', node 1 has 'fp8'"
    assert last0.startswith("ember serve: fatal: cannot load the model: ") and expected in last0, last0
    assert last1.startswith("ember serve: fatal: node 1: ") and expected in last1, last1


def test_a_node_with_another_quantization_is_refused_on_both(wide_model: Path) -> None:
    with two_nodes(wide_model, wide_model, [], ["--quantization", "w4a16"]) as (url, procs):
        last0, last1 = refused_on_both(url, procs)
    for last in (last0, last1):
        assert "fatal:" in last and "quantization: node 0 has None, node 1 has 'w4a16'" in last, last


def test_a_node_with_another_checkpoint_of_the_same_shapes_is_refused_on_both(
    wide_model: Path, tmp_path: Path
) -> None:
    from ember_engine.tools import testmodel

    other = testmodel.make_test_model(
        tmp_path / "model", testmodel.ModelSize(256, 512, 2, 4, 2, 2048), seed=4
    )
    with two_nodes(wide_model, other, [], []) as (url, procs):
        last0, last1 = refused_on_both(url, procs)
    for last in (last0, last1):
        assert "fatal:" in last and "checkpoint weights: node 0 has " in last, last
