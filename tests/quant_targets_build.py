"""Writes a copy of a test checkpoint quantized by llm-compressor with a choice of which layers hold which
scheme (run as a script, in its own process, like quant_build.py): `python quant_targets_build.py SRC DST
PRESET`.

PRESET, mixed precision (config groups of different schemes, each over its own projections):
- W8_ATTENTION: int8 weights (W8A16) on the attention projections, int4 (W4A16) on the MLP's. Both are
  `pack-quantized`, so that is the format the config names.
- FP8_ATTENTION: W4A16 on every linear layer ("Linear"), with FP8_DYNAMIC on the attention projections
  ("re:" pattern, which compressed-tensors ranks above a class name). The groups' formats differ, so the
  config's format is `mixed-precision` and each group names its own.
or an LM head quantized with the rest (nothing ignored, so "Linear" takes `lm_head` too): W8A16_HEAD,
W4A16_HEAD, FP8_DYNAMIC_HEAD; or W4A16 after Hadamard rotations (a `transform_config`): W4A16_QUIP
(QuIP's V, Sylvester's matrices, applied to each projection's whole input as it runs), W4A16_QUIP_UV
(QuIP's V and U, random Hadamard matrices over blocks of 32 columns, at each projection's input and
output), W4A16_SPIN (SpinQuant's R1 and R2, both folded into the weights) and W4A16_SPIN_R4 (with R4
too, applied to the down projection's input as it runs).
"""

from __future__ import annotations

import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "transformers",
    "compressed_tensors.quantization",
    "llmcompressor",
    "llmcompressor.modifiers.quantization",
    "llmcompressor.modifiers.transform",
)

ATTENTION = r"re:.*self_attn\..*"
MLP = r"re:.*mlp\..*"
# preset: ((llm-compressor preset, targets) for each config group, in order; ignore)
PRESETS = {
    "W8_ATTENTION": ((("W8A16", [ATTENTION]), ("W4A16", [MLP])), ["lm_head"]),
    "FP8_ATTENTION": ((("W4A16", ["Linear"]), ("FP8_DYNAMIC", [ATTENTION])), ["lm_head"]),
    **{f"{p}_HEAD": (((p, ["Linear"]),), []) for p in ("W8A16", "W4A16", "FP8_DYNAMIC")},
    "W4A16_QUIP": ((("W4A16", ["Linear"]),), ["lm_head"]),
    "W4A16_QUIP_UV": ((("W4A16", ["Linear"]),), ["lm_head"]),
    "W4A16_SPIN": ((("W4A16", ["Linear"]),), ["lm_head"]),
    "W4A16_SPIN_R4": ((("W4A16", ["Linear"]),), ["lm_head"]),
}


def build(src: Path, dst: Path, preset: str) -> None:
    from compressed_tensors.quantization import preset_name_to_scheme
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from quant_build import copy_tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    schemes, ignore = PRESETS[preset]
    groups = {f"group_{i}": preset_name_to_scheme(name, t) for i, (name, t) in enumerate(schemes)}
    recipe = [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if preset == "W4A16_QUIP":
        from llmcompressor.modifiers.transform import QuIPModifier

        recipe.insert(0, QuIPModifier(transform_type="hadamard", targets="Linear", ignore=["lm_head"]))
    elif preset == "W4A16_QUIP_UV":
        from llmcompressor.modifiers.transform import QuIPModifier

        quip = QuIPModifier(
            rotations=["v", "u"],
            transform_type="random-hadamard",
            transform_block_size=32,
            targets="Linear",
            ignore=["lm_head"],
        )
        recipe.insert(0, quip)
    elif preset.startswith("W4A16_SPIN"):
        from llmcompressor.modifiers.transform import SpinQuantModifier

        rotations = ["R1", "R2", "R4"] if preset.endswith("_R4") else ["R1", "R2"]
        recipe.insert(0, SpinQuantModifier(rotations=rotations, transform_type="hadamard"))
    oneshot(model=model, recipe=recipe)
    model.save_pretrained(dst, save_compressed=True)
    copy_tokenizer(src, dst)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
