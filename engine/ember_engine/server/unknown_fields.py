"""Top-level request fields ember does not declare: refused by name when ignoring them would change what
the client gets (OpenAI's legacy `functions`/`function_call`), otherwise ignored with a log line and a `Warning`
header, as vLLM's server does."""

from __future__ import annotations

import logging

from ember_engine.server.protocol import APIError

log = logging.getLogger("ember.server")

_LEGACY = "the legacy function-calling fields are not supported: use tools and tool_choice"
REFUSED: dict[str, str] = {"functions": _LEGACY, "function_call": _LEGACY}


def check_unknown(extra: dict[str, object] | None) -> dict[str, str]:
    """The response headers for a request's undeclared fields; APIError for one that is refused."""
    names = sorted(extra or {})
    for name in names:
        if name in REFUSED and (extra or {}).get(name) is not None:
            raise APIError(400, f"{name}: {REFUSED[name]}", param=name, code="unsupported_field")
    if not names:
        return {}
    log.warning("the following fields were present in the request but ignored: %s", names)
    # A header holds printable ASCII only: anything else in a name is escaped.
    listed = ", ".join(names).encode("ascii", "backslashreplace").decode()
    listed = "".join(c if " " <= c <= "~" and c != '"' else "?" for c in listed)[:1000]
    return {"Warning": f'299 ember "ignored unknown fields: {listed}"'}
