"""Top-level request fields ember does not declare: refused by name when ignoring them would change what
the client gets (structured outputs, tool calling), otherwise ignored with a log line and a `Warning`
header, as vLLM's server does."""

from __future__ import annotations

import logging

from ember_engine.server.protocol import APIError

log = logging.getLogger("ember.server")

_STRUCTURED = "structured outputs are not supported by this server"
_TOOLS = "tool calling is not supported by this server"
REFUSED: dict[str, str] = {
    "response_format": _STRUCTURED,
    "structured_outputs": _STRUCTURED,
    "guided_json": _STRUCTURED,
    "guided_regex": _STRUCTURED,
    "guided_choice": _STRUCTURED,
    "guided_grammar": _STRUCTURED,
    "tools": _TOOLS,
    "tool_choice": _TOOLS,
    "parallel_tool_calls": _TOOLS,
    "functions": _TOOLS,
    "function_call": _TOOLS,
}


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
