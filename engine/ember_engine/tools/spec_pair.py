"""A trained target/draft pair for speculative decoding: a deep, narrow Llama and a one-layer Llama that
imitates it, both trained on CPU in a few minutes on the Python standard library's own sources.

Random-weight checkpoints (`testmodel`) agree with each other only by chance, so a draft built that way
is almost never accepted. Here the target learns the corpus first; the draft then learns the *target*
(distillation: the target's next-token distribution is its label), so the draft's guesses are the
target's guesses as often as a one-layer model can manage. The held-out top-1 agreement between the two
is written to `training.json`: it estimates the acceptance rate of greedy speculative decoding.

This module holds the pair's sizes and settings, the builder (`make_spec_pair`, `ember make-spec-pair`)
and where the committed pair lives; the training model and loops are in `training`. Everything is seeded
and the data order is fixed: the same code on the same machine writes byte-identical weights.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ember_engine.tools import testmodel
from ember_engine.tools.training import (
    DRAFT_LM_WEIGHT,
    EVAL_SEQ_LEN,
    Log,
    TrainingLlama,
    TrainSettings,
    corpus_tokens,
    evaluate,
    train_draft,
    train_target,
)

# The committed pair, shipped as package data: `target/` and `draft/`, each a Hugging Face checkpoint.
PACKAGED_DIR = Path(__file__).parent.parent / "models" / "spec_pair"

TARGET_SIZE = testmodel.ModelSize(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=12,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
DRAFT_SIZE = testmodel.ModelSize(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)

TARGET_TRAINING = TrainSettings(
    steps=800, tokens_per_step=512, seq_len=64, long_seq_len=256, long_steps=200, lr=2e-3, warmup=20, seed=1
)
DRAFT_TRAINING = TrainSettings(
    steps=350, tokens_per_step=1024, seq_len=128, long_seq_len=512, long_steps=100, lr=3e-3, warmup=20, seed=2
)
THREADS = 2  # fixed: how CPU kernels split a sum can depend on the thread count


def packaged_pair() -> tuple[Path, Path]:
    """The committed (target, draft) checkpoint directories."""
    target, draft = PACKAGED_DIR / "target", PACKAGED_DIR / "draft"
    for path in (target, draft):
        if not (path / "model.safetensors").exists():
            raise FileNotFoundError(
                f"no speculative-decoding checkpoint at {path}: run `ember make-spec-pair` to train the pair"
            )
    return target, draft


def _write_checkpoint(
    directory: Path, model: TrainingLlama, config: dict[str, Any], tokenizer_dir: Path, ids: dict[str, int]
) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(tokenizer_dir / name, directory / name)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {
        "bos_token_id": ids[testmodel.BOS],
        "eos_token_id": [ids[testmodel.EOS], ids["<|end|>"]],
        "do_sample": False,
    }
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)  # readable like the other files


def _dir_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def trained_target(
    config: dict[str, Any], train: torch.Tensor, log: Log = None
) -> tuple[TrainingLlama, float]:
    """A target of `config` trained on `train` with the pair's target recipe, and its final loss."""
    torch.manual_seed(TARGET_TRAINING.seed)
    model = TrainingLlama(config)
    model.init_weights(torch.Generator().manual_seed(TARGET_TRAINING.seed))
    return model, train_target(model, train, TARGET_TRAINING, log)


