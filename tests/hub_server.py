"""A local Hugging Face hub: model repositories served over the hub's own HTTP API, for `ember fetch-model`.

What it speaks, as the hub does (and as `huggingface_hub` expects):
- `GET /api/models/{repo}/revision/{revision}`: `{"id", "sha", "siblings": [{"rfilename"}]}`;
- `GET /api/models/{repo}/tree/{revision}?recursive=true`: `[{"type", "oid", "size", "path", "lfs"}]`, in
  pages linked by an absolute `Link: <...>; rel="next"` (`cursor=`);
- `GET|HEAD /{repo}/resolve/{revision}/{path}`: a regular file straight back (`ETag: "<git blob id>"`,
  `X-Repo-Commit`, ranges); an LFS file as a 302 to the storage origin (another port, like the hub's CDN)
  carrying `X-Repo-Commit`, `X-Linked-Etag: "<sha256>"`, `X-Linked-Size` and the pointer's `ETag`;
- errors with `X-Error-Code` (`RepoNotFound` — also for a private repository without a valid token, 401 —,
  `RevisionNotFound`, `EntryNotFound`, which also carries `X-Repo-Commit`) and `X-Error-Message`;
- a renamed repository answers 307 with a relative Location to its new name.

The storage origin serves LFS content with ranges, records whether a request carried an Authorization header
(it must not), and can be told to cut a transfer half-way (`cut_once`) or to serve wrong bytes (`corrupt`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

PAGE_SIZE = 3
LFS_SUFFIXES = (".safetensors", ".bin")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    private: bool = False
    branch: str = "main"

    @property
    def commit(self) -> str:
        digest = hashlib.sha1()
        for path in sorted(self.files):
            digest.update(path.encode() + b"\0" + git_blob_id(self.files[path]).encode())
        return digest.hexdigest()

    def is_lfs(self, path: str) -> bool:
        return path.endswith(LFS_SUFFIXES)


@dataclass
class Hub:
    token: str = "hf_test_token"
    repos: dict[str, Repo] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)  # old repo id -> new
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (origin, path, headers)
    cut_once: set[str] = field(default_factory=set)  # sha256s whose next transfer stops half-way
    corrupt: set[str] = field(default_factory=set)  # sha256s served with a byte flipped
    hub_url: str = ""
    storage_url: str = ""

    def add(self, repo_id: str, directory: Path, *, private: bool = False) -> Repo:
        files = {
            p.relative_to(directory).as_posix(): p.read_bytes() for p in directory.rglob("*") if p.is_file()
        }
        repo = self.repos[repo_id] = Repo(files, private=private)
        return repo

    def lfs_blob(self, sha256: str) -> bytes | None:
        for repo in self.repos.values():
            for data in repo.files.values():
                if hashlib.sha256(data).hexdigest() == sha256:
                    return data
        return None


def _range(header: str | None, size: int) -> tuple[int, int] | None:
    if not header or not header.startswith("bytes="):
        return None
    start_text, _, end_text = header.removeprefix("bytes=").partition("-")
    start = int(start_text)
    end = int(end_text) if end_text else size - 1
    return start, min(end, size - 1)


class _Handler(BaseHTTPRequestHandler):
    hub: Hub
    origin: str  # "hub" or "storage"
    protocol_version = "HTTP/1.1"

    def log_message(self, *_: Any) -> None:
        pass

    def _record(self) -> None:
        self.hub.requests.append((self.origin, self.path, dict(self.headers.items())))

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, extra: dict[str, str] | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        headers = {"X-Error-Code": code, "X-Error-Message": message, "Content-Type": "application/json"}
        self._send(status, body, {**headers, **(extra or {})})

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        self._record()
        if self.origin == "storage":
            self._storage()
        else:
            self._hub()

    # -- the hub ---------------------------------------------------------------------------------------------

    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        auth = self.headers.get("Authorization")
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if auth is not None and auth != f"Bearer {self.hub.token}":
            self._error(401, "RepoNotFound", "Invalid credentials in Authorization header")
            return None
        if repo.private and auth is None:
            self._error(401, "RepoNotFound", "Repository not found")
            return None
        return repo

    def _commit(self, repo: Repo, revision: str) -> str | None:
        if revision in (repo.branch, repo.commit):
            return repo.commit
        self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        return None

    def _hub(self) -> None:
        parts = urlsplit(self.path)
        segments = [unquote(s) for s in parts.path.strip("/").split("/")]
        api = segments[:2] == ["api", "models"]
        repo_id = "/".join(segments[2:4] if api else segments[0:2])
        if repo_id in self.hub.renamed:
            new = self.hub.renamed[repo_id]
            self._send(
                307,
                b"",
                {
                    "Location": parts.path.replace(f"/{repo_id}/", f"/{new}/", 1)
                    + (f"?{parts.query}" if parts.query else "")
                },
            )
            return
        repo = self._repo(repo_id)
        if repo is None:
            return
        if api and len(segments) >= 6 and segments[4] == "revision":
            commit = self._commit(repo, "/".join(segments[5:]))
            if commit is not None:
                info = {
                    "id": repo_id,
                    "sha": commit,
                    "siblings": [{"rfilename": p} for p in sorted(repo.files)],
                }
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"})
        elif api and len(segments) >= 6 and segments[4] == "tree":
            commit = self._commit(repo, segments[5])
            if commit is not None:
                self._tree(repo, repo_id, commit, parts.query)
        elif not api and len(segments) >= 5 and segments[2] == "resolve":
            commit = self._commit(repo, segments[3])
            if commit is not None:
                self._resolve(repo, "/".join(segments[4:]))
        else:
            self._error(404, "EntryNotFound", f"no route for {parts.path}")

    def _tree(self, repo: Repo, repo_id: str, commit: str, query: str) -> None:
        entries = []
        for path in sorted(repo.files):
            data = repo.files[path]
            entry: dict[str, Any] = {
                "type": "file",
                "oid": git_blob_id(data),
                "size": len(data),
                "path": path,
            }
            if repo.is_lfs(path):
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\nsize {len(data)}\n"
                entry["oid"] = git_blob_id(pointer.encode())
                entry["lfs"] = {
                    "oid": hashlib.sha256(data).hexdigest(),
                    "size": len(data),
                    "pointerSize": len(pointer),
                }
            entries.append(entry)
        cursor = int(parse_qs(query).get("cursor", ["0"])[0])
        page = entries[cursor : cursor + PAGE_SIZE]
        headers = {"Content-Type": "application/json"}
        if cursor + PAGE_SIZE < len(entries):
            # Absolute, as the hub sends it (huggingface_hub requests it as it is).
            following = f"{self.hub.hub_url}/api/models/{repo_id}/tree/{commit}?recursive=true&cursor={cursor + PAGE_SIZE}"
            headers["Link"] = f'<{following}>; rel="next"'
        self._send(200, json.dumps(page).encode(), headers)

    def _resolve(self, repo: Repo, path: str) -> None:
        data = repo.files.get(path)
        if data is None:
            # The revision exists: the hub names its commit (huggingface_hub caches the miss under it).
            self._error(404, "EntryNotFound", f"{path} does not exist", {"X-Repo-Commit": repo.commit})
            return
        common = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
        if repo.is_lfs(path):
            sha = hashlib.sha256(data).hexdigest()
            self._send(
                302,
                b"",
                {
                    **common,
                    "Location": f"{self.hub.storage_url}/lfs/{sha}?sig=signed",
                    "X-Linked-Etag": f'"{sha}"',
                    "X-Linked-Size": str(len(data)),
                    "ETag": f'"{git_blob_id(data)}"',
                },
            )
            return
        self._content(data, {**common, "ETag": f'"{git_blob_id(data)}"'})

    def _content(self, data: bytes, headers: dict[str, str], cut: bool = False) -> None:
        span = _range(self.headers.get("Range"), len(data))
        if span is None:
            status, body = 200, data
        else:
            status, body = 206, data[span[0] : span[1] + 1]
            headers = {**headers, "Content-Range": f"bytes {span[0]}-{span[1]}/{len(data)}"}
        if not cut:
            self._send(status, body, headers)
            return
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[: len(body) // 2])
        self.wfile.flush()
        self.close_connection = True

    # -- the storage origin ----------------------------------------------------------------------------------

    def _storage(self) -> None:
        sha = urlsplit(self.path).path.rsplit("/", 1)[-1]
        data = self.hub.lfs_blob(sha)
        if data is None:
            self._send(404, b"NoSuchKey")
            return
        if sha in self.hub.corrupt:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        cut = sha in self.hub.cut_once
        self.hub.cut_once.discard(sha)
        self._content(data, {"ETag": f'"{sha}"', "Accept-Ranges": "bytes"}, cut=cut)


class HubServer:
    """The hub and its storage origin in background threads, on hosts of their own (127.0.0.1 and
    127.0.0.2): the hub's LFS content comes from another host (its CDN), and huggingface_hub follows a
    redirect to the same host as the hub, so a storage origin there would hide the redirect's headers."""

    def __init__(self, hub: Hub) -> None:
        self.hub = hub
        self._servers = [self._serve("hub", "127.0.0.1"), self._serve("storage", "127.0.0.2")]
        hub.hub_url = f"http://127.0.0.1:{self._servers[0].server_address[1]}"
        hub.storage_url = f"http://127.0.0.2:{self._servers[1].server_address[1]}"

    def _serve(self, origin: str, host: str) -> ThreadingHTTPServer:
        handler = type(f"{origin}Handler", (_Handler,), {"hub": self.hub, "origin": origin})
        server = ThreadingHTTPServer((host, 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    def close(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()


@contextlib.contextmanager
def serving(repo_id: str, directory: Path, *, private: bool = True) -> Iterator[Hub]:
    """A hub holding `directory` as the repository `repo_id`, served while the block runs."""
    hub = Hub()
    hub.add(repo_id, directory, private=private)
    server = HubServer(hub)
    try:
        yield hub
    finally:
        server.close()
