"""Trains a target like the packaged pair's, but with every matrix a whole number of GGUF's 256-value K
blocks (hidden size 256, MLP 768), so that K-quant files of a trained model can be measured
(`ember bench quant`): `python scripts/wide_target.py OUT` writes the checkpoint to OUT (under 2 minutes
on 2 CPU cores). Same tokenizer, corpus and training recipe as the pair's target (`ember make-spec-pair`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ember_engine.tools import testmodel
from ember_engine.tools.spec_pair import _write_checkpoint, trained_target
from ember_engine.tools.training import corpus_tokens

SIZE = testmodel.ModelSize(256, 768, 6, 4, 2, 2048)


def main(out: Path) -> None:
    torch.set_num_threads(2)
    tok_dir = out.with_name(out.name + ".tokenizer")
    tok_dir.mkdir(parents=True, exist_ok=True)
    ids = testmodel.write_tokenizer(tok_dir)
    train, _, _ = corpus_tokens(tok_dir / "tokenizer.json", ids[testmodel.EOS])
    config = testmodel.llama_config(SIZE, ids, tie_word_embeddings=True)
    start = time.perf_counter()
    model, loss = trained_target(config, train, print)
    print(f"trained in {time.perf_counter() - start:.0f} s, final loss {loss:.3f}")
    _write_checkpoint(out, model, config, tok_dir, ids)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
