"""uvicorn, with SIGTERM meaning "drain", not "stop"."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

import uvicorn

from ember_engine.server.protocol import APIError

if TYPE_CHECKING:
    from ember_engine.server.state import ServerState

log = logging.getLogger("ember.serve")

# How long requests ended by a stop get to write their error before uvicorn closes what is left.
_GRACE_S = 0.8


class DrainingServer(uvicorn.Server):
    """SIGTERM starts a drain: /ready turns false at once, new requests go to the fallback or get a 503,
    in-flight ones get up to `drain_timeout` seconds, then the process exits 0. A second signal, or
    SIGINT, stops at once. Requests a stop ends get a 503 `code: "draining"` (a stream: an error event
    and [DONE]), not a cut connection."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout = state, drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig != signal.SIGTERM or self.state.draining:
            self._abort_in_flight("server is stopping")
            super().handle_exit(sig, frame)
            return
        log.info("SIGTERM: draining (%d in flight, up to %g s)", self.state.in_flight, self.drain_timeout)
        self.state.draining = True
        self.state.metrics.set_draining(True)
        threading.Thread(target=self._drain, name="ember-drain", daemon=True).start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if self.state.in_flight > 0:
            self._abort_in_flight("server is draining: its drain timeout has passed")
            until = time.monotonic() + _GRACE_S
            while self.state.in_flight > 0 and time.monotonic() < until:
                time.sleep(0.02)
        log.info("drained (%d still in flight); exiting", self.state.in_flight)
        self.should_exit = True

    def _abort_in_flight(self, message: str) -> None:
        """End the engine's requests now, each with a 503 its handler answers (uvicorn would cancel them)."""
        engine = self.state.engine
        if engine is None or self.state.in_flight == 0:
            return
        log.info("%s: aborting %d request(s) in flight", message, self.state.in_flight)
        error = APIError(503, message, "overloaded", code="draining")
        error.headers["Retry-After"] = "1"
        engine.abort_all(error)
