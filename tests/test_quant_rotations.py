"""Hadamard rotations applied as the model runs (compressed-tensors' `transform_config` at locations
"input" and "output": llm-compressor's QuIP, whose V rotates each projection's input and U its output, and
SpinQuant's R4, the down projection's input).
The oracle is transformers for the quantized projections with compressed-tensors' own transform modules
(`HadamardTransform`, over the checkpoint's matrices) hooked onto their inputs and outputs, as
compressed-tensors runs them; without those rotations the logits are another model's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_engine_greedy import hf_greedy
from test_quant_load import _prompts
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant.layer import QuantLinear

BUILD = "quant_targets_build.py"
# preset: (the projections whose input is rotated, whether every projection's output is, the matrices the
# model holds: one per group, location and size, whichever layers take it)
CASES = {
    "W4A16_QUIP": (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), False, 2),  # inputs of 128 and 256
    "W4A16_QUIP_UV": (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), True, 2),  # blocks of 32, V and U
    "W4A16_SPIN_R4": (("down_proj",), False, 1),  # SpinQuant's R1 and R2 folded, R4 at run time
}


def _oracle(path: Path, hooked: bool = True):  # type: ignore[no-untyped-def]
    """transformers on the checkpoint, with compressed-tensors' transforms hooked onto each linear layer
    the config's online locations target (the matrices the checkpoint holds, one per group and size)."""
    import json

    from compressed_tensors.transform import TransformScheme
    from compressed_tensors.transform.factory.hadamard import HadamardTransform
    from compressed_tensors.utils import is_match

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if not hooked:
        return hf
    config = json.loads((path / "config.json").read_text())["quantization_config"]["transform_config"]
    matrices: dict[tuple[str, str, int], torch.Tensor] = {}
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors file)
            stem, _, kind = name.rpartition(".")
            group, _, location = stem.rpartition(".")[2].rpartition("_")
            if kind == "weight" and location in ("input", "output"):
                matrix = f.get_tensor(name)
                matrices[(group, location, matrix.shape[0])] = matrix
    for group, raw in config["config_groups"].items():
        scheme = TransformScheme(**raw)
        for args in scheme.apply:
            if args.location not in ("input", "output"):
                continue
            for name, module in hf.named_modules():
                if not isinstance(module, torch.nn.Linear) or not is_match(
                    name, module, args.targets, args.ignore
                ):
                    continue
                size = scheme.head_dim or (
                    module.in_features if args.location == "input" else module.out_features
                )
                weight = torch.nn.Parameter(matrices[(group, args.location, size)], requires_grad=False)
                transform = HadamardTransform(weight, None, scheme, args, torch.nn.Linear)
                if args.location == "input":
                    module.register_forward_pre_hook(lambda m, a, t=transform: (t(a[0]),))
                else:
                    module.register_forward_hook(lambda m, a, out, t=transform: t(out))
    return hf


