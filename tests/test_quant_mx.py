"""MX checkpoints as llm-compressor's MX presets write them (compressed-tensors `mxfp4-pack-quantized`: FP4
E2M1 weights two a byte; `mxfp8-quantized`: E4M3 weights; each under a power-of-two E8M0 scale per group
of 32): with activations as they are (MXFP4A16, MXFP8A16), run as 4-bit codes into the E2M1 values
(`codebook`) and as FP8 weight-only with a scale per row and group (`w8a16-fp8`); with activations
quantized the same way as the model runs (MXFP4, MXFP8), the codes after MXFP4's activations and
block-scaled `fp8` with MXFP8's. The model computes what transformers + compressed-tensors computes on the
same checkpoint. Their weights, an E2M1 or E4M3 value times a power of two, are exact in the bfloat16
compressed-tensors decompresses them to, so the oracle holds them exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quant_modelopt import _forward
from test_quant_nvfp4 import PARTS
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant import schemes
from ember_engine.model.quant.codebook_linear import CodebookLinear
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8WeightOnlyLinear
from ember_engine.model.quant.linear import make_layer

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# llm-compressor's preset -> (ember's scheme, its layer, the format, its inputs' quantization)
PRESETS = {
    "MXFP4A16": ("codebook", CodebookLinear, "mxfp4-pack-quantized", ""),
    "MXFP8A16": ("w8a16-fp8", Fp8WeightOnlyLinear, "mxfp8-quantized", ""),
    "MXFP4": ("codebook", CodebookLinear, "mxfp4-pack-quantized", "mxfp4"),
    "MXFP8": ("fp8", Fp8BlockLinear, "mxfp8-quantized", "mxfp8"),
}


@pytest.fixture(scope="module", params=list(PRESETS))
def pair(quantized_model, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    """(the preset, the checkpoint, ember's LLM, transformers + compressed-tensors on it, weights widened to
    float32)."""
    preset = request.param
    path = quantized_model("tiny", preset)
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
            module.weight.data = module.weight.data.float()
    return preset, path, LLM(str(path), num_kv_blocks=64, max_num_seqs=4), hf


def test_weights_are_the_oracles(pair) -> None:  # type: ignore[no-untyped-def]
    preset, _, llm, hf = pair
    scheme, layer_class, fmt, input_quant = PRESETS[preset]
    runner = llm.engine.runner
    assert (
        runner.quant.format == fmt
        and runner.quant.scheme == scheme
        and runner.quant.input_quant == input_quant
    )
    checked = 0
    for i, layer in enumerate(runner.model.model.layers):
        for module, name, parts in PARTS:
            ours = getattr(getattr(layer, module), name)
            assert isinstance(ours, layer_class) and ours.group_size == 32
            assert getattr(ours, "input_quant", "") == input_quant
            block = getattr(hf.model.layers[i], module)
            theirs = torch.cat([getattr(block, p).weight.detach() for p in parts])
            assert torch.equal(ours.dequantized(torch.float32), theirs), (i, name)
            checked += 1
    assert checked == 4 * len(runner.model.model.layers)


def test_logits_and_greedy_tokens_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    _, _, llm, hf = pair
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (9, 17, 40)]
    for prompt in prompts:
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        ours = _forward(llm.engine.runner, prompt)
        assert (ours - theirs).abs().max().item() <= 1e-5 * (theirs.max() - theirs.min()).item()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with torch.inference_mode():
        expected = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    assert got == expected


def test_two_ranks_run_it_as_one(pair) -> None:  # type: ignore[no-untyped-def]
    _, path, llm, _ = pair
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 99, 300, 1000, 7, 8, 9], [11] * 20]
    expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    split = LLM(str(path), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in split.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        split.engine.shutdown()


@pytest.mark.parametrize("bits", [4, 8])
def test_activations_quantize_as_compressed_tensors_quantizes_them(bits: int, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """MX activation quantization is compressed-tensors' own to the bit in float32 and bfloat16: a zero
    group, a group whose largest magnitude is 1.75 times a power of two (its scale rounds up) and one just
    below (rounds down), magnitudes from 1e-30 to 1e30 and float32's subnormals. (In float16
    compressed-tensors finds a power of two from the float16 bits and so quantizes a group whose largest
    magnitude is a float16 subnormal, below 2^-14, to zero; ember keeps such a group's values.)"""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    path = quantized_model("tiny", f"MXFP{bits}")
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    module = hf.model.layers[1].mlp.down_proj
    args = module.quantization_scheme.input_activations
    g = torch.Generator().manual_seed(11)
    x = torch.randn(9, module.in_features, generator=g) * torch.logspace(-30, 30, 9)[:, None]
    x[2, :32] = 0
    x[3, 32:64] = 1.75 * 2**3
    x[4, :32] = 1.74 * 2**-5
    x[5, :32] = 1e-39
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        theirs = forward_quantize(module, xd.clone(), "input", args)
        ours = schemes.fake_quantize_input(xd, f"mxfp{bits}").to(dtype)
        assert torch.equal(ours, theirs), (bits, dtype)
    values, scale = schemes.quantize_activation_mx(x, bits)
    assert scale.shape == (9, module.in_features // 32)
    assert torch.equal(scale[3, 1], torch.tensor(2.0 ** (4 - schemes.MX_BINADE[bits])))
    assert torch.equal(scale[4, 0], torch.tensor(2.0 ** (-5 - schemes.MX_BINADE[bits])))
    assert values.dtype == (torch.float8_e4m3fn if bits == 8 else torch.float32)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 5, 33])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_each_path_computes_the_product_of_the_quantized_activations(
    bits: int, rows: int, path: str, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    """MXFP4's codes and MXFP8's block-scaled FP8 (the Triton GEMM interpreted on a CPU, the CPU loops):
    the float64 product of the MX-quantized activations and the dequantized weight."""
    g = torch.Generator().manual_seed(rows * 10 + bits)
    n, k = 72, 256
    scheme = "codebook" if bits == 4 else "fp8"
    layer = make_layer(scheme, k, n, False, torch.float32, 32, input_quant=f"mxfp{bits}")
    scales = torch.exp2(torch.randint(-9, 3, (n, k // 32), generator=g).float())
    if isinstance(layer, CodebookLinear):
        layer.weight_packed.copy_(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8))
        layer.set_code(torch.tensor(schemes.E2M1_VALUES + tuple(-v for v in schemes.E2M1_VALUES)), "e2m1")
        layer.weight_scale.copy_(scales)
    else:
        weight = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
        layer.set_rows(0, weight, scales)
    layer.to(DEVICE)
    x = (torch.randn(rows, k, generator=g) * torch.logspace(-2, 2, k)[torch.randperm(k, generator=g)]).to(
        DEVICE
    )
    expected = schemes.fake_quantize_input(x, f"mxfp{bits}").double() @ layer.dequantized().double().t()
    monkeypatch.setenv("EMBER_QUANT_GEMM", path)
    got = layer(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    # Hopper's FP8 tensor cores (the Triton GEMM's E4M3 dots, in tiles of 64 rows) add a step's products
    # with fewer bits than float32 has; each step's sum is then added in float32.
    tolerance = 1e-3 if DEVICE == "cuda" and bits == 8 and path == "triton" else 1e-6
    assert (got.double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def _activations(bits: int, **changed):  # type: ignore[no-untyped-def]
    def edit(group: dict) -> None:  # type: ignore[type-arg]
        group["input_activations"] = {
            "type": "float",
            "num_bits": bits,
            "strategy": "group",
            "group_size": 32,
            "dynamic": True,
            "symmetric": True,
            "scale_dtype": "torch.uint8",
        } | changed

    return edit


def _groups_of_16(group: dict) -> None:  # type: ignore[type-arg]
    group["weights"]["group_size"] = 16


def _nan_scale(state: dict) -> None:  # type: ignore[type-arg]
    state["model.layers.1.mlp.down_proj.weight_scale"][0, 0] = 255


@pytest.mark.parametrize(
    ("preset", "group", "tensors", "error"),
    [
        (
            "MXFP4A16",
            _activations(8),
            None,
            r"MXFP4 weights with input activations \('float', 8, 'group', 32, True\) \(scale_dtype torch.uint8, "
            r"symmetric=True\) are not supported; supported: none \(MXFP4A16\), or float 4-bit, group, groups "
            r"of 32, dynamic, symmetric, scale_dtype torch.uint8 \(MXFP4\)",
        ),
        (
            "MXFP8A16",
            _activations(8, dynamic=False),
            None,
            r"MXFP8 weights with input activations \('float', 8, 'group', 32, False\)",
        ),
        (
            "MXFP4A16",
            _activations(4, scale_dtype=None),
            None,
            r"MXFP4 weights with input activations \('float', 4, 'group', 32, True\) \(scale_dtype None",
        ),
        (
            "MXFP8A16",
            _activations(8, strategy="token", group_size=None),
            None,
            r"MXFP8 weights with input activations \('float', 8, 'token', None, True\)",
        ),
        (
            "MXFP4A16",
            _groups_of_16,
            None,
            r"mxfp4-pack-quantized with float 4-bit weights, strategy 'group', groups of 16 \(symmetric=True\) "
            r"is not supported; supported: float 4-bit, group, groups of 32, symmetric \(MXFP4A16\)",
        ),
        (
            "MXFP8A16",
            _groups_of_16,
            None,
            r"mxfp8-quantized with float 8-bit weights, strategy 'group', groups of 16 \(symmetric=True\) is "
            r"not supported; supported: float 8-bit, group, groups of 32, symmetric \(MXFP8A16\)",
        ),
        (
            "MXFP4",
            None,
            _nan_scale,
            r"model.layers.1.mlp.down_proj: MX scales must be E8M0 bytes other than 255",
        ),
        (
            "MXFP8",
            None,
            _nan_scale,
            r"model.layers.1.mlp.down_proj: MX scales must be E8M0 bytes other than 255",
        ),
    ],
)
def test_what_mx_checkpoints_hold_that_ember_cannot_run_is_refused_by_name(
    preset: str, group, tensors, error: str, quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = edited_checkpoint(quantized_model("tiny", preset), tmp_path / "m", group=group, tensors=tensors)
    with pytest.raises(ValueError, match=error):
        LLM(str(path), num_kv_blocks=16)


def test_an_older_writers_mx_activations_without_scale_dtype_run_as_mx(
    quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """compressed-tensors' versions before `scale_dtype` wrote MXFP4's activations without it and took
    power-of-two scales for them all the same."""

    def older(group: dict) -> None:  # type: ignore[type-arg]
        for args in (group["weights"], group["input_activations"]):
            del args["scale_dtype"]

    path = edited_checkpoint(quantized_model("tiny", "MXFP4"), tmp_path / "m", group=older)
    llm = LLM(str(path), num_kv_blocks=16)
    assert llm.engine.runner.quant.input_quant == "mxfp4"
