"""Writes a quantized copy of a test checkpoint with llm-compressor (run as a script, in its own process,
so its imports stay out of the test process): `python quant_build.py SRC DST SCHEME`.

SCHEME is an llm-compressor preset: FP8_DYNAMIC, FP8_BLOCK, W8A8, W8A16, W4A16, W4A16_ASYM, NVFP4A16
(round-to-nearest; no calibration data), FP8 (static per-tensor activation scales) or NVFP4 (FP4
weights and activations, a global activation scale per projection), the last two calibrated on 16
sequences of 64 token ids: drawn from a fixed seed, or for the packaged pair's target windows of its
training split. W8A16_PARTIAL is W8A16 with layer 1's MLP and layer 0's o_proj left in full precision
(`ignore`), FP8_DYNAMIC_ATTENTION FP8_DYNAMIC on the attention projections alone (`targets`), and
W4A16_GPTQ W4A16 by llm-compressor's GPTQ (calibrated, activation order "weight"), and FP8_DYNAMIC_GPTQ
FP8_DYNAMIC by the same GPTQ (FP8 weights rounded to compensate each other's error). FP8_WEIGHT is FP8
weights per channel with no input activations (weight-only; vLLM's W8A16-FP8), a scheme of ours given to
llm-compressor as a config group, and W8A8_STATIC W8A8's int8 weights with int8 activations under one
calibrated scale per projection (static per tensor), another.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "datasets",
    "transformers",
    "compressed_tensors.quantization",
    "llmcompressor",
    "llmcompressor.modifiers.quantization",
    "llmcompressor.modifiers.gptq",
)

CALIBRATED = ("FP8", "NVFP4", "W4A16_GPTQ", "FP8_DYNAMIC_GPTQ", "W8A8_STATIC")
GPTQ = {"W4A16_GPTQ": "W4A16", "FP8_DYNAMIC_GPTQ": "FP8_DYNAMIC"}  # presets of ours: llm-compressor's GPTQ
# Presets of ours: (llm-compressor's preset, extra ignore entries, targets). Some projections left in full
# precision by name or pattern, or only the attention projections quantized.
PARTIAL = {
    "W8A16_PARTIAL": ("W8A16", [r"re:.*layers\.1\.mlp\..*", "model.layers.0.self_attn.o_proj"], ["Linear"]),
    "FP8_DYNAMIC_ATTENTION": ("FP8_DYNAMIC", [], [r"re:.*self_attn\..*"]),
}


def build(src: Path, dst: Path, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    preset, ignore, targets = PARTIAL.get(scheme, (scheme, [], ["Linear"]))
    if scheme in GPTQ:  # GPTQ's error-compensating rounding, as most "...-W4A16" downloads are made
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = GPTQModifier(targets="Linear", scheme=GPTQ[scheme], ignore=["lm_head"], actorder="weight")
    elif scheme in ("FP8_WEIGHT", "W8A8_STATIC"):
        from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

        kind = "float" if scheme == "FP8_WEIGHT" else "int"
        weights = QuantizationArgs(num_bits=8, type=kind, strategy="channel", symmetric=True, dynamic=False)
        inputs = QuantizationArgs(num_bits=8, type="int", strategy="tensor", symmetric=True, dynamic=False)
        group = QuantizationScheme(
            targets=["Linear"], weights=weights, input_activations=inputs if kind == "int" else None
        )
        recipe = QuantizationModifier(config_groups={"group_0": group}, ignore=["lm_head"])
    else:
        recipe = QuantizationModifier(targets=targets, scheme=preset, ignore=["lm_head", *ignore])
    if scheme in CALIBRATED:
        from datasets import Dataset
        from gptq_build import _calibration as calibration

        text = "pair" if (src / "tokenizer.json").exists() and _is_pair(src) else "random"
        ids = [t.reshape(-1).tolist() for t in calibration(src, text)]
        data = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(i) for i in ids]})
        oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=len(ids))
    else:
        oneshot(model=model, recipe=recipe)
    model.save_pretrained(dst, save_compressed=True)
    copy_tokenizer(src, dst)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """The tokenizer and generation files, which save_pretrained does not write."""
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        if (src / name).exists() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)


def _is_pair(src: Path) -> bool:
    from ember_engine.tools.spec_pair import packaged_pair

    return src.resolve() == Path(packaged_pair()[0]).resolve()


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
