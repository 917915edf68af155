"""Shared fixtures: test checkpoints built once per session into a cache directory."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest
import torch

# Triton reads TRITON_INTERPRET as each @triton.jit decorator runs, so it is set before any test module
# can import a kernel: without a GPU, Triton kernels run only in its CPU interpreter.
os.environ["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")

from script_runs import run_script

import ember_engine.tools.testmodel as testmodel

# Under `make pytest` two pytest-xdist workers share the machine's cores: each runs torch on one thread, or
# the two workers' thread pools (each as wide as the machine) spin against each other. Processes the tests
# start (engines, benchmarks) keep torch's own default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _cache_root() -> Path:
    root = os.environ.get("EMBER_TEST_CACHE") or Path.home() / ".cache" / "ember-tests"
    # Keyed by the generator's source, so a change to it rebuilds the checkpoints.
    key = hashlib.sha256(Path(testmodel.__file__).read_bytes()).hexdigest()[:12]
    return Path(root) / key


def _checkpoint(size: str) -> Path:
    path = _cache_root() / size
    if not (path / "model.safetensors").exists():
        tmp = path.with_name(f"{size}.tmp{os.getpid()}")
        testmodel.make_test_model(tmp, size=size, force=True)
        if path.exists():  # another process finished first
            shutil.rmtree(tmp)
        else:
            tmp.replace(path)
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return _checkpoint("tiny")


@pytest.fixture(scope="session")
def small_model() -> Path:
    return _checkpoint("small")


def quantized_checkpoint(size: str, preset: str, script: str = "quant_build.py") -> Path:
    """The `size` test model (or, for "trained", the packaged trained target) quantized by llm-compressor
    with `preset` (FP8_DYNAMIC, W8A16, W4A16), built once into the cache (keyed also by the build script,
    so a change to it rebuilds). `script`
    kv_scales_build.py adds static KV-cache scales (preset FP8_KV: to FP8 weights; KV: alone)."""
    build = Path(__file__).with_name(script)
    key = hashlib.sha256(build.read_bytes()).hexdigest()[:8]
    path = _cache_root() / f"{size}-{preset.lower()}-{key}"
    if not path.exists():  # it appears whole: built under another name, then renamed
        tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
        if size == "trained":
            from ember_engine.tools.spec_pair import packaged_pair

            source = packaged_pair()[0]
        else:
            source = _checkpoint(size)
        run_script(build, source, tmp, preset)
        if path.exists():
            shutil.rmtree(tmp)
        else:
            tmp.replace(path)
    return path


@pytest.fixture(scope="session")
def quantized_model():  # -> Callable[[str, str], Path]
    return quantized_checkpoint


def edited_copy(src: Path, dst: Path, group=None, tensors=None, quantization=None) -> Path:  # type: ignore[no-untyped-def]
    """A copy of compressed-tensors checkpoint `src` at `dst`, `group(config group 0)` and
    `quantization(quantization_config)` applied to its config and `tensors(state dict)` to its (single)
    safetensors file, each edited in place."""
    import json

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    if group is not None or quantization is not None:
        raw = json.loads((src / "config.json").read_text())
        if group is not None:
            group(raw["quantization_config"]["config_groups"]["group_0"])
        if quantization is not None:
            quantization(raw["quantization_config"])
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        state = load_file(str(src / "model.safetensors"))
        tensors(state)
        save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="session")
def edited_checkpoint():  # -> Callable[..., Path]
    return edited_copy


# The longest test modules, longest first: each one's time in a whole `make pytest` run on two cores, and
# `test_kernels_compile.py` by its time on a fresh machine (CI), where Triton's cache is cold (256 s in a
# fresh run; 47 s warm). `make pytest` hands whole modules to its two pytest-xdist workers in collection order
# (`--no-loadscope-reorder`; xdist's own order, most tests first, would leave these few-test, long modules
# to the end, one worker busy and one idle), so these start first and the many short modules fill in behind
# them: the workers' last modules are short, and they end close together.
LONGEST_FIRST = (
    "test_kernels_compile.py",
    "test_bench_scale.py",
    "test_tensor_parallel.py",
    "test_node_loss.py",
    "test_e2e.py",
    "test_devcluster.py",
    "test_e2e_lifecycle.py",
    "test_operator_kopf.py",
    "test_quant_kernels.py",
    "test_gguf.py",
    "test_quant_gptq.py",
    "test_e2e_groups.py",
    "test_demo.py",
    "test_prometheus.py",
    "test_server_robustness.py",
    "test_e2e_podspec.py",
    "test_tensor_parallel_failures.py",
    "test_e2e_router.py",
    "test_gguf_arch.py",
    "test_fetch_model.py",
    "test_fp8_kv_engine.py",
    "test_rbac.py",
    "test_kubelet.py",
    "test_cli.py",
    "test_preempted_engines.py",
    "test_kernel_variants.py",
    "test_router_breaks.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's own order stays
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
