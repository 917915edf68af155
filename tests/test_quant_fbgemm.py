"""fbgemm FP8 checkpoints (`quant_method: fbgemm_fp8`, Meta's "…-FP8" Llama releases): FP8 weights with a
scale per output channel, activations quantized per token with their largest magnitude taken as at most
`activation_scale_ub`. fbgemm's kernels run on CUDA only, so the oracles are llm-compressor's FP8_DYNAMIC
checkpoint of the same model (the same bytes and scales, the same arithmetic where the bound does not
bind; it is checked against transformers + compressed-tensors in test_quant_load.py), and, where the bound
binds, transformers' model holding the checkpoint's weights with each projection's input quantized by the
rule fbgemm's `quantize_fp8_per_row(scale_ub=...)` and vLLM's `scaled_fp8_quant(scale_ub=...)` apply."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_quant_modelopt import _forward
from torch import nn

from ember_engine import LLM, SamplingParams
from ember_engine.model.quant.fp8_linear import Fp8Linear

FP8_MAX = 448.0


def _fbgemm(src: Path, dst: Path, ub: float | None = 1200.0, not_convert: tuple[str, ...] = ()) -> Path:
    """llm-compressor's FP8_DYNAMIC checkpoint `src` in fbgemm_fp8's form (the same tensor names: E4M3
    `weight`, float32 `weight_scale` [out, 1]); the modules in `not_convert` stored dequantized."""
    shutil.copytree(src, dst)
    config = json.loads((src / "config.json").read_text())
    qc: dict = {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head", *not_convert]}
    if ub is not None:
        qc["activation_scale_ub"] = ub
    config["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(config))
    state = load_file(str(src / "model.safetensors"))
    for module in not_convert:
        scale = state.pop(f"{module}.weight_scale")
        state[f"{module}.weight"] = state[f"{module}.weight"].float() * scale
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(10, 4000, (24 + i,), generator=g).tolist() for i in range(4)]


def _llm(path: Path) -> LLM:
    return LLM(str(path), num_kv_blocks=64, max_num_seqs=4)


def test_the_bound_unmet_runs_as_fp8_dynamic(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """transformers' default bound (1200) is far above this model's activations: every logit is the
    FP8_DYNAMIC checkpoint's, bit for bit."""
    src = quantized_model("tiny", "FP8_DYNAMIC")
    ours = _llm(_fbgemm(src, tmp_path / "fbgemm", ub=None)).engine.runner
    theirs = _llm(src).engine.runner
    assert ours.quant.format == "fbgemm_fp8" and ours.quant.scheme == "fp8"
    assert ours.quant.activation_ub == 1200.0
    down = ours.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.activation_ub == 1200.0
    assert not isinstance(ours.model.lm_head, Fp8Linear)  # "lm_head" in modules_to_not_convert
    for prompt in _prompts():
        assert torch.equal(_forward(ours, prompt), _forward(theirs, prompt))


def _bounded_reference(path: Path, ub: float) -> nn.Module:
    """transformers' model of fbgemm checkpoint `path` holding its E4M3 weights times their scales, each
    projection's input quantized per token with the largest magnitude taken as at most `ub`."""
    from transformers import AutoModelForCausalLM

    state = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    plain = path.parent / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps(config))
    quantized = sorted(n.removesuffix(".weight_scale") for n in state if n.endswith(".weight_scale"))
    for module in quantized:
        state[f"{module}.weight"] = state[f"{module}.weight"].float() * state.pop(f"{module}.weight_scale")
    save_file(state, str(plain / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()

    def quantize(module, args):  # type: ignore[no-untyped-def]
        x = args[0].float()
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(max=ub) / FP8_MAX
        q = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale
        return (q, *args[1:])

    for module in quantized:
        model.get_submodule(module).register_forward_pre_hook(quantize)
    return model


def test_a_binding_bound_saturates_the_largest_activations(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A bound below most tokens' largest magnitude: those tokens' scales are ub / 448 and their larger
    values saturate at +-448, as the reference computes them; the logits move away from the unbounded
    ones."""
    src = quantized_model("tiny", "FP8_DYNAMIC")
    ub = 0.5
    path = _fbgemm(src, tmp_path / "fbgemm", ub=ub)
    llm = _llm(path)
    runner = llm.engine.runner
    reference = _bounded_reference(path, ub)
    unbounded = _llm(src).engine.runner
    for prompt in _prompts():
        ours = _forward(runner, prompt)
        with torch.inference_mode():
            theirs = reference(torch.tensor([prompt])).logits[0]
        span = (theirs.max() - theirs.min()).item()
        assert (ours - theirs).abs().max().item() <= 1e-5 * span
        assert (ours - _forward(unbounded, prompt)).abs().max().item() >= 1e-2 * span
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = [o.token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
    with torch.inference_mode():
        expected = [
            reference.generate(
                torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in _prompts()
        ]
    assert got == expected


def test_modules_not_converted_stay_in_full_precision(quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    src = quantized_model("tiny", "FP8_DYNAMIC")
    left_out = ("model.layers.1.mlp.down_proj", "model.layers.2.self_attn.o_proj")
    layers = _llm(_fbgemm(src, tmp_path / "fbgemm", not_convert=left_out)).engine.runner.model.model.layers
    assert type(layers[1].mlp.down_proj) is nn.Linear and type(layers[2].self_attn.o_proj) is nn.Linear
    assert isinstance(layers[2].mlp.down_proj, Fp8Linear) and isinstance(
        layers[1].self_attn.o_proj, Fp8Linear
    )


@pytest.mark.parametrize("ub", [0, -3.0, "big", True])
def test_a_bound_that_is_no_positive_number_is_refused(ub, quantized_model, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    path = _fbgemm(quantized_model("tiny", "FP8_DYNAMIC"), tmp_path / "fbgemm", ub=ub)
    with pytest.raises(
        ValueError, match=r"fbgemm_fp8 checkpoint: activation_scale_ub must be a positive number"
    ):
        _llm(path)


def test_the_method_may_be_named(quantized_model, tmp_path: Path, tiny_model: Path) -> None:  # type: ignore[no-untyped-def]
    path = _fbgemm(quantized_model("tiny", "FP8_DYNAMIC"), tmp_path / "fbgemm")
    assert (
        LLM(str(path), num_kv_blocks=16, quantization="fbgemm_fp8").engine.runner.quant.format == "fbgemm_fp8"
    )
    with pytest.raises(ValueError, match=r"'fbgemm_fp8' names a quantized checkpoint's method"):
        LLM(str(tiny_model), num_kv_blocks=16, quantization="fbgemm_fp8")
