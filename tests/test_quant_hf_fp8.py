"""Hugging Face block-scaled `fp8` checkpoints (`quant_method: fp8`, `weight_block_size: [128, 128]`, E4M3
`weight` and `weight_scale_inv` per 128x128 tile) run in their own scheme: the checkpoint's weights as
they are, activations quantized per token and group of 128 columns at run time.

The oracle is transformers' own loading of the format. Without a GPU it cannot run FP8 (it dequantizes
the weights at load, to the model's dtype, and multiplies unquantized activations), so the activation
arithmetic is checked against a float64 product of the format's definition, and whole-model logits
against transformers' model with that activation quantization put in front of each projection."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk

GROUP = 128
K_PROJ = "model.layers.2.self_attn.k_proj"
PARTS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


def fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """The format's activations: per token and group of 128 columns, scale |x|max / 448 in float32,
    values rounded to the nearest E4M3 (saturated at 448); returned dequantized, in float32."""
    groups = x.float().reshape(*x.shape[:-1], x.shape[-1] // GROUP, GROUP)
    scale = groups.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    q = (groups / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return (q * scale).reshape(x.shape)


@pytest.fixture(scope="module")
def checkpoint(quantized_model) -> Path:  # type: ignore[no-untyped-def]
    return quantized_model("tiny", "FP8_BLOCK", "hf_fp8_build.py")


@pytest.fixture(scope="module")
def oracle(checkpoint: Path):  # type: ignore[no-untyped-def]
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(checkpoint: Path) -> LLM:
    return LLM(str(checkpoint), num_kv_blocks=64)


def _pairs(llm: LLM, oracle):  # type: ignore[no-untyped-def]
    """(ember's merged projection, transformers' weight for it: its parts stacked), every layer."""
    for ours, theirs in zip(llm.engine.runner.model.model.layers, oracle.model.layers, strict=True):
        for name, (block, parts) in PARTS.items():
            module = getattr(getattr(ours, block), name)
            weight = torch.cat([getattr(getattr(theirs, block), p).weight.detach() for p in parts])
            yield module, weight


def test_weights_are_the_checkpoints_own(llm: LLM, oracle) -> None:  # type: ignore[no-untyped-def]
    """Every projection holds exactly the weight transformers reads from the checkpoint (E4M3 value times
    its tile's scale): the block scales are kept, not re-expressed per row."""
    assert llm.engine.runner.quant is not None and llm.engine.runner.quant.scheme == "fp8"
    pairs = list(_pairs(llm, oracle))
    assert len(pairs) == 4 * len(oracle.model.layers)
    for module, weight in pairs:
        assert module.scheme == "fp8"
        assert torch.equal(module.dequantized(torch.float32), weight), module


def test_projections_compute_the_formats_arithmetic(llm: LLM, oracle) -> None:  # type: ignore[no-untyped-def]
    """Each projection equals the float64 product of the format: activations quantized per token per
    group of 128 columns (in float32, as the kernels do), times the checkpoint's weights."""
    g = torch.Generator().manual_seed(5)
    for module, weight in _pairs(llm, oracle):
        x = torch.randn(9, module.in_features, generator=g) * torch.logspace(-2, 1, module.in_features)
        expected = fake_quantize(x).double() @ weight.double().t()
        with torch.inference_mode():
            got = module(x)
        # float32 sums only: one activation on another E4M3 step, or scaled per token instead of per
        # group, moves the output by 1e-3 to 1e-2 of its norm
        assert (got.double() - expected).norm() <= 1e-6 * expected.norm(), module


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 4000, (length + i,), generator=g).tolist() for i in range(n)]


