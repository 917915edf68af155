"""What GPTQModel's own loader dequantizes a GPTQ checkpoint to, per module (the per-module formats of
`dynamic` and a quantized LM head included), and what transformers computes with those weights: `python
gptq_mixed_oracle.py CKPT OUT PROMPTS`. Writes to OUT (torch.save) every quantized module's weight ([out,
in], float32: its scales widened before it dequantizes, so the products are exact), each prompt's logits
from a float32 transformers model holding those weights and the checkpoint's others, and 12 greedy tokens
after each prompt. PROMPTS is a JSON file of token-id lists. Run in its own process: GPTQModel's imports
patch transformers.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import);
# not gptqmodel, whose import starts threads (its worker pools), which a forked run would not have
PRELOAD = (
    "torch",
    "transformers",
    "safetensors.torch",
)

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def main(ckpt: str, out: str, prompts_file: str) -> None:
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    # GPTQModel's kernels compile their dequantization with torch.compile at first use, which took 5 to
    # 20 s of a run on a CPU for the same operations eagerly run (measured: the same logits, weights
    # and checkpoint bytes): eager here.
    torch._dynamo.config.disable = True

    ckpt, out, prompts_file = (str(Path(p).resolve()) for p in (ckpt, out, prompts_file))
    os.chdir(tempfile.mkdtemp())  # GPTQModel writes a log folder where it runs
    # GPTQModel's CPU kernels take float16 or bfloat16 only.
    quantized = GPTQModel.load(ckpt, device="cpu", dtype=torch.float16, backend=BACKEND.TORCH)
    layers = {n: m for n, m in quantized.model.named_modules() if hasattr(m, "qweight")}
    # Which way round the kernel gives its weight, told by a module that is not square.
    probe = next(m for m in layers.values() if m.in_features != m.out_features)
    flip = probe.dequantize_weight().shape[0] == probe.in_features
    weights = {}
    for name, module in layers.items():
        module.scales = module.scales.float()
        w = module.dequantize_weight()
        weights[name] = (w.t() if flip else w).float().contiguous()
    config = AutoConfig.from_pretrained(ckpt)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {n: t.float() for n, t in load_file(str(Path(ckpt) / "model.safetensors")).items()}
    state = {n: t for n, t in state.items() if n.rpartition(".")[0] not in weights}
    state |= {f"{n}.weight": w for n, w in weights.items()}
    model.load_state_dict(state, strict=not config.tie_word_embeddings)
    result: dict = {"weights": weights, "logits": [], "greedy": []}
    with torch.inference_mode():
        for p in json.loads(Path(prompts_file).read_text()):
            ids = torch.tensor([p])
            result["logits"].append(model(ids).logits[0].float())
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
            result["greedy"].append(gen[0, len(p) :].tolist())
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
