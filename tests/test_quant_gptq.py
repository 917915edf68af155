"""GPTQ and AWQ checkpoints (`quant_method: gptq`, `awq`) that GPTQModel wrote load into ember and compute
what transformers + GPTQModel compute on them: GPTQ 4-bit with and without act-order (desc_act), 8-bit,
and 4-bit with zero points (sym: false); AWQ with and without zero points; GPTQ and AWQ with projections
left in full precision by GPTQModel's `dynamic` overrides."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from script_runs import run_script

from ember_engine import LLM, SamplingParams
from ember_engine.model.loader import CheckpointError
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant import schemes
from ember_engine.model.quant.int_linear import Int4Linear, Int8Linear
from ember_engine.model.quant.schemes import UnsupportedQuantizationError

# The layer each preset runs in: 4-bit values as w4a16 (with their zero points where they have their own),
# 8-bit ones as w8a16.
PRESETS = {
    "INT4": Int4Linear,
    "INT4_ACT": Int4Linear,
    "INT8": Int8Linear,
    "INT4_ASYM": Int4Linear,
    "AWQ": Int4Linear,
    "AWQ_ASYM": Int4Linear,
    "INT4_DYNAMIC": Int4Linear,
    "AWQ_DYNAMIC": Int4Linear,
}
# The projections each preset leaves in full precision (`gptq_build.DYNAMIC`).
LEFT_OUT = {
    "INT4_DYNAMIC": (
        "layers.1.mlp.gate_up_proj",
        "layers.1.mlp.down_proj",
        *(f"layers.{i}.self_attn.o_proj" for i in (1, 2, 3)),
    ),
}
LEFT_OUT["AWQ_DYNAMIC"] = LEFT_OUT["INT4_DYNAMIC"]
# Largest |ember - oracle| logit difference, as a fraction of the logits' range. The oracle runs
# GPTQModel's torch kernels (on every machine: `gptq_oracle.py`), which multiply by their weights
# dequantized to float16, where ember keeps the float32 products: measured 1.8e-4 to 3.4e-4 for GPTQ and
# 3.1e-4 to 6.0e-4 for AWQ (the weights themselves are compared exactly, below).
TOLERANCE = 1e-3
MERGED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
BEFORE = {"k_proj": ("q_proj",), "v_proj": ("q_proj", "k_proj"), "up_proj": ("gate_proj",)}  # rows ahead


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(10, 4000, (20 + 7 * i,), generator=g).tolist() for i in range(6)]


@pytest.fixture(scope="module", params=list(PRESETS))
def gptq(request: pytest.FixtureRequest, quantized_model: Callable[..., Path], tmp_path_factory) -> tuple:  # type: ignore[no-untyped-def]
    preset = request.param
    path = quantized_model("tiny", preset, "gptq_build.py")
    work = tmp_path_factory.mktemp(preset.lower())
    (work / "prompts.json").write_text(json.dumps(_prompts()))
    oracle = Path(__file__).with_name("gptq_oracle.py")
    run_script(oracle, path, work / "oracle.pt", work / "prompts.json")
    return preset, path, torch.load(work / "oracle.pt")


def _checkpoint_order(layer: torch.nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """A layer's weight with its columns back in the checkpoint's order."""
    if layer.input_order is None:
        return weight
    back = torch.empty_like(weight)
    back[:, layer.input_order] = weight
    return back


def test_every_weight_is_what_gptqmodel_dequantizes(gptq) -> None:  # type: ignore[no-untyped-def]
    preset, path, oracle = gptq
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    method = "awq" if preset.startswith("AWQ") else "gptq"
    assert (config["quant_method"], config["desc_act"]) == (method, preset == "INT4_ACT")
    assert config.get("sym", config.get("zero_point") is False) == (not preset.endswith("ASYM"))
    model = LLM(str(path), num_kv_blocks=64, dtype="float32").engine.runner.model
    left_out = LEFT_OUT.get(preset, ())
    parts = sum(2 if "gate_up" in m else 1 for m in left_out)  # checkpoint projections left out
    assert len(oracle["weights"]) == 7 * len(model.model.layers) - parts
    for name in left_out:
        assert type(model.model.get_submodule(name)) is torch.nn.Linear, name
    for name, theirs in oracle["weights"].items():
        module, proj = name.rsplit(".", 1)
        layer = model.get_submodule(f"{module}.{MERGED.get(proj, proj)}")
        assert isinstance(layer, PRESETS[preset])
        ours = _checkpoint_order(layer, layer.dequantized(torch.float32))
        start = sum(oracle["weights"][f"{module}.{p}"].shape[0] for p in BEFORE.get(proj, ()))
        # GPTQModel's kernel dequantizes to float16; ember keeps the float32 products (exact).
        assert torch.equal(ours[start : start + theirs.shape[0]].half(), theirs.half()), name
    if preset == "INT4_ACT":
        assert all(layer.mlp.down_proj.input_order is not None for layer in model.model.layers)


def test_logits_and_greedy_tokens_match_transformers(gptq) -> None:  # type: ignore[no-untyped-def]
    preset, path, oracle = gptq
    llm = LLM(str(path), num_kv_blocks=64, dtype="float32")
    runner = llm.engine.runner
    for prompt, theirs in zip(_prompts(), oracle["logits"], strict=True):
        ours = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
        span = (theirs.max() - theirs.min()).item()
        assert (ours - theirs).abs().max().item() <= TOLERANCE * span, preset
    got = llm.generate(
        _prompts(), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False
    )
    agree = sum(list(g.token_ids) == e for g, e in zip(got, oracle["greedy"], strict=True))
    assert agree >= len(got) - 1, (preset, agree)


def _edited(src: Path, dst: Path, config: dict | None = None, tensors: Callable | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((src / "config.json").read_text())
        raw["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensors is not None:
        t = load_file(str(src / "model.safetensors"))
        tensors(t)
        save_file(t, str(dst / "model.safetensors"))
    return dst


def test_gptq_v2_zero_points_load_as_the_same_weights(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = quantized_model("tiny", "INT4", "gptq_build.py")

    def to_v2(t: dict) -> None:  # v1 stores each zero point less one
        for name in [n for n in t if n.endswith(".qzeros")]:
            words = t[name].shape[1]
            zeros = schemes.unpack_int32(t[name], 4, words * 8) + 1
            t[name] = schemes.pack_int32(zeros, 4)

    v2 = _edited(src, tmp_path / "v2", {"checkpoint_format": "gptq_v2"}, to_v2)
    prompt = _prompts()[0]
    chunk = [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
    a = LLM(str(src), num_kv_blocks=16).engine.runner.forward(chunk)
    b = LLM(str(v2), num_kv_blocks=16).engine.runner.forward(chunk)
    assert torch.equal(a, b)


def _swap_groups(t: dict, name: str) -> None:
    """A g_idx that reorders the groups (act-order), the weight left as it is."""
    g = t[name]
    t[name] = torch.cat((g[len(g) // 2 :], g[: len(g) // 2]))


# (config changes, tensor edits, the error) for a GPTQ and an AWQ checkpoint ember cannot run.
GPTQ_REFUSALS = [
    (
        {"sym": False, "bits": 8},
        None,
        r"gptq: asymmetric 8-bit weights \(sym: false\) are not supported; supported: sym: true, or 4 bits",
    ),
    ({"bits": 3}, None, r"gptq: 3-bit weights are not supported; supported: 4, 8"),
    (
        {"checkpoint_format": "marlin"},
        None,
        r"gptq: checkpoint_format 'marlin' is not supported; supported: gptq, gptq_v2",
    ),
    (
        {"group_size": -1},
        None,
        r"gptq: group_size -1 is not supported with 4-bit weights; supported: a positive group size$",
    ),
    # configs that claim what the tensors are not: a quantized LM head, 8-bit down projections
    ({"lm_head": True}, None, r"unexpected tensor 'lm_head.weight' in a gptq checkpoint"),
    (
        {"dynamic": {"-:.*o_proj": {}, "+:.*down": {"bits": 8, "damp_percent": 0.1}}},
        None,
        r"model\.layers\.\d\.mlp\.down_proj\.scales: a \[128, 128\] weight in groups of 64 needs scales "
        r"\[2, 128\]; found \[4, 128\]",
    ),
    (
        {"quant_method": "eetq"},
        None,
        r"quant_method 'eetq' is not supported; supported: compressed-tensors .*, fp8, fbgemm_fp8, gptq, awq, "
        r"bitsandbytes \(4- and 8-bit\), modelopt \(FP8, FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, "
        r"W4A16_NVFP4, NVFP4, W8A16, W4A16_AWQ, MXFP8, NVFP4_AWQ, W4A8_NVFP4_FP8, W8A8_SQ_PER_CHANNEL, "
        r"W4A8_AWQ\), quark \(FP8\)$",
    ),
    (
        None,
        lambda t: t.__setitem__(
            "model.layers.0.mlp.up_proj.qzeros", t["model.layers.0.mlp.up_proj.qzeros"] + 1
        ),
        r"model\.layers\.0\.mlp\.up_proj\.qzeros: zero points other than the midpoint \(asymmetric weights\) "
        r"in a checkpoint that declares "
        r"them symmetric",
    ),
    (
        None,
        lambda t: _swap_groups(t, "model.layers.1.mlp.down_proj.g_idx"),
        r"model.layers.1.mlp.down_proj.g_idx: g_idx reorders the groups, but desc_act is false",
    ),
    (
        None,
        lambda t: t.__setitem__(
            "model.layers.0.mlp.down_proj.scales", t["model.layers.0.mlp.down_proj.scales"][:1]
        ),
        r"model\.layers\.0\.mlp\.down_proj\.scales: a \[128, 256\] weight in groups of 64 needs scales "
        r"\[4, 128\]; found \[1, 128\]",
    ),
]
AWQ_REFUSALS = [
    ({"version": "gemv"}, None, r"awq: version 'gemv' is not supported; supported: gemm"),
    (
        {"dynamic": {"-:.*o_proj": {}, "+:.*down": {"group_size": 32, "damp_percent": 0.1}}},
        None,
        r"awq: dynamic '\+:\.\*down' sets \{'group_size': 32\} for the modules it matches \(base: "
        r"\{'group_size': 64\}\); per-module formats are not supported",
    ),
    ({"bits": 8}, None, r"awq: 8-bit weights are not supported; supported: 4"),
    ({"group_size": -1}, None, r"awq: group_size -1 is not supported; supported: a positive group size"),
    (
        {"modules_to_not_convert": ["layers.1.self_attn.k_proj"]},
        None,
        r"model.layers.1.self_attn: k_proj is left in full precision but q_proj, v_proj are quantized",
    ),
    (
        None,
        lambda t: t.__setitem__(
            "model.layers.1.self_attn.o_proj.qzeros", t["model.layers.1.self_attn.o_proj.qzeros"] - 1
        ),
        r"model\.layers\.1\.self_attn\.o_proj\.qzeros: zero points other than the midpoint \(asymmetric "
        r"weights\) in a checkpoint that declares "
        r"them symmetric",
    ),
]


@pytest.mark.parametrize(
    ("preset", "config", "edit", "error"),
    [("INT4", *case) for case in GPTQ_REFUSALS] + [("AWQ", *case) for case in AWQ_REFUSALS],
)
def test_what_ember_cannot_run_is_refused_by_name(  # type: ignore[no-untyped-def]
    quantized_model, tmp_path: Path, preset, config, edit, error
) -> None:
    bad = _edited(quantized_model("tiny", preset, "gptq_build.py"), tmp_path / "m", config, edit)
    with pytest.raises(UnsupportedQuantizationError, match=error):
        LLM(str(bad), num_kv_blocks=16)


def test_a_zero_point_of_zero_survives_gptqs_v1_format(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """v1 stores each zero point less one, word by word: a zero point of 0 borrows from its neighbour.
    The v1 and v2 copies of the same zero points give the same model."""
    src = quantized_model("tiny", "INT4_ASYM", "gptq_build.py")
    name = "model.layers.0.mlp.gate_proj.qzeros"
    ones = 0x11111111

    def words(t: torch.Tensor, delta: int) -> torch.Tensor:
        return schemes.as_int32(t.to(torch.int64) + delta)

    def as_v2(t: dict) -> None:
        for n in [n for n in t if n.endswith(".qzeros")]:
            t[n] = words(t[n], ones)
        zeros = schemes.unpack_int32(t[name], 4, t[name].shape[1] * 8)
        zeros[:, ::3] = -8  # a zero point of 0 in every third column
        t[name] = schemes.pack_int32(zeros, 4)

    v2 = _edited(src, tmp_path / "v2", {"checkpoint_format": "gptq_v2"}, as_v2)
    v1 = _edited(
        v2,
        tmp_path / "v1",
        {"checkpoint_format": "gptq"},
        lambda t: t.update({n: words(t[n], -ones) for n in t if n.endswith(".qzeros")}),
    )
    stored_v1 = load_file(str(v1 / "model.safetensors"))[name]
    zeros_v2 = schemes.unpack_int32(load_file(str(v2 / "model.safetensors"))[name], 4, stored_v1.shape[1] * 8)
    each_less_one = schemes.pack_int32((zeros_v2 + 7) % 16 - 8, 4)  # field by field, no borrow
    assert not torch.equal(stored_v1, each_less_one)  # the 0s borrowed
    prompt = _prompts()[0]
    chunk = [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
    a = LLM(str(v1), num_kv_blocks=16).engine.runner.forward(chunk)
    b = LLM(str(v2), num_kv_blocks=16).engine.runner.forward(chunk)
    assert torch.equal(a, b)
    # The zero points of 0 read back as 0 (held less 8) from the v1 words that borrowed for them.
    gate_up = LLM(str(v1), num_kv_blocks=16).engine.runner.model.model.layers[0].mlp.gate_up_proj
    held = gate_up.weight_zero[: zeros_v2.shape[1]]
    assert torch.equal(held, zeros_v2.t()) and (held[::3] == -8).all()


def test_act_order_parts_of_a_merged_projection_must_agree(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = quantized_model("tiny", "INT4_ACT", "gptq_build.py")
    bad = _edited(
        src, tmp_path / "m", None, lambda t: _swap_groups(t, "model.layers.0.self_attn.k_proj.g_idx")
    )
    with pytest.raises(
        UnsupportedQuantizationError,
        match=r"model.layers.0.self_attn.(k|q)_proj: its g_idx orders the input columns unlike "
        r"model.layers.0.self_attn.(q|k)_proj's, with which it is merged \(they share an input\); not supported",
    ):
        LLM(str(bad), num_kv_blocks=16)


@pytest.mark.parametrize("gemm", ["torch", "triton"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
def test_zero_points_enter_every_product(gemm: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """w4a16 with a checkpoint's own zero points: the CPU's fused loops (up to 8 rows) and its int8 matmul
    (more), and the Triton kernel (in the interpreter on a CPU), against the float64 product of the
    dequantized weight (value - zero) * scale."""
    g = torch.Generator().manual_seed(rows)
    layer = Int4Linear(256, 96, bias=False, dtype=torch.float32, group_size=64, zero_points=True)
    layer.set_rows(0, torch.randint(-8, 8, (96, 256), generator=g, dtype=torch.int8), torch.rand(96, 4) * 0.1)
    layer.set_zero_rows(0, torch.randint(-8, 8, (96, 4), generator=g, dtype=torch.int8))
    values = schemes.unpack_int4(layer.weight_packed).double()
    weight = (
        values - layer.weight_zero.double().repeat_interleave(64, dim=1)
    ) * layer.weight_scale.double().repeat_interleave(64, dim=1)
    assert torch.allclose(layer.dequantized(torch.float64), weight)
    x = torch.randn(rows, 256, generator=g)
    monkeypatch.setenv("EMBER_QUANT_GEMM", gemm)
    got = layer(x).double()
    want = x.double() @ weight.t()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (gemm, rows)
    # Without them (every zero point 8) the product differs: the zero points are not ignored.
    assert (
        got - x.double() @ (values * layer.weight_scale.double().repeat_interleave(64, dim=1)).t()
    ).abs().max() > 0.1


def test_dynamic_patterns_are_read_in_order_first_match_deciding() -> None:
    """GPTQModel's rule: a module's first matching pattern (from the start of its name) decides, so a
    positive pattern ahead of a negative one keeps what it matches quantized."""
    from ember_engine.model.quant.checkpoint import parse_quantization_config

    base = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False}
    dynamic = {r"+:.*layers\.0\.": {"damp_percent": 0.1}, r"-:.*o_proj": {}, "model.layers.2.mlp": {}}
    spec = parse_quantization_config({**base, "dynamic": dynamic})
    assert spec.quantizes("model.layers.0.self_attn.o_proj")
    assert not spec.quantizes("model.layers.1.self_attn.o_proj")
    assert spec.quantizes("model.layers.1.self_attn.q_proj")
    assert spec.quantizes("model.layers.2.mlp.down_proj")
    # a pattern matches from the start of the name: "-:mlp" matches no module
    assert parse_quantization_config({**base, "dynamic": {"-:mlp": {}}}).quantizes(
        "model.layers.2.mlp.down_proj"
    )


def test_modules_in_block_to_quantize_leaves_the_others_in_full_precision(
    quantized_model, tiny_model: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """AutoGPTQ's and GPTQModel's `modules_in_block_to_quantize` (each decoder layer's projections that
    are quantized, in lists or one list): the others are stored in full precision, as transformers +
    GPTQModel load them. It was not read: such a checkpoint was refused as holding an unexpected tensor."""
    full = load_file(str(tiny_model / "model.safetensors"))

    def o_proj_in_full(t: dict) -> None:  # type: ignore[type-arg]
        for name in [n for n in t if ".o_proj." in n]:
            del t[name]
        t.update({n: w for n, w in full.items() if n.endswith("o_proj.weight")})

    listed = [["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], ["mlp.gate_proj", "mlp.up_proj"]]
    listed.append(["mlp.down_proj"])
    path = _edited(
        quantized_model("tiny", "INT4", "gptq_build.py"),
        tmp_path / "m",
        {"modules_in_block_to_quantize": listed},
        o_proj_in_full,
    )
    (tmp_path / "prompts.json").write_text(json.dumps(_prompts()))
    run_script(
        Path(__file__).with_name("gptq_oracle.py"), path, tmp_path / "oracle.pt", tmp_path / "prompts.json"
    )
    oracle = torch.load(tmp_path / "oracle.pt")
    assert not any("o_proj" in name for name in oracle["weights"])  # GPTQModel left them unquantized too
    llm = LLM(str(path), num_kv_blocks=64, dtype="float32")
    layers = llm.engine.runner.model.model.layers
    assert all(type(layer.self_attn.o_proj) is not Int4Linear for layer in layers)
    assert all(isinstance(layer.mlp.down_proj, Int4Linear) for layer in layers)
    for prompt, theirs in zip(_prompts(), oracle["logits"], strict=True):
        blocks = list(range(-(-len(prompt) // 16)))
        ours = llm.engine.runner.forward([Chunk(blocks, 0, prompt, num_logits=len(prompt))])
        assert (ours - theirs).abs().max().item() <= 1e-3 * (theirs.max() - theirs.min()).item()


@pytest.mark.parametrize(
    ("config", "module"),
    [
        # a fused name the checkpoint does not store (its projections are gate_proj and up_proj)
        (
            {
                "modules_in_block_to_quantize": [
                    ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                    ["self_attn.o_proj"],
                    ["mlp.gate_up_proj"],
                    ["mlp.down_proj"],
                ]
            },
            "mlp.(gate|up)_proj",
        ),
        ({"dynamic": {"-:.*down_proj": {}}}, r"mlp\.down_proj"),
    ],
)
def test_a_quantized_projection_its_config_leaves_in_full_precision_is_named(
    config: dict, module: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A config whose lists leave out projections the file holds quantized (a misspelt or fused name in
    modules_in_block_to_quantize, a too-wide dynamic pattern): the error said only "no such parameter"."""
    path = _edited(quantized_model("tiny", "INT4", "gptq_build.py"), tmp_path / "m", config)
    with pytest.raises(CheckpointError) as refused:
        LLM(str(path), num_kv_blocks=16)
    message = str(refused.value)
    assert re.search(rf"model\.layers\.\d+\.{module} is quantized in the file", message), message
    assert "the checkpoint's gptq config leaves it in full precision" in message


