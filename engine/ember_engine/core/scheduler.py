"""Continuous batching with chunked prefill (vLLM V1 semantics).

There is no prefill or decode phase: each request has tokens computed and tokens known, and each step
hands out one token budget — running requests first (decodes and unfinished prompt chunks), then
waiting ones (after their prefix-cache hit), chunking what does not fit. Once the running requests have
theirs, a decode may also take slots for speculative (lookahead) tokens, from budget and free blocks left
over. When blocks run out the newest request (or, under the priority policy, the least important, then
latest) is preempted by recompute: its blocks are freed and it goes back to the head of the queue, to be
resumed only when its whole known sequence fits again, so a resumed request is not preempted again
half-way through its prompt.

With `max_loras`, a step runs requests of at most that many LoRA adapters (the base model not counted): a
waiting request on another adapter is passed over, keeping its place, and those behind it may start
(vLLM's `--max-loras`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ember_engine.core.block_manager import BlockManager
from ember_engine.core.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # tokens scheduled for each request
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        max_loras: int | None = None,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy: unknown {policy!r}; choose fcfs or priority")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.max_loras = max_loras
        self.waiting: list[Request] = []  # fcfs: arrival order; priority: sorted by (priority, arrival)
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        # Whether the latest schedule() left requests waiting for KV blocks (it preempted, or the next one
        # did not fit), rather than for the token budget: such a request starts only when others end.
        self.blocked_on_memory = False

    def add(self, request: Request, front: bool = False) -> None:
        request.status = RequestStatus.WAITING
        if self.policy == "priority":
            # A binary search reads O(log n) keys; the insert itself is one memmove.
            at = bisect.bisect_right(self.waiting, request.sort_key(), key=Request.sort_key)
            self.waiting.insert(at, request)
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        running = list(self.running)
        for request in running:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            left = len(request.all_token_ids) - request.num_computed_tokens
            n = min(left, budget)
            bm = self.block_manager
            if request.num_computed_tokens + n <= len(request.block_ids) * bm.block_size:
                out.requests.append(request)  # its blocks already hold the tokens (most decodes)
                out.num_tokens.append(n)
                budget -= n
                continue
            while not self.block_manager.allocate(request, n):
                victim = self._pick_victim()
                if victim in out.requests:  # under the priority policy it may already be scheduled
                    slot = out.requests.index(victim)
                    budget += out.num_tokens.pop(slot)
                    out.requests.pop(slot)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    break
            else:
                out.requests.append(request)
                out.num_tokens.append(n)
                budget -= n
        budget = self._grant_lookahead(out, budget)
        # A step that had to preempt admits nobody: the freed room goes to the running requests.
        self.blocked_on_memory = bool(out.preempted)
        at = 0  # waiting requests passed over: their adapter has no room in this step
        while (
            len(self.waiting) > at
            and not out.preempted
            and budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[at]
            if not self._adapter_fits(request):
                at += 1
                continue
            if not self._admit(request, budget, out, at):
                self.blocked_on_memory = True
                break
            budget -= out.num_tokens[-1]
        return out

    def _adapter_fits(self, request: Request) -> bool:
        if self.max_loras is None or request.adapter == 0:
            return True
        running = {r.adapter for r in self.running} - {0}
        return request.adapter in running or len(running) < self.max_loras

    def _grant_lookahead(self, out: SchedulerOutput, budget: int) -> int:
        """Give decodes slots for speculative tokens, once every running request has what it needs this
        step: only budget and free blocks left over go to lookahead, so it never causes a preemption nor
        shrinks another request's chunk. Returns the budget left."""
        bm = self.block_manager
        for i, request in enumerate(out.requests):
            if budget <= 0:
                break
            n = out.num_tokens[i]
            decoding = len(request.all_token_ids) - request.num_computed_tokens == 1
            extra = min(request.spec_lookahead, budget) if decoding else 0
            if extra > 0 and bm.allocate(request, n + extra):
                out.num_tokens[i] += extra
                budget -= extra
        return budget

    def _admit(self, request: Request, budget: int, out: SchedulerOutput, at: int = 0) -> bool:
        bm = self.block_manager
        hits = bm.find_cached_prefix(request)
        num_hit = len(hits) * bm.block_size
        remaining = request.num_tokens - num_hit
        # Only admit what can be carried through its whole known sequence, so chunked prefills are not
        # preempted midway (the thrash of re-admitting a victim that cannot fit).
        if not bm.can_allocate(request, remaining, hits):
            return False
        n = min(remaining, budget)
        if not bm.allocate(request, n, hits):
            return False
        if not request.collecting_prompt_logprobs:  # it looked nothing up
            bm.record_lookup(request.num_tokens, num_hit, preempted=request.num_preemptions > 0)
        self.waiting.pop(at)
        request.num_computed_tokens = num_hit
        if request.num_preemptions == 0:
            request.num_prompt_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        out.requests.append(request)
        out.num_tokens.append(n)
        return True

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=Request.sort_key)
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = request.num_draft_computed = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.add(request, front=True)

    def finish(self, request: Request, reason: str) -> None:
        """Retire a running request (stopped or out of length) and release its blocks at once."""
        self.running.remove(request)
        self._release(request, reason)

    def abort(self, request: Request) -> None:
        """Stop a request: running, waiting, or not yet handed here (a sibling of n > 1 waiting for the
        first sample's prefill), which ends too. A request already finished keeps its reason."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request.finished:
            return
        self._release(request, "abort")

    def _release(self, request: Request, reason: str) -> None:
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
