"""`hf://org/name[@revision]`: a model repository on the Hugging Face hub, through its HTTP API.

The revision (a branch, tag or commit; default `main`) is resolved once to its commit
(`GET /api/models/{repo}/revision/{revision}` → `sha`), and everything after reads that commit, so every file
comes from one commit even if the branch moves. The file list comes from
`GET /api/models/{repo}/tree/{commit}?recursive=true` (pages followed through the `Link: <...>; rel="next"`
header): each file's size, its git blob id (`oid`) and, for LFS files, `lfs.oid`, the content's sha256.
Files come from `GET /{repo}/resolve/{commit}/{path}`, with `Range: bytes=N-` to resume. The hub answers an
LFS file with a redirect to its storage: the redirect carries `X-Repo-Commit`, `X-Linked-Etag` (the sha256)
and `X-Linked-Size`, which are checked against the listing; a small file comes straight back with
`ETag` (its git blob id) and `X-Repo-Commit`. Redirects on the hub's own origin (a renamed repository) keep
the token; a redirect to another origin (the storage) does not carry it.

HF_TOKEN (or HUGGING_FACE_HUB_TOKEN) authorises private and gated repositories; HF_ENDPOINT or
`--endpoint` names a mirror. Errors use the hub's `X-Error-Code` (RepoNotFound, RevisionNotFound,
GatedRepo, EntryNotFound) to say what is wrong.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import httpx

from ember_engine.fetch.files import FetchError, RemoteFile, TransientError

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
_MAX_REDIRECTS = 5
_SOURCE = re.compile(r"^hf://(?P<repo>[^/@\s]+/[^/@\s]+)(@(?P<revision>[^@\s]+))?/?$")


def _etag(value: str | None) -> str | None:
    return None if value is None else value.removeprefix("W/").strip('"')


def _origin(url: str) -> tuple[str, str]:
    parts = urlsplit(url)
    return parts.scheme, parts.netloc


class HubSource:
    def __init__(self, uri: str, endpoint: str | None = None, timeout: float = 30.0) -> None:
        match = _SOURCE.match(uri)
        if match is None:
            raise FetchError(f"not a hub source: {uri!r} (hf://org/name[@revision])")
        self.uri = uri
        self.repo = match["repo"]
        self.revision = match["revision"] or "main"
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
        self.token = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN") or None
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), follow_redirects=False)
        self.commit = ""

    def describe(self) -> str:
        # The repository alone: the revision is the commit the listing resolves, so @main and @<its commit>
        # are the same content.
        return f"hf://{self.repo}"

    # -- requests ------------------------------------------------------------------------------------------

    def _headers(self, url: str) -> dict[str, str]:
        headers = {"User-Agent": "ember-fetch-model", "Accept-Encoding": "identity"}
        if self.token and _origin(url) == _origin(self.endpoint):
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _send(self, url: str, extra: dict[str, str] | None = None, stream: bool = False) -> httpx.Response:
        """A GET that follows redirects itself: the token goes only to the hub's own origin. The hub's last
        response before leaving its origin (the one with the X-Linked-* headers) is kept on
        `response.extensions["hub"]`."""
        hub_response: httpx.Response | None = None
        for _ in range(_MAX_REDIRECTS + 1):
            request = self.client.build_request("GET", url, headers={**self._headers(url), **(extra or {})})
            try:
                response = self.client.send(request, stream=stream)
            except httpx.TransportError as error:
                raise TransientError(f"{url}: {type(error).__name__}: {error}") from error
            if _origin(url) == _origin(self.endpoint):
                hub_response = response
            if not response.is_redirect:
                response.extensions["hub"] = hub_response
                self._raise_for_status(response, url)
                return response
            response.close()
            url = urljoin(url, response.headers["Location"])
        raise FetchError(f"too many redirects fetching {url}")

    def _raise_for_status(self, response: httpx.Response, url: str) -> None:
        if response.status_code < 400:
            return
        if response.is_stream_consumed is False:
            response.read()
        code = response.headers.get("X-Error-Code", "")
        detail = response.headers.get("X-Error-Message") or response.text[:200].strip()
        status = f"{response.status_code} {response.reason_phrase}"
        if response.status_code >= 500 or response.status_code in (408, 429):
            raise TransientError(f"{url}: {status}")
        if code == "RevisionNotFound":
            why = f"revision {self.revision!r} not found in {self.repo}"
        elif code == "EntryNotFound":
            why = f"{url} not found in {self.repo}"
        elif code == "GatedRepo":
            why = f"{self.repo} is gated: accept its conditions on the hub with the token's account"
        elif code == "RepoNotFound" or response.status_code == 401:
            token = "with the given HF_TOKEN" if self.token else "without a token (HF_TOKEN)"
            why = f"repository {self.repo} not found, or private and not readable {token}"
        else:
            why = url
        raise FetchError(f"the hub answered {status}: {why}" + (f" ({detail})" if detail else ""))

    def _json(self, url: str) -> Any:
        response = self._send(url)
        try:
            return response.json()
        except ValueError as error:
            raise FetchError(f"{url}: not JSON: {response.text[:200]!r}") from error

    # -- the Source protocol -------------------------------------------------------------------------------

    def listing(self) -> tuple[str, list[RemoteFile]]:
        info = self._json(f"{self.endpoint}/api/models/{self.repo}/revision/{quote(self.revision, safe='')}")
        commit = info.get("sha") if isinstance(info, dict) else None
        if not isinstance(commit, str) or not commit:
            raise FetchError(f"the hub gave no commit for {self.repo}@{self.revision}")
        self.commit = commit
        files = []
        url: str | None = f"{self.endpoint}/api/models/{self.repo}/tree/{commit}?recursive=true"
        while url is not None:
            response = self._send(url)
            for entry in response.json():
                if entry.get("type") != "file":
                    continue
                digests = {"git-sha1": entry["oid"]} if entry.get("oid") else {}
                lfs = entry.get("lfs")
                if lfs:  # the blob id is then the pointer file's; the content has a sha256
                    digests = {"sha256": lfs["oid"]}
                files.append(RemoteFile(entry["path"], int(entry["size"]), digests))
            following = response.links.get("next", {}).get("url")
            url = urljoin(url, following) if following else None
        return commit, files

    def read(self, file: RemoteFile, offset: int) -> tuple[int, Iterator[bytes]]:
        url = f"{self.endpoint}/{self.repo}/resolve/{self.commit}/{quote(file.path)}"
        response = self._send(url, {"Range": f"bytes={offset}-"} if offset else None, stream=True)
        self._check_metadata(file, response.extensions.get("hub"), response)
        start = 0
        if response.status_code == 206:
            match = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
            start = int(match.group(1)) if match else 0
        return start, self._chunks(response)

    def _check_metadata(self, file: RemoteFile, hub: httpx.Response | None, final: httpx.Response) -> None:
        """What the hub says about the file must be what the listing said."""
        if hub is None:
            return
        commit = hub.headers.get("X-Repo-Commit")
        if commit and commit != self.commit:
            raise FetchError(f"{file.path}: the hub served commit {commit}, not {self.commit}")
        linked_size = hub.headers.get("X-Linked-Size")
        if linked_size is not None and int(linked_size) != file.size:
            raise FetchError(f"{file.path}: X-Linked-Size {linked_size} but the listing says {file.size}")
        etag = _etag(hub.headers.get("X-Linked-Etag")) or (
            _etag(hub.headers.get("ETag")) if hub is final else None
        )
        expected = file.digests.get("sha256") or file.digests.get("git-sha1")
        if etag and expected and etag != expected:
            raise FetchError(f"{file.path}: the hub's ETag {etag} is not the listed {expected}")

    def _chunks(self, response: httpx.Response) -> Iterator[bytes]:
        try:
            yield from response.iter_bytes(CHUNK)
        except (httpx.TransportError, httpx.StreamError) as error:
            raise TransientError(f"{type(error).__name__}: {error}") from error
        finally:
            response.close()
