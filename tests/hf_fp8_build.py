"""Writes a Hugging Face block-scaled FP8 copy of a test checkpoint (run as a script:
`python hf_fp8_build.py SRC DST FP8_BLOCK`): `quantization_config: {quant_method: fp8, activation_scheme:
dynamic, weight_block_size: [128, 128]}`, each decoder projection's E4M3 `weight` and float32
`weight_scale_inv` per 128x128 tile, everything else copied as it is (the layout of the "...-FP8"
checkpoints of recent models). FP8_BLOCK_PARTIAL leaves layer 1's MLP in full precision
(`modules_to_not_convert: ["model.layers.1.mlp", "lm_head"]`)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from ember_engine.model.quant.schemes import quantize_fp8_blocks

BLOCK = (128, 128)
LEFT_OUT = {"FP8_BLOCK": None, "FP8_BLOCK_PARTIAL": ["model.layers.1.mlp", "lm_head"]}


def build(src: Path, dst: Path, preset: str = "FP8_BLOCK") -> None:
    left_out = LEFT_OUT[preset]
    shutil.copytree(src, dst)
    tensors = {}
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            t = f.get_tensor(name)
            if name.endswith("_proj.weight") and not (left_out and name.startswith(left_out[0])):
                q, scale = quantize_fp8_blocks(t, BLOCK)
                tensors[name], tensors[name.replace(".weight", ".weight_scale_inv")] = q, scale
            else:
                tensors[name] = t
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
        **({"modules_to_not_convert": left_out} if left_out else {}),
    }
    (dst / "config.json").write_text(json.dumps(config, indent=2))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