def make_spec_pair(out: Path, force: bool = False, log: Log = None) -> tuple[Path, Path]:
    """Train the pair and write `out/target`, `out/draft` and `out/training.json` (settings, losses,
    agreement, sizes, timings); refuses to replace an existing pair unless force."""
    out = Path(out)
    target_dir, draft_dir = out / "target", out / "draft"
    existing = [p for p in (target_dir, draft_dir, out / "training.json") if p.exists()]
    if existing and not force:
        raise FileExistsError(f"{out} already holds a pair (use --force to overwrite)")

    start = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    try:
        staging = out.with_name(out.name + ".partial")
        if staging.exists():
            shutil.rmtree(staging)
        tok_dir = staging / "tokenizer"
        tok_dir.mkdir(parents=True)
        ids = testmodel.write_tokenizer(tok_dir)
        train, held_out, held_out_names = corpus_tokens(tok_dir / "tokenizer.json", ids[testmodel.EOS])
        tokenizer_s = time.perf_counter() - start

        target_config = testmodel.llama_config(TARGET_SIZE, ids, tie_word_embeddings=True)
        draft_config = testmodel.llama_config(DRAFT_SIZE, ids, tie_word_embeddings=True)

        t0 = time.perf_counter()
        target, target_train_loss = trained_target(target_config, train, log)
        target_s = time.perf_counter() - t0

        torch.manual_seed(DRAFT_TRAINING.seed)
        draft = TrainingLlama(draft_config)
        draft.init_weights(torch.Generator().manual_seed(DRAFT_TRAINING.seed))
        _init_draft_from_target(draft, target)
        t0 = time.perf_counter()
        draft_train_loss = train_draft(draft, target, train, DRAFT_TRAINING, log)
        draft_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        held = evaluate(target, draft, held_out)
        eval_s = time.perf_counter() - t0

        _write_checkpoint(staging / "target", target, target_config, tok_dir, ids)
        _write_checkpoint(staging / "draft", draft, draft_config, tok_dir, ids)
        shutil.rmtree(tok_dir)
        report = {
            "threads": THREADS,
            "torch": torch.__version__,
            "corpus": {
                "files": len(testmodel.corpus_files()),
                "train_tokens": len(train),
                "held_out_tokens": len(held_out),
                "held_out_files": held_out_names,
            },
            "target": {
                "size": asdict(TARGET_SIZE),
                "parameters": target.num_parameters(),
                "training": asdict(TARGET_TRAINING),
                "train_loss": round(target_train_loss, 4),
                "held_out_loss": round(held["target_loss"], 4),
                "train_seconds": round(target_s, 1),
                "bytes": _dir_bytes(staging / "target"),
            },
            "draft": {
                "size": asdict(DRAFT_SIZE),
                "parameters": draft.num_parameters(),
                "training": asdict(DRAFT_TRAINING),
                "lm_loss_weight": DRAFT_LM_WEIGHT,
                "train_loss": round(draft_train_loss, 4),
                "held_out_loss": round(held["draft_loss"], 4),
                "train_seconds": round(draft_s, 1),
                "bytes": _dir_bytes(staging / "draft"),
            },
            # The fraction of held-out positions where the draft's argmax is the target's argmax.
            "held_out_agreement": round(held["agreement"], 4),
            "eval_seq_len": EVAL_SEQ_LEN,
            "tokenizer_seconds": round(tokenizer_s, 1),
            "eval_seconds": round(eval_s, 1),
            "wall_seconds": round(time.perf_counter() - start, 1),
        }
        (staging / "training.json").write_text(json.dumps(report, indent=2) + "\n")
        out.mkdir(parents=True, exist_ok=True)
        for name in ("target", "draft", "training.json"):
            dest = out / name
            if dest.is_dir():
                shutil.rmtree(dest)
            elif dest.exists():
                dest.unlink()
            (staging / name).replace(dest)
        staging.rmdir()
    finally:
        torch.set_num_threads(threads)
    return target_dir, draft_dir


@torch.no_grad()
def _init_draft_from_target(draft: TrainingLlama, target: TrainingLlama) -> None:
    """Start the draft from the target's embeddings, final norm and first layer: it begins in the
    target's representation space instead of learning one from scratch."""
    d_state, t_state = draft.state_dict(), target.state_dict()
    for name, tensor in d_state.items():
        if name in t_state and t_state[name].shape == tensor.shape:
            tensor.copy_(t_state[name])


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`ember make-spec-pair`."""
    p.add_argument("dir", nargs="?", help="output directory (default: the pair packaged with ember)")
    p.add_argument("--force", action="store_true", help="overwrite an existing pair")


def main(args: argparse.Namespace) -> int:
    out = Path(args.dir) if args.dir else PACKAGED_DIR
    try:
        target, draft = make_spec_pair(out, force=args.force, log=print)
    except FileExistsError as exc:
        print(f"ember make-spec-pair: {exc}", file=sys.stderr)
        return 1
    r = json.loads((out / "training.json").read_text())
    for name, path in (("target", target), ("draft", draft)):
        m = r[name]
        print(
            f"{name}: {path} ({m['size']['num_hidden_layers']} layers, {m['parameters']:,} parameters, "
            f"{m['bytes'] / 1e6:.1f} MB) train loss {m['train_loss']:.3f}, held-out loss {m['held_out_loss']:.3f}"
        )
    print(f"held-out top-1 agreement (draft == target): {r['held_out_agreement']:.3f}")
    total = (r["target"]["bytes"] + r["draft"]["bytes"]) / 1e6
    print(f"total {total:.1f} MB on disk; trained in {r['wall_seconds']:.0f} s")
    return 0
