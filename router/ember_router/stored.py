"""Where the Responses API's stored responses are: each engine keeps its own (`ember serve
--responses-store N`), so a request continuing one (`previous_response_id`) and a `GET`/`DELETE` of one
must reach the engine that answered it. The router notes the engine of each response it relays (the
engine's `x-ember-response-id` header); one it has not seen (a router restarted, or another replica of it
relayed the answer) is looked for on the Ready engines."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from ember_engine.server.protocol import APIError
from ember_engine.server.responses_request import chat_body

HOMES = 65536  # responses whose engine is remembered (the oldest forgotten first)


class ResponseHomes:
    """Response id -> the URL of the engine that has it, for the last `size` responses."""

    def __init__(self, size: int = HOMES) -> None:
        self.size = size
        self._homes: OrderedDict[str, str] = OrderedDict()

    def put(self, response_id: str, engine: str) -> None:
        self._homes[response_id] = engine
        self._homes.move_to_end(response_id)
        while len(self._homes) > self.size:
            self._homes.popitem(last=False)

    def get(self, response_id: str) -> str | None:
        return self._homes.get(response_id)

    def drop(self, response_id: str) -> None:
        self._homes.pop(response_id, None)


def prompt_body(body: Any) -> dict[str, Any] | None:
    """The chat request a Responses API body runs as on an engine (for its prompt's hashes), or None when
    the engine will refuse it (it is then routed by load, and the engine answers the error). A body
    continuing a stored response gives the new input only: its route is the stored response's engine."""
    if not isinstance(body, dict):
        return None
    try:
        return chat_body(body)
    except (APIError, TypeError, ValueError, AttributeError):  # a refusal: the engine answers it
        return None
