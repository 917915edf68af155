"""A GGUF file described as a model directory: what the engine reads of a checkpoint directory
(`config.json`, the tokenizer's files) written from the file's metadata (`gguf.read_config`) and the
base model's tokenizer (or the file's own, `vocab.py`), under $EMBER_CACHE_DIR (default ~/.cache/ember)/gguf/. The weights stay in the
file; the loader reads them from it (`gguf.iter_tensors`)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from ember_engine.core.config import is_gguf
from ember_engine.model.gguf import GGUFError, field, read_config, reader_of
from ember_engine.model.gguf import split as gguf_split
from ember_engine.model.gguf import vocab as gguf_vocab

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_UNUSED = 5  # GGUF's token type of a padding entry (llama.cpp's converter writes "[PAD<id>]" for them)


def describe(config: Any) -> Any:
    """An engine config (`EngineConfig`) whose model (or draft model) is a .gguf file pointed at the
    directory describing it (in place, and returned); `quantization` "gguf" asks for the file's own types,
    which it runs in anyway. A draft's tokenizer is `tokenizer`, else the one beside its file, else the
    target's (they must be the same)."""
    tokenizer = config.tokenizer
    if is_gguf(config.model):
        config.model = str(materialize(config.model, tokenizer))
        config.tokenizer = None  # its files are in that directory now
        if config.quantization == "gguf":
            config.quantization = None
    if config.draft_model is not None and is_gguf(config.draft_model):
        beside = Path(config.draft_model).parent / "tokenizer.json"
        source = tokenizer or (None if beside.exists() else config.model)
        config.draft_model = str(materialize(config.draft_model, source))
    return config


def materialize(path: str | Path, tokenizer: str | Path | None = None) -> Path:
    """The directory describing GGUF file `path`. The tokenizer comes from `tokenizer` (a directory with
    tokenizer.json, the base model's), else from the file's own directory, else from the vocabulary the
    file carries (`vocab.py`); where the file lists its vocabulary, a tokenizer directory's must be the
    same. The end-of-sequence ids are the file's EOS, EOT and EOM and those of the tokenizer directory's
    generation_config.json."""
    path = Path(path).resolve()
    reader = reader_of(path)
    config = read_config(reader, path)
    source = Path(tokenizer) if tokenizer is not None else path.parent
    if (source / "tokenizer.json").exists():
        check_vocabulary(reader, source / "tokenizer.json", path)
        files = {name: (source / name).read_bytes() for name in TOKENIZER_FILES if (source / name).exists()}
        origin = str(source.resolve())
    elif tokenizer is None and gguf_vocab.has_tokenizer(reader):
        files, origin = gguf_vocab.tokenizer_files(reader, path), "the file's own"
    else:
        raise GGUFError(
            f"{path}: a GGUF model needs a tokenizer: {source} has no tokenizer.json"
            + ("" if tokenizer is not None else " and the file carries none (tokenizer.ggml.model)")
            + "; give tokenizer (--tokenizer) the base model's directory"
        )
    config["eos_token_id"] = _stop_ids(reader, source)
    stats = [(p.stat().st_size, p.stat().st_mtime_ns) for p in gguf_split.files_of(reader, path)]
    key = f"{path}:{stats}:{origin}".encode()
    root = Path(os.environ.get("EMBER_CACHE_DIR", Path.home() / ".cache" / "ember")) / "gguf"
    out = root / f"{path.stem}-{hashlib.sha256(key).hexdigest()[:12]}"
    out.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        _write(out / name, data)
    _write(out / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    return out


def _stop_ids(reader: Any, source: Path) -> list[int]:
    ids = [field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    generation = source / "generation_config.json"
    if generation.exists():
        theirs = json.loads(generation.read_text()).get("eos_token_id")
        ids += theirs if isinstance(theirs, list) else [theirs]
    return [int(i) for i in dict.fromkeys(ids) if i is not None]


def _write(dst: Path, data: bytes) -> None:
    """Write a whole file: a reader (another process or thread) sees the old file or the new one."""
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, dst)


def check_vocabulary(reader: Any, tokenizer_file: Path, path: Path) -> None:
    """The tokenizer's tokens must be the file's, id by id; the file's padding entries (type UNUSED, where
    its embedding has more rows than the tokenizer has tokens) have none in the tokenizer."""
    tokens = field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        return
    from tokenizers import Tokenizer

    kinds = field(reader, "tokenizer.ggml.token_type") or []
    tok = Tokenizer.from_file(str(tokenizer_file))
    for i, token in enumerate(tokens):
        mine = tok.id_to_token(i)
        if mine is None and i < len(kinds) and kinds[i] == _UNUSED:
            continue
        if mine != token:
            raise GGUFError(
                f"{path}: the tokenizer in {tokenizer_file.parent} is not the file's: token {i} is {mine!r} there "
                f"and {token!r} in the file"
            )
