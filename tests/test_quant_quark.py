"""AMD Quark checkpoints that its `export_safetensors` wrote (`quark_build.py`): ember holds the exported E4M3
bytes and scales and computes what transformers with Quark computes on the same checkpoint (`oracle.pt`);
the FP8 KV cache takes the export's `k_proj.output_scale` and `v_proj.output_scale`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_quant_modelopt import _forward, _projection

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant.fp8_linear import Fp8Linear, Fp8WeightOnlyLinear

BUILD = "quark_build.py"
DOWN = "model.layers.0.mlp.down_proj"
# preset -> (ember's scheme, static input scales)
PRESETS = {"FP8": ("fp8", True), "PTPC": ("fp8", False), "FP8_WO": ("w8a16-fp8", False)}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_exports_compute_what_transformers_with_quark_computes(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", preset, BUILD)
    oracle = torch.load(path / "oracle.pt")
    stored = load_file(str(path / "model.safetensors"))
    llm = LLM(str(path), num_kv_blocks=64, max_num_seqs=4)
    runner = llm.engine.runner
    scheme, static = PRESETS[preset]
    assert (runner.quant.format, runner.quant.scheme, runner.quant.static_input) == ("quark", scheme, static)
    down = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8WeightOnlyLinear if scheme == "w8a16-fp8" else Fp8Linear)
    assert torch.equal(down.weight.view(torch.uint8), stored[DOWN + ".weight"].view(torch.uint8))
    assert torch.equal(down.weight_scale, stored[DOWN + ".weight_scale"].float().reshape(-1).expand(128))
    if static:
        assert torch.equal(down.input_scale.reshape(()), stored[DOWN + ".input_scale"])
    assert type(runner.model.lm_head) is not Fp8Linear  # the template's exclude: lm_head
    # Each projection, given the input Quark's was given, gives its output (float rounding apart).
    assert len(oracle["probes"]) == 28
    for name, (x, theirs) in oracle["probes"].items():
        ours = _projection(runner.model, name, x)
        assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item(), name
    # Both divide an activation by its scale, clamp to +-448 and round to the nearest E4M3 value (ties to
    # even); an ulp apart elsewhere (attention's sums) can still round one value the other way, which
    # moves the rest of its prompt (measured: 7 of 8 prompts within 1e-6 for FP8, one 2.6e-2 off; PTPC 5
    # within 2.7e-7, three 5.4e-3 to 2.4e-2 off). Weight-only FP8: the same products, float rounding apart.
    close = 0
    for prompt, theirs in zip(oracle["prompts"], oracle["logits"], strict=True):
        worst = (_forward(runner, prompt) - theirs).abs().max().item() / (theirs.max() - theirs.min()).item()
        assert worst <= (1e-5 if scheme == "w8a16-fp8" else 3e-2), (preset, worst)
        close += worst <= 1e-5
    assert close >= (8 if scheme == "w8a16-fp8" else 4), (preset, close)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [g.token_ids for g in llm.generate(oracle["prompts"][:6], params, use_tqdm=False)]
    assert sum(g == t for g, t in zip(got, oracle["greedy"], strict=True)) >= (
        6 if scheme == "w8a16-fp8" else 4
    )


def test_the_fp8_cache_takes_the_exported_kv_scales(quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", "FP8_KV", BUILD)
    stored = load_file(str(path / "model.safetensors"))
    llm = LLM(str(path), num_kv_blocks=64, kv_cache_dtype="fp8")
    runner = llm.engine.runner
    assert runner.kv_cache.dtype == torch.float8_e4m3fn
    for i, layer in enumerate(runner.model.attention_layers()):
        # one scale for K and V: the export writes the larger of the two
        assert layer.k_scale == float(stored[f"model.layers.{i}.self_attn.k_proj.output_scale"]) != 1.0
        assert layer.v_scale == float(stored[f"model.layers.{i}.self_attn.v_proj.output_scale"]) != 1.0
    # transformers with Quark quantizes K and V to E4M3 as they leave their projections, before RoPE
    # (`kv_cache_post_rope: false`) and caches them unquantized; ember, as vLLM, stores them after RoPE in
    # the FP8 cache with those scales. Same scales, another point: measured 4.0e-2 to 5.4e-2 of the range.
    oracle = torch.load(path / "oracle.pt")
    for prompt, theirs in zip(oracle["prompts"], oracle["logits"], strict=True):
        worst = (_forward(runner, prompt) - theirs).abs().max().item() / (theirs.max() - theirs.min()).item()
        assert worst <= 8e-2


def _edited(path: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(path, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config["quantization_config"])
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _weight(q: dict) -> dict:  # type: ignore[type-arg]
    return q["global_quant_config"]["weight"]


@pytest.mark.parametrize(
    ("edit", "options", "error"),
    [
        (
            lambda q: _weight(q).update(dtype="int8"),
            {},
            r"quark checkpoint: weight int8 per_tensor \(ch_axis None, dynamic=False, symmetric=True\) is not "
            r"supported; supported: fp8_e4m3 per_tensor or per_channel",
        ),
        (
            lambda q: q["global_quant_config"]["input_tensors"].update(is_dynamic=True),
            {},
            r"input_tensors fp8_e4m3 per_tensor \(ch_axis None, dynamic=True, symmetric=True\) is not supported",
        ),
        (
            lambda q: q["layer_quant_config"].update(
                {"*down_proj": {**q["global_quant_config"], "input_tensors": None}}
            ),
            {},
            r"layer_quant_config gives '\*down_proj' its own scheme \(mixed precision\)",
        ),
        (
            lambda q: q["export"].update(weight_format="fake_quantized"),
            {},
            r"weight_format 'fake_quantized' is not supported; supported: real_quantized",
        ),
        (
            lambda q: q["kv_cache_quant_config"]["*k_proj"]["output_tensors"].update(is_dynamic=True),
            {"kv_cache_dtype": "fp8"},
            r"KV-cache spec of '\*k_proj' .* is not supported with kv_cache_dtype fp8",
        ),
    ],
)
def test_what_ember_cannot_run_is_refused_by_name(
    edit, options: dict, error: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = _edited(quantized_model("tiny", "FP8_KV", BUILD), tmp_path / "m", edit)
    with pytest.raises(ValueError, match=error):
        LLM(str(path), num_kv_blocks=16, **options)


def test_an_excluded_layer_loads_as_full_precision_and_stray_scales_are_named(
    quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    # Quark matches `exclude` entries as shell-style patterns; a pattern that takes layer 1's MLP leaves it
    # unquantized, and its weights must then be stored as they are: a checkpoint whose excluded layer
    # holds E4M3 bytes fails to load, naming the tensor.
    path = _edited(
        quantized_model("tiny", "FP8", BUILD), tmp_path / "m", lambda q: q["exclude"].append("*.1.mlp.*")
    )
    with pytest.raises(ValueError, match=r"model.layers.1.mlp"):
        LLM(str(path), num_kv_blocks=16)


def test_exclude_entries_are_shell_style_patterns(quantized_model) -> None:  # type: ignore[no-untyped-def]
    from ember_engine.model.quant import quark

    config = json.loads((quantized_model("tiny", "FP8", BUILD) / "config.json").read_text())[
        "quantization_config"
    ]
    spec = quark.parse({**config, "exclude": ["lm_head", "*.1.mlp.*", "model.layers.2.self_attn.o_proj"]})
    left_out = ["lm_head", "model.layers.1.mlp.up_proj", "model.layers.2.self_attn.o_proj"]
    quantized = ["model.layers.11.mlp.up_proj", "model.layers.2.self_attn.q_proj", "model.lm_head"]
    assert [spec.quantizes(n) for n in left_out + quantized] == [False] * 3 + [True] * 3
