"""Split GGUF files: a model llama.cpp's `gguf-split` (or its converter's `--split-max-size`) wrote as
several parts, `NAME-00001-of-0000N.gguf` to `NAME-0000N-of-0000N.gguf`. The first part holds the
metadata; every part holds some of the tensors and says which part it is (`split.no`, counted from 0)
and how many there are (`split.count`). A model is named by its first part, as llama.cpp names it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PART = re.compile(r"^(?P<prefix>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class SplitError(ValueError):
    pass


@dataclass
class Parts:
    """The parts of a split file read as one: the first part's metadata, every part's tensors."""

    fields: dict[str, Any]
    tensors: list[Any]
    paths: list[Path]


def part_paths(path: Path, count: int) -> list[Path]:
    """Every part's path, from the first part's (llama.cpp's naming: PREFIX-%05d-of-%05d.gguf)."""
    m = PART.match(path.name)
    if m is None or int(m["no"]) != 1 or int(m["count"]) != count:
        raise SplitError(
            f"{path}: the file says it is the first of {count} parts (split.count), but is not named as one "
            f"(PREFIX-00001-of-{count:05d}.gguf)"
        )
    return [path.with_name(f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


def join(first: Any, path: Path, open_part: Any) -> Any:
    """`first` (the reader of `path`) as it is where the file is whole, else the parts read as one
    (`open_part(path)` reads a part)."""
    count = _number(first, "split.count", 1)
    if count <= 1:
        return first
    no = _number(first, "split.no", 0)
    if no != 0:
        m = PART.match(path.name)
        name = f"{m['prefix']}-00001-of-{count:05d}.gguf" if m else "its first part"
        raise SplitError(f"{path} is part {no + 1} of {count} of a split GGUF file: give the first, {name}")
    paths = part_paths(path, count)
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise SplitError(f"{path}: part(s) {', '.join(missing)} of the split GGUF file not found beside it")
    readers = [first, *(open_part(p) for p in paths[1:])]
    for i, (reader, p) in enumerate(zip(readers, paths, strict=True)):
        if _number(reader, "split.no", -1) != i or _number(reader, "split.count", -1) != count:
            raise SplitError(f"{p}: says it is not part {i + 1} of {count} (split.no, split.count)")
    expected = _number(first, "split.tensors.count", -1)
    tensors = [t for r in readers for t in r.tensors]
    if expected >= 0 and len(tensors) != expected:
        raise SplitError(
            f"{path}: the parts hold {len(tensors)} tensors; split.tensors.count says {expected}"
        )
    return Parts(first.fields, tensors, paths)


def files_of(reader: Any, path: Path) -> list[Path]:
    """The files a model read by `reader` is made of."""
    return list(reader.paths) if isinstance(reader, Parts) else [path]


def _number(reader: Any, key: str, default: int) -> int:
    f = reader.fields.get(key)
    return default if f is None else int(f.contents())
