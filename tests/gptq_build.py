"""Writes a GPTQ or AWQ copy of a test checkpoint with GPTQModel (run as a script, in its own process, so
its imports stay out of the test process): `python gptq_build.py SRC DST PRESET [pair]`.

PRESET: INT4 (GPTQ, 4-bit, symmetric, groups of 64 input columns), INT4_ACT (the same with desc_act,
act-order), INT8 (8-bit), INT4_ASYM (4-bit with zero points, sym: false), all in GPTQ's own format
(`checkpoint_format: gptq`); AWQ (AWQ's GEMM format, 4-bit, zero_point: false) and AWQ_ASYM (zero_point:
true, as AutoAWQ's checkpoints are). INT4_DYNAMIC and AWQ_DYNAMIC leave some projections in full
precision through GPTQModel's per-module `dynamic` overrides: layer 1's MLP and the o_proj of layers 1
to 3 (and tune down_proj's calibration, which changes nothing in the format). The calibration text is
16 sequences of 64 token ids drawn from a fixed seed, or with `pair` (for the packaged pair's target, whose tokenizer it needs) 16 windows of 64
tokens spread evenly over the pair's training split.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import);
# not gptqmodel, whose import starts threads (its worker pools), which a forked run would not have
PRELOAD = ("torch", "transformers")

# preset: (method, bits, act-order, symmetric)
PRESETS = {
    "INT4": ("gptq", 4, False, True),
    "INT4_ACT": ("gptq", 4, True, True),
    "INT8": ("gptq", 8, False, True),
    "INT4_ASYM": ("gptq", 4, False, False),
    "AWQ": ("awq", 4, False, True),
    "AWQ_ASYM": ("awq", 4, False, False),
    "INT4_DYNAMIC": ("gptq", 4, False, True),
    "AWQ_DYNAMIC": ("awq", 4, False, True),
}
DYNAMIC = {
    r"-:.*layers\.1\.mlp\..*": {},
    r"-:.*layers\.[1-3]\.self_attn\.o_proj": {},
    r"+:.*down_proj": {"damp_percent": 0.02},
}


def _calibration(src: Path, text: str):  # type: ignore[no-untyped-def]
    import json

    import torch

    if text == "pair":
        from ember_engine.tools import testmodel
        from ember_engine.tools.training import corpus_tokens

        added = json.loads((src / "tokenizer.json").read_text())["added_tokens"]
        eos = next(t["id"] for t in added if t["content"] == testmodel.EOS)
        train = corpus_tokens(src / "tokenizer.json", eos)[0]
        stride = (len(train) - 64) // 16
        return [train[i * stride : i * stride + 64].reshape(1, 64) for i in range(16)]
    g = torch.Generator().manual_seed(0)
    return list(torch.randint(3, 4000, (16, 1, 64), generator=g))


def build(src: Path, dst: Path, preset: str, text: str = "random") -> None:
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")  # its CPU pool wants two workers at least
    # Packed by its torch code, not its C++ packer, which it compiles at first use (a minute or more of a
    # fresh machine's two cores): the same bytes (compared on INT4).
    os.environ["GPTQMODEL_DISABLE_PACK_EXT"] = "1"
    src, dst = src.resolve(), dst.resolve()
    os.chdir(tempfile.mkdtemp())  # GPTQModel writes a log folder where it runs
    import torch
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.quantization.config import FORMAT, METHOD

    # GPTQModel's kernels compile their dequantization with torch.compile at first use, which took 5 to
    # 20 s of a run on a CPU for the same operations eagerly run (measured: the same logits, weights
    # and checkpoint bytes): eager here.
    torch._dynamo.config.disable = True

    method, bits, act_order, sym = PRESETS[preset]
    options: dict = {"quant_method": METHOD.AWQ, "format": FORMAT.GEMM} if method == "awq" else {}
    if preset.endswith("_DYNAMIC"):
        options["dynamic"] = DYNAMIC
    config = QuantizeConfig(bits=bits, group_size=64, desc_act=act_order, sym=sym, **options)
    model = GPTQModel.load(str(src), config, device="cpu")
    calibration = [
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in _calibration(src, text)
    ]
    model.quantize(calibration, batch_size=1)
    model.save(str(dst))


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), *sys.argv[3:5])