@pytest.mark.parametrize(
    ("listed", "error"),
    [
        ("self_attn.q_proj", r"gptq: modules_in_block_to_quantize must be a list of module names"),
        ([["self_attn.q_proj"], 3], r"gptq: modules_in_block_to_quantize must be a list of module names"),
        (3, r"gptq: modules_in_block_to_quantize must be a list of module names"),
    ],
)
def test_modules_in_block_to_quantize_not_a_list_of_names_is_refused(listed, error: str) -> None:  # type: ignore[no-untyped-def]
    from ember_engine.model.quant.checkpoint import parse_quantization_config

    base = {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": True, "desc_act": False}
    with pytest.raises(UnsupportedQuantizationError, match=error):
        parse_quantization_config({**base, "modules_in_block_to_quantize": listed})
    flat = parse_quantization_config({**base, "modules_in_block_to_quantize": ["mlp.down_proj"]})
    assert flat.quantizes("model.layers.3.mlp.down_proj") and not flat.quantizes("model.layers.3.mlp.up_proj")
    assert parse_quantization_config({**base, "modules_in_block_to_quantize": []}).quantizes(
        "model.layers.0.self_attn.o_proj"
    )


def test_an_older_gptq_checkpoint_is_read_from_quantize_config_json(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """AutoGPTQ before transformers read GPTQ wrote its config to `quantize_config.json` only, without a
    `quant_method` (vLLM reads that file for GPTQ): the same model as with the config in `config.json`.
    It was not read, and the checkpoint was refused as holding unexpected tensors."""
    path = quantized_model("tiny", "INT4", "gptq_build.py")
    shutil.copytree(path, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    qc = raw.pop("quantization_config")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    fields = ("bits", "group_size", "desc_act", "sym", "damp_percent", "true_sequential")
    (tmp_path / "m" / "quantize_config.json").write_text(json.dumps({f: qc[f] for f in fields if f in qc}))
    usual = LLM(str(path), num_kv_blocks=16).engine.runner
    older = LLM(str(tmp_path / "m"), num_kv_blocks=16).engine.runner
    assert older.quant is not None and (older.quant.scheme, older.quant.format) == ("w4a16", "gptq")
    for prompt in _prompts()[:2]:
        chunk = [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
        assert torch.equal(older.forward(chunk), usual.forward(chunk))


@pytest.mark.parametrize("file", ["quant_config.json", "quantize_config.json"])
def test_an_older_awq_checkpoint_is_read_from_its_own_config_file(
    file: str, quantized_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """AutoAWQ before transformers read AWQ wrote its config to a file of its own, in its own field names
    (`w_bit`, `q_group_size`, `zero_point`, `version: "GEMM"`; no `quant_method`), as vLLM reads it: the
    same model as with the config in `config.json`. It was refused as holding unexpected tensors."""
    path = quantized_model("tiny", "AWQ_ASYM", "gptq_build.py")
    shutil.copytree(path, tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    qc = raw.pop("quantization_config")
    (tmp_path / "m" / "config.json").write_text(json.dumps(raw))
    (tmp_path / "m" / "quantize_config.json").unlink()  # GPTQModel's own copy of the config
    older = {
        "zero_point": qc["zero_point"],
        "q_group_size": qc["group_size"],
        "w_bit": qc["bits"],
        "version": "GEMM",
    }
    (tmp_path / "m" / file).write_text(json.dumps(older))
    usual = LLM(str(path), num_kv_blocks=16).engine.runner
    runner = LLM(str(tmp_path / "m"), num_kv_blocks=16).engine.runner
    assert runner.quant is not None and (runner.quant.scheme, runner.quant.format) == ("w4a16", "awq")
    assert runner.quant.zero_points
    for prompt in _prompts()[:2]:
        chunk = [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
        assert torch.equal(runner.forward(chunk), usual.forward(chunk))


@pytest.mark.parametrize("file", ["quantize_config.json", "quant_config.json", "hf_quant_config.json"])
def test_an_older_config_file_that_is_not_json_is_named(file: str, tiny_model: Path, tmp_path: Path) -> None:
    """Was a bare JSONDecodeError naming no file."""
    shutil.copytree(tiny_model, tmp_path / "m")
    (tmp_path / "m" / file).write_text('{"bits": 4, "group_size": 128,}')
    with pytest.raises(UnsupportedQuantizationError, match=rf"{file}: not JSON \(Expecting property name"):
        LLM(str(tmp_path / "m"), num_kv_blocks=16)
