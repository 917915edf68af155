"""Where the router sends what no engine takes: the fallback of the policy file (the engines' own file and
parser, re-read while the router runs), or of the `--fallback-*` flags when a router runs without one."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp

from ember_engine.server.policy import Fallback, PolicyWatcher

log = logging.getLogger("ember.router")

# The flags' deadline unless given: the policy file's `fallback.timeoutSeconds` unless set.
DEFAULT_TIMEOUT = Fallback().timeout_seconds


@dataclass(frozen=True, slots=True)
class FallbackTarget:
    url: str  # base URL, no trailing slash
    model: str | None  # the model name to send; None: the first one the fallback's /v1/models lists
    when: frozenset[str]  # Overloaded (the engines refused the request), Unavailable (none Ready)
    timeout: float | None = None  # seconds to connect and between reads; None: the router's own


def from_flags(
    url: str | None, model: str | None, when: frozenset[str], timeout: float = DEFAULT_TIMEOUT
) -> FallbackTarget | None:
    return FallbackTarget(url.rstrip("/"), model, when, timeout) if url else None


def from_policy(policy: PolicyWatcher) -> FallbackTarget | None:
    """The fallback of the policy in effect now (the watcher swaps in each good new file)."""
    f = policy.policy.fallback
    if f.url is None:
        return None
    return FallbackTarget(f.url.rstrip("/"), f.model, frozenset(f.when), f.timeout_seconds)


class ModelNames:
    """The model a fallback serves, asked of its /v1/models once per address when the policy names none."""

    def __init__(self) -> None:
        self._known: dict[str, str] = {}

    async def name(
        self, session: aiohttp.ClientSession, target: FallbackTarget, headers: Mapping[str, str] | None = None
    ) -> str | None:
        """The name to put in the request; None when it cannot be learnt (the request's own is kept)."""
        if target.model:
            return target.model
        if target.url not in self._known:
            timeout = aiohttp.ClientTimeout(total=target.timeout or 5.0, sock_connect=2.0)
            try:
                async with session.get(
                    f"{target.url}/v1/models", headers=headers, timeout=timeout
                ) as response:
                    listed = (await response.json()).get("data") or [] if response.status == 200 else []
            except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
                log.warning("fallback %s: could not list its models: %s", target.url, exc)
                return None
            if not listed or not isinstance(listed[0], dict) or "id" not in listed[0]:
                return None
            self._known[target.url] = str(listed[0]["id"])
        return self._known[target.url]
