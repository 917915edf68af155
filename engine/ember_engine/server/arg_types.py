"""The types of `ember serve`'s options: a value out of range or misshapen is refused by argparse, naming it."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def seconds(text: str) -> float:
    seconds = float(text)
    if not (seconds >= 0 and seconds != float("inf")):  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds, not {text}")
    return seconds


def byte_size(text: str) -> int:
    size = int(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more bytes, not {text}")
    return size


def log_interval(text: str) -> float:
    seconds = float(text)
    if not seconds >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 (off) or more seconds, not {text}")
    return seconds


def add_name_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="the names clients use, the first in metrics (default: the directory's name)",
    )


def served_names(args: argparse.Namespace) -> tuple[str, ...]:
    """The model's names, each once: --served-model-name's, else the model directory's name."""
    return tuple(dict.fromkeys(args.served_model_name or [Path(args.model).resolve().name]))


def chat_template(text: str) -> str:
    """`--chat-template`: a file holding the template, or the template itself (as vLLM takes it), compiled
    here so a template that cannot compile is refused at start."""
    import jinja2

    from ember_engine.server.chat import _compile

    path = Path(text)
    if path.is_file():
        text = path.read_text()
    elif not any(c in text for c in "{}\n"):
        raise argparse.ArgumentTypeError(f"{text!r}: no such file, and no template (no {{ }} in it)")
    try:
        _compile(text)
    except jinja2.TemplateSyntaxError as exc:
        raise argparse.ArgumentTypeError(
            f"the template does not compile: line {exc.lineno}: {exc.message}"
        ) from None
    return text


def add_chat_template_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        type=chat_template,
        metavar="FILE|TEMPLATE",
        help="render chats with this Jinja template (a file, or the template) instead of the checkpoint's",
    )


def lora_module(text: str) -> tuple[str, str]:
    """A LoRA adapter as `--lora-modules` takes it: NAME=PATH, or a JSON object with "name" and "path"."""
    if text.lstrip().startswith("{"):
        try:
            given = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
        extra = set(given) - {"name", "path", "base_model_name"} if isinstance(given, dict) else set()
        if extra:
            raise argparse.ArgumentTypeError(f"unknown key(s) {', '.join(sorted(extra))}; give name and path")
        name, path = (given.get("name"), given.get("path")) if isinstance(given, dict) else (None, None)
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not isinstance(path, str) or not name.strip() or not path:
        raise argparse.ArgumentTypeError(f'expected NAME=PATH or {{"name": ..., "path": ...}}, got {text!r}')
    return name.strip(), path


def add_lora_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) served beside the model: a request names one as its model",
    )
    p.add_argument(
        "--allow-runtime-lora-updates",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (they read any directory this "
        "process can)",
    )
    p.add_argument(
        "--max-loras",
        type=int,
        metavar="N",
        help="the most adapters one step runs: requests on another wait for room (default: any number)",
    )
    p.add_argument(
        "--max-lora-rank", type=int, metavar="R", help="refuse adapters of a higher rank (default: any rank)"
    )


def lora_problem(args: argparse.Namespace, models: tuple[str, ...]) -> str | None:
    """Why the LoRA options cannot work: an adapter name given twice, or the model's own name; runtime
    updates under tensor parallelism (the ranks are given their adapters at start only)."""
    names = [name for name, _ in args.lora_modules or ()]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        return f"--lora-modules: adapter name(s) given twice: {', '.join(twice)}"
    if clash := next((m for m in models if m in names), None):
        return f"--lora-modules: an adapter is named {clash!r}, the model's own name (--served-model-name)"
    if args.allow_runtime_lora_updates and args.tensor_parallel_size > 1:
        return (
            "--allow-runtime-lora-updates: adapters are not loaded while serving under tensor parallelism "
            "(give them at start with --lora-modules)"
        )
    return None
