"""Where a weight scheme changes greedy tokens, on `ember bench quant`'s 32 prompts:

    python scripts/quant_margins.py [MODEL] [SCHEMES]

(MODEL: a checkpoint sharing the packaged pair's tokenizer, by default the packaged target; SCHEMES:
comma-separated, default fp8,w8a16). Full precision's own 64-token greedy continuations are run
teacher-forced through full precision and through each scheme; printed: the share of positions whose
top-two logit gap is under 0.05 and 0.2, then per scheme the share of positions where its argmax differs,
how far it moves the logits (median over positions of the standard deviation over the vocabulary of the
change, less its mean), the gaps where it picked another token, its greedy agreement over the 64 tokens,
and where each prompt's free-running output first differs (64: never).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from ember_engine import LLM, SamplingParams
from ember_engine.bench.quant import GEN_TOKENS, first_difference, held_out, prompts_from
from ember_engine.model.model_runner import Chunk
from ember_engine.tools.spec_pair import packaged_pair

PROMPTS = 32


def logits(llm: LLM, seqs: list[list[int]]) -> list[torch.Tensor]:
    """The last GEN_TOKENS positions' logits of each sequence, teacher-forced."""
    runner = llm.engine.runner
    out = []
    for seq in seqs:
        blocks = list(range(-(-len(seq) // runner.block_size)))
        got = runner.forward([Chunk(blocks, 0, seq, num_logits=GEN_TOKENS)])
        assert got is not None
        out.append(got)
    return out


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=GEN_TOKENS, ignore_eos=True)
    return [list(o.token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def main() -> None:
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else packaged_pair()[0]
    schemes = (sys.argv[2] if len(sys.argv) > 2 else "fp8,w8a16").split(",")
    text = held_out(model)
    prompts = prompts_from(text, PROMPTS)
    full = LLM(str(model), num_kv_blocks=64)
    base = greedy(full, prompts)
    seqs = [p + g[:-1] for p, g in zip(prompts, base, strict=True)]
    ref = logits(full, seqs)
    top2 = torch.cat([x.topk(2).values for x in ref])
    gaps = top2[:, 0] - top2[:, 1]
    print(
        f"{model}: top-two gap < 0.05 at {(gaps < 0.05).float().mean():.4f} of positions, < 0.2 at {(gaps < 0.2).float().mean():.4f}"
    )
    for scheme in schemes:
        llm = LLM(str(model), quantization=scheme, num_kv_blocks=64)
        got = logits(llm, seqs)
        flips = torch.cat([(a.argmax(-1) != b.argmax(-1)) for a, b in zip(ref, got, strict=True)])
        noise = torch.cat(
            [(b - a).sub((b - a).mean(-1, keepdim=True)).std(-1) for a, b in zip(ref, got, strict=True)]
        )
        outs = greedy(llm, prompts)
        agree = sum(a == b for x, y in zip(base, outs, strict=True) for a, b in zip(x, y, strict=True))
        differ = [first_difference(x, y) for x, y in zip(base, outs, strict=True)]
        firsts = [GEN_TOKENS if f is None else f for f in differ]
        print(
            f"{scheme}: another argmax at {flips.float().mean():.4f} of positions, logit change {noise.median():.4f},"
            f" largest gap where it did {gaps[flips].max().item() if flips.any() else 0.0:.4f};"
            f" greedy agreement {agree / (GEN_TOKENS * PROMPTS):.3f}; first differences {sorted(firsts)}"
        )


if __name__ == "__main__":
    main()
