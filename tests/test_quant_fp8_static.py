"""FP8 with static activation scales (llm-compressor's FP8 preset: per-tensor weights, one calibrated
`input_scale` per projection): the kernels, merged projections whose parts were calibrated apart, and
the configurations refused by name. Its logits against transformers + compressed-tensors are checked in
test_quant_load.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_quant_kernels import DEVICE, TORCH_FP8_TOLERANCE

from ember_engine import LLM
from ember_engine.model.quant import schemes
from ember_engine.model.quant.fp8_linear import Fp8Linear
from ember_engine.model.quant.linear import quantize_linear


@pytest.mark.parametrize("shape", [(1, 128, 64), (5, 256, 96), (33, 128, 200)], ids=str)
def test_kernels_quantize_every_token_with_the_static_scale(shape: tuple[int, int, int], monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The Triton kernel (interpreted on CPU) and the torch path against the reference: activations
    divided by the one scale, saturated at +-448 (the scale is set so that some do), E4M3-rounded."""
    m, k, n = shape
    g = torch.Generator().manual_seed(m + n)
    linear = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    layer = quantize_linear(linear, "fp8", group_size=0)
    assert isinstance(layer, Fp8Linear)
    x = torch.randn(m, k, generator=g)
    layer.set_input_scale(torch.tensor([x.abs().max().item() / 448 / 2]), "test")
    layer.to(DEVICE)
    x = x.to(DEVICE)
    s = layer.input_scale
    assert s is not None
    xq = (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert (xq.float().abs() == 448).any()  # some activations saturate
    expected = (xq.float() * s) @ layer.dequantized().t()
    monkeypatch.setenv("EMBER_QUANT_GEMM", "triton")
    got = layer(x)
    monkeypatch.setenv("EMBER_QUANT_GEMM", "torch")
    torch_path = layer(x)
    dynamic_xq, dynamic_scale = schemes.quantize_activation_fp8(x)
    dynamic = (dynamic_xq.float() * dynamic_scale) @ layer.dequantized().t()
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 1e-3 * scale
    assert (torch_path - expected).abs().max().item() <= TORCH_FP8_TOLERANCE * scale
    assert (dynamic - expected).abs().max().item() > 1e-2 * scale  # the static scale is what was used


def test_merged_parts_calibrated_apart_share_the_largest_scale(
    quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """q, k and v (gate and up) share one input and so one quantization of it: the largest of their
    scales, which saturates none of them."""
    src = quantized_model("tiny", "FP8")

    def spread(state: dict[str, torch.Tensor]) -> None:
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            state[f"model.layers.0.self_attn.{part}.input_scale"] = torch.tensor([0.01 * (i + 1)])
        state["model.layers.0.mlp.up_proj.input_scale"] = torch.tensor([0.5])
        state["model.layers.0.mlp.gate_proj.input_scale"] = torch.tensor([0.125])

    model = LLM(
        str(edited_checkpoint(src, tmp_path / "m", tensors=spread)), num_kv_blocks=16
    ).engine.runner.model
    first = model.model.layers[0]
    assert first.self_attn.qkv_proj.input_scale.tolist() == pytest.approx([0.03])
    assert first.mlp.gate_up_proj.input_scale.tolist() == [0.5]
    original = load_file(str(src / "model.safetensors"))
    second = model.model.layers[1].self_attn.o_proj.input_scale
    assert torch.equal(second, original["model.layers.1.self_attn.o_proj.input_scale"])


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda g: g.update(input_activations=None),
            # FP8 weights alone run as w8a16-fp8; calibrated activation scales contradict that config
            r"input_scale: an activation scale in a checkpoint whose config quantizes no activations",
        ),
        (
            lambda g: g["input_activations"].update(strategy="channel"),
            r"FP8 input activations 'channel' \(dynamic=False\) are not supported; supported: dynamic per "
            r"token, static per tensor",
        ),
        (
            lambda g: g["input_activations"].update(type="int"),
            r"FP8 weights with input activations int 8-bit \(symmetric=True\) are not supported",
        ),
        (
            lambda g: g["input_activations"].update(symmetric=False),
            r"FP8 weights with input activations float 8-bit \(symmetric=False\) are not supported",
        ),
    ],
    ids=["weight-only", "static-per-channel", "int8-activations", "asymmetric-activations"],
)
def test_unsupported_activation_schemes_are_refused_by_name(
    edit, message: str, quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    path = edited_checkpoint(quantized_model("tiny", "FP8"), tmp_path / "m", group=edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)


def test_a_static_scale_that_is_not_one_positive_number_is_refused(
    quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    def bad(state: dict[str, torch.Tensor]) -> None:
        state["model.layers.1.mlp.down_proj.input_scale"] = torch.tensor([0.0])

    path = edited_checkpoint(quantized_model("tiny", "FP8"), tmp_path / "m", tensors=bad)
    with pytest.raises(
        ValueError, match=r"model.layers.1.mlp.down_proj: input_scale must be one positive finite number"
    ):
        LLM(str(path), num_kv_blocks=16)


def test_a_checkpoint_missing_a_static_scale_names_the_projection(
    quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    def drop(state: dict[str, torch.Tensor]) -> None:
        del state["model.layers.1.self_attn.o_proj.input_scale"]

    path = edited_checkpoint(quantized_model("tiny", "FP8"), tmp_path / "m", tensors=drop)
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.o_proj"):
        LLM(str(path), num_kv_blocks=16)
