"""Fetching a source's files into a directory: resumable, checked, reported.

Each file is written to `<name>.incomplete` beside its final place and renamed only once its size and every
digest the source published (sha256, git blob sha1, MD5) match; an interrupted file resumes from its
partial bytes, in the same run (after a dropped connection) or the next (a restarted init container). The
ledger `.ember-fetch.json` records the source, its revision and each verified file, so a second fetch of the
same revision skips what is there and a new revision fetches again. A lock file keeps two fetches into one
directory (pods sharing a cache volume) from writing the same files. Progress goes to the log every few
seconds.
"""

from __future__ import annotations

import fcntl
import fnmatch
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

LEDGER = ".ember-fetch.json"
LOCK = ".ember-fetch.lock"
PARTIAL = ".incomplete"
# Weight formats the engine does not load, which a hub repository often carries beside the safetensors, and
# GGUF files: a "…-GGUF" repository holds one per quantization (take the one to serve with --include).
SKIPPED_BY_DEFAULT = ("*.bin", "*.pt", "*.pth", "*.h5", "*.msgpack", "*.ot", "*.onnx", "*.gguf", "*.tflite")


class FetchError(Exception):
    """The fetch cannot succeed as asked; the message says why."""


class TransientError(FetchError):
    """A failure worth trying again (a dropped connection, a timeout, a 5xx): the file resumes."""


@dataclass(frozen=True, slots=True)
class RemoteFile:
    path: str  # relative to the source's root, '/'-separated
    size: int
    digests: dict[str, str] = field(default_factory=dict)  # "sha256" | "git-sha1" | "md5" -> hex


