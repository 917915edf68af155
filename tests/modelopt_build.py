"""Writes a ModelOpt (NVIDIA Model Optimizer) copy of a test checkpoint the way its users make one:
`mtq.quantize` with a preset config, calibrated on 16 rows of 64 token ids (fixed random ones, or for
the packaged pair's target windows of its training split: `gptq_build._calibration`), then
`export_hf_checkpoint` (run as a script, in its own process: `python modelopt_build.py SRC DST PRESET`).

PRESET: FP8 (FP8_DEFAULT_CFG: E4M3 weights per tensor, static per-tensor input scales), FP8_PCPT
(FP8_PER_CHANNEL_PER_TOKEN_CFG), FP8_PB_WO (FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG: weights in tiles of 128 x 128,
activations as they are), FP8_KV (FP8 with FP8_KV_CFG's static K and V scales) or FP8_PARTIAL
(FP8 with layer 1's MLP and layer 0's o_proj left unquantized, which the export lists in its
`exclude_modules`), MIXED (FP8 on the attention projections but layer 3's o_proj, FP8_PB_WO's
block-scaled weights on the MLPs: ModelOpt exports MIXED_PRECISION, a `quantized_layers` entry a
projection), W4A16_NVFP4 (W4A16_NVFP4_CFG: FP4 weights in groups of 16 with E4M3 scales under a
scale per tensor, activations as they are) or NVFP4 (NVFP4_DEFAULT_CFG: those weights, and activations
quantized to NVFP4 as the model runs, under a calibrated global scale per projection), W8A16
(INT8_WEIGHT_ONLY_CFG: int8 weights per output channel, activations as they are) or W4A16_AWQ
(INT4_AWQ_CFG: int4 weights in groups of 128 after AWQ's smoothing, calibrated; the export packs two a
byte along the output and keeps a `pre_quant_scale` per input column where it cannot fold it into the
layer before), MXFP8 (MXFP8_DEFAULT_CFG: E4M3 weights under an E8M0 scale per group of 32, and
activations quantized the same way as the model runs), INT8_SQ (INT8_SMOOTHQUANT_CFG: SmoothQuant's
factors per input column, int8 weights per output channel, int8 activations under a calibrated scale
per projection; the export keeps the factors as `pre_quant_scale`) or W4A8_AWQ (W4A8_AWQ_BETA_CFG:
W4A16_AWQ's int4 weights, each then rounded to E4M3 under a scale per tensor, and FP8 activations under
a calibrated scale per projection), NVFP4_AWQ (NVFP4 after AWQ-style smoothing, see `_smooth`) or
W4A8_NVFP4 (W4A8_NVFP4_FP8_CFG: NVFP4's weights with FP8 activations under a calibrated scale per
projection). MXFP4 (MXFP4_DEFAULT_CFG: E2M1 weights under an E8M0 scale per group of 32, activations
quantized the same way), MXFP4_WO (MXFP4_MLP_WEIGHT_ONLY_CFG: those weights on the MLPs, activations as
they are) and W4A8_MXFP4 (W4A8_MXFP4_FP8_CFG: those weights, FP8 activations under a scale per tensor
taken as the model runs) are exported for the refusals ember gives them, with no oracle.

No library loads these checkpoints on a CPU, so the oracle is ModelOpt's own: for the FP8, W8A16,
W4A16_AWQ, INT8_SQ and W4A8_AWQ presets its simulated quantization (AWQ's and SmoothQuant's factors applied
to each input as it runs), the model the checkpoint was exported from (holding the exported weights, see
`_exported_weights`; W4A8_AWQ's as its two weight quantizers compute them); for W4A16_NVFP4 and NVFP4, whose simulation ModelOpt runs on CUDA only,
transformers' model holding the weights ModelOpt's `NVFP4QTensor` dequantizes from the export (W4A16_NVFP4's
weights need no calibration data, so none is run), and for NVFP4 each quantized projection's input
quantized by `NVFP4QTensor` too, under the exported `input_scale` (`_nvfp4_inputs`; for NVFP4_AWQ times its
`pre_quant_scale` first, the model holding the norms the export folded the other factors into); for
W4A8_NVFP4 the simulated model, whose FP8 input quantizers run on a CPU, holding the weights `NVFP4QTensor`
dequantizes (`_nvfp4_weights`); for MXFP8, whose
activations ModelOpt simulates on CUDA only too, the weights `MXFP8QTensor` dequantizes and each input
quantized and dequantized by `MXFP8QTensor` (`_mxfp8_inputs`). `oracle.pt` beside
the checkpoint holds that model's logits for fixed prompts, its greedy tokens after some of them, and
each quantized projection's output for a fixed input.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

# what a run imports, imported ahead by `script_server.py` (which serves many runs from one import)
PRELOAD = ("torch", "transformers", "safetensors.torch", "modelopt.torch.quantization")
PROMPTS, PROMPT_LENGTH, GREEDY_PROMPTS, GREEDY_TOKENS = 8, 40, 6, 12
PARTIAL = ["*layers.1.mlp*", "*layers.0.self_attn.o_proj*"]
# presets that are ModelOpt's configs as they are
CONFIGS = {
    "FP8_PCPT": "FP8_PER_CHANNEL_PER_TOKEN_CFG",
    "FP8_PB_WO": "FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",
    "W4A16_NVFP4": "W4A16_NVFP4_CFG",
    "NVFP4": "NVFP4_DEFAULT_CFG",
    "W8A16": "INT8_WEIGHT_ONLY_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "MXFP8": "MXFP8_DEFAULT_CFG",
    "INT8_SQ": "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
    "NVFP4_AWQ": "NVFP4_DEFAULT_CFG",  # then smoothed by `_smooth`
    "W4A8_NVFP4": "W4A8_NVFP4_FP8_CFG",
    "MXFP4": "MXFP4_DEFAULT_CFG",
    "MXFP4_WO": "MXFP4_MLP_WEIGHT_ONLY_CFG",
    "W4A8_MXFP4": "W4A8_MXFP4_FP8_CFG",
}
# presets ember refuses: exported only (their configs calibrate nothing), no oracle
REFUSED = ("MXFP4", "MXFP4_WO", "W4A8_MXFP4")


def _config(preset: str) -> dict:  # type: ignore[type-arg]
    """The preset's config, its rules (applied in order, a later one winning) extended for ours."""
    import modelopt.torch.quantization as mtq

    if preset in CONFIGS:
        return copy.deepcopy(getattr(mtq, CONFIGS[preset]))
    config = copy.deepcopy(mtq.FP8_DEFAULT_CFG)
    if preset == "FP8_KV":
        config["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    elif preset == "FP8_PARTIAL":
        config["quant_cfg"] += [{"quantizer_name": pattern, "enable": False} for pattern in PARTIAL]
    elif preset == "MIXED":
        blocks = {"num_bits": (4, 3), "axis": None, "block_sizes": {-1: 128, -2: 128}}
        config["quant_cfg"] += [
            {"quantizer_name": "*mlp*weight_quantizer", "cfg": blocks},
            {"quantizer_name": "*mlp*input_quantizer", "enable": False},
            {"quantizer_name": "*layers.3.self_attn.o_proj*", "enable": False},
        ]
    else:
        assert preset == "FP8", preset
    return config


def _exported_weights(model, dst: Path, simulated: dict | None = None) -> None:  # type: ignore[no-untyped-def,type-arg]
    """Give each quantized projection of the simulated model the weight its export holds (E4M3 values
    times their scales). The export divides a weight by its scale where the simulation multiplies by the
    scale's reciprocal, and the two can round a value at the midpoint of two E4M3 steps apart (measured:
    one weight in 600,000, which moves every token's output of its projection); the simulation then
    quantizes these values back to themselves (times the reciprocal's reciprocal: to within a float32
    rounding)."""
    import torch
    from safetensors.torch import load_file

    stored = load_file(str(dst / "model.safetensors"))
    for name, module in model.named_modules():
        if f"{name}.weight_scale" not in stored:
            continue
        weight, scale = stored[f"{name}.weight"], stored[f"{name}.weight_scale"].float()
        if f"{name}.weight_scale_2" in stored:  # W4A8_AWQ: its two weight quantizers' product
            module.weight.data = _w4a8_weight(weight, scale, stored[f"{name}.weight_scale_2"].float())
            if f"{name}.pre_quant_scale" in stored:  # not re-smoothed by the export: the simulation's weight
                assert torch.allclose(module.weight.data, simulated[name], rtol=1e-6, atol=0), name
            module.weight_quantizer.disable()  # applied twice, the two are not idempotent
            continue
        if weight.dtype == torch.uint8:  # int4 two a byte along the output, a scale per group of 128
            nibbles = torch.stack([weight & 15, weight >> 4], dim=1).reshape(-1, weight.shape[1])
            weight = nibbles.to(torch.int8) - 16 * (nibbles >= 8).to(torch.int8)
            scale = scale.repeat_interleave(128, dim=1)
        elif scale.dim() == 4:  # [row tiles, 1, column tiles, 1] of 128 x 128
            scale = scale[:, 0, :, 0].repeat_interleave(128, 0).repeat_interleave(128, 1)
            scale = scale[: weight.shape[0], : weight.shape[1]]
        else:
            scale = scale.reshape(-1, 1) if scale.numel() > 1 else scale
        module.weight.data = weight.float() * scale
        with torch.inference_mode():
            again = module.weight_quantizer(module.weight)
        assert torch.allclose(again, module.weight, rtol=1e-6, atol=0), name


def _w4a8_weight(packed, scale, outer):  # type: ignore[no-untyped-def]
    """W4A8_AWQ's exported weight as the weight ModelOpt's simulation computes with: its int4 values (two a
    byte along the output) times their group's scale, rounded to E4M3 under `weight_scale_2` (the second of
    its two weight quantizers), times that scale."""
    import torch

    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1, packed.shape[1])
    values = (nibbles.to(torch.int8) - 16 * (nibbles >= 8).to(torch.int8)).float()
    fp8 = (values * scale.repeat_interleave(128, dim=1) / outer).clamp(-448, 448).to(torch.float8_e4m3fn)
    return fp8.float() * outer


