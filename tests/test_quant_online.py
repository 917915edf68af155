"""Online quantization at load, refusals naming the scheme, and `ember quantize`, whose output
transformers (with compressed-tensors) loads and computes as ember does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from ember_engine import LLM
from ember_engine.cli import main as ember
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.apply import weight_bytes
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8Linear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear, W8A8Linear

LAYERS = {"fp8": Fp8Linear, "w8a16": Int8Linear, "w4a16": Int4Linear, "w8a8": W8A8Linear}
PROMPT = list(range(20, 60))


def _logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    out = llm.engine.runner.forward([Chunk([0, 1, 2, 3], 0, prompt, num_logits=len(prompt))])
    assert out is not None
    return out


@pytest.fixture(scope="module")
def full(tiny_model: Path) -> LLM:
    return LLM(str(tiny_model), num_kv_blocks=16)


@pytest.mark.parametrize("scheme", list(LAYERS))
def test_online_quantization_replaces_every_projection(scheme: str, tiny_model: Path, full: LLM) -> None:
    llm = LLM(str(tiny_model), quantization=scheme, num_kv_blocks=16)
    model = llm.engine.runner.model
    for layer in model.model.layers:
        for proj in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ):
            assert isinstance(proj, LAYERS[scheme])
    # Embeddings and the LM head keep the model dtype; the projections shrink.
    assert model.lm_head.weight.dtype == torch.float32
    assert weight_bytes(model) < weight_bytes(full.engine.runner.model)
    ours, theirs = _logits(llm, PROMPT), _logits(full, PROMPT)
    span = (theirs.max() - theirs.min()).item()
    assert (ours - theirs).abs().max().item() < 0.25 * span  # quantized, yet the same model
    assert not torch.equal(ours, theirs)


def test_unsupported_scheme_is_named_with_the_supported_ones(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match=r"unsupported scheme 'hqq'; supported: fp8, w8a16, w4a16"):
        LLM(str(tiny_model), quantization="hqq")
    with pytest.raises(
        ValueError, match=r"'awq' names a quantized checkpoint's method, but .* is not quantized"
    ):
        LLM(str(tiny_model), quantization="awq")


def test_unsupported_checkpoint_format_is_named(tiny_model: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "hqq"
    ckpt.mkdir()
    for f in tiny_model.iterdir():
        (ckpt / f.name).symlink_to(f)
    config = json.loads((tiny_model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "hqq", "nbits": 4}
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"quant_method 'hqq' is not supported; supported: compressed-tensors"
    ):
        LLM(str(ckpt))


@pytest.mark.parametrize("scheme", [*LAYERS, "fp8-block"])
def test_ember_quantize_writes_what_transformers_loads(
    scheme: str, tiny_model: Path, tmp_path: Path, full: LLM
) -> None:
    """Each scheme, and fp8 with 32 x 32 tiles of weight scales (FP8_BLOCK), as transformers with
    compressed-tensors reads it, and still the model it was made from."""
    dst = tmp_path / scheme
    extra = {"fp8-block": ["--block-size", "32"], "w4a16": ["--group-size", "64"]}.get(scheme, [])
    args = ["quantize", str(tiny_model), str(dst), "--scheme", scheme.removesuffix("-block")]
    assert ember([*args, *extra]) == 0
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    hf = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
    with torch.inference_mode():
        theirs = hf(torch.tensor([PROMPT])).logits[0].float()
    llm = LLM(str(dst), num_kv_blocks=16)
    quant = llm.engine.runner.quant
    assert quant is not None and quant.scheme == scheme.removesuffix("-block")
    if scheme == "fp8-block":
        assert (quant.group_size, quant.block_rows) == (32, 32)
        assert isinstance(llm.engine.runner.model.model.layers[0].mlp.down_proj, Fp8BlockLinear)
    ours = _logits(llm, PROMPT)
    span = (theirs.max() - theirs.min()).item()
    # fp8 and w8a8: an activation may round to a neighbouring E4M3 or int8 step; the weight-only schemes
    # multiply the activations as they are (float32 here), so only float rounding separates the two.
    tolerance = {"fp8": 2e-2, "fp8-block": 2e-2, "w8a8": 2e-2, "w8a16": 1e-4, "w4a16": 1e-4}[scheme]
    assert (ours - theirs).abs().max().item() <= tolerance * span
    assert (ours - _logits(full, PROMPT)).abs().max().item() < 0.25 * span


@pytest.mark.parametrize(
    ("scheme", "size", "message"),
    [
        ("w8a16", "32", "--block-size applies to the fp8 scheme only, not w8a16"),
        ("fp8", "40", "--block-size must be a positive multiple of 16, got 40"),
        ("fp8", "0", "--block-size must be a positive multiple of 16, got 0"),
        ("fp8", "-16", "--block-size must be a positive multiple of 16, got -16"),
        # The tiny model's projections take 128 and 256 input columns: tiles of 48 (or 512) split their
        # rows, whose activations' groups neither transformers nor ember can take.
        ("fp8", "48", "is not a multiple of the block size 48"),
        ("fp8", "512", "is not a multiple of the block size 512"),
    ],
)
def test_ember_quantize_refuses_a_block_size_it_cannot_write(
    scheme: str, size: str, message: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "out"
    assert ember(["quantize", str(tiny_model), str(dst), "--scheme", scheme, "--block-size", size]) == 2
    assert message in capsys.readouterr().err
    assert not dst.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # A documented option the scheme does not use is refused by name, not ignored.
        (["--scheme", "fp8", "--group-size", "64"], "--group-size applies to the w4a16 scheme only, not fp8"),
        (
            ["--scheme", "w8a16", "--group-size", "64"],
            "--group-size applies to the w4a16 scheme only, not w8a16",
        ),
        (["--scheme", "w4a16", "--group-size", "0"], "--group-size must be a positive even number, got 0"),
        (
            ["--scheme", "w4a16", "--group-size", "-128"],
            "--group-size must be a positive even number, got -128",
        ),
        # The tiny model's projections take 128 and 256 input columns: 96 divides neither.
        (["--scheme", "w4a16", "--group-size", "96"], "is not a multiple of the group size 96"),
    ],
)
def test_ember_quantize_refuses_a_group_size_it_cannot_write(
    args: list[str], message: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "out"
    assert ember(["quantize", str(tiny_model), str(dst), *args]) == 2
    assert message in capsys.readouterr().err
    assert not dst.exists()  # nothing half-written that a second try would trip over


def test_ember_quantize_refuses_what_it_would_overwrite_or_cannot_read(
    tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dst = tmp_path / "out"
    assert ember(["quantize", str(tiny_model), str(dst), "--scheme", "w8a16"]) == 0
    capsys.readouterr()
    written = sorted(p.name for p in dst.iterdir())
    probe = tmp_path / "probe"
    probe.mkdir()
    assert dst.stat().st_mode == probe.stat().st_mode  # made as any directory is, not owner-only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "probe"]  # no partial copy left

    assert ember(["quantize", str(tiny_model), str(dst), "--scheme", "fp8"]) == 2
    assert f"{dst} already exists" in capsys.readouterr().err
    assert sorted(p.name for p in dst.iterdir()) == written  # the earlier output is untouched

    again = tmp_path / "again"
    assert ember(["quantize", str(dst), str(again), "--scheme", "fp8"]) == 2
    assert f"{dst} is already quantized (compressed-tensors)" in capsys.readouterr().err
    assert not again.exists()
    # a pruned model's config, sparsity alone (written with no quant_method under the older key), is no
    # quantization, but a quantized copy would lose it
    pruned = tmp_path / "pruned"
    shutil.copytree(tiny_model, pruned)
    config = json.loads((pruned / "config.json").read_text())
    config["compression_config"] = {"sparsity_config": {"format": "dense", "sparsity_structure": "2:4"}}
    (pruned / "config.json").write_text(json.dumps(config))
    assert ember(["quantize", str(pruned), str(again), "--scheme", "fp8"]) == 2
    assert (
        f"{pruned} holds a compressed-tensors config (sparsity_config) that a quantized copy would lose"
        in (capsys.readouterr().err)
    )
    assert not again.exists()
    # quantized tensors its config.json does not describe (an AWQ checkpoint whose config is in a file of
    # its own): an "fp8" copy was written with the int32 words copied over, which nothing could load
    awq = tmp_path / "awq"
    shutil.copytree(tiny_model, awq)
    state = load_file(str(awq / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.qweight"] = torch.zeros(16, 128, dtype=torch.int32)
    del state["model.layers.0.mlp.down_proj.weight"]
    save_file(state, str(awq / "model.safetensors"))
    assert ember(["quantize", str(awq), str(again), "--scheme", "fp8"]) == 2
    err = capsys.readouterr().err
    assert f"{awq} holds quantized weights (model.layers.0.mlp.down_proj.qweight: torch.int32)" in err
    assert not again.exists()
    # older AutoAWQ's own config file describes them
    (awq / "quant_config.json").write_text(json.dumps({"w_bit": 4, "q_group_size": 128, "version": "GEMM"}))
    assert ember(["quantize", str(awq), str(again), "--scheme", "fp8"]) == 2
    assert f"{awq} is already quantized (awq)" in capsys.readouterr().err
    assert not again.exists()
    # the config under the older `compression_config` key is as quantized
    config = json.loads((dst / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(config))
    assert ember(["quantize", str(dst), str(again), "--scheme", "fp8"]) == 2
    assert f"{dst} is already quantized (compressed-tensors)" in capsys.readouterr().err
    assert not again.exists()

    missing = tmp_path / "missing"
    assert ember(["quantize", str(missing), str(again), "--scheme", "fp8"]) == 2
    assert f"{missing} has no config.json" in capsys.readouterr().err
    assert not again.exists()

    dangling = tmp_path / "dangling"  # a symbolic link to nothing exists all the same
    dangling.symlink_to(tmp_path / "nowhere")
    assert ember(["quantize", str(tiny_model), str(dangling), "--scheme", "fp8"]) == 2
    assert f"{dangling} already exists" in capsys.readouterr().err
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_quantized_checkpoints_own_method_may_be_named(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """As vLLM takes `quantization` for a quantized checkpoint: its own method (gptq_marlin and awq_marlin
    for gptq and awq) or its scheme, which it runs in; another is refused, naming what would do."""
    gptq = quantized_model("tiny", "INT4", "gptq_build.py")
    for name in ("gptq", "gptq_marlin", "w4a16"):
        assert LLM(str(gptq), num_kv_blocks=16, quantization=name).engine.runner.quant.format == "gptq"
    with pytest.raises(
        ValueError, match=r"'awq_marlin' requested, but .* is already quantized as 'w4a16' \(gptq\)"
    ):
        LLM(str(gptq), num_kv_blocks=16, quantization="awq_marlin")
    ct = quantized_model("tiny", "W8A16")
    llm = LLM(str(ct), num_kv_blocks=16, quantization="compressed-tensors")
    assert llm.engine.runner.quant.scheme == "w8a16"
    with pytest.raises(ValueError, match=r"give compressed-tensors or w8a16, or no quantization"):
        LLM(str(ct), num_kv_blocks=16, quantization="gptq")