@pytest.mark.parametrize("preset", list(CASES))
def test_rotations_run_as_compressed_tensors_runs_them(preset: str, quantized_model) -> None:  # type: ignore[no-untyped-def]
    path = quantized_model("tiny", preset, BUILD)
    hf, bare = _oracle(path), _oracle(path, hooked=False)
    llm = LLM(str(path), num_kv_blocks=64)
    runner = llm.engine.runner
    inputs, outputs, matrices = CASES[preset]
    layers = {n: m for n, m in runner.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 16
    for name, layer in layers.items():
        assert (layer.input_rotation is not None) == name.endswith(inputs), name
        assert (layer.output_rotation is not None) == outputs, name
    held = {b.data_ptr() for layer in layers.values() for n, b in layer.named_buffers() if "rotation" in n}
    assert len(held) == matrices
    for prompt in _prompts(4, 40):
        with torch.inference_mode():
            theirs, unrotated = (m(torch.tensor([prompt])).logits[0].float() for m in (hf, bare))
        ours = runner.forward([Chunk(list(range(-(-len(prompt) // 16))), 0, prompt, num_logits=len(prompt))])
        assert ours is not None
        span = (theirs.max() - theirs.min()).item()
        assert (ours - theirs).abs().max().item() <= 1e-4 * span
        assert (unrotated - theirs).abs().max().item() > 0.1 * span  # the rotations matter
    prompts = _prompts(8, 20)
    expected = hf_greedy(hf, prompts, 12)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [g.token_ids for g in got] == expected


def _edited(quantized_model, edited_checkpoint, tmp_path: Path, edit, preset: str = "W4A16_QUIP") -> Path:  # type: ignore[no-untyped-def]
    def config(qc: dict) -> None:
        edit(qc["transform_config"]["config_groups"])

    return edited_checkpoint(quantized_model("tiny", preset, BUILD), tmp_path / "m", quantization=config)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (  # SpinQuant's R3 rotates attention's queries and keys
            lambda g: g["v"]["apply"][0].update(location="q_attn"),
            r"compressed-tensors: transform_config group 'v' \(hadamard\) at 'q_attn' is not supported; "
            r"supported: rotations of a linear layer's input or output as the model runs, and transforms "
            r"folded into the weights \(weight_input, weight_output\)",
        ),
        (
            lambda g: g["v"].update(type="random-matrix"),
            r"group 'v' \(random-matrix\) at 'input': type not supported; supported: hadamard, random-hadamard",
        ),
        (
            lambda g: g["v"].update(randomize=True),
            r"at 'input': randomize \(permuted matrices\) is not supported",
        ),
        (
            lambda g: g["v"].update(head_dim=48),
            r"model.layers.0.self_attn.qkv_proj: transform group 'v' rotates blocks of 48, which do not divide "
            r"its input of 128",
        ),
        (  # the LM head, left in full precision, rotated too
            lambda g: g["v"]["apply"][0].update(ignore=[]),
            r"lm_head: the transform_config rotates it as the model runs, but it is in full precision; ember "
            r"applies run-time rotations to quantized layers only",
        ),
        (
            lambda g: g["v"]["apply"][0].update(targets=[r"re:.*q_proj$", r"re:.*mlp\..*"]),
            r"model.layers.0.self_attn.qkv_proj: the transform_config rotates the inputs of q_proj, k_proj, "
            r"v_proj unlike each other",
        ),
    ],
)
def test_a_rotation_ember_cannot_apply_is_refused_by_name(
    edit, message: str, quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    path = _edited(quantized_model, edited_checkpoint, tmp_path, edit)
    with pytest.raises(ValueError, match=message):
        LLM(str(path), num_kv_blocks=16)


def test_a_missing_matrix_is_named(quantized_model, edited_checkpoint, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    def drop(state: dict) -> None:
        del state["model.layers.0.mlp.down_proj.v_input.weight"]  # the 256-wide one, down_proj's input

    path = edited_checkpoint(quantized_model("tiny", "W4A16_QUIP", BUILD), tmp_path / "m", tensors=drop)
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.mlp.down_proj: the checkpoint holds no 256x256 matrix for transform group 'v' at "
        r"input \(v_input.weight\)",
    ):
        LLM(str(path), num_kv_blocks=16)


def test_outputs_of_a_merged_layer_rotated_in_part_are_refused(
    quantized_model, edited_checkpoint, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    def edit(groups: dict) -> None:
        next(a for a in groups["u"]["apply"] if a["location"] == "output")["targets"] = [r"re:.*(q|up)_proj$"]

    path = _edited(quantized_model, edited_checkpoint, tmp_path, edit, "W4A16_QUIP_UV")
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn.qkv_proj: the transform_config rotates the outputs of some of q_proj, "
        r"k_proj, v_proj only; ember runs them as one layer, so they must all be rotated or none",
    ):
        LLM(str(path), num_kv_blocks=16)
