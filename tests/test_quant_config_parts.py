"""The parts of a compressed-tensors config beside its quantization groups: `transform_config` folded into
the weights (rotations applied as the model runs: `test_quant_rotations.py`) and `sparsity_config`. What
the weights already hold runs (rotations folded into them, sparsity stored dense); a compressed sparse
format is refused by name, never read as dense."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quant_load import _prompts
from transformers import AutoModelForCausalLM

from ember_engine import LLM
from ember_engine.model.model_runner import Chunk

BUILD = "quant_targets_build.py"


def test_rotations_folded_into_the_weights_run_as_they_are(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """SpinQuant's R1 and R2 live in the weights (locations weight_input and weight_output): the checkpoint
    computes what transformers + compressed-tensors computes on it."""
    path = quantized_model("tiny", "W4A16_SPIN", BUILD)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    runner = LLM(str(path), num_kv_blocks=64).engine.runner
    for prompt in _prompts(2, 40):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        ours = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
        assert ours is not None
        assert (ours - theirs).abs().max().item() <= 1e-4 * (theirs.max() - theirs.min()).item()


def _sparse(quantized_model, edited_checkpoint, tmp_path: Path, fmt: str) -> Path:  # type: ignore[no-untyped-def]
    def edit(qc: dict) -> None:
        qc["sparsity_config"] = {
            "format": fmt,
            "sparsity_structure": "2:4",
            "global_sparsity": 0.5,
            "targets": ["Linear"],
            "ignore": ["lm_head"],
        }

    return edited_checkpoint(quantized_model("tiny", "W8A16"), tmp_path / "m", quantization=edit)


def test_sparsity_stored_dense_loads_as_it_is(quantized_model, edited_checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    plain = LLM(str(quantized_model("tiny", "W8A16")), num_kv_blocks=16).engine.runner
    dense = LLM(str(_sparse(quantized_model, edited_checkpoint, tmp_path, "dense")), num_kv_blocks=16)
    prompt = _prompts(1, 30)[0]
    chunk = [Chunk([0, 1], 0, prompt, num_logits=len(prompt))]
    assert torch.equal(dense.engine.runner.forward(chunk), plain.forward(chunk))


def test_sparsity_in_a_compressed_format_is_refused_by_name(
    quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = _sparse(quantized_model, edited_checkpoint, tmp_path, "sparse-24-bitmask")
    with pytest.raises(
        ValueError,
        match=r"compressed-tensors: sparsity_config format 'sparse-24-bitmask' \(2:4\) is not supported; "
        r"supported: dense \(the weights stored whole\)",
    ):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize("key", ["quantization_config", "compression_config"])
@pytest.mark.parametrize("fmt", ["dense", "sparse-24-bitmask"])
def test_a_config_of_sparsity_alone_quantizes_nothing(
    fmt: str, key: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A compressed-tensors config with no config groups and a sparsity_config (a pruned model): stored
    dense it is the full-precision model; in a compressed sparse format it is refused by name. Under the
    older `compression_config` key compressed-tensors wrote no `quant_method` (only it writes that key);
    such a config was refused as "quant_method None" once that key was read."""
    import json
    import shutil

    path = tmp_path / "m"
    shutil.copytree(tiny_model, path)
    config = json.loads((path / "config.json").read_text())
    sparsity = {"format": fmt, "sparsity_structure": "2:4", "global_sparsity": 0.5, "targets": ["Linear"]}
    qc = {"quant_method": "compressed-tensors", "format": fmt, "sparsity_config": sparsity}
    if key == "compression_config":
        qc = {"sparsity_config": sparsity}
    (path / "config.json").write_text(json.dumps(config | {key: qc}))
    if fmt != "dense":
        with pytest.raises(
            ValueError, match=r"sparsity_config format 'sparse-24-bitmask' \(2:4\) is not supported"
        ):
            LLM(str(path), num_kv_blocks=16)
        return
    pruned = LLM(str(path), num_kv_blocks=16).engine.runner
    plain = LLM(str(tiny_model), num_kv_blocks=16).engine.runner
    assert pruned.quant is None
    prompt = _prompts(1, 30)[0]
    chunk = [Chunk([0, 1], 0, prompt, num_logits=len(prompt))]
    assert torch.equal(pruned.forward(chunk), plain.forward(chunk))


def test_a_config_under_the_older_compression_config_key_runs(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """compressed-tensors' config under `compression_config`, the key older llm-compressor releases
    wrote (vLLM reads it where `quantization_config` is absent): the same model as under the usual key.
    It was not read, and the checkpoint was refused as holding unexpected tensors."""
    import json
    import shutil

    path = quantized_model("tiny", "W8A16")
    shutil.copytree(path, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    raw["compression_config"] = raw.pop("quantization_config")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    usual = LLM(str(path), num_kv_blocks=16).engine.runner
    older = LLM(str(tmp_path / "m"), num_kv_blocks=16).engine.runner
    assert older.quant is not None and older.quant.scheme == usual.quant.scheme == "w8a16"
    for prompt in _prompts(2, 20):
        chunk = [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
        assert torch.equal(older.forward(chunk), usual.forward(chunk))
