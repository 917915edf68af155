"""Polling with a deadline (tests synchronise on state, never on bare sleeps) and free local ports."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 30.0, what: str | Callable[[], str] = "condition") -> T:
    """Poll `check` until it returns something truthy, and return that; fail naming `what` after `timeout`
    (a callable `what` is asked at the deadline, so a description of the state is the state then).

    A check that raises AssertionError, KeyError, TypeError or IndexError (state not there yet) counts as
    not yet.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        with contextlib.suppress(AssertionError, KeyError, TypeError, IndexError):
            last = check()
            if last:
                return last
        time.sleep(0.05)
    described = what() if callable(what) else what
    raise AssertionError(f"timed out after {timeout:g} s waiting for {described} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
