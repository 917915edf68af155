"""Quantized checkpoints that leave some projections in full precision: compressed-tensors' `ignore` (by
name or "re:" pattern) and `targets`, as llm-compressor writes them. The projections left out load as
ordinary full-precision layers and the model computes what transformers + compressed-tensors computes;
a merged projection whose parts disagree is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ember_engine import LLM
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.layer import QuantLinear

# preset: (projections left in full precision, tolerance on the logits as a fraction of their range)
CASES = {
    "W8A16_PARTIAL": (
        {"layers.0.self_attn.o_proj", "layers.1.mlp.gate_up_proj", "layers.1.mlp.down_proj"},
        1e-4,
    ),
    # every MLP projection, the attention ones in FP8 (activations rounded to E4M3 steps)
    "FP8_DYNAMIC_ATTENTION": (
        {f"layers.{i}.mlp.{p}" for i in range(4) for p in ("gate_up_proj", "down_proj")},
        2e-2,
    ),
}


@pytest.mark.parametrize("preset", list(CASES))
def test_projections_left_out_run_in_full_precision(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", preset)
    full, tolerance = CASES[preset]
    llm = LLM(str(path), num_kv_blocks=32)
    model = llm.engine.runner.model
    seen = set()
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            short = name.removeprefix("model.")
            seen.add(short)
            if short in full:
                assert type(module) is nn.Linear and module.weight.dtype == torch.float32, name
            else:
                assert isinstance(module, QuantLinear), name
    assert full < seen
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(9)
    for n in (19, 40):
        prompt = torch.randint(10, 4000, (n,), generator=g).tolist()
        with torch.inference_mode():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        got = llm.engine.runner.forward([Chunk(list(range(-(-n // 16))), 0, prompt, num_logits=n)])
        assert got is not None
        span = (expected.max() - expected.min()).item()
        assert (got - expected).abs().max().item() <= tolerance * span


@pytest.mark.parametrize(
    ("ignore", "message"),
    [
        (
            ["model.layers.2.self_attn.k_proj"],
            r"model.layers.2.self_attn: k_proj is left in full precision but q_proj, v_proj are quantized",
        ),
        (
            [r"re:.*layers\.3\.mlp\.up_proj$"],
            r"model.layers.3.mlp: up_proj is left in full precision but gate_proj is quantized",
        ),
    ],
)
def test_merged_parts_quantized_apart_are_refused_by_name(
    ignore: list[str], message: str, quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    def config(raw: dict) -> None:
        raw["ignore"] = [*raw["ignore"], *ignore]

    path = edited_checkpoint(quantized_model("tiny", "W8A16"), tmp_path / "m", quantization=config)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)


def test_hugging_face_fp8_modules_not_converted_run_in_full_precision(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """Hugging Face's `fp8` with `modules_to_not_convert: ["model.layers.1.mlp", "lm_head"]` (an entry
    matches a module whose name it starts, as transformers reads it): layer 1's MLP projections hold the
    checkpoint's own float32 weights, every other projection FP8, and transformers builds the same split."""
    from safetensors.torch import load_file

    path = quantized_model("tiny", "FP8_BLOCK_PARTIAL", "hf_fp8_build.py")
    llm = LLM(str(path), num_kv_blocks=16)
    layers = llm.engine.runner.model.model.layers
    stored = load_file(str(path / "model.safetensors"))
    mlp = layers[1].mlp
    assert type(mlp.gate_up_proj) is nn.Linear and type(mlp.down_proj) is nn.Linear
    gate_up = torch.cat(
        [stored["model.layers.1.mlp.gate_proj.weight"], stored["model.layers.1.mlp.up_proj.weight"]]
    )
    assert torch.equal(mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(mlp.down_proj.weight, stored["model.layers.1.mlp.down_proj.weight"])
    others = [layers[0].mlp.down_proj, layers[1].self_attn.qkv_proj, layers[2].mlp.gate_up_proj]
    assert all(isinstance(m, QuantLinear) for m in others)
    # transformers, on a CPU, dequantizes the FP8 weights as it loads them: the same split shows as the
    # same values, layer 1's MLP as stored and the others as ember's dequantized FP8.
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(hf.model.layers[1].mlp.down_proj.weight, stored["model.layers.1.mlp.down_proj.weight"])
    fp8 = layers[0].mlp.down_proj.dequantized()
    assert torch.equal(hf.model.layers[0].mlp.down_proj.weight, fp8)
    assert not torch.equal(
        fp8, load_file(str(path.parent / "tiny" / "model.safetensors"))["model.layers.0.mlp.down_proj.weight"]
    )