def _simulated_weights(model) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Each quantized projection's weight as the simulation computes with it (before the export packs the
    model's weights in place)."""
    import torch

    with torch.inference_mode():
        return {
            name: module.weight_quantizer(module.weight).clone()
            for name, module in model.named_modules()
            if getattr(module, "weight_quantizer", None) is not None and module.weight_quantizer.is_enabled
        }


def _input_maxima(model, calibrate) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Each projection's largest input magnitude per column over the calibration rows."""
    import torch

    maxima: dict = {}  # type: ignore[type-arg]

    def hook(name: str):  # type: ignore[no-untyped-def]
        def record(module, args):  # type: ignore[no-untyped-def]
            m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(0)
            maxima[name] = torch.maximum(maxima[name], m) if name in maxima else m

        return record

    handles = [
        module.register_forward_pre_hook(hook(name))
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name.startswith("model.layers.")
    ]
    with torch.no_grad():
        calibrate(model)
    for handle in handles:
        handle.remove()
    return maxima


def _smooth(model, maxima: dict, calibrate) -> None:  # type: ignore[no-untyped-def,type-arg]
    """AWQ's smoothing set by hand (its search runs NVFP4's simulation, which ModelOpt has on CUDA only):
    each projection's weight columns times sqrt(max|x|), its input quantizer's `pre_quant_scale` the
    reciprocal, then every amax calibrated again. The export writes NVFP4_AWQ, folding the factors into
    the norms before q/k/v and gate/up (and down's into up's rows) and keeping o's as `pre_quant_scale`."""
    import modelopt.torch.quantization as mtq
    import torch

    for name, module in model.named_modules():
        if name in maxima:
            factors = maxima[name].clamp(min=1e-2).sqrt()
            with torch.no_grad():
                module.weight.mul_(factors)
            module.input_quantizer.pre_quant_scale = 1 / factors
    mtq.calibrate(model, algorithm="max", forward_loop=calibrate)


