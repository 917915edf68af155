"""Mixed-precision compressed-tensors checkpoints, as llm-compressor writes them: config groups of different
schemes, each over its own projections (`quant_targets_build.py`). Each projection runs its group's scheme,
chosen as compressed-tensors chooses (an exact name before a "re:" pattern before a class name), and the
model computes what transformers + compressed-tensors computes on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_engine_greedy import hf_greedy
from test_quant_load import _prompts
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.fp8_linear import Fp8Linear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear

# preset: (attention's layer, the MLP's layer, their schemes, tolerance on the logits as a fraction of their
# range, prompts whose 12 greedy tokens all match transformers')
CASES = {
    "W8_ATTENTION": (Int8Linear, Int4Linear, ("w8a16", "w4a16"), 1e-4, 1.0),
    # FP8 activations may round a value to the neighbouring E4M3 step where the orders of operations differ
    "FP8_ATTENTION": (Fp8Linear, Int4Linear, ("fp8", "w4a16"), 2e-2, 0.75),
}
BUILD = "quant_targets_build.py"


@pytest.fixture(scope="module", params=list(CASES))
def mixed(request: pytest.FixtureRequest, quantized_model) -> tuple[str, Path, object]:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", request.param, BUILD)
    return request.param, path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def test_each_group_runs_its_own_scheme_and_matches_transformers(mixed) -> None:  # type: ignore[no-untyped-def]
    preset, path, hf = mixed
    attention, mlp, schemes, tolerance, _ = CASES[preset]
    llm = LLM(str(path), num_kv_blocks=64)
    runner = llm.engine.runner
    assert runner.quant is not None and runner.quant.scheme == "mixed"
    assert sorted(g.scheme for g in runner.quant.groups) == sorted(schemes)
    for layer in runner.model.model.layers:
        assert type(layer.self_attn.qkv_proj) is attention and type(layer.self_attn.o_proj) is attention
        assert type(layer.mlp.gate_up_proj) is mlp and type(layer.mlp.down_proj) is mlp
    for prompt in _prompts(4, 40):
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt])).logits[0].float()
        ours = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
        assert ours is not None
        span = (theirs.max() - theirs.min()).item()
        assert (ours - theirs).abs().max().item() <= tolerance * span, preset


def test_greedy_agrees_with_transformers(mixed) -> None:  # type: ignore[no-untyped-def]
    preset, path, hf = mixed
    prompts = _prompts(8, 20)
    expected = hf_greedy(hf, prompts, 12)
    llm = LLM(str(path), num_kv_blocks=64, quantization="compressed-tensors")
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    agree = sum(g.token_ids == e for g, e in zip(got, expected, strict=True)) / len(prompts)
    assert agree >= CASES[preset][4], (preset, agree)


def _group(qc: dict, target: str) -> dict:
    return next(g for g in qc["config_groups"].values() if target in g["targets"])


def _edited(quantized_model, edited_checkpoint, tmp_path: Path, preset: str, edit) -> Path:  # type: ignore[no-untyped-def]
    return edited_checkpoint(quantized_model("tiny", preset, BUILD), tmp_path / "m", quantization=edit)


def test_an_exact_name_outranks_a_pattern_and_a_merged_layer_split_between_groups_is_refused(
    quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """k_proj named in the int4 group (its exact name outranks the FP8 group's pattern) while q_proj and
    v_proj stay FP8: ember runs q, k and v as one layer, so it refuses the checkpoint by name."""

    def edit(qc: dict) -> None:
        _group(qc, "Linear")["targets"].append("model.layers.0.self_attn.k_proj")

    path = _edited(quantized_model, edited_checkpoint, tmp_path, "FP8_ATTENTION", edit)
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn: k_proj is w4a16 but q_proj, v_proj are fp8 \(config groups\); ember "
        r"runs q_proj, k_proj, v_proj as one layer, so they must be quantized alike",
    ):
        LLM(str(path), num_kv_blocks=16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda qc: _group(qc, "Linear").pop("format"),
            r"compressed-tensors: config group 'group_\d' names no format, which a mixed-precision "
            r"config needs; supported: float-quantized, pack-quantized",
        ),
        (
            lambda qc: _group(qc, "Linear").update(format="marlin-24"),
            r"compressed-tensors: config group 'group_\d': format 'marlin-24' is not supported; supported: ",
        ),
        (
            lambda qc: _group(qc, "Linear")["weights"].update(num_bits=3),
            r"compressed-tensors: config group 'group_\d': int 3-bit weights, strategy 'group' are not "
            r"supported",
        ),
    ],
)
def test_a_group_ember_cannot_run_is_refused_by_name(
    edit, message: str, quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = _edited(quantized_model, edited_checkpoint, tmp_path, "FP8_ATTENTION", edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)


def test_another_scheme_requested_is_refused_naming_the_groups(quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", "FP8_ATTENTION", BUILD)
    with pytest.raises(
        ValueError,
        match=r"quantization: 'w4a16' requested, but .* is already quantized as 'mixed' \(compressed-tensors: "
        r"fp8 and w4a16 by layer\); it runs in that scheme: give compressed-tensors, or no quantization",
    ):
        LLM(str(path), num_kv_blocks=16, quantization="w4a16")


def test_each_layer_takes_the_group_compressed_tensors_gives_it(tiny_model: Path) -> None:
    """Overlapping targets (a class name, patterns, an exact name) and `ignore`: compressed-tensors itself,
    applying the config to the model, is the oracle for which group each linear layer takes."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        apply_quantization_config,
        preset_name_to_scheme,
    )

    from ember_engine.model.quant.checkpoint import parse_quantization_config

    groups = {
        "a": preset_name_to_scheme("W4A16", ["Linear"]),
        "b": preset_name_to_scheme("W8A16", [r"re:.*mlp\..*", "model.layers.1.self_attn.o_proj"]),
        "c": preset_name_to_scheme("FP8_DYNAMIC", [r"re:.*down_proj$", r"re:.*layers\.2\..*"]),
    }
    config = QuantizationConfig(config_groups=groups, ignore=["lm_head", "model.layers.3.mlp.down_proj"])
    hf = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    apply_quantization_config(hf, config)
    qc = config.model_dump(mode="json") | {"quant_method": "compressed-tensors", "format": "mixed-precision"}
    for name, group in qc["config_groups"].items():
        group["format"] = "float-quantized" if name == "c" else "pack-quantized"
    spec = parse_quantization_config(qc)
    scheme = {("int", 4): "w4a16", ("int", 8): "w8a16", ("float", 8): "fp8"}
    seen = set()
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            theirs = getattr(module, "quantization_scheme", None)
            expected = None if theirs is None else scheme[(theirs.weights.type, theirs.weights.num_bits)]
            ours = spec.layer_spec(name)
            assert (None if ours is None else ours.scheme) == expected, name
            seen.add(expected)
    assert seen == {None, "w4a16", "w8a16", "fp8"}


def test_parts_in_two_groups_of_one_scheme_are_told_apart_by_their_groups() -> None:
    from ember_engine.model.quant.checkpoint import parse_quantization_config
    from ember_engine.model.quant.layer_specs import layer_spec

    def group(size: int, targets: list[str]) -> dict:
        weights = {"type": "int", "num_bits": 4, "strategy": "group", "group_size": size, "symmetric": True}
        return {"format": "pack-quantized", "weights": weights, "targets": targets}

    qc = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"a": group(128, ["Linear"]), "b": group(64, ["model.layers.0.self_attn.k_proj"])},
    }
    spec = parse_quantization_config(qc)
    assert spec.scheme == "mixed" and layer_spec(spec, "model.layers.1.self_attn.qkv_proj") == spec.groups[0]
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn: k_proj is w4a16 \(pack-quantized, groups of 64\) but q_proj, v_proj "
        r"are w4a16 \(pack-quantized, groups of 128\) \(config groups\)",
    ):
        layer_spec(spec, "model.layers.0.self_attn.qkv_proj")
