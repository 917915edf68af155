"""Writes a quantized copy of a test checkpoint with llm-compressor (run as a script, in its own process,
so its imports stay out of the test process): `python quant_build.py SRC DST SCHEME`.

SCHEME is an llm-compressor preset: FP8_DYNAMIC, W8A16 or W4A16 (round-to-nearest; no calibration data).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def build(src: Path, dst: Path, scheme: str) -> None:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"]))
    model.save_pretrained(dst, save_compressed=True)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "special_tokens_map.json",
    ):
        if (src / name).exists() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
