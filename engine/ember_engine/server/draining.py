"""uvicorn, with SIGTERM meaning "drain", not "stop"."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

if TYPE_CHECKING:
    from ember_engine.server.state import ServerState

log = logging.getLogger("ember.serve")


class DrainingServer(uvicorn.Server):
    """SIGTERM starts a drain: /ready turns false at once, new requests go to the fallback or get a 503,
    in-flight ones get up to `drain_timeout` seconds, then the process exits 0. A second signal, or
    SIGINT, stops at once."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.state.draining:
            super().handle_exit(sig, frame)
            return
        log.info("SIGTERM: draining (%d in flight, up to %.0f s)", self.state.in_flight, self.drain_timeout)
        self.state.draining = True
        self.state.metrics.set_draining(True)
        threading.Thread(target=self._drain, name="ember-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        log.info("drained (%d still in flight); exiting", self.state.in_flight)
        self.should_exit = True
