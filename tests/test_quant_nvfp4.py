"""NVFP4A16 checkpoints (compressed-tensors `nvfp4-pack-quantized`: FP4 E2M1 weights, an FP8 scale per
group of 16 input columns and a per-tensor global scale; activations unquantized), as llm-compressor's
NVFP4A16 preset writes them: the nibbles decode as compressed-tensors decodes them, every path computes
the float64 product of the dequantized weight, and the model computes what transformers +
compressed-tensors computes on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
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


@pytest.fixture(scope="module")
def checkpoint(quantized_model) -> Path:  # type: ignore[no-untyped-def]
    return quantized_model("tiny", "NVFP4A16")


@pytest.fixture(scope="module")
def oracle(checkpoint: Path):  # type: ignore[no-untyped-def]
    """transformers + compressed-tensors on the checkpoint. compressed-tensors decompresses NVFP4 weights to
    bfloat16 whatever the model's dtype (and its forward then refuses float32 inputs), so they are widened
    to float32 after loading; nothing else changes."""
    hf = AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
            module.weight.data = module.weight.data.float()
    return hf


def test_weights_and_logits_match_transformers(checkpoint: Path, oracle) -> None:  # type: ignore[no-untyped-def]
    """ember keeps each weight as the float32 product of its E2M1 value and its group's FP8 scale over
    the global scale; rounded to bfloat16 it is the oracle's weight bit for bit. The logits, through the
    oracle's bfloat16 weights, are within 1e-2 of their range (measured 2.5e-3)."""
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.quant is not None and runner.quant.scheme == "nvfp4a16"
    for i, layer in enumerate(runner.model.model.layers):
        for ours, parts in (
            (layer.self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
            (layer.self_attn.o_proj, ("o_proj",)),
            (layer.mlp.gate_up_proj, ("gate_proj", "up_proj")),
            (layer.mlp.down_proj, ("down_proj",)),
        ):
            assert isinstance(ours, Fp4Linear)
            block = oracle.model.layers[i]
            theirs = torch.cat(
                [
                    getattr(
                        block.self_attn
                        if p.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                        else block.mlp,
                        p,
                    ).weight
                    for p in parts
                ]
            )
            assert torch.equal(ours.dequantized().bfloat16().float(), theirs), (i, parts)
    g = torch.Generator().manual_seed(3)
    for n in (17, 40):
        prompt = torch.randint(10, 4000, (n,), generator=g).tolist()
        with torch.inference_mode():
            expected = oracle(torch.tensor([prompt])).logits[0].float()
        got = runner.forward([Chunk(list(range(-(-n // 16))), 0, prompt, num_logits=n)])
        assert got is not None
        span = (expected.max() - expected.min()).item()
        assert (got - expected).abs().max().item() <= 1e-2 * span


def test_greedy_agrees_with_transformers(checkpoint: Path, oracle) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 4000, (20 + i,), generator=g).tolist() for i in range(8)]
    with torch.inference_mode():
        expected = [
            oracle.generate(
                torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    llm = LLM(str(checkpoint), num_kv_blocks=64)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    agree = sum(o.token_ids == e for o, e in zip(got, expected, strict=True))
    assert agree >= 7, agree


@pytest.mark.parametrize(
    ("group", "tensors", "message"),
    [
        (
            lambda g: g.update(input_activations={**g["weights"], "dynamic": "local"}),
            None,
            r"NVFP4 with FP4 input activations \(W4A4\) is not supported; supported: NVFP4A16",
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
            r"nvfp4a16 checkpoint: weight_packed \[\d+, \d+\] \(torch.uint8\) needs uint8 and weight_scale "
            r"\[\d+, \d+\] in float8_e4m3fn, found \[\d+, 4\]",
        ),
    ],
    ids=["w4a4", "group-32", "global-scale", "scale-shape"],
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
