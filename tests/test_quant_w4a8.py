"""W4AFP8 and W4A8 checkpoints as llm-compressor's presets write them (compressed-tensors `int-quantized`:
int4 values one a byte, a float32 scale per group of 128 input columns; activations quantized dynamically
per token, to FP8 E4M3 or to int8): run as `w4a16` after the activations are quantized and dequantized
as compressed-tensors quantizes them. The model computes what transformers + compressed-tensors computes on
the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_greedy import hf_greedy
from test_quant_kernels import DEVICE
from test_quant_load import _projection_inputs_and_outputs, _prompts
from test_quant_modelopt import _forward
from test_quant_nvfp4 import PARTS
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant import schemes
from ember_engine.model.quant.int_linear import Int4Linear

PRESETS = {"W4AFP8": "fp8", "W4A8": "int8"}  # llm-compressor's preset: the inputs' quantization


@pytest.fixture(scope="module", params=list(PRESETS))
def pair(quantized_model, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """(the preset, ember's LLM, transformers + compressed-tensors on the checkpoint)."""
    preset = request.param
    path = quantized_model("tiny", preset)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    return preset, LLM(str(path), num_kv_blocks=64, max_num_seqs=4), hf


def test_weights_are_the_oracles(pair) -> None:  # type: ignore[no-untyped-def]
    preset, llm, hf = pair
    runner = llm.engine.runner
    assert runner.quant.format == "int-quantized" and runner.quant.scheme == "w4a16"
    assert runner.quant.input_quant == PRESETS[preset] and runner.quant.group_size == 128
    for i, layer in enumerate(runner.model.model.layers):
        for module, name, parts in PARTS:
            ours = getattr(getattr(layer, module), name)
            assert isinstance(ours, Int4Linear) and ours.input_quant == PRESETS[preset]
            block = getattr(hf.model.layers[i], module)
            theirs = torch.cat([getattr(block, p).weight.detach().float() for p in parts])
            assert torch.equal(ours.dequantized(torch.float32), theirs), (i, name)


def test_activations_quantize_as_compressed_tensors_quantizes_them(pair) -> None:  # type: ignore[no-untyped-def]
    """Per token: a zero row, rows from 1e-6 to 1e6 (given to compressed-tensors as the model gives them,
    [batch, tokens, hidden]: of a 2-D tensor it takes the rows together). In float32, compressed-tensors'
    own to the bit. In bfloat16 compressed-tensors takes each token's scale in bfloat16, ember in float32
    (as vLLM's kernels do), so a value may land one step of the format away: within an E4M3 step at the
    top of the row (1/14 of its largest magnitude) or two int8 steps."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    preset, _, hf = pair
    module = hf.model.layers[1].mlp.down_proj
    args = module.quantization_scheme.input_activations
    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, module.in_features, generator=g) * torch.logspace(-6, 6, 8)[:, None]
    x[3] = 0
    kind = PRESETS[preset]
    theirs = forward_quantize(module, x[None].clone(), "input", args)[0]
    assert torch.equal(schemes.fake_quantize_input(x, kind), theirs)
    xb = x.bfloat16()
    theirs = forward_quantize(module, xb[None].clone(), "input", args)[0].float()
    ours = schemes.fake_quantize_input(xb, kind).bfloat16().float()
    step = xb.float().abs().amax(dim=1, keepdim=True) * (1 / 14 if kind == "fp8" else 2 / 127.5)
    assert bool(((ours - theirs).abs() <= step).all())
    assert not torch.equal(ours, theirs)  # the two roundings of the scale do differ here


def test_projections_compute_what_the_oracles_layers_compute(pair) -> None:  # type: ignore[no-untyped-def]
    """Each projection, given the very input the transformers + compressed-tensors layer saw, gives that
    layer's output (float32 rounding of the sums only; measured: equal)."""
    _, llm, hf = pair
    seen = _projection_inputs_and_outputs(hf, _prompts(1, 48)[0])
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        for module, name, parts in PARTS:
            x = seen[(i, parts[0])][0]
            expected = torch.cat([seen[(i, p)][1] for p in parts], dim=-1)
            with torch.inference_mode():
                got = getattr(getattr(layer, module), name)(x)
            assert (got - expected).norm() <= 1e-6 * expected.norm(), (i, name)


def test_logits_and_greedy_tokens_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    """Whole-model logits within 2e-2 of their range, the bound of the other schemes whose activations are
    quantized per token (`test_quant_load.py`): a float rounding difference elsewhere can move an
    activation across a rounding boundary of E4M3 or int8. So 12 greedy tokens agree on most of 8 prompts
    (measured: 7 with FP8 activations, 5 with int8), and where they part, ember's token is one the oracle
    itself all but ties with its own: its logit there within 2e-2 of the range of the oracle's largest
    (measured: within 0.07 of a range of 20; one an exact tie, and the oracle's own forward over the whole
    sequence picks ember's token there, where its generation, step by step, picked the other)."""
    _, llm, hf = pair
    for prompt in _prompts(4, 40):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        ours = _forward(llm.engine.runner, prompt)
        assert (ours - theirs).abs().max().item() <= 2e-2 * (theirs.max() - theirs.min()).item()
    prompts = _prompts(8, 20)
    expected = hf_greedy(hf, prompts, 12)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert sum(g == e for g, e in zip(got, expected, strict=True)) >= 4
    for prompt, ours, theirs in zip(prompts, got, expected, strict=True):
        if ours == theirs:
            continue
        k = next(i for i in range(12) if ours[i] != theirs[i])
        with torch.inference_mode():
            logits = hf(torch.tensor([prompt + theirs[:k]])).logits[0, -1].float()
        gap = (logits.max() - logits[ours[k]]).item()
        assert gap <= 2e-2 * (logits.max() - logits.min()).item(), (k, gap)


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_each_path_computes_the_product_of_the_quantized_activations(
    kind: str, rows: int, path: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    from ember_engine.model.quant.linear import make_layer

    g = torch.Generator().manual_seed(rows)
    n, k = 72, 256
    layer = make_layer("w4a16", k, n, False, torch.float32, 128, input_quant=kind)
    assert isinstance(layer, Int4Linear)
    layer.set_rows(0, torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8), torch.rand(n, 2) + 0.01)
    x = torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)
    expected = schemes.fake_quantize_input(x, kind).double() @ layer.dequantized().double().t()
    monkeypatch.setenv("EMBER_QUANT_GEMM", path)
    got = layer.to(DEVICE)(x.to(DEVICE)).cpu()  # on a GPU the kernel runs compiled
    assert (got.double() - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def _weights_out_of_range(state: dict) -> None:  # type: ignore[type-arg]
    state["model.layers.0.mlp.up_proj.weight"][2, 3] = 9


@pytest.mark.parametrize(
    ("group", "tensors", "error"),
    [
        (
            lambda g: g["input_activations"].update(dynamic=False, strategy="tensor"),
            None,
            r"int4 weights with input activations float 8-bit, strategy 'tensor' \(dynamic=False, "
            r"symmetric=True\) are not supported; supported: float or int 8-bit, dynamic per token, "
            r"symmetric \(W4AFP8, W4A8\)",
        ),
        (
            lambda g: g["input_activations"].update(num_bits=4, type="int"),
            None,
            r"int4 weights with input activations int 4-bit, strategy 'token'",
        ),
        (
            lambda g: g["input_activations"].update(symmetric=False),
            None,
            r"int4 weights with input activations float 8-bit, strategy 'token' \(dynamic=True, "
            r"symmetric=False\)",
        ),
        (
            None,
            _weights_out_of_range,
            r"model.layers.0.mlp.up_proj: int4 weights held one a byte must lie in \[-8, 7\], found -8 to 9",
        ),
    ],
)
def test_what_it_cannot_run_is_refused_by_name(
    group, tensors, error: str, quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = edited_checkpoint(quantized_model("tiny", "W4AFP8"), tmp_path / "m", group=group, tensors=tensors)
    with pytest.raises(ValueError, match=error):
        LLM(str(path), num_kv_blocks=16)
