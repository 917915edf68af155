"""Writes a bitsandbytes 8-bit copy of a test checkpoint the way users make one: transformers loads it with
`BitsAndBytesConfig(load_in_8bit=True)` (bitsandbytes quantizes on the CPU) and saves it (run as a script,
in its own process: `python bnb8_build.py SRC DST PRESET`). PRESET: INT8 (LLM.int8(), outlier threshold
6.0, the usual "...-bnb-8bit" download)."""

from __future__ import annotations

import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "transformers",
    "bitsandbytes",
)


def build(src: Path, dst: Path, preset: str) -> None:
    import torch
    from quant_build import copy_tokenizer
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    assert preset == "INT8", preset
    config = BitsAndBytesConfig(load_in_8bit=True)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=torch.float32)
    model.save_pretrained(dst)
    copy_tokenizer(src, dst)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
