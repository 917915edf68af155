"""bitsandbytes 4-bit checkpoints (`quant_method: bitsandbytes`, NF4 and bitsandbytes' FP4, with and
without double quantization) run as `bnb-nf4` / `bnb-fp4`, against the field's own tooling: checkpoints
transformers + bitsandbytes wrote from the test model (`bnb_build.py`), run by transformers +
bitsandbytes.

bitsandbytes' CPU forward on a machine with AVX512-BF16 repacks the weights and multiplies in bfloat16
(absmax rounded to bfloat16 too), which is not the format's arithmetic; the oracle is put on its general
path (`support_avx512bf16_for_cpu = False`: the weight dequantized by bitsandbytes in the compute dtype,
float32 here, then multiplied)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_engine_greedy import hf_greedy
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant import cpu_codebook, triton_gemm
from ember_engine.model.quant.codebook_linear import CodebookLinear

PARTS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
PRESETS = ("NF4", "NF4_SINGLE", "FP4", "NF4_STORAGE")


def oracle_model(path: Path, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    import bitsandbytes as bnb

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False
    return model


@pytest.fixture(scope="module", params=PRESETS)
def pair(request, quantized_model):  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", request.param, "bnb_build.py")
    return request.param, LLM(str(path), num_kv_blocks=64), oracle_model(path)


def _prompts(n: int, length: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 4000, (length + i,), generator=g).tolist() for i in range(n)]


def _logit_gap(llm: LLM, oracle, prompts: list[list[int]]) -> float:  # type: ignore[no-untyped-def]
    """The largest |ember - oracle| logit over the prompts, as a fraction of the oracle's logit range."""
    worst = 0.0
    for prompt in prompts:
        with torch.inference_mode():
            theirs = oracle(torch.tensor([prompt])).logits[0].float()
        ours = llm.engine.runner.forward(
            [Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))]
        )
        assert ours is not None
        worst = max(worst, (ours.float() - theirs).abs().max().item() / (theirs.max() - theirs.min()).item())
    return worst


def _greedy_agreement(llm: LLM, oracle, prompts: list[list[int]]) -> int:  # type: ignore[no-untyped-def]
    """On how many prompts ember's 12 greedy tokens are the oracle's."""
    expected = hf_greedy(oracle, prompts, 12)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return sum(o.token_ids == e for o, e in zip(got, expected, strict=True))


def test_weights_are_bitsandbytes_own(pair) -> None:  # type: ignore[no-untyped-def]
    """Every projection holds exactly the weight bitsandbytes dequantizes from the checkpoint (codes, code
    table, absmax, and with double quantization the absmax's own decoding)."""
    import bitsandbytes.functional as bf

    preset, llm, oracle = pair
    assert llm.engine.runner.quant.scheme == ("bnb-fp4" if preset == "FP4" else "bnb-nf4")
    assert llm.engine.runner.quant.nested == (preset != "NF4_SINGLE")
    checked = 0
    for ours, theirs in zip(llm.engine.runner.model.model.layers, oracle.model.layers, strict=True):
        for name, (block, parts) in PARTS.items():
            module = getattr(getattr(ours, block), name)
            assert isinstance(module, CodebookLinear) and module.scheme == llm.engine.runner.quant.scheme
            weight = torch.cat(
                [
                    bf.dequantize_4bit(p.weight.data, p.weight.quant_state)
                    for p in (getattr(getattr(theirs, block), n) for n in parts)
                ]
            )
            assert torch.equal(module.dequantized(torch.float32), weight), (preset, name)
            checked += 1
    assert checked == 4 * len(oracle.model.layers)


def test_logits_and_greedy_tokens_match_transformers(pair) -> None:  # type: ignore[no-untyped-def]
    preset, llm, oracle = pair
    # the same weights, float32 sums in another order: measured 2.5e-7 to 3.2e-7 of the range
    assert _logit_gap(llm, oracle, _prompts(3, 40)) <= 1e-5, preset
    assert _greedy_agreement(llm, oracle, _prompts(8, 20)) == 8, preset


