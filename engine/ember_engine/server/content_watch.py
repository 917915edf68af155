"""Whether a file a process re-reads while it runs (a policy, a routes file) holds something new: compared
by content, not mtime or inode, since a ConfigMap update swaps a symlink and may keep the mtime."""

from __future__ import annotations

import hashlib
from pathlib import Path


class ContentWatch:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._seen = ""  # what the file held at the last look: a content hash, or why it could not be read

    def look(self) -> tuple[bool, bytes | None, OSError | None]:
        """(whether the file changed since the last look, its content, or why it could not be read). A file
        that stays unreadable, or stays bad, counts as changed once, so it is reported once."""
        found: bytes | None
        error: OSError | None
        try:
            data = self.path.read_bytes()
        except OSError as e:
            seen, found, error = f"unreadable: {e}", None, e
        else:
            seen, found, error = hashlib.sha256(data).hexdigest(), data, None
        changed = seen != self._seen
        self._seen = seen
        return changed, found, error
