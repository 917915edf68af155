"""NVFP4A16 checkpoints (compressed-tensors `nvfp4-pack-quantized`: FP4 E2M1 weights, an FP8 scale per
group of 16 input columns and a per-tensor global scale; activations unquantized), as llm-compressor's
NVFP4A16 preset writes them: the nibbles decode as compressed-tensors decodes them, every path computes
the float64 product of the dequantized weight, and the model computes what transformers +
compressed-tensors computes on the same checkpoint."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant import cpu_fp4, schemes
from ember_engine.model.quant.fp4_linear import Fp4Linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_every_byte_decodes_as_compressed_tensors_decodes_it() -> None:
    every = torch.arange(256, dtype=torch.uint8).reshape(2, 128)
    theirs = unpack_fp4_from_uint8(every, 2, 256, dtype=torch.float32)
    assert torch.equal(schemes.unpack_fp4(every), theirs)
    ones = torch.ones(2, 16, dtype=torch.float8_e4m3fn)
    assert torch.equal(cpu_fp4.dequantize(every, ones, torch.ones(2)), theirs)
    assert set(theirs.abs().unique().tolist()) == set(schemes.E2M1_VALUES)


def test_rounding_to_e2m1_is_compressed_tensors_own_ties_included() -> None:
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 2.0, 4.0, 6.0])
    near = [torch.nextafter(ties, torch.tensor(d)) for d in (10.0, -10.0)]
    v = torch.cat([torch.linspace(-6, 6, 120001), ties, -ties, *near, *(-n for n in near)])
    assert torch.equal(schemes.round_to_e2m1(v), cast_to_fp4(v.clone()))


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
@pytest.mark.parametrize("path", ["torch", "triton"])
def test_each_path_computes_the_dequantized_product(rows: int, path: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The CPU's fused loops (up to 8 rows) and blocked decoder, and the Triton GEMM (interpreted on a
    CPU), against the float64 product of the dequantized weight, every byte value present."""
    g = torch.Generator().manual_seed(rows)
    n, k = 72, 256
    layer = Fp4Linear(k, n, False, torch.float32)
    layer.weight_packed.copy_(torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8))
    layer.weight_scale.copy_((torch.rand(n, k // 16, generator=g) * 400 + 1).to(torch.float8_e4m3fn))
    layer.weight_global.copy_(torch.rand(n, generator=g) * 5000 + 100)
    layer.to(DEVICE)
    x = torch.randn(rows, k, generator=g).to(DEVICE)
    expected = x.double() @ layer.dequantized().double().t()
    monkeypatch.setenv("EMBER_QUANT_GEMM", path)
    got = layer(x)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert (got.double() - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


PRESETS = {"nvfp4a16": "NVFP4A16", "nvfp4": "NVFP4"}  # ember's scheme: llm-compressor's preset
PARTS = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


@pytest.fixture(scope="module", params=list(PRESETS))
def pair(request: pytest.FixtureRequest, quantized_model):  # type: ignore[no-untyped-def]
    """(scheme, ember's LLM, the oracle: transformers + compressed-tensors on the checkpoint).
    compressed-tensors decompresses NVFP4 weights to bfloat16 whatever the model's dtype (its forward
    then refuses float32 inputs, so they are widened here), which moves an NVFP4 model's logits by up to
    13 % of their range where FP4 activations land on the other side of a rounding step; with the
    checkpoint's exact float32 weights in their place (`_exact`) the oracle's own forward, activation
    quantization included, gives ember's logits."""
    scheme = request.param
    checkpoint = quantized_model("tiny", PRESETS[scheme])
    hf = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    for module in hf.modules():  # its bfloat16 weights, widened for a float32 forward
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
            module.weight.data = module.weight.data.float()
    return scheme, LLM(str(checkpoint), num_kv_blocks=64), hf


@pytest.fixture(scope="module")
def checkpoint(quantized_model) -> Path:  # type: ignore[no-untyped-def]
    return quantized_model("tiny", "NVFP4A16")


def _projections(llm: LLM, hf):  # type: ignore[no-untyped-def]
    """(ember's merged projection, the oracle's module holding its parts, the parts' names), every one."""
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        for module, name, parts in PARTS:
            yield getattr(getattr(layer, module), name), getattr(hf.model.layers[i], module), parts


def _exact(llm: LLM, hf):  # type: ignore[no-untyped-def]
    """A copy of the oracle holding ember's float32 weights, each the checkpoint's exact value."""
    exact = copy.deepcopy(hf)
    for ours, block, parts in _projections(llm, exact):
        rows = [getattr(block, p).weight.shape[0] for p in parts]
        for part, value in zip(parts, ours.dequantized().split(rows), strict=True):
            getattr(block, part).weight.data = value.clone()
    return exact


def test_weights_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    """ember keeps each weight as the float32 product of its E2M1 value and its group's FP8 scale over
    the global scale; rounded to bfloat16 it is the oracle's weight bit for bit."""
    scheme, llm, hf = pair
    assert llm.engine.runner.quant is not None and llm.engine.runner.quant.scheme == scheme
    for ours, block, parts in _projections(llm, hf):
        assert isinstance(ours, Fp4Linear) and ours.scheme == scheme
        theirs = torch.cat([getattr(block, p).weight.detach().float() for p in parts])
        assert torch.equal(ours.dequantized().bfloat16().float(), theirs), parts


def test_activations_quantize_as_compressed_tensors_quantizes_them(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """NVFP4's activation quantization (per token and group of 16, E4M3 local scales under the
    calibrated global scale, E2M1 values) is compressed-tensors' own to the bit, zero groups and values
    beyond the calibrated range included."""
    from compressed_tensors.quantization.lifecycle.forward import forward_quantize

    path = quantized_model("tiny", "NVFP4")
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    llm = LLM(str(path), num_kv_blocks=16)
    module = hf.model.layers[1].mlp.down_proj
    g = torch.Generator().manual_seed(11)
    x = torch.randn(7, module.in_features, generator=g) * torch.logspace(-3, 3, 7)[:, None]
    x[2, :16] = 0  # a zero group: its scale becomes E4M3's smallest step
    theirs = forward_quantize(module, x.clone(), "input", module.quantization_scheme.input_activations)
    assert torch.equal(schemes.fake_quantize_nvfp4(x, module.input_global_scale.data), theirs)
    ours = llm.engine.runner.model.model.layers[1].mlp.down_proj
    assert torch.equal(ours.input_global, module.input_global_scale.data.reshape(-1))


def test_logits_and_greedy_tokens_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    """The oracle's forward (with the exact weights, see `pair`): logits within 1e-5 of their range
    (measured: equal), and the 12 greedy tokens of 8 prompts. NVFP4A16's activations are not quantized,
    so there the oracle with its own bfloat16 weights stays close too: within 1e-2 (measured 2.5e-3)."""
    scheme, llm, hf = pair
    exact = _exact(llm, hf)
    runner = llm.engine.runner
    g = torch.Generator().manual_seed(3)
    for n in (17, 40):
        prompt = torch.randint(10, 4000, (n,), generator=g).tolist()
        with torch.inference_mode():
            expected = exact(torch.tensor([prompt])).logits[0].float()
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        got = runner.forward([Chunk(list(range(-(-n // 16))), 0, prompt, num_logits=n)])
        assert got is not None
        span = (expected.max() - expected.min()).item()
        assert (got - expected).abs().max().item() <= 1e-5 * span, scheme
        if scheme == "nvfp4a16":
            assert (got - theirs).abs().max().item() <= 1e-2 * span
    hf = exact
    prompts = [torch.randint(10, 4000, (20 + i,), generator=g).tolist() for i in range(8)]
    expected_tokens = hf_greedy(hf, prompts, 12)
    got_tokens = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    agree = sum(o.token_ids == e for o, e in zip(got_tokens, expected_tokens, strict=True))
    assert agree >= 7, (scheme, agree)


@pytest.mark.parametrize(
    ("group", "tensors", "message"),
    [
        (
            lambda g: g.update(input_activations={**g["weights"], "dynamic": True}),
            None,
            r"NVFP4 weights with input activations \('float', 4, 'tensor_group', 16, True\) are not supported; "
            r"supported: none \(NVFP4A16\), or float 4-bit, tensor_group, groups of 16, dynamic 'local'",
        ),
        (
            lambda g: g["weights"].update(group_size=32),
            None,
            r"nvfp4-pack-quantized with float 4-bit weights, strategy 'tensor_group', groups of 32 "
            r"\(symmetric=True\) is not supported",
        ),
        (
            None,
            lambda s: s.update({"model.layers.0.mlp.up_proj.weight_global_scale": torch.tensor([0.0])}),
            r"weight_global_scale must be one positive finite number",
        ),
        (
            None,
            lambda s: s.update(
                {
                    "model.layers.1.self_attn.o_proj.weight_scale": s[
                        "model.layers.1.self_attn.o_proj.weight_scale"
                    ][:, :4].contiguous()
                }
            ),
            r"nvfp4 checkpoint: weight_packed \[\d+, \d+\] \(torch.uint8\) needs uint8 and weight_scale "
            r"\[\d+, \d+\] in float8_e4m3fn, found \[\d+, 4\]",
        ),
    ],
    ids=["dynamic-activations", "group-32", "global-scale", "scale-shape"],
)
def test_what_it_cannot_run_is_refused_by_name(
    group, tensors, message: str, checkpoint: Path, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        LLM(str(edited_checkpoint(checkpoint, tmp_path / "m", group, tensors)), num_kv_blocks=16)


def test_nvfp4a16_is_not_an_online_scheme(tiny_model: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unsupported scheme 'nvfp4a16'; supported: fp8, w8a16, w4a16, w8a8"
    ):
        LLM(str(tiny_model), quantization="nvfp4a16", num_kv_blocks=16)


def test_merged_parts_calibrated_apart_share_the_largest_activation_global_scale(
    quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    """q, k and v share one input and so one quantization of it (W4A4): the largest of their global
    scales. A projection without one is named."""

    def spread(state: dict[str, torch.Tensor]) -> None:
        for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
            state[f"model.layers.0.self_attn.{part}.input_global_scale"] = torch.tensor([100.0 * (i + 1)])

    src = quantized_model("tiny", "NVFP4")
    llm = LLM(str(edited_checkpoint(src, tmp_path / "a", tensors=spread)), num_kv_blocks=16)
    assert llm.engine.runner.model.model.layers[0].self_attn.qkv_proj.input_global.tolist() == [300.0]

    def drop(state: dict[str, torch.Tensor]) -> None:
        del state["model.layers.1.mlp.down_proj.input_global_scale"]

    with pytest.raises(
        ValueError, match=r"is missing tensor\(s\): model.layers.1.mlp.down_proj.input_global_scale$"
    ):
        LLM(str(edited_checkpoint(src, tmp_path / "b", tensors=drop)), num_kv_blocks=16)
