"""The model's recommended sampling settings as the server's defaults, as vLLM's `--generation-config auto`
does: the `temperature`, `top_p`, `top_k`, `min_p` and `repetition_penalty` of the checkpoint's
`generation_config.json`, and its `max_new_tokens` as the `max_tokens` of a request that gives none, apply
to each request that leaves the field out (a field given, even as the OpenAI default, is the request's).
`--generation-config none` (or vLLM's spelling, `vllm`) keeps the API's own defaults; a directory reads
its `generation_config.json` instead; `--override-generation-config JSON` sets or replaces some.
`do_sample` is not read: as in vLLM, a file's `temperature` applies even where it says `false`."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:  # pydantic is imported where a default is read: `ember serve --help` needs none of it
    from pydantic import BaseModel

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
FILE = "generation_config.json"
NONE = ("none", "vllm")

Body = TypeVar("Body", bound="BaseModel")
log = logging.getLogger("ember.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|none|DIR",
        help=f"sampling defaults for fields a request leaves out: the model's {FILE} (auto, the default), "
        f"the API's own (none), or DIR's {FILE}",
    )
    p.add_argument(
        "--override-generation-config",
        type=overrides,
        metavar="JSON",
        help=f"defaults set over the generation config's: an object of {', '.join(FIELDS)}, max_new_tokens",
    )


def overrides(text: str) -> dict[str, Any]:
    """`--override-generation-config`: a JSON object of the fields read here only."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(given, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unknown = sorted(set(given) - {*FIELDS, "max_new_tokens"})
    if unknown:
        known = ", ".join((*FIELDS, "max_new_tokens"))
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: not a sampling default ({known})")
    return given


def read(source: str, model_dir: str | Path, override: dict[str, Any] | None) -> dict[str, Any]:
    """The defaults by request field (`max_new_tokens` as `max_tokens`); ValueError naming the file and
    field for one a request could not hold (checked as a request's are)."""
    from pydantic import ValidationError

    from ember_engine.server.protocol import _SamplingFields

    found: dict[str, Any] = {}
    where = "--override-generation-config"
    if source not in NONE:
        path = (Path(model_dir) if source == "auto" else Path(source)) / FILE
        if path.exists():
            raw = json.loads(path.read_text())
            found = {k: raw[k] for k in (*FIELDS, "max_new_tokens") if raw.get(k) is not None}
            where = str(path)
        elif source != "auto":
            raise ValueError(f"--generation-config: {path} not found")
    found.update(override or {})
    if "max_new_tokens" in found:
        found["max_tokens"] = found.pop("max_new_tokens")
    try:
        _SamplingFields.model_validate({"model": "-", **found})
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(map(str, first["loc"]))
        raise ValueError(f"{where}: {field}: {first['msg']}") from None
    return found


def of_args(args: argparse.Namespace, model_dir: str | Path) -> dict[str, Any]:
    """`read` as `ember serve`'s flags say, the defaults taken logged."""
    defaults = read(args.generation_config, model_dir, args.override_generation_config)
    if defaults:
        log.info("sampling defaults from the generation config: %s", json.dumps(defaults))
    return defaults


def apply(body: Body, defaults: dict[str, Any]) -> Body:
    """The request with the defaults for the fields it left out (`max_tokens`: where it gave neither it nor
    `max_completion_tokens`)."""
    given = body.model_fields_set
    update = {k: v for k, v in defaults.items() if k not in given and k in type(body).model_fields}
    if "max_tokens" in update and "max_completion_tokens" in given:
        del update["max_tokens"]
    return body.model_copy(update=update) if update else body