def test_logits_and_greedy_tokens_match_transformers_running_the_format(llm: LLM, oracle) -> None:  # type: ignore[no-untyped-def]
    hooks = [
        getattr(getattr(layer, block), part).register_forward_pre_hook(
            lambda m, args: (fake_quantize(args[0]),)
        )
        for layer in oracle.model.layers
        for block, parts in PARTS.values()
        for part in parts
    ]
    try:
        runner = llm.engine.runner
        for prompt in _prompts(4, 40):
            with torch.inference_mode():
                theirs = oracle(torch.tensor([prompt])).logits[0].float()
            ours = runner.forward(
                [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
            )
            assert ours is not None
            span = (theirs.max() - theirs.min()).item()
            # as for per-channel fp8: a float rounding difference elsewhere may move an activation to
            # the neighbouring E4M3 step
            assert (ours - theirs).abs().max().item() <= 2e-2 * span
        prompts = _prompts(8, 20)
        expected = hf_greedy(oracle, prompts, 12)
    finally:
        for hook in hooks:
            hook.remove()
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    agree = sum(o.token_ids == e for o, e in zip(got, expected, strict=True)) / len(prompts)
    assert agree >= 0.75, agree


def test_malformed_blocks_are_refused_by_name() -> None:
    from ember_engine.model.quant.checkpoint import decode, parse_quantization_config
    from ember_engine.model.quant.schemes import UnsupportedQuantizationError

    for block, message in (
        ([128], r"weight_block_size \[128\] is not supported"),
        ([128, 100], "multiple of 16"),
    ):
        with pytest.raises(UnsupportedQuantizationError, match=message):
            parse_quantization_config({"quant_method": "fp8", "weight_block_size": block})
    spec = parse_quantization_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert (spec.scheme, spec.group_size, spec.block_rows) == ("fp8", 128, 128)
    weight = torch.zeros(200, 256).to(torch.float8_e4m3fn)
    with pytest.raises(UnsupportedQuantizationError, match=r"needs scales \[2, 2\], found \[1, 2\]"):
        decode(spec, {"weight": weight, "weight_scale_inv": torch.ones(1, 2)})
    _, scale, zero = decode(
        spec, {"weight": weight, "weight_scale_inv": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}
    )
    assert zero is None
    assert scale.shape == (200, 2) and scale[127].tolist() == [1.0, 2.0] and scale[128].tolist() == [3.0, 4.0]


@pytest.mark.parametrize("names", ["autofp8", "transformers"])
@pytest.mark.parametrize("preset", ["FP8", "FP8_DYNAMIC"])
def test_fp8_without_blocks_runs_as_the_same_tensors_under_compressed_tensors(
    preset: str, names: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """`quant_method: fp8` without `weight_block_size`, its tensors named either way: AutoFP8's and vLLM's
    (`weight_scale`, a static `input_scale`, `ignored_layers`: the "...-FP8" downloads made before
    compressed-tensors) or transformers' (`weight_scale_inv`, a static `activation_scale`). They hold the
    arithmetic of compressed-tensors' FP8 (static, per tensor) and FP8_DYNAMIC (per channel, dynamic per
    token) presets, so llm-compressor's tensors under this config compute what they compute under their
    own. Before, `weight_scale` was refused as an unexpected tensor and a static scheme by name."""
    src = quantized_model("tiny", preset)
    shutil.copytree(src, tmp_path / "m")
    raw = json.loads((src / "config.json").read_text())
    scheme = "static" if preset == "FP8" else "dynamic"
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": scheme}
    if names == "autofp8":
        raw["quantization_config"]["ignored_layers"] = ["lm_head"]
    else:
        raw["quantization_config"]["modules_to_not_convert"] = ["lm_head"]
        renamed = {".weight_scale": ".weight_scale_inv", ".input_scale": ".activation_scale"}
        state = {}
        for name, tensor in load_file(str(src / "model.safetensors")).items():
            suffix = next((s for s in renamed if name.endswith(s)), None)
            state[name.removesuffix(suffix) + renamed[suffix] if suffix else name] = tensor
        save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    own = LLM(str(src), num_kv_blocks=16).engine.runner
    hf = LLM(str(tmp_path / "m"), num_kv_blocks=16).engine.runner
    assert hf.quant is not None and (hf.quant.scheme, hf.quant.static_input) == ("fp8", preset == "FP8")
    g = torch.Generator().manual_seed(3)
    for n in (9, 30):
        prompt = torch.randint(10, 4000, (n,), generator=g).tolist()
        chunk = [Chunk(list(range(-(-n // 16))), 0, prompt, num_logits=n)]
        assert torch.equal(hf.forward(chunk), own.forward(chunk))


def test_fp8_configs_name_what_they_leave_out_and_what_they_cannot_run() -> None:
    from ember_engine.model.quant.checkpoint import parse_quantization_config
    from ember_engine.model.quant.schemes import UnsupportedQuantizationError

    # vLLM's `ignored_layers`: whole module names
    spec = parse_quantization_config(
        {"quant_method": "fp8", "ignored_layers": ["model.layers.1.mlp.down_proj"]}
    )
    assert not spec.quantizes("model.layers.1.mlp.down_proj")
    assert spec.quantizes("model.layers.11.mlp.down_proj") and spec.quantizes("model.layers.1.mlp.up_proj")
    for qc, message in (
        (
            {"activation_scheme": "static", "weight_block_size": [128, 128]},
            r"activation_scheme 'static' with ",
        ),
        ({"activation_scheme": "per-token"}, r"activation_scheme 'per-token' is not supported; supported: "),
        ({"ignored_layers": "lm_head"}, r"ignored_layers must be a list of names"),
    ):
        with pytest.raises(UnsupportedQuantizationError, match=message):
            parse_quantization_config({"quant_method": "fp8", **qc})


def test_autofp8_kv_cache_scales_are_the_fp8_caches(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """AutoFP8 writes `kv_cache_scheme: "static"` (a string) and each layer's `self_attn.k_scale` and
    `v_scale`: an FP8 cache takes them. The string crashed the load ("'str' object has no attribute
    'get'"); another string is refused by name."""
    src = quantized_model("tiny", "FP8")
    shutil.copytree(src, tmp_path / "m")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "static",
        "kv_cache_scheme": "static",
    }
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    state = load_file(str(src / "model.safetensors"))
    layers = raw["num_hidden_layers"]
    for i in range(layers):
        state[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.25 + i)
        state[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.5 + i)
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    attention = LLM(
        str(tmp_path / "m"), num_kv_blocks=16, kv_cache_dtype="fp8"
    ).engine.runner.model.attention_layers()
    assert [(a.k_scale, a.v_scale) for a in attention] == [(0.25 + i, 0.5 + i) for i in range(layers)]
    raw["quantization_config"]["kv_cache_scheme"] = "dynamic"
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError, match=r"kv_cache_scheme 'dynamic' is not supported with kv_cache_dtype fp8"
    ):
        LLM(str(tmp_path / "m"), num_kv_blocks=16, kv_cache_dtype="fp8")


@pytest.mark.parametrize(
    ("names", "edit", "message"),
    [
        (
            "autofp8",
            lambda s: s.pop(f"{K_PROJ}.weight_scale"),
            rf"missing tensor\(s\): {K_PROJ}\.weight_scale$",
        ),
        ("transformers", lambda s: s.pop(f"{K_PROJ}.activation_scale"), rf"{K_PROJ}\.activation_scale$"),
        (
            "transformers",
            lambda s: s.__setitem__(f"{K_PROJ}.activation_scale", torch.tensor([0.0])),
            rf"{K_PROJ}\.activation_scale: must be one positive finite number",
        ),
    ],
    ids=["weight-scale-missing", "activation-scale-missing", "activation-scale-zero"],
)
def test_fp8_tensors_are_named_as_the_file_spells_them(
    names: str, edit, message: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A missing or unusable tensor of a `quant_method: fp8` checkpoint is named as its file spells it,
    not by ember's name for it (`weight_scale_inv`, `input_scale`)."""
    src = quantized_model("tiny", "FP8")
    shutil.copytree(src, tmp_path / "m")
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    state = load_file(str(src / "model.safetensors"))
    if names == "transformers":
        renamed = {".weight_scale": ".weight_scale_inv", ".input_scale": ".activation_scale"}
        for name in list(state):
            suffix = next((s for s in renamed if name.endswith(s)), None)
            if suffix:
                state[name.removesuffix(suffix) + renamed[suffix]] = state.pop(name)
    edit(state)
    save_file(state, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path / "m"), num_kv_blocks=16)
