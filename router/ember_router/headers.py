"""What of a client's request headers the router sends on, and what of an answer's it passes back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

# Headers that belong to one hop, never forwarded either way (RFC 9110 §7.6.1; `Proxy-Connection`, its
# old spelling, too), besides those a message's `Connection` names.
HOP = frozenset(
    {
        "connection",
        "proxy-connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "host",
        "upgrade",
        "te",
        "trailer",
    }
)
# Of a client's request, what the router has dealt with itself: its `Expect: 100-continue` (the router
# answered it and has the whole body: sent on, the router's client would wait for an engine's `100
# Continue` before sending the body, and an engine need not send one), and its `Content-Encoding` (the
# router's server decoded the body, which goes on as it is).
_HANDLED = frozenset({"expect", "content-encoding"})

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
        sent = list(client)
        dropped = _hop_by_hop(sent) | _PROXY_ONLY | _HANDLED
        headers = CIMultiDict((k, v) for k, v in sent if k.lower() not in dropped)
    if stream:
        headers["Accept-Encoding"] = "identity"
    return headers


def answer_headers(upstream: Iterable[tuple[str, str]]) -> CIMultiDict[str]:
    """The headers of the answer passed back: the upstream's, but those of its hop."""
    answer = list(upstream)
    hop = _hop_by_hop(answer)
    return CIMultiDict((k, v) for k, v in answer if k.lower() not in hop)


def _hop_by_hop(headers: list[tuple[str, str]]) -> frozenset[str]:
    """The lowercase names of a message's headers of one hop: `HOP`, and those its `Connection` names."""
    named = {
        token.strip().lower()
        for k, v in headers
        if k.lower() == "connection"
        for token in v.split(",")
        if token.strip()
    }
    return HOP | named


def encoded(headers: Mapping[str, str]) -> bool:
    """Whether a body comes in a content coding (compressed), not as it is."""
    return headers.get("Content-Encoding", "identity").strip().lower() not in ("", "identity")
