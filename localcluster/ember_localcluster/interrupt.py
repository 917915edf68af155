"""For the benchmarks that start processes (`bench scale`, `fleet`, `operator`): SIGTERM stops a run as
SIGINT does, so the cluster's processes are stopped and the temporary directory removed either way, and
either signal ends the command with a line and 128 + the signal's number, not a traceback."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from types import FrameType


def run_interruptible(command: str, body: Callable[[], int]) -> int:
    received: list[int] = []

    def on_term(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # started in the background: SIGINT ignored
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGINT)  # unwind as SIGINT does (asyncio.run cancels its task first)

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return body()
    except KeyboardInterrupt:
        signum = received[0] if received else signal.SIGINT
        print(f"ember bench {command}: stopped by {signal.Signals(signum).name}", file=sys.stderr)
        return 128 + signum
    finally:
        signal.signal(signal.SIGTERM, previous)
