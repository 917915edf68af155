"""Block accounting under random arrivals, aborts and finishes (scheduler + block manager, no model):
after every step each block is free, cached, or referenced by exactly the live requests holding it."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from pytest import MonkeyPatch

from ember_engine.core.block_manager import BlockManager
from ember_engine.core.request import Request, RequestStatus
from ember_engine.core.scheduler import Scheduler
from ember_engine.sample.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 24


def check_invariants(bm: BlockManager, sched: Scheduler) -> None:
    live = [*sched.running, *sched.waiting]
    holders = Counter(b for r in live for b in r.block_ids)
    for block in bm.blocks:
        assert block.ref_count == holders[block.block_id], block
        assert (block.block_id in bm.free_queue) == (block.ref_count == 0), block
    for h, block in bm.cached.items():
        assert block.hash == h and len(block.token_ids) == BLOCK
    for r in sched.waiting:
        assert r.block_ids == [] and r.num_computed_tokens == 0 and r.status is RequestStatus.WAITING
    for r in sched.running:
        assert r.status is RequestStatus.RUNNING
        assert len(r.block_ids) * BLOCK >= r.num_computed_tokens
        # A computed, registered block still holds exactly the tokens it is keyed by.
        for i in range(min(r.num_computed_tokens // BLOCK, len(r.block_ids))):
            block = bm.blocks[r.block_ids[i]]
            if block.hash is not None:
                assert block.token_ids == tuple(r.all_token_ids[i * BLOCK : (i + 1) * BLOCK])
    assert len(sched.running) <= sched.max_num_seqs


events = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 30), st.integers(1, 12), st.integers(0, 3), st.integers(0, 2)
        ),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("step"), st.integers(1, 3)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
    events=events,
    policy=st.sampled_from(["fcfs", "priority"]),
    budget=st.sampled_from([5, 16, 64]),
    prefix=st.booleans(),
)
def test_blocks_are_always_accounted_for(events: list, policy: str, budget: int, prefix: bool) -> None:
    bm = BlockManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=prefix)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=budget, policy=policy)
    requests: list[Request] = []
    bases = [[7] * 12, [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9]]
    for event in events:
        if event[0] == "add":
            _, prompt_len, max_tokens, priority, base = event
            prompt = (bases[base] * 10)[:prompt_len]  # shared prefixes exercise the cache
            # Like the engine: refuse what could never fit the whole cache.
            if bm.blocks_needed(prompt_len + max_tokens) > NUM_BLOCKS:
                continue
            req = Request(
                f"r{len(requests)}",
                prompt,
                SamplingParams(max_tokens=max_tokens),
                max_tokens=max_tokens,
                priority=priority,
                arrival_time=float(len(requests)),
            )
            requests.append(req)
            sched.add(req)
        elif event[0] == "abort":
            if requests:
                sched.abort(requests[event[1] % len(requests)])
        else:
            for _ in range(event[1]):
                out = sched.schedule()
                for req, n in zip(out.requests, out.num_tokens, strict=True):
                    assert n >= 1
                    req.num_computed_tokens += n
                    bm.cache_full_blocks(req)
                    if req.num_computed_tokens == req.num_tokens:  # sampled: a new token
                        req.append_token(len(req.all_token_ids) % 5)
                        if req.num_output_tokens >= req.max_tokens:
                            sched.finish(req, "length")
                check_invariants(bm, sched)
        check_invariants(bm, sched)
    # Draining the rest always terminates: nothing can wait forever.
    for _ in range(2000):
        if not sched.has_unfinished():
            break
        out = sched.schedule()
        assert out.requests, "no progress with requests pending"
        for req, n in zip(out.requests, out.num_tokens, strict=True):
            req.num_computed_tokens += n
            bm.cache_full_blocks(req)
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(1)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish(req, "length")
        check_invariants(bm, sched)
    assert not sched.has_unfinished()
    assert bm.num_free_blocks == NUM_BLOCKS


def test_preemption_order_fcfs_newest_first() -> None:
    bm = BlockManager(6, BLOCK)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    reqs = [
        Request(f"r{i}", [i + 1] * 8, SamplingParams(), max_tokens=50, arrival_time=float(i))
        for i in range(3)
    ]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()  # all three prompts: 2 blocks each, cache full
    assert out.requests == reqs
    for r, n in zip(out.requests, out.num_tokens, strict=True):
        r.num_computed_tokens += n
        r.all_token_ids.append(0)
    out = sched.schedule()  # each needs a third block: the newest is preempted
    assert out.preempted == [reqs[2]] and sched.waiting == [reqs[2]]
    assert reqs[2].num_computed_tokens == 0 and reqs[2].block_ids == []


def test_preemption_order_priority_least_important_first() -> None:
    bm = BlockManager(6, BLOCK)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, policy="priority")
    prios = [2, 0, 1]
    reqs = [
        Request(f"r{i}", [i + 1] * 8, SamplingParams(), max_tokens=50, arrival_time=float(i), priority=p)
        for i, p in enumerate(prios)
    ]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert out.requests == [reqs[1], reqs[2], reqs[0]]  # admitted by priority
    for r, n in zip(out.requests, out.num_tokens, strict=True):
        r.num_computed_tokens += n
        r.all_token_ids.append(0)
    out = sched.schedule()
    assert reqs[0] in out.preempted and reqs[1] in out.requests


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    bm = BlockManager(64, BLOCK)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    short = Request("short", [1, 2, 3], SamplingParams(), max_tokens=20)
    sched.add(short)
    out = sched.schedule()
    short.num_computed_tokens += out.num_tokens[0]
    short.all_token_ids.append(5)
    long = Request("long", list(range(1, 40)), SamplingParams(), max_tokens=5)
    sched.add(long)
    out = sched.schedule()
    # The running decode gets its token and the long prompt's first chunk fills the rest of the budget.
    assert out.requests == [short, long] and out.num_tokens == [1, 9]


def test_priority_insertion_reads_logarithmically_many_keys(monkeypatch: MonkeyPatch) -> None:
    calls = 0
    original = Request.sort_key

    def counted(self: Request) -> tuple[int, float]:
        nonlocal calls
        calls += 1
        return original(self)

    monkeypatch.setattr(Request, "sort_key", counted)
    sched = Scheduler(
        BlockManager(NUM_BLOCKS, BLOCK), max_num_seqs=8, max_num_batched_tokens=64, policy="priority"
    )
    n = 2000
    for i in range(n):
        sched.add(Request(f"r{i}", [1], SamplingParams(), arrival_time=float(i), priority=(i * 7919) % 13))
    assert calls <= n * (n.bit_length() + 2)  # a sorted insert reads O(log n) keys, not every waiting one
    keys = [r.sort_key() for r in sched.waiting]
    assert keys == sorted(keys) and len(keys) == n
