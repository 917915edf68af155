"""Checkpoints llm-compressor wrote (compressed-tensors: FP8_DYNAMIC, FP8_BLOCK and FP8 (static activation
scales) float-quantized, W8A8 (dynamic per-token and static per-tensor activations) int-quantized, W8A16, W4A16 (round-to-nearest and GPTQ) and W4A16_ASYM
pack-quantized, FP8 weights without input activations naive-quantized) load into ember and compute what
transformers computes on the same checkpoint.
The keys below are ember's schemes, "fp8-block" being fp8 with block-scaled weights and "fp8-static" fp8
(and "w8a8-static" w8a8) with calibrated per-tensor activation scales."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.checkpoint import parse_quantization_config
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8Linear, Fp8WeightOnlyLinear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear, W8A8Linear
from ember_engine.model.quant.schemes import UnsupportedQuantizationError
from ember_engine.tools.quantize import quantization_config

PRESETS = {
    "fp8": "FP8_DYNAMIC",
    "w8a16": "W8A16",
    "w4a16": "W4A16",
    "w4a16-asym": "W4A16_ASYM",
    "fp8-block": "FP8_BLOCK",
    "fp8-static": "FP8",
    "w8a8": "W8A8",
    "w8a8-static": "W8A8_STATIC",
    "w4a16-gptq": "W4A16_GPTQ",
    "w8a16-fp8": "FP8_WEIGHT",
}
LAYERS = {
    "fp8": Fp8Linear,
    "w8a16": Int8Linear,
    "w4a16": Int4Linear,
    "w4a16-asym": Int4Linear,
    "fp8-block": Fp8BlockLinear,
    "fp8-static": Fp8Linear,
    "w8a8": W8A8Linear,
    "w8a8-static": W8A8Linear,
    "w4a16-gptq": Int4Linear,
    "w8a16-fp8": Fp8WeightOnlyLinear,
}
# Largest |ember - transformers| logit difference allowed, as a fraction of the logits' own range. w8a16
# and w4a16 compute the same dequantized products in the model's dtype (float rounding apart); FP8
# activations may round a value to the neighbouring E4M3 step where the two orders of operations differ
# by an ulp.
TOLERANCE = {
    "fp8": 2e-2,
    "w8a16": 1e-4,
    "w4a16": 1e-4,
    "w4a16-asym": 1e-4,
    "fp8-block": 2e-2,
    "fp8-static": 2e-2,
    "w8a8": 2e-2,
    "w8a8-static": 2e-2,
    "w4a16-gptq": 1e-4,
    "w8a16-fp8": 1e-4,
}
# Prompts whose 12 greedy tokens all match; the random-weight test model has many near-tied logits, which
# rounded activations (fp8) may break the other way.
GREEDY_AGREEMENT = {
    "fp8": 0.75,
    "w8a16": 1.0,
    "w4a16": 1.0,
    "w4a16-asym": 1.0,
    "fp8-block": 0.75,
    "fp8-static": 0.75,
    "w8a8": 0.75,
    "w8a8-static": 0.75,
    "w4a16-gptq": 1.0,
    "w8a16-fp8": 1.0,
}


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, 4000, (length + i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module", params=list(PRESETS))
def pair(request: pytest.FixtureRequest, quantized_model) -> tuple[str, Path, object]:  # type: ignore[no-untyped-def]
    scheme = request.param
    path = quantized_model("tiny", PRESETS[scheme])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return scheme, path, hf


def test_logits_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    scheme, path, hf = pair
    llm = LLM(str(path), num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.quant is not None
    assert runner.quant.scheme == (scheme if scheme == "w8a16-fp8" else scheme.split("-")[0])
    assert runner.quant.zero_points == scheme.endswith("-asym")
    assert runner.quant.static_input == scheme.endswith("-static")
    layers = runner.model.model.layers
    assert all(isinstance(layer.mlp.down_proj, LAYERS[scheme]) for layer in layers)
    for prompt in _prompts(4, 40):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        blocks = list(range(-(-len(prompt) // 16)))
        ours = runner.forward([Chunk(blocks, 0, prompt, num_logits=len(prompt))])
        assert ours is not None
        span = (theirs.max() - theirs.min()).item()
        err = (ours - theirs).abs().max().item()
        assert err <= TOLERANCE[scheme] * span, (scheme, err, span)


def test_greedy_agrees_with_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    scheme, path, hf = pair
    prompts = _prompts(8, 20)
    expected = hf_greedy(hf, prompts, 12)
    llm = LLM(str(path), num_kv_blocks=64)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    agree = sum(g.token_ids == e for g, e in zip(got, expected, strict=True)) / len(prompts)
    assert agree >= GREEDY_AGREEMENT[scheme], (scheme, agree)


def _projection_inputs_and_outputs(
    hf, prompt: list[int]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:  # type: ignore[no-untyped-def]
    """What each of the oracle's projections was given and gave, by (layer, name), on one prompt."""
    seen: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for parent, names in (
            (layer.self_attn, ("q_proj", "k_proj", "v_proj", "o_proj")),
            (layer.mlp, ("gate_proj", "up_proj", "down_proj")),
        ):
            for name in names:

                def keep(module, args, out, key=(i, name)) -> None:  # type: ignore[no-untyped-def]
                    seen[key] = (args[0][0].detach().clone(), out[0].detach().clone())

                hooks.append(getattr(parent, name).register_forward_hook(keep))
    with torch.inference_mode():
        hf(torch.tensor([prompt]))
    for hook in hooks:
        hook.remove()
    return seen


