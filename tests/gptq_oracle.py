"""What transformers + GPTQModel compute on a GPTQ checkpoint, run in its own process (GPTQModel's
imports patch transformers): `python gptq_oracle.py CKPT OUT PROMPTS`. Writes to OUT (torch.save) each
prompt's logits (float32 model), 12 greedy tokens after each prompt, and every projection's weight as
GPTQModel dequantizes it ([out, in], the checkpoint's column order), by module name. PROMPTS is a JSON
file of token-id lists.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import);
# not gptqmodel, whose import starts threads (its worker pools), which a forked run would not have
PRELOAD = (
    "torch",
    "transformers",
    "safetensors.torch",
)

os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")


def _leave_out(model, ckpt: Path) -> None:  # type: ignore[no-untyped-def]
    """transformers' GPTQ and AWQ loading (5.17 with GPTQModel 7.7) ignores the config's `dynamic`: every
    projection becomes a quantized layer, the ones the checkpoint holds in full precision left
    uninitialized. Those GPTQModel's own rule (`dynamic_get`) leaves out get their checkpoint weights
    back, as GPTQModel's loader gives them (whose CPU kernels take no float32 model)."""
    import torch
    from gptqmodel.quantization.config import dynamic_get
    from safetensors.torch import load_file

    dynamic = json.loads((ckpt / "config.json").read_text())["quantization_config"].get("dynamic")
    if not dynamic:
        return
    state = load_file(str(ckpt / "model.safetensors"))
    for name, module in list(model.named_modules()):
        if hasattr(module, "qweight") and dynamic_get(dynamic, name) is False:
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=False)
            linear.weight.data = state[f"{name}.weight"].float()
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, linear)


def _dequantized(module):  # type: ignore[no-untyped-def]
    """A layer's weight as GPTQModel's kernel multiplies by it: its torch AWQ kernel has no
    `dequantize_weight`, and multiplies by what GPTQModel's AWQ dequantization (`dequantize_gemm`) gives."""
    if hasattr(module, "dequantize_weight"):
        return module.dequantize_weight()
    from gptqmodel.quantization.awq.utils.packing_utils import dequantize_gemm

    return dequantize_gemm(module.qweight, module.qzeros, module.scales, module.bits, module.group_size)


def main(ckpt: str, out: str, prompts_file: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AwqConfig, GPTQConfig

    # GPTQModel's kernels compile their dequantization with torch.compile at first use, which took 5 to
    # 20 s of a run on a CPU for the same operations eagerly run (measured: the same logits, weights
    # and checkpoint bytes): eager here.
    torch._dynamo.config.disable = True

    # GPTQModel's torch kernels, on every machine: by default it picks by the CPU (on one with AVX-512
    # BF16, a C++ kernel it compiles at first use, minutes of a fresh machine's two cores). transformers
    # takes only the loading attributes (the backend) from this config; the rest is the checkpoint's.
    method = json.loads((Path(ckpt) / "config.json").read_text())["quantization_config"]["quant_method"]
    kernel = (
        GPTQConfig(bits=4, backend="torch") if method == "gptq" else AwqConfig(bits=4, backend="torch_awq")
    )
    model = AutoModelForCausalLM.from_pretrained(
        ckpt, device_map="cpu", dtype=torch.float32, quantization_config=kernel
    )
    _leave_out(model, Path(ckpt))
    prompts = json.loads(Path(prompts_file).read_text())
    result: dict = {"logits": [], "greedy": [], "weights": {}}
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            result["logits"].append(model(ids).logits[0].float())
            gen = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
            result["greedy"].append(gen[0, len(p) :].tolist())
        layers = {n: m for n, m in model.named_modules() if hasattr(m, "qweight")}
        # Which way round the kernel gives its weight, told by a projection that is not square.
        probe = next(m for m in layers.values() if m.in_features != m.out_features)
        flip = _dequantized(probe).shape[0] == probe.in_features
        for name, module in layers.items():
            w = _dequantized(module)
            result["weights"][name] = (w.t() if flip else w).contiguous()
    result["kernel"] = type(model.model.layers[0].mlp.down_proj).__name__
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
