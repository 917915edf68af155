"""Grammar masks computed while the forward pass runs.

A step's masks depend only on tokens already known (kept, or proposed for verification), so they can be
computed before its logits exist. The engine starts them on a worker thread just before the forward pass
and collects them when it samples: llguidance computes them with the GIL released, in its own thread pool,
all of the batch's rows in one call per kind. They are written into one buffer, grown only when a step
needs more rows than any before: a row per request that samples plainly with a grammar, and 1 + k rows per
constrained request with k proposals (the state before each proposal and after the last, as
`grammar.draft_block` walks them).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ember_engine.sample.grammar import GrammarState, StepMasks, allows, bitmask_words, draft_masks

Drafted = tuple[GrammarState, Sequence[int]]  # a constrained request's state and its proposals


class MaskPrefetcher:
    """`device_type` is the forward pass's. On the CPU, whose every core the forward pass already keeps busy
    (a thread beside it only contends: measured slower), `start` does nothing and the masks are computed
    when asked for, into the same buffer."""

    def __init__(self, max_rows: int, vocab: int, device_type: str = "cuda") -> None:
        self.overlap = device_type != "cpu"
        self.buffer = np.full((max_rows, bitmask_words(vocab)), -1, dtype=np.int32)
        self._worker: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance's LLExecutor, made on first use
        self._pending: Future[None] | None = None
        self._row_of: dict[int, int] = {}  # id(grammar state) -> its first buffer row

    def start(self, plain: Sequence[GrammarState], drafted: Sequence[Drafted] = ()) -> None:
        """Begin the masks of the requests that will sample with a grammar this step: `plain` without
        proposals, `drafted` with theirs."""
        self.wait()
        self._row_of = {id(s): k for k, s in enumerate(plain)} if self.overlap else {}
        if not self.overlap or (not plain and not drafted):
            return
        jobs = [(s.matcher, k) for k, s in enumerate(plain)]
        draft_jobs, row = [], len(plain)
        for state, proposal in drafted:
            self._row_of[id(state)] = row
            if proposal:
                draft_jobs.append((state.matcher, row, list(proposal)))
            else:
                jobs.append((state.matcher, row))
            row += 1 + len(proposal)
        if row > self.buffer.shape[0]:
            self.buffer = np.full((row, self.buffer.shape[1]), -1, dtype=np.int32)
        if self._worker is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending = self._worker.submit(self._fill, jobs, draft_jobs)

    def _fill(self, jobs: list[Any], draft_jobs: list[Any]) -> None:
        ptr, size, rows = self.buffer.ctypes.data, self.buffer.shape[1] * 4, self.buffer.shape[0]
        if jobs:
            self._executor.unsafe_compute_mask_ptr(jobs, ptr, size, rows)
        if draft_jobs:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(draft_jobs, ptr, size, rows)

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
        if not self._row_of and len(rows) <= self.buffer.shape[0]:
            packed = self.buffer[: len(rows)]  # nothing was started: computed here, into the buffer
        else:
            packed = np.empty((len(rows), self.buffer.shape[1]), dtype=np.int32)
        for k, (i, w) in enumerate(zip(rows, where, strict=True)):
            if w >= 0:
                packed[k] = self.buffer[w]
            else:
                state = states[i]
                assert state is not None
                state.fill(packed[k])
        return StepMasks(rows, packed)

    def draft_masks(
        self, states: Sequence[GrammarState | None], drafts: Sequence[Sequence[int]]
    ) -> StepMasks | None:
        """Verification's masks (`grammar.draft_masks`), from the buffer where they were started."""
        if all(s is None for s in states):
            return None
        self.wait()

        def computed(i: int) -> np.ndarray | None:
            state, proposal = states[i], drafts[i]
            base = self._row_of.get(id(state), -1)
            if state is None or base < 0:
                return None
            block = self.buffer[base : base + 1 + len(proposal)].copy()
            for j, token in enumerate(proposal):
                if not allows(block[j], token):
                    block[j + 1 :] = block[j]  # refused: the rows after it keep its mask
                    return block
                if token in state.eos_token_ids:
                    return None  # the grammar ends inside the proposals: walked instead
            return block

        return draft_masks(states, drafts, computed)

    def verifying(self, requests: Sequence[Any]) -> StepMasks | None:
        """`draft_masks` of requests (each with `grammar` and `spec_token_ids`) in verification order."""
        return self.draft_masks([r.grammar for r in requests], [r.spec_token_ids for r in requests])

    def close(self) -> None:
        self.wait()
        if self._worker is not None:
            self._worker.shutdown()


def sampling_grammars(
    requests: Sequence[Any], num_tokens: Sequence[int]
) -> tuple[list[GrammarState], list[Drafted]]:
    """The grammar states of the scheduled requests that sample this step (their chunk reaches their last
    known token and their proposals): those without proposals, and those with theirs."""
    plain: list[GrammarState] = []
    drafted: list[Drafted] = []
    for r, n in zip(requests, num_tokens, strict=True):
        if r.grammar is None or r.num_computed_tokens + n != r.num_tokens + len(r.spec_token_ids):
            continue
        if r.spec_token_ids:
            drafted.append((r.grammar, r.spec_token_ids))
        else:
            plain.append(r.grammar)
    return plain, drafted
