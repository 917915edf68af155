"""Writes a bitsandbytes 4-bit copy of a test checkpoint the way users make one: transformers loads it
with a `BitsAndBytesConfig` (bitsandbytes quantizes on the CPU) and saves it (run as a script, in its own
process: `python bnb_build.py SRC DST PRESET`).

PRESET: NF4 (NF4 with double quantization, the usual "...-bnb-4bit" download), NF4_SINGLE (NF4, one
float32 absmax per block), FP4 (bitsandbytes' FP4, double quantization), NF4_PARTIAL (NF4 with layer 1's
MLP and layer 0's o_proj left in full precision, `llm_int8_skip_modules`), NF4_BF16 (NF4 with double
quantization of the model loaded in bfloat16, as most downloads are), NF4_STORAGE (NF4 with double
quantization, the codes stored as bfloat16 elements: `bnb_4bit_quant_storage`, as FSDP training sets it).
"""

from __future__ import annotations

import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "transformers",
    "bitsandbytes",
)

PRESETS = {  # (quant type, double quantization, modules left in full precision)
    "NF4": ("nf4", True, None),
    "NF4_SINGLE": ("nf4", False, None),
    "FP4": ("fp4", True, None),
    "NF4_PARTIAL": ("nf4", True, ["lm_head", "model.layers.1.mlp", "layers.0.self_attn.o_proj"]),
    "NF4_BF16": ("nf4", True, None),
    "NF4_STORAGE": ("nf4", True, None),
}


def build(src: Path, dst: Path, preset: str) -> None:
    import torch
    from quant_build import copy_tokenizer
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kind, nested, skip = PRESETS[preset]
    dtype = torch.bfloat16 if preset.endswith("_BF16") else torch.float32
    config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=kind,
        bnb_4bit_use_double_quant=nested,
        bnb_4bit_compute_dtype=dtype,
        llm_int8_skip_modules=skip,
        bnb_4bit_quant_storage=torch.bfloat16 if preset == "NF4_STORAGE" else torch.uint8,
    )
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=config, dtype=dtype)
    model.save_pretrained(dst)
    copy_tokenizer(src, dst)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
