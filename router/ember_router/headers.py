"""What of a client's request headers the router sends on, and what of an answer's it passes back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

# Headers that belong to one hop, never forwarded either way.
HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}
)


def upstream_headers(client: Iterable[tuple[str, str]], stream: bool) -> CIMultiDict[str]:
    """The headers of the request sent on: the client's, but those of its hop. Accept-Encoding is the
    client's own (none when it sent none); for a stream, `identity`, so that the router can find the ends
    of its events (an uncompressed body is always acceptable to the client)."""
    headers = CIMultiDict((k, v) for k, v in client if k.lower() not in HOP)
    if stream:
        headers["Accept-Encoding"] = "identity"
    return headers


def answer_headers(upstream: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The headers of the answer passed back: the upstream's, but those of its hop."""
    return CIMultiDict((k, v) for k, v in upstream if k.lower() not in HOP)


def encoded(headers: Mapping[str, str]) -> bool:
    """Whether a body comes in a content coding (compressed), not as it is."""
    return headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
