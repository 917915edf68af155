"""Grammar masks computed while the forward pass runs.

A step's masks depend only on tokens already kept, so they can be computed before its logits exist. The
engine starts them on a worker thread just before the forward pass (llguidance computes masks with the GIL
released, in its own thread pool, all rows of the batch in one call) and collects them when it samples. They
are written into one buffer allocated once, a row per request of the batch that samples this step, has a
grammar and no speculative proposals (verification masks its rows itself, walking the proposals).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ember_engine.sample.grammar import GrammarState, StepMasks, bitmask_words


class MaskPrefetcher:
    def __init__(self, max_rows: int, vocab: int) -> None:
        self.buffer = np.full((max_rows, bitmask_words(vocab)), -1, dtype=np.int32)
        self._worker: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance's LLExecutor, made on first use
        self._pending: Future[None] | None = None
        self._row_of: dict[int, int] = {}  # id(grammar state) -> buffer row

    def start(self, states: Sequence[GrammarState]) -> None:
        """Begin the masks of these states (the requests that will sample with a grammar this step)."""
        self.wait()
        self._row_of = {id(s): k for k, s in enumerate(states)}
        if not states:
            return
        if self._worker is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        jobs = [(s.matcher, k) for k, s in enumerate(states)]
        self._pending = self._worker.submit(self._fill, jobs)

    def _fill(self, jobs: list[tuple[Any, int]]) -> None:
        words = self.buffer.shape[1]
        self._executor.unsafe_compute_mask_ptr(jobs, self.buffer.ctypes.data, words * 4, self.buffer.shape[0])

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def masks(self, states: Sequence[GrammarState | None]) -> StepMasks | None:
        """The masks of the rows that have a state (rows in `states`' order), once the worker is done; a
        state that was not started is computed here. Valid until the next `start`."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return None
        self.wait()
        where = [self._row_of.get(id(states[i]), -1) for i in rows]
        if where == list(range(len(rows))):
            return StepMasks(rows, self.buffer[: len(rows)])
        packed = np.empty((len(rows), self.buffer.shape[1]), dtype=np.int32)
        for k, (i, w) in enumerate(zip(rows, where, strict=True)):
            if w >= 0:
                packed[k] = self.buffer[w]
            else:
                state = states[i]
                assert state is not None
                state.fill(packed[k])
        return StepMasks(rows, packed)

    def close(self) -> None:
        self.wait()
        if self._worker is not None:
            self._worker.shutdown()


def sampling_grammars(requests: Sequence[Any], num_tokens: Sequence[int]) -> list[GrammarState]:
    """The grammar states of the scheduled requests that will sample plainly this step: their chunk reaches
    their last known token, they have a grammar and no proposals."""
    return [
        r.grammar
        for r, n in zip(requests, num_tokens, strict=True)
        if r.grammar is not None and not r.spec_token_ids and r.num_computed_tokens + n == r.num_tokens
    ]
