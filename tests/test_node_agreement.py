"""The comparison of a node's engine options and checkpoint with node 0's (`distributed/agreement.py`),
without processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ember_engine.core.config import EngineConfig
from ember_engine.distributed.agreement import checkpoint_identity, disagreement, node_identity


def identity(model: Path, **options: object) -> dict[str, object]:
    options = {"tensor_parallel_size": 2, "nnodes": 2, **options}
    config = EngineConfig(model=str(model), **options)  # type: ignore[arg-type]
    return node_identity(config, "cpu")


def test_nodes_started_alike_agree_whatever_their_node_specific_options(tiny_model: Path) -> None:
    leader = identity(tiny_model, node_rank=0, master_addr="0.0.0.0", master_port=1234)
    other = identity(
        tiny_model,
        node_rank=1,
        master_addr="10.0.0.1",
        master_port=1234,
        tokenizer="/elsewhere",
        scheduling_policy="priority",
        num_kv_blocks=7,
        enable_prefix_caching=False,
    )
    assert disagreement([(0, leader), (1, other)]) is None


def test_each_differing_option_is_named_with_both_values(tiny_model: Path) -> None:
    leader = identity(tiny_model)
    other = identity(tiny_model, node_rank=1, kv_cache_dtype="fp8", quantization="w4a16", block_size=32)
    message = disagreement([(0, leader), (0, leader), (1, other), (1, other)])
    assert message is not None
    assert "node 1 was not started as node 0 was" in message
    for line in (
        "kv_cache_dtype: node 0 has 'auto', node 1 has 'fp8'",
        "quantization: node 0 has None, node 1 has 'w4a16'",
        "block_size: node 0 has 16, node 1 has 32",
    ):
        assert line in message
    assert message.count("kv_cache_dtype") == 1  # a node's ranks are one node


@pytest.mark.parametrize(
    "option",
    [
        ("dtype", "bfloat16"),
        ("max_model_len", 64),
        ("max_num_batched_tokens", 512),
        ("max_num_seqs", 8),
        ("seed", 1),
        ("tensor_parallel_size", 4),
        ("num_speculative_tokens", 2),
        ("speculative_method", "ngram"),
    ],
)
def test_options_that_decide_what_ranks_compute_are_compared(tiny_model: Path, option: tuple) -> None:
    name, value = option
    message = disagreement([(0, identity(tiny_model)), (1, identity(tiny_model, **{name: value}))])
    assert message is not None and f"node 1 has {value!r}" in message, message


def test_the_checkpoint_is_known_by_its_config_and_weight_files_not_its_path(
    tiny_model: Path, tmp_path: Path
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    same = shutil.copytree(tiny_model, tmp_path / "same")
    assert checkpoint_identity(str(same)) == checkpoint_identity(str(tiny_model))
    other = shutil.copytree(tiny_model, tmp_path / "other")
    state = load_file(str(other / "model.safetensors"))
    for tensor in state.values():
        tensor.add_(1.0)
    save_file(state, str(other / "model.safetensors"), metadata={"format": "pt"})
    message = disagreement([(0, identity(tiny_model)), (1, identity(other))])
    assert message is not None and "checkpoint weights: node 0 has " in message, message
    (other / "config.json").write_text((other / "config.json").read_text().replace("1e-05", "1e-06"))
    message = disagreement([(0, identity(tiny_model)), (1, identity(other))])
    assert message is not None and "checkpoint config.json: node 0 has " in message, message


def test_a_checkpoint_a_node_cannot_read_is_a_difference_not_a_crash(
    tiny_model: Path, tmp_path: Path
) -> None:
    message = disagreement([(0, identity(tiny_model)), (1, identity(tmp_path / "missing"))])
    assert message is not None and "checkpoint config.json" in message, message