@pytest.mark.parametrize(
    "scheme", ["fp8", "w8a16", "fp8-block", "fp8-static", "w8a8", "w8a8-static", "w8a16-fp8"]
)
def test_projections_compute_what_the_oracles_layers_compute(scheme: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """Each FP8_DYNAMIC (W8A16, FP8_BLOCK) projection, given the very input the transformers +
    compressed-tensors layer saw, gives that layer's output: for fp8 the same per-token activation scales
    (per token and group of 128 columns for FP8_BLOCK), the same E4M3 rounding and saturation, the same
    per-channel (per 128x128 tile) weight scales; for w8a16 the same int8 weights and
    per-group scales, multiplied with the float32 activations as they are; for FP8 each projection's
    calibrated activation scale, the same for every token; for W8A8 the same int8 weights and per-token
    int8 activations (scale max|x| / 127.5, compressed-tensors' rule), or, static, int8 activations under
    the projection's calibrated scale (rounded half to even, saturated to [-128, 127]). (Whole-model fp8 logits differ
    a little more, because a float rounding difference elsewhere can move an activation across an E4M3
    rounding boundary.)"""
    path = quantized_model("tiny", PRESETS[scheme])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    seen = _projection_inputs_and_outputs(hf, _prompts(1, 48)[0])
    ours = LLM(str(path), num_kv_blocks=64).engine.runner.model.model.layers
    assert len(seen) == 7 * len(ours)
    for i, layer in enumerate(ours):
        checks = (
            (layer.self_attn.qkv_proj, "q_proj", ("q_proj", "k_proj", "v_proj")),
            (layer.self_attn.o_proj, "o_proj", ("o_proj",)),
            (layer.mlp.gate_up_proj, "gate_proj", ("gate_proj", "up_proj")),
            (layer.mlp.down_proj, "down_proj", ("down_proj",)),
        )
        for module, source, parts in checks:
            assert isinstance(module, LAYERS[scheme])
            x = seen[(i, source)][0]
            expected = torch.cat([seen[(i, p)][1] for p in parts], dim=-1)
            with torch.inference_mode():
                got = module(x)
            # float32 rounding of the dot products only: one activation moved by an E4M3 step, or
            # rounded to bfloat16, would be a change of about 1e-3 to 1e-2 of the output's norm.
            assert (got - expected).norm() <= 1e-6 * expected.norm(), (i, source)


def test_online_fp8_is_llm_compressors_fp8_dynamic(tiny_model: Path, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """`quantization="fp8"` on a full-precision checkpoint holds the very E4M3 bytes and per-channel
    scales that llm-compressor's FP8_DYNAMIC preset writes for it, so `ember bench quant`'s fp8 row is
    that preset."""
    ckpt = LLM(str(quantized_model("tiny", "FP8_DYNAMIC")), num_kv_blocks=16).engine.runner.model
    online = LLM(str(tiny_model), quantization="fp8", num_kv_blocks=16).engine.runner.model
    theirs = {n: m for n, m in ckpt.named_modules() if isinstance(m, Fp8Linear)}
    ours = {n: m for n, m in online.named_modules() if isinstance(m, Fp8Linear)}
    assert theirs.keys() == ours.keys() and len(ours) == 4 * len(online.model.layers)
    for name, layer in ours.items():
        assert torch.equal(layer.weight.view(torch.uint8), theirs[name].weight.view(torch.uint8)), name
        assert torch.equal(layer.weight_scale, theirs[name].weight_scale), name


def test_fp8_on_the_trained_target_differs_from_the_oracle_far_less_than_fp8_moves_it(
    quantized_model,
) -> None:  # type: ignore[no-untyped-def]
    """llm-compressor's FP8_DYNAMIC checkpoint of the packaged trained target, over two held-out windows:
    ember's logits stay much closer to transformers + compressed-tensors' than FP8 itself moves them from
    full precision (measured: mean |difference| 0.0019 against 0.022; argmax 99.9 % the oracle's), so the
    scheme's quality cost on this model is the scheme's own."""
    from ember_engine.bench.quant import held_out
    from ember_engine.tools.spec_pair import packaged_pair

    target = packaged_pair()[0]
    path = quantized_model("trained", "FP8_DYNAMIC")
    text = held_out(target)
    windows = [text[start : start + 256] for start in (0, 9000)]

    def ours(model: Path) -> torch.Tensor:
        runner = LLM(str(model), num_kv_blocks=32).engine.runner
        out = [runner.forward([Chunk(list(range(16)), 0, w.tolist(), num_logits=256)]) for w in windows]
        return torch.cat([x for x in out if x is not None])

    with torch.inference_mode():
        oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        theirs = torch.cat([oracle(w[None]).logits[0] for w in windows])
        full = ours(target)
        got = ours(path)
    scheme_cost = (theirs - full).abs().mean().item()
    assert scheme_cost > 0.01  # FP8 really moves the logits
    assert (got - theirs).abs().mean().item() < 0.2 * scheme_cost
    assert (got.argmax(-1) == theirs.argmax(-1)).float().mean().item() >= 0.995


def test_asymmetric_weights_other_than_int4_groups_are_refused_by_name(
    quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    path = edited_checkpoint(
        quantized_model("tiny", "W8A16"), tmp_path / "m", group=lambda g: g["weights"].update(symmetric=False)
    )
    with pytest.raises(
        ValueError,
        match=r"compressed-tensors: asymmetric int 8-bit weights, strategy 'group' are not supported; "
        r"supported: asymmetric int 4-bit per group \(pack-quantized, W4A16_ASYM\)",
    ):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda acts: acts.update(dynamic=False),
            r"int8 weights with input activations int 8-bit, strategy 'token' \(dynamic=False, "
            r"symmetric=True\) are not supported; supported: int 8-bit, symmetric, dynamic per token or "
            r"static per tensor \(W8A8, w8a8\)",
        ),
        (
            lambda acts: acts.update(strategy="tensor"),
            r"int8 weights with input activations int 8-bit, strategy 'tensor' \(dynamic=True, ",
        ),
        (
            lambda acts: acts.update(symmetric=False),
            r"input activations int 8-bit, strategy 'token' \(dynamic=True, symmetric=False\) are not "
            r"supported",
        ),
        (
            lambda acts: acts.update(type="float"),
            r"input activations float 8-bit, strategy 'token' \(dynamic=True, symmetric=True\) are not "
            r"supported",
        ),
    ],
    ids=["static-per-token", "dynamic-per-tensor", "asymmetric", "fp8-activations"],
)
def test_w8a8_activation_schemes_other_than_symmetric_int8_dynamic_per_token_or_static_are_refused(
    edit, message: str, quantized_model, tmp_path: Path, edited_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    path = edited_checkpoint(
        quantized_model("tiny", "W8A8"), tmp_path / "m", group=lambda g: edit(g["input_activations"])
    )
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize("block", [[128, 8], [128, 24], [128], [0, 128], "128"])
def test_fp8_blocks_the_gemm_cannot_step_through_are_refused_by_name(block) -> None:  # type: ignore[no-untyped-def]
    """A K step of the GPU GEMM lies within one block of columns, the narrowest step 16 columns: blocks
    of 8 or 24 columns ran on a CPU and then failed on every GPU with a bare StopIteration."""
    qc = quantization_config("fp8", 128, 128)
    group = qc["config_groups"]["group_0"]
    group["weights"]["block_structure"] = block
    group["input_activations"]["group_size"] = (
        block[1] if isinstance(block, list) and len(block) == 2 else 128
    )
    with pytest.raises(
        UnsupportedQuantizationError, match=rf"FP8 weights in {re.escape(repr(block))} blocks: "
    ):
        parse_quantization_config(qc)


def test_fp8_blocks_of_any_multiple_of_16_columns_are_taken() -> None:
    for columns in (16, 48, 128):
        qc = quantization_config("fp8", 128, columns)
        spec = parse_quantization_config(qc)
        assert (spec.scheme, spec.group_size, spec.block_rows) == ("fp8", columns, columns)
    # compressed-tensors' older spelling, "ROWSxCOLUMNS", which it still reads as [ROWS, COLUMNS]
    qc["config_groups"]["group_0"]["weights"]["block_structure"] = "64x128"
    qc["config_groups"]["group_0"]["input_activations"]["group_size"] = 128
    spec = parse_quantization_config(qc)
    assert (spec.group_size, spec.block_rows) == (128, 64)