@pytest.mark.parametrize("block", [64, 32, 16])  # bitsandbytes' blocks; GGUF i-quants' groups
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 33])
def test_cpu_loops_and_triton_kernel_give_the_float64_product(rows: int, block: int) -> None:
    g = torch.Generator().manual_seed(rows)
    codes = torch.randint(0, 256, (70, 96), dtype=torch.uint8, generator=g)
    table = torch.randn(16, generator=g)
    scale = torch.rand(70, 192 // block, generator=g) + 0.1
    x = torch.randn(rows, 192, generator=g)
    low, high = (codes & 15).long(), (codes >> 4).long()
    weight = torch.stack([table[low], table[high]], dim=-1).reshape(70, 192) * scale.repeat_interleave(
        block, 1
    )
    expected = x.double() @ weight.double().t()
    for path in (
        cpu_codebook.codebook_matmul(x, codes, cpu_codebook.pair_table(table), scale),
        triton_gemm.codebook_matmul(x, codes, table, scale, block),  # TRITON_INTERPRET=1 on this machine
    ):
        assert path.shape == (rows, 70)
        assert (path.double() - expected).abs().max() <= 1e-6 * expected.abs().max()
    assert torch.equal(cpu_codebook.dequantize(codes, cpu_codebook.pair_table(table), scale), weight)


def test_modules_left_in_full_precision(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """`llm_int8_skip_modules` (read as transformers reads it: a module whose name starts with or ends with
    an entry) leaves those projections as ordinary layers."""
    path = quantized_model("tiny", "NF4_PARTIAL", "bnb_build.py")
    llm, oracle = LLM(str(path), num_kv_blocks=64), oracle_model(path)
    layers = llm.engine.runner.model.model.layers
    assert not isinstance(layers[1].mlp.gate_up_proj, CodebookLinear)
    assert not isinstance(layers[1].mlp.down_proj, CodebookLinear)
    assert not isinstance(layers[0].self_attn.o_proj, CodebookLinear)
    assert isinstance(layers[0].self_attn.qkv_proj, CodebookLinear)
    assert isinstance(layers[0].mlp.down_proj, CodebookLinear)
    assert _logit_gap(llm, oracle, _prompts(2, 30)) <= 1e-5


def _edit_config(src: Path, dst: Path, **changes: object) -> Path:
    import shutil

    shutil.copytree(src, dst)
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (  # a config that says 8-bit over 4-bit tensors
            {"load_in_8bit": True, "load_in_4bit": False, "_load_in_4bit": False},
            r"unexpected tensor '.*\.weight\.absmax' in checkpoint",
        ),
        ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type 'int4' is not supported; supported: nf4, fp4"),
        ({"bnb_4bit_quant_storage": "float8"}, "bnb_4bit_quant_storage 'float8' is not supported"),
        ({"bnb_4bit_quant_type": "fp4"}, "quant_type 'nf4' in a checkpoint of bnb_4bit_quant_type 'fp4'"),
        ({"llm_int8_skip_modules": ["model.layers.0.self_attn.q_proj"]}, "q_proj is left in full precision"),
    ],
)
def test_refused_by_name(changes, message: str, quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = _edit_config(quantized_model("tiny", "NF4", "bnb_build.py"), tmp_path / "m", **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)


def test_online_nf4_is_bitsandbytes_own_quantization(tiny_model: Path, quantized_model) -> None:  # type: ignore[no-untyped-def]
    """`quantization="bitsandbytes"` on a full-precision checkpoint quantizes to NF4 at load exactly as
    bitsandbytes does: the codes, absmax and table transformers + bitsandbytes wrote for the same model
    (without double quantization), bit for bit."""
    online = LLM(str(tiny_model), num_kv_blocks=16, quantization="bitsandbytes")
    written = LLM(str(quantized_model("tiny", "NF4_SINGLE", "bnb_build.py")), num_kv_blocks=16)
    assert online.engine.runner.quant.scheme == "bnb-nf4" and online.engine.runner.quant.format == "online"
    pairs = [
        (a, b)
        for a, b in zip(
            online.engine.runner.model.modules(), written.engine.runner.model.modules(), strict=True
        )
        if isinstance(a, CodebookLinear)
    ]
    assert len(pairs) == 4 * len(online.engine.runner.model.model.layers)
    for a, b in pairs:
        assert isinstance(b, CodebookLinear)
        assert torch.equal(a.weight_packed, b.weight_packed)
        assert torch.equal(a.weight_scale, b.weight_scale)
        assert torch.equal(a.code, b.code)


def test_requested_scheme_against_a_bitsandbytes_checkpoint(quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", "FP4", "bnb_build.py")
    assert (
        LLM(str(path), num_kv_blocks=16, quantization="bitsandbytes").engine.runner.quant.scheme == "bnb-fp4"
    )
    with pytest.raises(ValueError, match=r"'fp8' requested, but .* is already quantized as 'bnb-fp4'"):
        LLM(str(path), num_kv_blocks=16, quantization="fp8")


def test_a_bfloat16_checkpoint_runs_in_bfloat16(quantized_model) -> None:  # type: ignore[no-untyped-def]
    """Most downloads quantize a bfloat16 model: the engine runs it in bfloat16, each weight rounded as
    bitsandbytes dequantizes it (code times absmax in float32, then bfloat16), the products in float32
    and rounded once, where bitsandbytes multiplies in bfloat16 (measured: 6.8e-3 of the logits' range,
    greedy tokens on 6 of 8 prompts)."""
    import bitsandbytes.functional as bf

    path = quantized_model("tiny", "NF4_BF16", "bnb_build.py")
    llm = LLM(str(path), num_kv_blocks=64)
    assert llm.engine.runner.dtype == torch.bfloat16
    oracle = oracle_model(path, torch.bfloat16)
    for ours, theirs in zip(llm.engine.runner.model.model.layers, oracle.model.layers, strict=True):
        for name, (block, parts) in PARTS.items():
            weight = torch.cat(
                [
                    bf.dequantize_4bit(p.weight.data, p.weight.quant_state)
                    for p in (getattr(getattr(theirs, block), n) for n in parts)
                ]
            )
            assert weight.dtype == torch.bfloat16
            assert torch.equal(getattr(getattr(ours, block), name).dequantized(torch.bfloat16), weight), name
    assert _logit_gap(llm, oracle, _prompts(3, 40)) <= 2e-2
    assert _greedy_agreement(llm, oracle, _prompts(8, 20)) >= 5
