"""A local directory as a source: a PersistentVolumeClaim mounted in the init container (`pvc://` sources),
copied onto the model cache (a node's local disk, say, from network storage). Sizes are checked; a
directory has no published digests. The revision is a digest of the names, sizes and modification times."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from ember_engine.fetch.files import FetchError, RemoteFile

CHUNK = 1 << 20


class LocalSource:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def describe(self) -> str:
        return str(self.root)

    def listing(self) -> tuple[str, list[RemoteFile]]:
        if not self.root.is_dir():
            raise FetchError(f"{self.root} is not a directory (the claim's path)")
        stamp = hashlib.sha256()
        files = []
        for path in sorted(self._walk()):
            relative = path.relative_to(self.root).as_posix()
            if relative.startswith("."):
                continue  # another fetch's ledger or lock, when the source is itself a cache
            if not path.exists():
                raise FetchError(f"{path}: a link to nothing ({os.readlink(path)})")
            stat = path.stat()
            stamp.update(f"{relative} {stat.st_size} {stat.st_mtime_ns}\n".encode())
            files.append(RemoteFile(relative, stat.st_size))
        return stamp.hexdigest()[:16], files

    def _walk(self) -> Iterator[Path]:
        """Every file below the root, through linked directories too (each directory once: a link back up
        ends nowhere), and links to nothing (refused by the listing, naming them)."""
        seen: set[str] = set()
        for folder, dirs, names in os.walk(self.root, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen:
                dirs[:] = []
                continue
            seen.add(real)
            for name in names:
                yield Path(folder) / name

    def read(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        return offset, self._chunks(self.root / file.path, offset)

    def _chunks(self, path: Path, offset: int) -> Iterator[bytes]:
        with path.open("rb") as f:
            f.seek(offset)
            yield from iter(lambda: f.read(CHUNK), b"")
