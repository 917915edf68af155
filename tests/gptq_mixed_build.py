"""Writes a GPTQ copy of a test checkpoint whose projections are stored in more than one format, with
GPTQModel (run as a script, in its own process, like gptq_build.py): `python gptq_mixed_build.py SRC DST
PRESET`.

PRESET INT4_MIXED: 4-bit in groups of 64, the down projections 8-bit in groups of 32 (a `dynamic`
override of bits and group size) and the LM head quantized too (`lm_head: true`, which GPTQModel stores
as 8-bit in groups of 32 with a `dynamic` entry of its own). Calibrated as gptq_build.py calibrates.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import);
# not gptqmodel, whose import starts threads (its worker pools), which a forked run would not have
PRELOAD = ("torch", "transformers")

PRESETS = {"INT4_MIXED": {r"+:.*mlp\.down_proj": {"bits": 8, "group_size": 32}}}


def build(src: Path, dst: Path, preset: str) -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    src, dst = src.resolve(), dst.resolve()
    os.chdir(tempfile.mkdtemp())  # GPTQModel writes a log folder where it runs
    import torch
    from gptq_build import _calibration
    from gptqmodel import GPTQModel, QuantizeConfig

    # GPTQModel's kernels compile their dequantization with torch.compile at first use, which took 5 to
    # 20 s of a run on a CPU for the same operations eagerly run (measured: the same logits, weights
    # and checkpoint bytes): eager here.
    torch._dynamo.config.disable = True

    config = QuantizeConfig(bits=4, group_size=64, sym=True, lm_head=True, dynamic=PRESETS[preset])
    model = GPTQModel.load(str(src), config, device="cpu")
    calibration = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in _calibration(src, "random")
    ]
    model.quantize(calibration, batch_size=1)
    model.save(str(dst))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
