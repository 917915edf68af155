"""ModelOpt (NVIDIA Model Optimizer) checkpoints that its `export_hf_checkpoint` wrote (`modelopt_build.py`):
ember holds the exported bytes (E4M3, or FP4 E2M1 pairs) and scales, and computes what ModelOpt computes
on the exported weights (`oracle.pt`), excluded modules, FP8 KV-cache scales and older exports'
`hf_quant_config.json` included."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant import modelopt, schemes
from ember_engine.model.quant.fp4_linear import Fp4Linear
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8Linear, Fp8WeightOnlyLinear
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear, W8A8Linear
from ember_engine.model.quant.spec import QuantSpec
from ember_engine.model.quant.w4a8_linear import W4Fp8Linear

BUILD = "modelopt_build.py"
# preset -> (ember's scheme, static input scales, its layer class)
PRESETS = {
    "FP8": ("fp8", True, Fp8Linear),
    "FP8_PCPT": ("fp8", False, Fp8Linear),
    "FP8_PB_WO": ("w8a16-fp8", False, Fp8WeightOnlyLinear),
    "FP8_PARTIAL": ("fp8", True, Fp8Linear),
    "FP8_KV": ("fp8", True, Fp8Linear),
    "W4A16_NVFP4": ("nvfp4a16", False, Fp4Linear),
    "NVFP4": ("nvfp4", True, Fp4Linear),
    "MIXED": ("mixed", False, Fp8WeightOnlyLinear),  # its MLPs; FP8 with static scales on attention
    "W8A16": ("w8a16", False, Int8Linear),
    "W4A16_AWQ": ("w4a16", False, Int4Linear),
    "MXFP8": ("fp8", False, Fp8BlockLinear),
    "NVFP4_AWQ": ("nvfp4", True, Fp4Linear),
    "W4A8_NVFP4": ("nvfp4a16", True, Fp4Linear),  # NVFP4's weights, FP8 inputs under a static scale
    "INT8_SQ": ("w8a8", True, W8A8Linear),
    "W4A8_AWQ": ("w4a8-fp8", True, W4Fp8Linear),  # codes, and each group's E4M3 values of them
}
# the same products as ModelOpt's, float rounding apart: weight-only, and NVFP4, whose activations both
# sides quantize under the same scales (measured: every prompt's logits within 2.3e-7 of their range;
# W8A16 and W4A16_AWQ within 4.3e-7), as MXFP8's do (within 2.9e-7)
EXACT = ("FP8_PB_WO", "W4A16_NVFP4", "NVFP4", "NVFP4_AWQ", "W8A16", "W4A16_AWQ", "MXFP8")
DOWN = "model.layers.0.mlp.down_proj"


def _forward(runner, prompt: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    out = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
    assert out is not None
    return out


def _projection(model, name: str, x: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Checkpoint projection `name`'s output from ember's layer holding it (q/k/v and gate/up merged)."""
    parent, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent)
    parts = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2)}
    parts |= {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    if leaf not in parts:
        return getattr(module, leaf)(x)
    merged, index = parts[leaf]
    attention = leaf in ("q_proj", "k_proj", "v_proj")
    sizes = (
        [module.q_size, module.kv_size, module.kv_size]
        if attention
        else [module.gate_up_proj.out_features // 2] * 2
    )
    return getattr(module, merged)(x).split(sizes, dim=-1)[index]


def _llm(path: Path, preset: str) -> LLM:
    kv = {"kv_cache_dtype": "fp8"} if preset == "FP8_KV" else {}
    return LLM(str(path), num_kv_blocks=64, max_num_seqs=4, **kv)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_exports_compute_what_modelopt_simulates(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", preset, BUILD)
    oracle = torch.load(path / "oracle.pt")
    stored = load_file(str(path / "model.safetensors"))
    llm = _llm(path, preset)
    runner = llm.engine.runner
    scheme, static, layer_class = PRESETS[preset]
    assert runner.quant.format == "modelopt" and runner.quant.scheme == scheme
    assert runner.quant.static_input == static
    model = runner.model.model
    # The exported bytes, as they are; each projection's scales expanded to its rows (and tiles).
    down = model.layers[0].mlp.down_proj
    assert isinstance(down, layer_class)
    scale = stored[DOWN + ".weight_scale"].float()
    if layer_class is Int4Linear:  # the export's two values a byte along the output; ember's along the input
        packed = stored[DOWN + ".weight"]
        values = torch.stack([packed & 15, packed >> 4], dim=1).reshape(128, 256).to(torch.int8)
        assert torch.equal(
            schemes.unpack_int4(down.weight_packed), values - 16 * (values >= 8).to(torch.int8)
        )
        assert torch.equal(down.weight_scale, scale)
        # AWQ's smoothing, where the export could not fold it into the layer before (o and down)
        assert torch.equal(down.input_smooth, stored[DOWN + ".pre_quant_scale"])
        attention = model.layers[0].self_attn
        assert attention.qkv_proj.input_smooth is None and attention.o_proj.input_smooth is not None
    elif preset == "W4A8_AWQ":  # int4 values times their group's scale, rounded to E4M3 under weight_scale_2
        packed, outer = stored[DOWN + ".weight"], stored[DOWN + ".weight_scale_2"]
        values = torch.stack([packed & 15, packed >> 4], dim=1).reshape(128, 256).to(torch.int8)
        values = values - 16 * (values >= 8).to(torch.int8)
        fp8 = (values * scale.repeat_interleave(128, dim=1) / outer).to(torch.float8_e4m3fn)
        assert torch.equal(down.e4m3_weight().view(torch.uint8), fp8.view(torch.uint8))
        assert torch.equal(down.weight_scale, outer.expand(128))
        # held: the file's 4-bit values (as codes, value + 8) and 16 E4M3 bytes a row and group of 128
        assert torch.equal(schemes.unpack_int4(down.weight_packed), values)
        assert down.weight_packed.shape == (128, 128) and down.weight_table.shape == (128, 2, 16)
        held = sum(
            t.numel() * t.element_size() for t in (down.weight_packed, down.weight_table, down.weight_scale)
        )
        assert held == 128 * 256 * 5 // 8 + 4 * 128  # 5 bits a weight, and weight_scale_2 per row
        # AWQ's smoothing where the export kept it (o and down; folded into the norms before q/k/v, gate/up)
        assert torch.equal(down.input_smooth, stored[DOWN + ".pre_quant_scale"])
        assert model.layers[0].self_attn.qkv_proj.input_smooth is None
    else:
        assert torch.equal(down.weight_data().view(torch.uint8), stored[DOWN + ".weight"].view(torch.uint8))
    if layer_class is W8A8Linear:  # SmoothQuant's factors on every projection's input, q/k/v's shared
        assert torch.equal(down.weight_scale.reshape(-1), scale)
        assert torch.equal(down.input_smooth, stored[DOWN + ".pre_quant_scale"])
        qkv = model.layers[0].self_attn.qkv_proj
        assert torch.equal(qkv.input_smooth, stored["model.layers.0.self_attn.k_proj.pre_quant_scale"])
    elif layer_class is Int8Linear:
        assert torch.equal(down.weight_scale.reshape(-1), scale)
    elif layer_class is Int4Linear or preset == "W4A8_AWQ":
        pass
    elif layer_class is Fp8BlockLinear:  # E8M0 bytes e, a scale 2^(e - 127) per row and group of 32
        assert stored[DOWN + ".weight_scale"].dtype == torch.uint8 and down.input_quant == "mxfp8-fit"
        assert torch.equal(down.weight_scale, torch.exp2(scale - 127))
    elif layer_class is Fp4Linear:  # E4M3 group scales as they are; weight_scale_2 multiplies, ours divides
        groups = stored[DOWN + ".weight_scale"].view(torch.uint8)
        if preset == "W4A8_NVFP4":  # a scale per 32 columns, held for each of its two groups of 16
            assert groups.shape == (128, 256 // 32)
            groups = groups.repeat_interleave(2, dim=1)
        assert torch.equal(down.weight_scale.view(torch.uint8), groups)
        assert torch.equal(down.weight_global, (1 / stored[DOWN + ".weight_scale_2"]).expand(128))
    elif layer_class is Fp8WeightOnlyLinear:  # [1, 1, 2, 1]: one row of tiles, two of columns
        assert down.weight_scale.shape == (128, 2) and torch.equal(
            down.weight_scale, scale.reshape(1, 2).expand(128, 2)
        )
    else:
        assert torch.equal(down.weight_scale, scale.reshape(-1).expand(128))
    if static and layer_class is Fp4Linear and preset != "W4A8_NVFP4":  # NVFP4's: input_scale's reciprocal
        assert torch.equal(down.input_global.reshape(()), 1 / stored[DOWN + ".input_scale"])
    elif static:
        assert torch.equal(down.input_scale.reshape(()), stored[DOWN + ".input_scale"])
    if preset == "W4A8_NVFP4":  # FP8 inputs, not NVFP4's
        assert down.input_global is None and down.scheme == "nvfp4a16"
    if (
        preset == "NVFP4_AWQ"
    ):  # the smoothing the export kept: o's (it folded the others into the layers before)
        o_proj = model.layers[0].self_attn.o_proj
        assert torch.equal(o_proj.input_smooth, stored["model.layers.0.self_attn.o_proj.pre_quant_scale"])
        assert down.input_smooth is None and model.layers[0].self_attn.qkv_proj.input_smooth is None
    if preset == "FP8_PARTIAL":  # exclude_modules: "model.layers.0.self_attn.o_proj", "model.layers.1.mlp*"
        plain = [
            model.layers[0].self_attn.o_proj,
            model.layers[1].mlp.gate_up_proj,
            model.layers[1].mlp.down_proj,
        ]
        assert all(type(m) is nn.Linear for m in plain)
        assert torch.equal(
            model.layers[1].mlp.down_proj.weight, stored["model.layers.1.mlp.down_proj.weight"]
        )
        assert isinstance(model.layers[2].mlp.down_proj, Fp8Linear)
    if preset == "MIXED":  # MIXED_PRECISION: a projection quantized_layers does not list stays as it is
        assert {g.scheme for g in runner.quant.groups} == {"fp8", "w8a16-fp8"}
        attention = [layer.self_attn for layer in model.layers]
        assert all(
            isinstance(a.qkv_proj, Fp8Linear) and a.qkv_proj.input_scale is not None for a in attention
        )
        assert type(attention[3].o_proj) is nn.Linear and isinstance(attention[2].o_proj, Fp8Linear)
    if preset == "FP8_KV":  # FP8_KV_CFG's scales, exported as k_proj.k_scale and v_proj.v_scale
        for i, layer in enumerate(runner.model.attention_layers()):
            assert layer.k_scale == float(stored[f"model.layers.{i}.self_attn.k_proj.k_scale"]) != 1.0
            assert layer.v_scale == float(stored[f"model.layers.{i}.self_attn.v_proj.v_scale"]) != 1.0
    # Each projection, given the input ModelOpt's was given, gives its output (float rounding apart).
    probes = oracle["probes"]
    assert len(probes) == 28 - {"FP8_PARTIAL": 4, "MIXED": 1}.get(preset, 0)  # 4 layers of 7 projections
    for name, (x, theirs) in probes.items():
        ours = _projection(runner.model, name, x)
        assert (ours - theirs).abs().max().item() <= 1e-5 * theirs.abs().max().item(), name
    # Logits. Weight-only (FP8_PB_WO, W4A16_NVFP4) and NVFP4: the same products, float rounding apart. With FP8 activations the two sides
    # scale a value differently (ModelOpt multiplies by 448 / amax, ember divides by the exported scale,
    # amax / 448), which can round a value lying at the midpoint of two E4M3 steps the other way, and that
    # moves the rest of its prompt (measured: 3 to 7 of 8 prompts within 2.3e-5, the others 2.9e-3 to 2.6e-2
    # of the range).
    close = 0
    for prompt, theirs in zip(oracle["prompts"], oracle["logits"], strict=True):
        ours = _forward(runner, prompt)
        worst = (ours - theirs).abs().max().item() / (theirs.max() - theirs.min()).item()
        assert worst <= (1e-5 if preset in EXACT else 3e-2), (preset, worst)
        close += worst <= 1e-4
    assert close >= (8 if preset in EXACT else 3), (preset, close)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = [g.token_ids for g in llm.generate(oracle["prompts"][:6], params, use_tqdm=False)]
    agree = sum(g == t for g, t in zip(got, oracle["greedy"], strict=True))
    # With FP8 activations one token rounded the other way turns the rest of the answer, and how often that
    # happens depends on the CPU's float kernels: 4 to 6 of 6 on some CPUs, 2 for FP8_PCPT on one with
    # AVX-512 and AMX (its logits within the bound above, each projection exact on ModelOpt's inputs).
    assert agree >= (6 if preset in EXACT else 2), (preset, agree)


def _legacy(src: Path, dst: Path) -> Path:
    """`src` as an export from before ModelOpt wrote `quantization_config`: hf_quant_config.json alone."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize("preset", ["FP8_PARTIAL", "MIXED"])
def test_an_older_export_is_read_from_hf_quant_config_json(
    preset: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", preset, BUILD)
    legacy = _legacy(path, tmp_path / "legacy")
    new, old = _llm(path, preset).engine.runner, _llm(legacy, preset).engine.runner
    assert old.quant == new.quant
    prompt = torch.load(path / "oracle.pt")["prompts"][0]
    assert torch.equal(_forward(old, prompt), _forward(new, prompt))
    # Its KV-cache algorithm comes from the same file.
    kv = _legacy(quantized_model("tiny", "FP8_KV", BUILD), tmp_path / "kv")
    runner = _llm(kv, "FP8_KV").engine.runner
    scale = load_file(str(kv / "model.safetensors"))["model.layers.0.self_attn.k_proj.k_scale"]
    assert runner.model.attention_layers()[0].k_scale == float(scale)


def _edit_legacy(path: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    raw = json.loads((path / modelopt.LEGACY_FILE).read_text())
    edit(raw)
    (path / modelopt.LEGACY_FILE).write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize(
    ("edit", "options", "error"),
    [
        (
            lambda q: q["quantization"].update(quant_algo="NVFP4_SVD"),
            {},
            r"modelopt checkpoint: quant_algo 'NVFP4_SVD' is not supported; supported: FP8, "
            r"FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, W4A16_NVFP4, NVFP4, W8A16, W4A16_AWQ, MXFP8, "
            r"NVFP4_AWQ, W4A8_NVFP4_FP8, W8A8_SQ_PER_CHANNEL, W4A8_AWQ, MIXED_PRECISION$",
        ),
        (
            lambda q: q["quantization"].update(quant_algo="W4A16_NVFP4", group_size=32),
            {},
            r"modelopt checkpoint: W4A16_NVFP4 in groups of 32 is not supported; supported: groups of 16",
        ),
        (
            lambda q: q["quantization"].update(quant_algo="W4A8_NVFP4_FP8", group_size=16),
            {},
            r"modelopt checkpoint: W4A8_NVFP4_FP8 in groups of 16 is not supported; supported: groups of 32",
        ),
        (
            lambda q: q["quantization"].update(kv_cache_quant_algo="NVFP4"),
            {"kv_cache_dtype": "fp8"},
            r"KV-cache quantization NVFP4 is not supported with kv_cache_dtype fp8; supported: FP8",
        ),
        (
            lambda q: q["quantization"].update(exclude_modules="lm_head"),
            {},
            r"excluded modules must be a list of names, found 'lm_head'",
        ),
        (
            lambda q: q.pop("quantization"),
            {},
            r"hf_quant_config.json: a ModelOpt config needs a 'quantization'",
        ),
    ],
)
def test_configs_it_cannot_run_are_refused_by_name(
    edit, options: dict, error: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = _edit_legacy(_legacy(quantized_model("tiny", "FP8", BUILD), tmp_path / "m"), edit)
    with pytest.raises(ValueError, match=error):
        LLM(str(path), num_kv_blocks=16, **options)


def test_mxfp4_exports_are_refused_saying_why(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """ModelOpt exports MXFP4 weights with quantized activations and without under one name, so both are
    refused, saying so; W4A8_MXFP4_FP8's activations take a scale per tensor as the model runs (the export
    holds no input_scale), and it is refused, saying that."""
    w4a4, weight_only = (quantized_model("tiny", preset, BUILD) for preset in ("MXFP4", "MXFP4_WO"))
    configs = [
        json.loads((p / "config.json").read_text())["quantization_config"] for p in (w4a4, weight_only)
    ]
    assert [c["quant_algo"] for c in configs] == ["mxfp4", "mxfp4"]
    assert {k for c in configs for k in c} <= {"quant_algo", "ignore", "producer", "quant_method"}
    for path in (w4a4, weight_only):
        with pytest.raises(
            ValueError,
            match=r"modelopt checkpoint: quant_algo 'MXFP4' is not supported \(ModelOpt writes it both where "
            r"MXFP4 activations were simulated \(MXFP4_DEFAULT_CFG\) and where the activations stay as they "
            r"are \(MXFP4_MLP_WEIGHT_ONLY_CFG\), and nothing in the export says which; compressed-tensors' "
            r"MXFP4 and MXFP4A16 say\); supported: FP8, ",
        ):
            LLM(str(path), num_kv_blocks=16)
    w4a8 = quantized_model("tiny", "W4A8_MXFP4", BUILD)
    stored = load_file(str(w4a8 / "model.safetensors"))
    assert f"{DOWN}.weight_scale" in stored and not any(k.endswith("input_scale") for k in stored)
    with pytest.raises(
        ValueError,
        match=r"quant_algo 'W4A8_MXFP4_FP8' is not supported \(its FP8 activations take one scale per "
        r"tensor as the model runs \(the export has no input_scale\), which would make each request's "
        r"output depend on the others batched with it\); supported: FP8, ",
    ):
        LLM(str(w4a8), num_kv_blocks=16)


def _layers(q: dict) -> dict:  # type: ignore[type-arg]
    return q["quantization"]["quantized_layers"]


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            lambda q: _layers(q).update(
                {"model.layers.0.mlp.gate_proj": {"quant_algo": "NVFP4_SVD", "group_size": 16}}
            ),
            r"modelopt checkpoint: model.layers.0.mlp.gate_proj: quant_algo 'NVFP4_SVD' is not supported; "
            r"supported: FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, W4A16_NVFP4, NVFP4, W8A16, W4A16_AWQ, MXFP8, "
            r"NVFP4_AWQ, W4A8_NVFP4_FP8, W8A8_SQ_PER_CHANNEL, W4A8_AWQ$",
        ),
        (
            lambda q: _layers(q).update(
                {"model.layers.1.self_attn.k_proj": {"quant_algo": "FP8_PER_CHANNEL_PER_TOKEN"}}
            ),
            r"model.layers.1.self_attn: k_proj is fp8 \(modelopt, per channel\) but q_proj, v_proj are fp8 "
            r"\(modelopt, per channel, static input scales\) \(config groups\)",
        ),
        (lambda q: q["quantization"].pop("quantized_layers"), r"MIXED_PRECISION needs quantized_layers"),
    ],
)
def test_mixed_precision_it_cannot_run_is_refused_by_name(
    edit, error: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = _edit_legacy(_legacy(quantized_model("tiny", "MIXED", BUILD), tmp_path / "m"), edit)
    with pytest.raises(ValueError, match=error):
        LLM(str(path), num_kv_blocks=16)


def test_a_dynamic_kv_cache_scheme_is_refused_with_an_fp8_cache(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "m"
    shutil.copytree(quantized_model("tiny", "FP8_KV", BUILD), path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["kv_cache_scheme"]["dynamic"] = True
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"KV-cache quantization FLOAT 8-BIT DYNAMIC=TRUE is not supported"):
        LLM(str(path), num_kv_blocks=16, kv_cache_dtype="fp8")
    assert LLM(str(path), num_kv_blocks=16).engine.runner.kv_cache.dtype == torch.float32  # unused


def test_the_method_named_for_a_model_that_is_not_quantized_is_refused(tiny_model: Path) -> None:
    with pytest.raises(
        ValueError, match=r"'modelopt' names a quantized checkpoint's method, but .* is not quantized"
    ):
        LLM(str(tiny_model), num_kv_blocks=16, quantization="modelopt")


@pytest.mark.parametrize(
    ("entry", "left_out", "quantized"),
    [
        (
            "model.layers.1.mlp*",
            ["model.layers.1.mlp.down_proj", "model.layers.1.mlp"],
            ["model.layers.10.mlp.up_proj"],
        ),
        ("*self_attn.o_proj", ["model.layers.3.self_attn.o_proj"], ["model.layers.3.self_attn.q_proj"]),
        ("lm_head", ["lm_head", "language_model.lm_head"], ["model.layers.0.mlp.up_proj"]),
        ("model.layers.?.mlp.gate_proj", ["model.layers.7.mlp.gate_proj"], ["model.layers.17.mlp.gate_proj"]),
    ],
)
def test_excluded_modules_are_names_wildcards_or_parts_of_names(
    entry: str, left_out: list[str], quantized: list[str]
) -> None:
    spec = QuantSpec("fp8", "modelopt", group_size=0, ignore=modelopt.ignore_patterns([entry]))
    assert [spec.quantizes(n) for n in left_out] == [False] * len(left_out)
    assert [spec.quantizes(n) for n in quantized] == [True] * len(quantized)


def _nvfp4_copy(path: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(path, dst)
    state = load_file(str(dst / "model.safetensors"))
    edit(state)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_nvfp4_merged_parts_take_the_largest_input_scale(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """ModelOpt's export gives q/k/v (gate/up) one input scale; where a checkpoint's parts differ, the
    merged layer quantizes its input under the largest, as vLLM does (its global scale the reciprocal)."""
    path = quantized_model("tiny", "NVFP4", BUILD)
    key = "model.layers.0.self_attn.k_proj.input_scale"
    original = load_file(str(path / "model.safetensors"))[key]

    def edit(state: dict) -> None:  # type: ignore[type-arg]
        state[key] = original * 2

    model = _llm(_nvfp4_copy(path, tmp_path / "m", edit), "NVFP4").engine.runner.model.model
    assert torch.equal(model.layers[0].self_attn.qkv_proj.input_global.reshape(()), 1 / (original * 2))
    assert torch.equal(
        model.layers[1].self_attn.qkv_proj.input_global.reshape(()),
        1 / load_file(str(path / "model.safetensors"))["model.layers.1.self_attn.k_proj.input_scale"],
    )


@pytest.mark.parametrize("value", [0.0, float("inf"), -1.0])
def test_nvfp4_input_scale_must_be_one_positive_number(value: float, quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", "NVFP4", BUILD)

    def edit(state: dict) -> None:  # type: ignore[type-arg]
        state["model.layers.2.mlp.down_proj.input_scale"] = torch.tensor(value)

    copy = _nvfp4_copy(path, tmp_path / "m", edit)
    with pytest.raises(ValueError, match=r"NVFP4's input_scale must be one positive finite number, found \["):
        LLM(str(copy), num_kv_blocks=16)


def test_a_scale_that_is_no_number_is_named_as_the_export_names_it(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """NVFP4's per-tensor scale is `weight_scale_2` in the export (ember holds its reciprocal as the global
    scale): a NaN there is refused under the export's name, not the name ember holds it by."""
    path = quantized_model("tiny", "NVFP4", BUILD)

    def edit(state: dict) -> None:  # type: ignore[type-arg]
        state["model.layers.1.mlp.down_proj.weight_scale_2"] = torch.tensor(float("nan"))

    copy = _nvfp4_copy(path, tmp_path / "m", edit)
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale_2: not finite \(nan"
    ):
        LLM(str(copy), num_kv_blocks=16)


@pytest.mark.parametrize("preset", ["W4A8_AWQ", "NVFP4"])
def test_a_refused_quantization_names_only_values_that_are_taken(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint run in a scheme of its own (w4a8-fp8, nvfp4) with another `quantization` is refused
    naming what it takes; each name given is then taken. (The scheme's own name was offered too, and then
    refused as an unsupported scheme.)"""
    path = str(quantized_model("tiny", preset, BUILD))
    with pytest.raises(
        ValueError, match=r"'w8a16' requested, .* give ([\w, -]+), or no quantization"
    ) as info:
        LLM(path, num_kv_blocks=16, quantization="w8a16")
    names = re.search(r"give ([\w, -]+), or no quantization", str(info.value)).group(1)  # type: ignore[union-attr]
    offered = [n for part in names.split(", ") for n in part.split(" or ")]
    assert "modelopt" in offered
    for name in offered:
        assert LLM(path, num_kv_blocks=16, quantization=name).engine.runner.quant.format == "modelopt"


def test_vllms_name_for_modelopts_fp4_checkpoints_is_taken(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """`quantization="modelopt_fp4"` (what vLLM's documentation gives for "nvidia/...-FP4") names an NVFP4
    or W4A16_NVFP4 export's method; for an FP8 export it names another, and is refused."""
    for preset in ("NVFP4", "W4A16_NVFP4"):
        llm = LLM(str(quantized_model("tiny", preset, BUILD)), num_kv_blocks=16, quantization="modelopt_fp4")
        assert llm.engine.runner.quant.format == "modelopt"
    with pytest.raises(ValueError, match=r"'modelopt_fp4' requested, but .* is already quantized as 'fp8'"):
        LLM(str(quantized_model("tiny", "FP8", BUILD)), num_kv_blocks=16, quantization="modelopt_fp4")


def _awq_copy(quantized_model, dst: Path, edit, config=None, preset: str = "W4A16_AWQ") -> Path:  # type: ignore[no-untyped-def]
    """A copy of the `preset` export with `edit(state dict)` applied; with `config`, as an older export
    (hf_quant_config.json alone), `config(its quantization)` applied."""
    src = quantized_model("tiny", preset, BUILD)
    if config is not None:
        src = _legacy(src, dst.with_name("legacy"))
        _edit_legacy(src, lambda raw: config(raw["quantization"]))
    return _nvfp4_copy(src, dst, edit)


QKV = "model.layers.1.self_attn"


@pytest.mark.parametrize(
    ("edit", "config", "error"),
    [
        (
            lambda s: s.update({f"{QKV}.q_proj.pre_quant_scale": torch.full((128,), 2.0)}),
            None,
            rf"{QKV}.k_proj, {QKV}.v_proj: no pre_quant_scale, where {QKV}.q_proj, with which it is merged "
            r"\(they share an input\), has one; not supported",
        ),
        (
            lambda s: s.update(
                {f"{QKV}.{p}_proj.pre_quant_scale": torch.full((128,), 1.0 + (p == "v")) for p in "qkv"}
            ),
            None,
            rf"{QKV}.v_proj: its pre_quant_scale differs from {QKV}.k_proj's, with which it is merged",
        ),
        (
            lambda s: s.update({f"{QKV}.o_proj.pre_quant_scale": torch.ones(64)}),
            None,
            rf"{QKV}.o_proj: pre_quant_scale must hold 128 finite factors, one per input column, found 64",
        ),
        (
            lambda s: s.update({f"{QKV}.o_proj.weight": s[f"{QKV}.o_proj.weight"].to(torch.int8)}),
            None,
            r"W4A16_AWQ's weight must be bytes \[out / 2, in\], two int4 values each, found torch.int8",
        ),
        (
            lambda s: None,
            lambda q: q.update(has_zero_point=True),
            r"modelopt checkpoint: W4A16_AWQ with zero points \(has_zero_point\) is not supported",
        ),
        (
            lambda s: None,
            lambda q: q.update(group_size=64),
            r"W4A16_AWQ in groups of 64 is not supported; supported: groups of 128",
        ),
        (  # config.json's form names no group size: the scales' shape tells (groups of 64 here)
            lambda s: s.update(
                {k: v.repeat_interleave(2, dim=1) for k, v in s.items() if k.endswith("weight_scale")}
            ),
            None,
            r"model.layers.\d.\w+.\w+: W4A16_AWQ's weight_scale \[\d+, \d+\] for \d+ input columns is not one "
            r"scale per row and group of 128; supported: groups of 128",
        ),
    ],
)
def test_awq_exports_it_cannot_run_are_refused_by_name(
    edit, config, error: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=error):
        LLM(str(_awq_copy(quantized_model, tmp_path / "m", edit, config)), num_kv_blocks=16)


@pytest.mark.parametrize(
    ("edit", "config", "error"),
    [
        (
            lambda s: s.update({f"{QKV}.o_proj.weight_scale_2": torch.tensor(0.0)}),
            None,
            rf"{QKV}.o_proj: W4A8_AWQ's weight_scale_2 must be one positive finite number, found \[0.0\]",
        ),
        (
            lambda s: None,
            lambda q: q.update(group_size=64),
            r"W4A8_AWQ in groups of 64 is not supported; supported: groups of 128",
        ),
        (
            lambda s: s.update(
                {k: v.repeat_interleave(2, dim=1) for k, v in s.items() if k.endswith(".weight_scale")}
            ),
            None,
            r"model.layers.\d.\w+.\w+: W4A8_AWQ's weight_scale \[\d+, \d+\] for \d+ input columns is not one "
            r"scale per row and group of 128; supported: groups of 128",
        ),
        (
            lambda s: s.pop(f"{QKV}.o_proj.weight_scale_2"),
            None,
            rf"checkpoint .* is missing tensor\(s\): {QKV}.o_proj.weight_scale_2$",
        ),
    ],
)
def test_w4a8_exports_it_cannot_run_are_refused_by_name(
    edit, config, error: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=error):
        LLM(str(_awq_copy(quantized_model, tmp_path / "m", edit, config, "W4A8_AWQ")), num_kv_blocks=16)


def test_mxfp8_activations_quantize_as_modelopt_quantizes_them() -> None:
    """ModelOpt's MXFP8 scale for a group: the smallest power of two at least max|x| / 448, that quotient
    rounded to float32 (its CUDA kernel's rule, which its simulation runs; 1 for a zero group). Against
    `MXFP8QTensor`, which takes the same power through float32 log2 and ceil: random groups over 60
    binades, a group whose quotient is a power of two exactly (448 times one), one at 1.75 times a power
    of two, one just above, and a zero group."""
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor

    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-30, 30, 64)[:, None]
    x[1, :32] = 0
    x[2, 0] = 448.0 * 2**-6
    x[3, 0] = 1.75 * 2**5
    x[4, 0] = torch.nextafter(torch.tensor(448.0 * 2**3), torch.tensor(1e9))
    values, scale = schemes.quantize_activation_mx(x, 8, fit=True)
    packed, exponent = MXFP8QTensor.quantize(x)
    theirs = packed.dequantize(dtype=torch.float32, scale=exponent)
    ours = (values.float().reshape(64, 8, 32) * scale[..., None]).reshape(64, 256)
    assert torch.equal(ours, theirs)
    assert torch.equal(scale[2:5, 0], torch.tensor([2.0**-6, 2.0**-3, 2.0**4]))
    assert scale[1, 0] == 1.0 and torch.equal(schemes.fake_quantize_input(x, "mxfp8-fit"), ours)


def test_two_ranks_run_an_mxfp8_export_as_one(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """MXFP8's groups of 32 fall within a rank's columns, and each group's activations are quantized alike
    on either side of the split."""
    path = quantized_model("tiny", "MXFP8", BUILD)
    oracle = torch.load(path / "oracle.pt")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    split = LLM(str(path), num_kv_blocks=64, tensor_parallel_size=2)
    try:
        got = [g.token_ids for g in split.generate(oracle["prompts"][:6], params, use_tqdm=False)]
    finally:
        split.engine.shutdown()
    assert got == oracle["greedy"]