def _nvfp4_model(src: Path, dst: Path):  # type: ignore[no-untyped-def]
    """transformers' model of `src` holding, for each projection the export quantized, the weight
    ModelOpt's NVFP4QTensor dequantizes from the exported tensors (in float32)."""
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    stored = load_file(str(dst / "model.safetensors"))
    own = model.state_dict()
    # what the export changed besides the projections: the norms it folded smoothing into
    with torch.no_grad():
        for key, value in stored.items():
            if key in own and value.dtype == own[key].dtype and value.shape == own[key].shape:
                own[key].copy_(value)
    for name in _quantized(stored):
        module = model.get_submodule(name)
        packed = NVFP4QTensor(module.weight.shape, torch.float32, stored[f"{name}.weight"])
        module.weight.data = packed.dequantize(
            scale=stored[f"{name}.weight_scale"],
            double_scale=stored[f"{name}.weight_scale_2"],
            block_sizes={-1: 16},
        )
    return model


def _nvfp4_weights(model, dst: Path) -> None:  # type: ignore[no-untyped-def]
    """W4A8_NVFP4: the simulated model (whose FP8 input quantizers run on a CPU) holding the weights
    `NVFP4QTensor` dequantizes from the export, its NVFP4 weight quantizers (CUDA only) disabled."""
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors.torch import load_file

    stored = load_file(str(dst / "model.safetensors"))
    for name in _quantized(stored):
        module = model.get_submodule(name)  # the export left the packed bytes in its weight
        shape = torch.Size([module.out_features, module.in_features])
        packed = NVFP4QTensor(shape, torch.float32, stored[f"{name}.weight"])
        scale = stored[f"{name}.weight_scale"]
        module.weight.data = packed.dequantize(
            scale=scale,
            double_scale=stored[f"{name}.weight_scale_2"],
            block_sizes={-1: module.in_features // scale.shape[1]},  # groups of 32 (its config's)
        )
        module.weight_quantizer.disable()


def _nvfp4_inputs(model, dst: Path) -> None:  # type: ignore[no-untyped-def]
    """Quantize each exported NVFP4 projection's input to NVFP4 and back as ModelOpt's `NVFP4QTensor`
    quantizes a tensor (per group of 16 columns an E4M3 scale of the group's max|x| / 6 under the global
    scale, each value rounded to E2M1), its global scale the exported `input_scale`; first times the
    exported `pre_quant_scale`, where there is one (NVFP4_AWQ)."""
    import torch
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
    from safetensors.torch import load_file

    stored = load_file(str(dst / "model.safetensors"))

    def hook(global_scale: torch.Tensor, smooth: torch.Tensor | None):  # type: ignore[no-untyped-def]
        def quantize(module, args):  # type: ignore[no-untyped-def]
            x = args[0] if smooth is None else args[0] * smooth
            flat = x.reshape(-1, x.shape[-1]).float()
            packed, scale, double = NVFP4QTensor.quantize(flat, 16, weights_scaling_factor_2=global_scale)
            flat = packed.dequantize(
                dtype=torch.float32, scale=scale, double_scale=double, block_sizes={-1: 16}
            )
            return (flat.reshape(x.shape).to(x.dtype), *args[1:])

        return quantize

    for name in _quantized(stored):
        scale = stored[f"{name}.input_scale"].float()
        smooth = stored.get(f"{name}.pre_quant_scale")
        model.get_submodule(name).register_forward_pre_hook(hook(scale, smooth))


def _mxfp8_model(src: Path, dst: Path):  # type: ignore[no-untyped-def]
    """transformers' model of `src` holding, for each exported MXFP8 projection, the weight ModelOpt's
    `MXFP8QTensor` dequantizes, and quantizing its input by `MXFP8QTensor` (a scale per group of 32
    from the group's largest magnitude) and back."""
    import torch
    from modelopt.torch.quantization.qtensor.mxfp8_tensor import MXFP8QTensor
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    stored = load_file(str(dst / "model.safetensors"))

    def quantize(module, args):  # type: ignore[no-untyped-def]
        x = args[0]
        packed, scale = MXFP8QTensor.quantize(x.float())
        return (packed.dequantize(dtype=torch.float32, scale=scale).to(x.dtype), *args[1:])

    for name in _quantized(stored):
        module = model.get_submodule(name)
        packed = MXFP8QTensor(module.weight.shape, torch.float32, stored[f"{name}.weight"])
        module.weight.data = packed.dequantize(dtype=torch.float32, scale=stored[f"{name}.weight_scale"])
        module.register_forward_pre_hook(quantize)
    return model


def _quantized(stored: dict) -> list[str]:  # type: ignore[type-arg]
    return [name.removesuffix(".weight_scale") for name in stored if name.endswith(".weight_scale")]


def _probes(model, names: list[str]) -> dict:  # type: ignore[no-untyped-def,type-arg]
    """Each quantized projection's output for a fixed input of 5 tokens: {name: (input, output)}."""
    import torch

    gen = torch.Generator().manual_seed(3)
    probes = {}
    with torch.inference_mode():
        for name in sorted(names):
            module = model.get_submodule(name)
            x = torch.randn(1, 5, module.in_features, generator=gen) * 2
            probes[name] = (x[0], module(x)[0])
    return probes


def build(src: Path, dst: Path, preset: str) -> None:
    import modelopt.torch.quantization as mtq
    import torch
    from gptq_build import _calibration
    from modelopt.torch.export import export_hf_checkpoint
    from quant_build import _is_pair, copy_tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    rows = _calibration(src, "pair" if _is_pair(src) else "random")

    def calibrate(m: torch.nn.Module) -> None:
        for row in rows:
            m(row)

    # MXFP8's inputs: no calibration, on CUDA only; the refused presets calibrate nothing
    weight_only = preset in ("W4A16_NVFP4", "W8A16", "MXFP8", *REFUSED)
    maxima = _input_maxima(model, calibrate) if preset == "NVFP4_AWQ" else {}
    model = mtq.quantize(model, _config(preset), forward_loop=None if weight_only else calibrate)
    if maxima:
        _smooth(model, maxima, calibrate)
    simulated = _simulated_weights(model) if preset == "W4A8_AWQ" else None
    export_hf_checkpoint(model, export_dir=dst)
    copy_tokenizer(src, dst)
    if preset in REFUSED:
        return
    if preset == "MXFP8":
        model = _mxfp8_model(src, dst)
    elif preset == "W4A8_NVFP4":
        _nvfp4_weights(model, dst)
    elif preset in ("W4A16_NVFP4", "NVFP4", "NVFP4_AWQ"):
        model = _nvfp4_model(src, dst)
        if preset != "W4A16_NVFP4":
            _nvfp4_inputs(model, dst)
    else:
        _exported_weights(model, dst, simulated)
    oracle(model, dst)


def oracle(model, dst: Path) -> None:  # type: ignore[no-untyped-def]
    """`dst/oracle.pt`: `model`'s logits for 8 fixed prompts, its greedy tokens after 6 of them, and each
    projection the export at `dst` quantized (a `weight_scale`) given a fixed input."""
    import torch
    from safetensors.torch import load_file

    prompts = fixed_prompts(PROMPT_LENGTH)
    logits, greedy = answers(model, prompts)
    probes = _probes(model, _quantized(load_file(str(dst / "model.safetensors"))))
    torch.save({"prompts": prompts, "logits": logits, "greedy": greedy, "probes": probes}, dst / "oracle.pt")


def fixed_prompts(length: int) -> list[list[int]]:
    """8 prompts of token ids, `length` to `length` + 7 long, the same every run."""
    import torch

    gen = torch.Generator().manual_seed(7)
    return [torch.randint(10, 4000, (length + i,), generator=gen).tolist() for i in range(PROMPTS)]


def answers(model, prompts: list[list[int]]) -> tuple[list, list[list[int]]]:  # type: ignore[no-untyped-def]
    """A transformers model's float32 logits for each prompt, and its greedy tokens after the first 6."""
    import torch

    with torch.inference_mode():
        logits = [model(torch.tensor([p])).logits[0].float() for p in prompts]
        greedy = []
        for p in prompts[:GREEDY_PROMPTS]:
            ids = model.generate(
                torch.tensor([p]),
                max_new_tokens=GREEDY_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            greedy.append(ids[0, len(p) :].tolist())
    return logits, greedy


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
