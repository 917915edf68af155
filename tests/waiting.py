"""Polling with a deadline (tests synchronise on state, never on bare sleeps) and free local ports."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 30.0, what: str = "condition") -> T:
    """Poll `check` until it returns something truthy, and return that; fail naming `what` after `timeout`.

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
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
