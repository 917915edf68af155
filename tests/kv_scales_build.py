"""Writes a copy of a test checkpoint with static FP8 KV-cache scales, as llm-compressor writes them
(`kv_cache_scheme`: one K and one V scale per attention layer, calibrated on a few fixed random-token
rows): `python kv_scales_build.py SRC DST PRESET`, PRESET FP8_KV (FP8_DYNAMIC weights too), KV (the
weights left as they are) or KV_HEAD (the weights left as they are, one K and one V scale per KV head:
strategy "attn_head"). Run in its own process, like quant_build.py."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "datasets",
    "transformers",
    "llmcompressor",
    "llmcompressor.modifiers.quantization",
)

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def build(src: Path, dst: Path, preset: str) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(10, 4000, (64,), generator=gen).tolist() for _ in range(8)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * 64 for _ in rows]})
    if preset == "FP8_KV":
        recipe = QuantizationModifier(
            targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"], kv_cache_scheme=KV_SCHEME
        )
    elif preset == "KV_HEAD":
        recipe = QuantizationModifier(kv_cache_scheme={**KV_SCHEME, "strategy": "attn_head"})
    else:
        recipe = QuantizationModifier(kv_cache_scheme=KV_SCHEME)
    oneshot(model=model, recipe=recipe, dataset=data, num_calibration_samples=8, max_seq_length=64)
    model.save_pretrained(dst, save_compressed=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists() and not (dst / name).exists():
            shutil.copy(src / name, dst / name)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
