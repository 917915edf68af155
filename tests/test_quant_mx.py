"""MX checkpoints as llm-compressor's MXFP4A16 and MXFP8A16 presets write them (compressed-tensors
`mxfp4-pack-quantized`: FP4 E2M1 weights two a byte; `mxfp8-quantized`: E4M3 weights; each under a
power-of-two E8M0 scale per group of 32; activations unquantized), run as 4-bit codes into the E2M1 values
(`codebook`) and as FP8 weight-only with a scale per row and group (`w8a16-fp8`): the model computes what
transformers + compressed-tensors computes on the same checkpoint. Their weights, an E2M1 or E4M3 value
times a power of two, are exact in the bfloat16 compressed-tensors decompresses them to, so the oracle
holds them exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quant_modelopt import _forward
from test_quant_nvfp4 import PARTS
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant.codebook_linear import CodebookLinear
from ember_engine.model.quant.fp8_linear import Fp8WeightOnlyLinear

# llm-compressor's preset -> (ember's scheme, its layer, the format)
PRESETS = {
    "MXFP4A16": ("codebook", CodebookLinear, "mxfp4-pack-quantized"),
    "MXFP8A16": ("w8a16-fp8", Fp8WeightOnlyLinear, "mxfp8-quantized"),
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
    scheme, layer_class, fmt = PRESETS[preset]
    runner = llm.engine.runner
    assert runner.quant.format == fmt and runner.quant.scheme == scheme
    checked = 0
    for i, layer in enumerate(runner.model.model.layers):
        for module, name, parts in PARTS:
            ours = getattr(getattr(layer, module), name)
            assert isinstance(ours, layer_class) and ours.group_size == 32
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


def _activations(bits: int):  # type: ignore[no-untyped-def]
    def edit(group: dict) -> None:  # type: ignore[type-arg]
        group["input_activations"] = {
            "type": "float",
            "num_bits": bits,
            "strategy": "group",
            "group_size": 32,
        }
        group["input_activations"] |= {"dynamic": True, "symmetric": True}

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
            _activations(4),
            None,
            r"MXFP4 weights with input activations \('float', 4, 'group', 32\) \(MXFP4, W4A4\) are not "
            r"supported; supported: none \(MXFP4A16\)",
        ),
        (
            "MXFP8A16",
            _activations(8),
            None,
            r"MXFP8 weights with input activations \('float', 8, 'group', 32\) \(MXFP8, W8A8\) are not "
            r"supported; supported: none \(MXFP8A16\)",
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
            "MXFP4A16",
            None,
            _nan_scale,
            r"model.layers.1.mlp.down_proj: MX scales must be E8M0 bytes other than 255",
        ),
        (
            "MXFP8A16",
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