class Source(Protocol):
    def describe(self) -> str: ...

    def listing(self) -> tuple[str, list[RemoteFile]]:
        """(revision: what identifies this exact content, the files)."""
        ...

    def read(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        """The file's bytes from `offset` on; the first value is where they really start (0 when the
        source cannot resume)."""
        ...


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Digests:
    def __init__(self, file: RemoteFile) -> None:
        self.hashes: dict[str, hashlib._Hash] = {}
        for kind in file.digests:
            if kind == "git-sha1":  # a git blob's id: sha1 over a header and the content
                self.hashes[kind] = hashlib.sha1(f"blob {file.size}\0".encode())
            elif kind in ("sha256", "md5"):
                self.hashes[kind] = hashlib.new(kind)

    def update(self, chunk: bytes) -> None:
        for h in self.hashes.values():
            h.update(chunk)

    def mismatches(self, file: RemoteFile) -> list[str]:
        return [
            f"{kind} {h.hexdigest()} where the source says {file.digests[kind]}"
            for kind, h in self.hashes.items()
            if h.hexdigest() != file.digests[kind].lower()
        ]


@dataclass(slots=True)
class Progress:
    total: int
    interval: float
    log: Callable[[str], None]
    done: int = 0
    started: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def add(self, n: int, current: str) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.last >= self.interval:
            self.last = now
            rate = self.done / max(now - self.started, 1e-9)
            share = 100 * self.done / self.total if self.total else 100.0
            self.log(f"{human(self.done)} of {human(self.total)} ({share:.0f}%), {human(rate)}/s; {current}")


def _selected(files: Iterable[RemoteFile], include: list[str], exclude: list[str]) -> list[RemoteFile]:
    skip = [*SKIPPED_BY_DEFAULT, *exclude] if not include else exclude
    out = []
    for f in files:
        name = f.path.rsplit("/", 1)[-1]
        if include and not any(fnmatch.fnmatch(f.path, p) or fnmatch.fnmatch(name, p) for p in include):
            continue
        if any(fnmatch.fnmatch(f.path, p) or fnmatch.fnmatch(name, p) for p in skip):
            continue
        out.append(f)
    return out


def _target(dest: Path, path: str) -> Path:
    parts = Path(path).parts
    if not parts or Path(path).is_absolute() or ".." in parts:
        raise FetchError(f"the source lists a file outside its root: {path!r}")
    return dest.joinpath(*parts)


def _record(file: RemoteFile) -> dict[str, object]:
    return {"size": file.size, "digests": file.digests}


@dataclass(slots=True)
class Fetch:
    source: Source
    dest: Path
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    retries: int = 5
    progress_interval: float = 5.0
    log: Callable[[str], None] = print
    counts: dict[str, int] = field(default_factory=lambda: {"resumed": 0, "present": 0, "fetched": 0})

    def run(self) -> None:
        self.dest.mkdir(parents=True, exist_ok=True)
        with (self.dest / LOCK).open("w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.log(f"waiting for another fetch into {self.dest} to finish")
                fcntl.flock(lock, fcntl.LOCK_EX)
            self._run_locked()

    def _run_locked(self) -> None:
        revision, listed = self.source.listing()
        files = _selected(listed, self.include, self.exclude)
        if not files:
            raise FetchError(f"{self.source.describe()} has no files to fetch (listed: {len(listed)})")
        ledger = self._ledger()
        before: set[str] = set()  # an earlier revision's files, removed once this one is complete
        changed = ledger.get("source") != self.source.describe() or ledger.get("revision") != revision
        if changed:
            before = set(ledger.get("files", {})) if ledger.get("source") == self.source.describe() else set()
            ledger = {"source": self.source.describe(), "revision": revision, "complete": False, "files": {}}
            self._write_ledger(
                ledger
            )  # before any byte: a cut run's partial files are known as this revision's
        total = sum(f.size for f in files)
        self.log(
            f"{self.source.describe()} (revision {revision}): {len(files)} files, {human(total)}, into {self.dest}"
        )
        progress = Progress(total, self.progress_interval, self.log)
        checked: dict[str, int] = {}
        for f in files:
            target = _target(self.dest, f.path)
            known = ledger["files"].get(f.path)
            if known == _record(f) and target.is_file() and target.stat().st_size == f.size:
                self.counts["present"] += 1
                progress.add(f.size, f.path)
                continue
            self._fetch_file(f, target, progress, stale=changed and not f.digests)
            for kind in f.digests:
                checked[kind] = checked.get(kind, 0) + 1
            ledger["files"][f.path] = _record(f)
            self._write_ledger(ledger)
        ledger["complete"] = True
        self._write_ledger(ledger)
        for path in sorted(before - {f.path for f in files}):  # gone from the source, or no longer selected
            for old in (_target(self.dest, path), _target(self.dest, path + PARTIAL)):
                old.unlink(missing_ok=True)
        seconds = time.monotonic() - progress.started
        digests = ", ".join(f"{n} {kind}" for kind, n in sorted(checked.items())) or "none published"
        self.log(
            f"done: {len(files)} files, {human(total)} in {seconds:.1f} s; {self.counts['fetched']} fetched "
            f"({self.counts['resumed']} resumed), {self.counts['present']} already there; sizes checked, "
            f"digests checked: {digests}"
        )

    def _fetch_file(self, f: RemoteFile, target: Path, progress: Progress, stale: bool) -> None:
        """`stale`: a partial file there may be an earlier revision's, and no digest would tell."""
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + PARTIAL)
        if partial.exists() and (stale or partial.stat().st_size > f.size):
            partial.unlink()  # not a prefix of this file, or none known to be
        if partial.exists():  # an earlier run's bytes, counted as there
            progress.add(partial.stat().st_size, f.path)
        for attempt in range(self.retries + 1):
            try:
                self._stream(f, partial, progress)
                break
            except TransientError as error:
                if attempt == self.retries:
                    raise FetchError(f"{f.path}: gave up after {self.retries + 1} tries: {error}") from error
                wait = min(2.0**attempt, 30.0)
                self.log(f"{f.path}: {error}; resuming in {wait:g} s")
                time.sleep(wait)
        os.replace(partial, target)
        self.counts["fetched"] += 1

    def _stream(self, f: RemoteFile, partial: Path, progress: Progress) -> None:
        have = partial.stat().st_size if partial.exists() else 0
        if have == f.size:  # cut between the last write and the rename: checked where it lies
            digests = _Digests(f)
            with partial.open("rb") as held:
                for block in iter(lambda: held.read(1 << 20), b""):
                    digests.update(block)
            if not digests.mismatches(f):
                return
            partial.unlink()
            progress.add(-have, f.path)
            have = 0
        start, chunks = self.source.read(f, have)
        if have and start == have:
            self.counts["resumed"] += 1
            self.log(f"{f.path}: resuming at {human(have)} of {human(f.size)}")
        digests = _Digests(f)
        with partial.open("r+b" if partial.exists() else "wb") as out:
            out.truncate(start)
            if start:  # the digests cover the whole file: read back the bytes already there
                for block in iter(lambda: out.read(1 << 20), b""):
                    digests.update(block)
            progress.add(start - have, f.path)  # bytes thrown away when the source could not resume
            written = start
            for chunk in chunks:
                out.write(chunk)
                digests.update(chunk)
                written += len(chunk)
                progress.add(len(chunk), f.path)
        if written != f.size:
            if written < f.size:
                raise TransientError(f"the transfer ended at {written} of {f.size} bytes")
            partial.unlink()
            raise FetchError(f"{f.path}: got {written} bytes where the source lists {f.size}")
        wrong = digests.mismatches(f)
        if wrong:
            partial.unlink()
            if start:  # the partial bytes may be an older revision's: one more try, from the start
                raise TransientError(f"resumed content does not match ({'; '.join(wrong)}); starting over")
            raise FetchError(f"{f.path}: content does not match: {'; '.join(wrong)}")

    def _ledger(self) -> dict[str, Any]:
        try:
            data = json.loads((self.dest / LEDGER).read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and isinstance(data.get("files"), dict) else {}

    def _write_ledger(self, ledger: dict[str, Any]) -> None:
        staged = self.dest / (LEDGER + ".tmp")
        staged.write_text(json.dumps(ledger, indent=1, sort_keys=True))
        os.replace(staged, self.dest / LEDGER)
