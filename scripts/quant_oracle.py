"""ember against transformers + compressed-tensors on llm-compressor's checkpoints of the packaged trained
target, layer by layer and token by token, with the quality each scheme costs the oracle itself:

    python scripts/quant_oracle.py [WORKDIR] [DTYPE]

(DTYPE: float32, the default, or bfloat16: both models, quantized and not, run in it) writes FP8_DYNAMIC, W8A16 and FP8_BLOCK checkpoints of the target with `tests/quant_build.py` into WORKDIR (kept and
reused), then prints, per scheme:
- every projection fed the input the oracle's layer saw: the largest relative L2 difference of outputs,
  ember against the oracle and each against the exact product (float64 arithmetic on the checkpoint's
  quantized weights and scales, activations quantized per token in float64 for fp8);
- each decoder layer's output, ember against the oracle, on one 256-token held-out window (relative L2);
- logits over held-out windows: ember against the oracle, and each against its own full precision
  (largest and mean |difference|, teacher-forced argmax agreement);
- greedy agreement over 64 tokens on `ember bench quant`'s 32 prompts: the oracle against the oracle in
  full precision, ember against ember in full precision, and ember against the oracle;
and, for reference, ember's fp8 with only its weights or only its activations quantized, and the model
in bfloat16 and float16 against float32, by the same greedy measure.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from ember_engine import LLM, SamplingParams
from ember_engine.bench.quant import GEN_TOKENS, PROMPT_TOKENS, held_out
from ember_engine.model.model_runner import Chunk
from ember_engine.model.quant import schemes
from ember_engine.model.quant.fp8_linear import Fp8BlockLinear, Fp8Linear
from ember_engine.tools.spec_pair import packaged_pair

PRESETS = {"fp8": "FP8_DYNAMIC", "w8a16": "W8A16", "fp8-block": "FP8_BLOCK"}
WINDOW, WINDOWS, PROMPTS = 256, 6, 32
ATTN, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


def build(src: Path, workdir: Path, preset: str) -> Path:
    dst = workdir / f"target-{preset.lower()}"
    if not (dst / "config.json").exists():
        script = Path(__file__).resolve().parents[1] / "tests" / "quant_build.py"
        subprocess.run([sys.executable, str(script), str(src), str(dst), preset], check=True)
    return dst


DTYPE = sys.argv[2] if len(sys.argv) > 2 else "float32"


def oracle(path: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPE))


def engine(path: Path, **options: Any) -> LLM:
    return LLM(str(path), dtype=DTYPE, max_num_seqs=64, **options)


def exact(module: Any, x: torch.Tensor) -> torch.Tensor:
    """The projection's product in float64, from the weights and scales ember holds."""
    w = module.dequantized(torch.float32).double()
    x = x.double()
    if isinstance(module, Fp8Linear | Fp8BlockLinear):
        # per token (and group of the block's columns, block-scaled)
        g = module.group_size if isinstance(module, Fp8BlockLinear) else x.shape[-1]
        xg = x.reshape(*x.shape[:-1], -1, g)
        scale = xg.abs().amax(dim=-1, keepdim=True) / schemes.FP8_MAX
        xg = (xg / scale).clamp(-schemes.FP8_MAX, schemes.FP8_MAX).float().to(
            torch.float8_e4m3fn
        ).double() * scale
        x = xg.reshape(x.shape)
    return x @ w.t()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def projections(hf: Any, llm: LLM, seq: torch.Tensor) -> tuple[float, float, float]:
    """Each of ember's projections on the input the oracle's layer saw: the worst relative L2 difference,
    ember against the oracle, ember against the exact product, the oracle against it."""
    seen: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        for parent, names in ((layer.self_attn, ATTN), (layer.mlp, MLP)):
            for name in names:

                def keep(module: Any, args: Any, out: torch.Tensor, key: tuple[int, str] = (i, name)) -> None:
                    seen[key] = (args[0][0].clone(), out[0].clone())

                hooks.append(getattr(parent, name).register_forward_hook(keep))
    hf(seq[None])
    for hook in hooks:
        hook.remove()
    worst = [0.0, 0.0, 0.0]
    for i, layer in enumerate(llm.engine.runner.model.model.layers):
        for module, parts in (
            (layer.self_attn.qkv_proj, ATTN[:3]),
            (layer.self_attn.o_proj, ("o_proj",)),
            (layer.mlp.gate_up_proj, MLP[:2]),
            (layer.mlp.down_proj, ("down_proj",)),
        ):
            want = torch.cat([seen[(i, p)][1] for p in parts], dim=-1)
            x = seen[(i, parts[0])][0]
            got, ref = module(x), exact(module, x)
            for k, d in enumerate((rel(got, want), rel(got, ref), rel(want, ref))):
                worst[k] = max(worst[k], d)
    return worst[0], worst[1], worst[2]


