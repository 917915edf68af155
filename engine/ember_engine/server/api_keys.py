"""API keys. Given keys (`ember serve --api-key`, `ember router --api-key`, else the environment's
`EMBER_API_KEY`), a request needs `Authorization: Bearer KEY` with one of them, or it is answered 401 in
OpenAI's shape (code `invalid_api_key`, with `WWW-Authenticate: Bearer`) before its body is read. Only what
a probe, a scrape or a version check reads stays open (`OPEN_PATHS`). Keys are compared by their SHA-256
digests in constant time, every key each time, so the answer's timing tells nothing of how much matched.

`ApiKeyCheck` is the engine's ASGI layer; the router applies `ApiKeys.refusal` in its own middleware. A
server that sends requests on (an engine's or the router's fallback) presents `EMBER_FALLBACK_API_KEY`
there, never its client's credentials."""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
from collections.abc import Iterable, Mapping, Sequence

from ember_engine.server.body_limit import ASGIApp, Receive, Scope, Send, send_json

ENV = "EMBER_API_KEY"
FALLBACK_ENV = "EMBER_FALLBACK_API_KEY"
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})
CHALLENGE = "Bearer"  # the WWW-Authenticate of a refusal (RFC 6750)


def given_keys(flags: Sequence[str] | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys on the command line, else the one in EMBER_API_KEY, else none."""
    if flags:
        return list(flags)
    return [environ[ENV]] if environ.get(ENV) else []


def key_problem(keys: Iterable[str], flag: str = "--api-key") -> str | None:
    """Why these keys cannot be used (a key an Authorization header cannot carry as it is), or None."""
    for key in keys:
        if not key:
            return f"{flag}: an empty key"
        if not all("!" <= c <= "~" for c in key):
            return f"{flag}: a key may hold only printable ASCII without spaces"
    return None


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help=f"requests must carry 'Authorization: Bearer KEY' (repeat for several keys; default: ${ENV}); "
        f"{', '.join(sorted(OPEN_PATHS))} stay open",
    )


def bearer(key: str | None) -> dict[str, str]:
    """The header presenting `key` (none without one)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def fallback_headers(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a request to the fallback carries for it: EMBER_FALLBACK_API_KEY's key, if set."""
    return bearer(environ.get(FALLBACK_ENV))


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("latin-1", "replace")).digest()


class ApiKeys:
    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = tuple(_digest(k) for k in keys)

    def __bool__(self) -> bool:
        return bool(self._digests)

    def refusal(self, path: str, authorizations: Sequence[str]) -> str | None:
        """None when a request for `path` with these Authorization headers may pass; else why not."""
        if not self._digests or path in OPEN_PATHS:
            return None
        if not authorizations:
            return "no API key: send one as 'Authorization: Bearer KEY'"
        if len(authorizations) > 1:
            return "more than one Authorization header"
        scheme, _, token = authorizations[0].strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return "the Authorization header must be 'Bearer KEY'"
        digest = _digest(token)
        matched = False
        for known in self._digests:  # all of them, whichever matches
            matched |= hmac.compare_digest(known, digest)
        return None if matched else "incorrect API key"


def refusal_body(message: str) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


class ApiKeyCheck:
    """The engine's check: an ASGI layer outside the body limit, so a refused request's body is never read."""

    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v.decode("latin-1") for k, v in scope.get("headers", ()) if k.lower() == b"authorization"]
        why = self.keys.refusal(scope.get("path", ""), given)
        if why is None:
            await self.app(scope, receive, send)
            return
        await send_json(send, 401, refusal_body(why), [(b"www-authenticate", CHALLENGE.encode())])
