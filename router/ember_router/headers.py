"""What of a client's request headers the router sends on, and what of an answer's it passes back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

# Headers that belong to one hop, never forwarded either way.
HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade", "te", "trailer"}
)

# A credential for the proxy itself (the router, or one before it), never the upstream's.
_PROXY_ONLY = frozenset({"proxy-authorization"})
# What of the client's headers reaches the fallback, a server outside the fleet: what the engines' own
# fallback request carries (none of the client's credentials, cookies or account headers), and the
# request's id.
_TO_FALLBACK = frozenset({"accept", "accept-encoding", "user-agent", "x-request-id"})


def upstream_headers(
    client: Iterable[tuple[str, str]], stream: bool, fallback: bool = False
) -> CIMultiDict[str]:
    """The headers of the request sent on: to an engine (or another InferenceService of the fleet) the
    client's, but those of its hop and Proxy-Authorization; to the `fallback`, only those `_TO_FALLBACK`
    names, with the JSON body the router wrote. Accept-Encoding is the client's own (none when it sent
    none); for a stream, `identity`, so that the router can find the ends of its events (an uncompressed
    body is always acceptable to the client)."""
    if fallback:
        headers = CIMultiDict((k, v) for k, v in client if k.lower() in _TO_FALLBACK)
        headers["Content-Type"] = "application/json"
    else:
        headers = CIMultiDict((k, v) for k, v in client if k.lower() not in HOP | _PROXY_ONLY)
    if stream:
        headers["Accept-Encoding"] = "identity"
    return headers


def answer_headers(upstream: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The headers of the answer passed back: the upstream's, but those of its hop."""
    return CIMultiDict((k, v) for k, v in upstream if k.lower() not in HOP)


def encoded(headers: Mapping[str, str]) -> bool:
    """Whether a body comes in a content coding (compressed), not as it is."""
    return headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
