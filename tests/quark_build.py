"""Writes an AMD Quark copy of a test checkpoint the way its users make one: Quark's Llama template with a
scheme, `ModelQuantizer` calibrated on 16 rows of 64 token ids (`gptq_build._calibration`), frozen, then
`export_safetensors` in Hugging Face's form (run as a script, in its own process: `python quark_build.py
SRC DST PRESET`). PRESET: FP8 (scheme "fp8": E4M3 weights and static input scales per tensor, what the
"amd/...-FP8" downloads are), FP8_KV (the same with kv_cache_scheme "fp8": `k_proj.output_scale` and
`v_proj.output_scale`, "...-FP8-KV"), PTPC (scheme "ptpc_fp8": weights per channel, activations per
token as the model runs) or FP8_WO (E4M3 weights per tensor, inputs unquantized: a scheme of ours,
registered with `LLMTemplate.register_scheme`).

The oracle is transformers with Quark installed loading the export (`quant_method: quark`): `oracle.pt`
beside the checkpoint holds its logits for fixed prompts, its greedy tokens after some of them, and each
quantized projection's output for a fixed input.
"""

from __future__ import annotations

import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = (
    "torch",
    "transformers",
    "quark.torch",
    "quark.torch.quantization.config.config",
)

SCHEMES = {
    "FP8": ("fp8", None),
    "FP8_KV": ("fp8", "fp8"),
    "PTPC": ("ptpc_fp8", None),
    "FP8_WO": ("fp8_weight_only", None),
}


def build(src: Path, dst: Path, preset: str) -> None:
    import torch
    from gptq_build import _calibration
    from modelopt_build import oracle
    from quant_build import _is_pair, copy_tokenizer
    from quark.torch import LLMTemplate, ModelQuantizer, export_safetensors
    from transformers import AutoModelForCausalLM

    scheme, kv = SCHEMES[preset]
    if preset == "FP8_WO":
        from quark.torch.quantization.config.config import FP8E4M3PerTensorSpec, QLayerConfig

        weight = FP8E4M3PerTensorSpec(observer_method="min_max", scale_type="float", is_dynamic=False)
        LLMTemplate.register_scheme(scheme, config=QLayerConfig(weight=weight.to_quantization_spec()))
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    config = LLMTemplate.get("llama").get_config(scheme=scheme, kv_cache_scheme=kv)
    rows = torch.cat(_calibration(src, "pair" if _is_pair(src) else "random"))
    quantizer = ModelQuantizer(config)
    model = quantizer.freeze(quantizer.quantize_model(model, torch.utils.data.DataLoader(rows, batch_size=4)))
    with torch.no_grad():
        export_safetensors(
            model=model,
            output_dir=dst,
            custom_mode="quark",
            weight_format="real_quantized",
            pack_method="reorder",
        )
    copy_tokenizer(src, dst)
    oracle(AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval(), dst)


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
