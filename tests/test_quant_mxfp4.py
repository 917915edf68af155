"""MXFP4A16 checkpoints (compressed-tensors `mxfp4-pack-quantized`: FP4 E2M1 weights, two a byte, under a
power-of-two E8M0 scale per group of 32; activations unquantized), as llm-compressor's MXFP4A16 preset
writes them, run as 4-bit codes into the E2M1 values (`codebook`): the model computes what transformers +
compressed-tensors computes on the same checkpoint. Its weights, an E2M1 value times a power of two, are
exact in the bfloat16 compressed-tensors decompresses them to, so the oracle holds them exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quant_modelopt import _forward
from transformers import AutoModelForCausalLM
from transformers.utils.quantization_config import CompressedTensorsConfig

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant.codebook_linear import CodebookLinear

PARTS = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


@pytest.fixture(scope="module")
def pair(quantized_model):  # type: ignore[no-untyped-def]
    """(the checkpoint, ember's LLM, transformers + compressed-tensors on it, weights widened to float32)."""
    path = quantized_model("tiny", "MXFP4A16")
    hf = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    for module in hf.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype != torch.float32:
            module.weight.data = module.weight.data.float()
    return path, LLM(str(path), num_kv_blocks=64, max_num_seqs=4), hf


def test_weights_are_the_oracles(pair) -> None:  # type: ignore[no-untyped-def]
    _, llm, hf = pair
    runner = llm.engine.runner
    assert runner.quant.format == "mxfp4-pack-quantized" and runner.quant.scheme == "codebook"
    checked = 0
    for i, layer in enumerate(runner.model.model.layers):
        for module, name, parts in PARTS:
            ours = getattr(getattr(layer, module), name)
            assert isinstance(ours, CodebookLinear) and ours.group_size == 32
            block = getattr(hf.model.layers[i], module)
            theirs = torch.cat([getattr(block, p).weight.detach() for p in parts])
            assert torch.equal(ours.dequantized(torch.float32), theirs), (i, name)
            checked += 1
    assert checked == 4 * len(runner.model.model.layers)


def test_logits_and_greedy_tokens_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    _, llm, hf = pair
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
    path, llm, _ = pair
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[5, 17, 99, 300, 1000, 7, 8, 9], [11] * 20]
    expected = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    split = LLM(str(path), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in split.generate(prompts, params, use_tqdm=False)] == expected
    finally:
        split.engine.shutdown()


def test_fp4_activations_other_groups_and_nan_scales_are_refused_by_name(
    quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    src = quantized_model("tiny", "MXFP4A16")

    def with_activations(group: dict) -> None:  # type: ignore[type-arg]
        group["input_activations"] = {
            "type": "float",
            "num_bits": 4,
            "strategy": "group",
            "group_size": 32,
            "dynamic": True,
            "symmetric": True,
        }

    w4a4 = edited_checkpoint(src, tmp_path / "w4a4", group=with_activations)
    with pytest.raises(
        ValueError,
        match=r"MXFP4 weights with input activations \('float', 4, 'group', 32\) "
        r"\(MXFP4, W4A4\) are not supported; supported: none \(MXFP4A16\)",
    ):
        LLM(str(w4a4), num_kv_blocks=16)

    def sixteen(group: dict) -> None:  # type: ignore[type-arg]
        group["weights"]["group_size"] = 16

    small_groups = edited_checkpoint(src, tmp_path / "sixteen", group=sixteen)
    with pytest.raises(
        ValueError,
        match=r"mxfp4-pack-quantized with float 4-bit weights, strategy 'group', groups of 16 \(symmetric=True\) "
        r"is not supported; supported: float 4-bit, group, groups of 32, symmetric \(MXFP4A16\)",
    ):
        LLM(str(small_groups), num_kv_blocks=16)

    def nan_scale(state: dict) -> None:  # type: ignore[type-arg]
        state["model.layers.1.mlp.down_proj.weight_scale"][0, 0] = 255

    nan = edited_checkpoint(src, tmp_path / "nan", tensors=nan_scale)
    with pytest.raises(
        ValueError, match=r"model.layers.1.mlp.down_proj: MXFP4 scales must be E8M0 bytes other than 255"
    ):
        LLM(str(nan), num_kv_blocks=16)
