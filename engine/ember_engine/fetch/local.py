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
        """Every file below the root, through linked directories too, as `cp -rL` copies them (a directory
        and a link to it are both copied), and links to nothing (refused by the listing, naming them). A link
        back up to a directory being walked is not followed: that would never end."""

        def walk(folder: Path, ancestors: frozenset[str]) -> Iterator[Path]:
            real = os.path.realpath(folder)
            if real in ancestors:
                return
            ancestors = ancestors | {real}
            with os.scandir(folder) as listing:
                entries = sorted(listing, key=lambda e: e.name)
            for entry in entries:
                path = folder / entry.name
                if entry.is_dir(follow_symlinks=True):
                    yield from walk(path, ancestors)
                else:
                    yield path

        yield from walk(self.root, frozenset())

    def read(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        return offset, self._chunks(self.root / file.path, offset)

    def _chunks(self, path: Path, offset: int) -> Iterator[bytes]:
        with path.open("rb") as f:
            f.seek(offset)
            yield from iter(lambda: f.read(CHUNK), b"")
