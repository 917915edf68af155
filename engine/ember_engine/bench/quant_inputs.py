"""`ember bench quant`'s inputs, each checked before the first row is measured (a row takes minutes with
the defaults): the schemes, the --checkpoint rows (each a checkpoint of --model that ember runs), the
model, the held-out windows asked for and where the JSON goes."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ember_engine.core.config import is_gguf

WINDOW = 512  # tokens a perplexity window scores

# What makes two checkpoints the same model for these rows, compared position by position.
_SHAPE = (
    "architectures",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


def checked_schemes(text: str) -> list[str]:
    """--schemes as names of online quantization (spaces around a name allowed); an unknown one is refused
    by name before anything is measured."""
    from ember_engine.core.config import QUANT_SCHEMES

    schemes = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in schemes if s not in QUANT_SCHEMES]
    if unknown:
        names = ", ".join(repr(s) for s in unknown)
        raise SystemExit(f"--schemes: unknown {names}; choose from {', '.join(QUANT_SCHEMES)}")
    return schemes


def _config_of(label: str, path: str) -> dict[str, Any]:
    """The config of a --checkpoint: a directory's config.json, or the one a GGUF file's metadata makes."""
    from ember_engine.model import gguf

    if is_gguf(path):
        try:
            return gguf.read_config(gguf.reader_of(Path(path)), Path(path))
        except (OSError, gguf.GGUFError) as e:  # not there, not a GGUF file, a model ember does not run
            raise SystemExit(f"--checkpoint {label}: {e}") from e
    config = Path(path) / "config.json"
    if not config.is_file():
        raise SystemExit(f"--checkpoint {label}: {path} has no config.json")
    return dict(json.loads(config.read_text()))


def checked_checkpoints(specs: list[str], model: Path) -> list[tuple[str, Path]]:
    """--checkpoint LABEL=PATH rows: each PATH a checkpoint directory or GGUF file of `model`'s shape (its
    rows are compared with the model's token by token), refused by name otherwise, before anything is
    measured."""
    if not (model / "config.json").is_file():
        raise SystemExit(f"--model: {model} has no config.json")
    ours = json.loads((model / "config.json").read_text())
    checkpoints = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--checkpoint: expected LABEL=PATH, got {spec!r}")
        theirs = _config_of(label, path)
        differ = [
            f"{k} {theirs[k]} against {ours[k]}"
            for k in _SHAPE
            if k in theirs and k in ours and theirs[k] != ours[k]  # head_dim: written by some tools only
        ]
        if differ:
            raise SystemExit(
                f"--checkpoint {label}: {path} is not a checkpoint of {model}: {', '.join(differ)}"
            )
        checkpoints.append((label, Path(path)))
    return checkpoints


def checked_inputs(
    args: argparse.Namespace,
    model: Path,
    checkpoints: list[tuple[str, Path]],
    held_out: Callable[[Path], torch.Tensor],
) -> torch.Tensor:
    """The held-out text, once --json's directory, --ppl-windows and each --checkpoint's quantization are
    known good."""
    from ember_engine.model.quant.checkpoint import resolve

    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise SystemExit(f"--json: {Path(args.json).parent} is not a directory")
    for label, path in checkpoints:
        if not is_gguf(str(path)):
            try:
                resolve(path, None)
            except ValueError as e:  # a quantization ember does not run, named by the loader
                raise SystemExit(f"--checkpoint {label}: {e}") from e
    text = held_out(model)
    windows = (len(text) - 1) // WINDOW
    if args.ppl_windows > windows:
        raise SystemExit(
            f"--ppl-windows {args.ppl_windows}: the held-out text holds {windows} windows of {WINDOW} tokens"
        )
    return text