def layer_outputs(hf: Any, llm: LLM, seq: torch.Tensor) -> list[float]:
    """Relative L2 difference of each decoder layer's output (the last is before the final norm)."""
    hidden = hf(seq[None], output_hidden_states=True).hidden_states
    got: dict[int, torch.Tensor] = {}
    layers = llm.engine.runner.model.model.layers

    def keep(i: int) -> Any:
        def hook(module: Any, args: Any, out: torch.Tensor) -> None:
            got[i] = out.clone()

        return hook

    hooks = [layer.register_forward_hook(keep(i)) for i, layer in enumerate(layers)]
    llm.engine.runner.forward([Chunk(list(range(len(seq) // 16 + 1)), 0, seq.tolist(), num_logits=1)])
    for hook in hooks:
        hook.remove()
    return [rel(got[i], hidden[i + 1][0]) for i in range(len(layers) - 1)]


def logits_ember(llm: LLM, windows: list[torch.Tensor]) -> torch.Tensor:
    runner = llm.engine.runner
    blocks = list(range(-(-WINDOW // runner.block_size)))
    out = [runner.forward([Chunk(blocks, 0, w.tolist(), num_logits=WINDOW)]) for w in windows]
    return torch.cat([x.float() for x in out if x is not None])


def logits_oracle(hf: Any, windows: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([hf(w[None]).logits[0].float() for w in windows])


def compare(a: torch.Tensor, b: torch.Tensor) -> str:
    d = (a - b).abs()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    return f"max |d| {d.max().item():.4f}, mean |d| {d.mean().item():.5f}, argmax agreement {agree:.4f}"


def greedy_ember(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def greedy_oracle(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    out = hf.generate(
        torch.tensor(prompts),
        max_new_tokens=GEN_TOKENS,
        min_new_tokens=GEN_TOKENS,
        do_sample=False,
        pad_token_id=hf.config.pad_token_id,
    )
    return out[:, len(prompts[0]) :].tolist()


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True)]
    return sum(x == y for x, y in pairs) / len(pairs)


def ablations(target: Path, prompts: list[list[int]], reference: list[list[int]]) -> None:
    """fp8 with only one side quantized, and whole-model 16-bit dtypes, against float32 greedy output."""
    full = {
        n: m.weight.detach()
        for n, m in engine(target).engine.runner.model.named_modules()
        if hasattr(m, "weight") and n.endswith("_proj")
    }
    scaled_mm = Fp8Linear.matmul
    try:
        Fp8Linear.matmul = lambda self, x: x @ self.dequantized(x.dtype).t()  # type: ignore[method-assign]
        weights_only = greedy_ember(engine(target, quantization="fp8"), prompts)
        llm = engine(target, quantization="fp8")
        for name, module in llm.engine.runner.model.named_modules():
            if isinstance(module, Fp8Linear):
                module.full_weight = full[name]

        def activations(self: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
            xq, scale = schemes.quantize_activation_fp8(x)
            return (xq.float() * scale).to(x.dtype) @ self.full_weight.t()

        Fp8Linear.matmul = activations  # type: ignore[method-assign]
        activations_only = greedy_ember(llm, prompts)
    finally:
        Fp8Linear.matmul = scaled_mm  # type: ignore[method-assign]
    print(
        f"fp8 weights only (activations unquantized): greedy agreement {agreement(weights_only, reference):.3f}"
    )
    print(
        f"fp8 activations only (weights unquantized): greedy agreement {agreement(activations_only, reference):.3f}"
    )
    for dtype in ("bfloat16", "float16"):
        out = greedy_ember(LLM(str(target), dtype=dtype, max_num_seqs=64), prompts)
        print(f"the whole model in {dtype} against float32: greedy agreement {agreement(out, reference):.3f}")


@torch.inference_mode()
def main() -> None:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "quant-oracle")
    workdir.mkdir(parents=True, exist_ok=True)
    target = packaged_pair()[0]
    text = held_out(target)
    windows = [text[w * WINDOW : (w + 1) * WINDOW] for w in range(WINDOWS)]
    stride = len(text) // (PROMPTS + 1)
    prompts = [text[i * stride : i * stride + PROMPT_TOKENS].tolist() for i in range(PROMPTS)]
    hf_full, llm_full = oracle(target), engine(target)
    ref_hf, ref_ember = logits_oracle(hf_full, windows), logits_ember(llm_full, windows)
    greedy_hf_full, greedy_ember_full = greedy_oracle(hf_full, prompts), greedy_ember(llm_full, prompts)
    print(
        f"full precision, ember against the oracle: logits {compare(ref_ember, ref_hf)}; "
        f"greedy agreement {agreement(greedy_ember_full, greedy_hf_full):.3f}"
    )
    for scheme, preset in PRESETS.items():
        path = build(target, workdir, preset)
        hf, llm = oracle(path), engine(path)
        print(f"\n{scheme} ({preset}, {path}, {DTYPE})")
        worst = projections(hf, llm, windows[0])
        print(
            f"  projections on the oracle's inputs, worst relative L2: ember against the oracle {worst[0]:.2e},"
            f" ember against the exact product {worst[1]:.2e}, the oracle against it {worst[2]:.2e}"
        )
        layers = " ".join(f"{d:.1e}" for d in layer_outputs(hf, llm, windows[0]))
        print(f"  decoder layer outputs, relative L2: {layers}")
        ours, theirs = logits_ember(llm, windows), logits_oracle(hf, windows)
        print(f"  logits, ember against the oracle:      {compare(ours, theirs)}")
        print(f"  logits, the oracle against full:       {compare(theirs, ref_hf)}")
        print(f"  logits, ember against full:            {compare(ours, ref_ember)}")
        g_hf, g_ember = greedy_oracle(hf, prompts), greedy_ember(llm, prompts)
        print(
            f"  greedy 64-token agreement: the oracle against its full precision {agreement(g_hf, greedy_hf_full):.3f},"
            f" ember against its full precision {agreement(g_ember, greedy_ember_full):.3f},"
            f" ember against the oracle {agreement(g_ember, g_hf):.3f}"
        )
    if DTYPE == "float32":  # the ablations compare with float32 output
        print()
        ablations(target, prompts, greedy_ember_full)


if __name__ == "__main__":
    main()
