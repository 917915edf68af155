"""llguidance against xgrammar on `ember bench serve --structured`'s schemas: schema compile time (p50/p99)
and the time to compute one token mask, on a given tokenizer.json or a byte-level BPE of VOCAB tokens
trained here on the standard library's sources.

    pip install xgrammar transformers   # xgrammar is not an ember dependency
    python scripts/compare_grammar_engines.py llguidance|xgrammar VOCAB [TOKENIZER_JSON]
"""

from __future__ import annotations

import json
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ember_engine.bench.schemas import SCHEMAS

ROUNDS, STEPS = 3, 30


def _utf8(path: Path) -> bool:
    try:
        path.read_text("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def train(vocab: int, out: str) -> str:
    if Path(out).exists():
        return out
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:2500]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in stdlib if _utf8(p)], trainer)
    tok.save(out)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _schemas() -> list[dict[str, Any]]:
    # A distinct description per round defeats any compile cache.
    return [{**s, "description": f"r{r}-{i}"} for r in range(ROUNDS) for i, s in enumerate(SCHEMAS)]


def _walk(allowed_of: Any, consume: Any, done: Any, masks: list[float]) -> None:
    """A path through the grammar: at each step the middle allowed token."""
    for _ in range(STEPS):
        t0 = time.perf_counter()
        bits = allowed_of()
        masks.append(time.perf_counter() - t0)
        allowed = np.flatnonzero(np.unpackbits(bits.view(np.uint8), bitorder="little"))
        if done() or not len(allowed) or not consume(int(allowed[len(allowed) // 2])) or done():
            return


def run_llguidance(path: str) -> tuple[float, list[float], list[float]]:
    import llguidance
    import llguidance.numpy

    t0 = time.perf_counter()
    lt = llguidance.LLTokenizer(path)
    init = time.perf_counter() - t0
    comp: list[float] = []
    masks: list[float] = []
    for schema in _schemas():
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        m = llguidance.LLMatcher(lt, grammar)
        comp.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
        bm = llguidance.numpy.allocate_token_bitmask(1, lt.vocab_size)

        def fill(m: Any = m, bm: Any = bm) -> Any:
            llguidance.numpy.fill_next_token_bitmask(m, bm, 0)
            return bm[0]

        _walk(fill, m.consume_token, m.is_stopped, masks)
    return init, comp, masks


def run_xgrammar(path: str) -> tuple[float, list[float], list[float]]:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|eos|>")
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=hf.vocab_size)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    init = time.perf_counter() - t0
    comp: list[float] = []
    masks: list[float] = []
    for schema in _schemas():
        t0 = time.perf_counter()
        m = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
        comp.append(time.perf_counter() - t0)
        bm = xgr.allocate_token_bitmask(1, info.vocab_size)

        def fill(m: Any = m, bm: Any = bm) -> Any:
            m.fill_next_token_bitmask(bm, 0)
            return bm[0].numpy()

        _walk(fill, m.accept_token, m.is_terminated, masks)
    return init, comp, masks


def main() -> None:
    engine, vocab = sys.argv[1], int(sys.argv[2])
    path = sys.argv[3] if len(sys.argv) > 3 else train(vocab, f"/tmp/bpe{vocab}.json")
    init, comp, masks = (run_llguidance if engine == "llguidance" else run_xgrammar)(path)
    result = {
        "engine": engine,
        "vocab": vocab,
        "tokenizer_init_ms": round(init * 1e3, 1),
        "compile_p50_ms": round(pct(comp, 0.5) * 1e3, 2),
        "compile_p99_ms": round(pct(comp, 0.99) * 1e3, 2),
        "mask_p50_us": round(pct(masks, 0.5) * 1e6, 1),
        "mask_p99_us": round(pct(masks, 0.99) * 1e6, 1),
        "compiles": len(comp),
        "masks": len(masks),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
