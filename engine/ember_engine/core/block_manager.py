"""Paged KV-cache blocks with prefix caching.

Every block is free, cached (free but still holding a registered prefix, evictable), or referenced by
live requests. Full blocks are keyed by a chained hash of (parent hash, token ids, extra key), so a
block's key names its whole prefix. Unreferenced blocks sit in one LRU free queue; a request frees its
blocks tail-first, so the blocks holding the longest (least shareable) prefixes are evicted first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ember_engine.core.kv_events import REMOVED, STORED, KVEvents, chain_hash
from ember_engine.core.request import Request


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # tokens looked up at a request's first admission
    hits: int = 0  # of those, tokens found in the cache
    # A preempted request's lookups when it is admitted again, kept apart as vLLM does, so that its own
    # blocks (or those it shares) found again do not read as prefix-cache hits.
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    # Unreferenced blocks in eviction order (front = least recently freed). O(1) pop, push and removal.
    free_queue: OrderedDict[int, None] = field(init=False)
    cached: dict[int, Block] = field(init=False)  # hash -> block holding that prefix
    stats: PrefixCacheStats = field(init=False)
    events: KVEvents = field(init=False)  # what entered and left `cached`, for routers

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_queue = OrderedDict.fromkeys(range(self.num_blocks))
        self.cached = {}
        self.stats = PrefixCacheStats()
        self.events = KVEvents()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (cached-but-idle blocks count as free)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ---------------------------------------------------------------------------------

    def update_block_hashes(self, request: Request) -> None:
        """Extend the request's chain of full-block hashes over its known tokens."""
        tokens, size = request.all_token_ids, self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * size <= len(tokens):
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(
                chain_hash(parent, tokens[i * size : (i + 1) * size], request.cache_salt, request.lora_key)
            )

    def find_cached_prefix(self, request: Request) -> list[Block]:
        """The longest run of cached blocks matching the request's prefix, leaving at least the last
        token to compute (its logits are needed); none for a request collecting prompt logprobs."""
        if not self.enable_prefix_caching:
            return []
        self.update_block_hashes(request)
        if request.collecting_prompt_logprobs:  # every prompt position's logits are wanted
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[Block] = []
        for i, h in enumerate(request.block_hashes[:max_blocks]):
            block = self.cached.get(h)
            # Verifying the tokens makes a hash collision harmless.
            if block is None or block.token_ids != tuple(
                request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
            ):
                break
            hits.append(block)
        return hits

    def record_lookup(self, num_tokens: int, num_hit_tokens: int, preempted: bool) -> None:
        """Count an admission's lookup; nothing while prefix caching is off, when no lookup happens (as
        vLLM records no prefix-cache stats then, rather than queries that never hit)."""
        if not self.enable_prefix_caching:
            return
        if preempted:
            self.stats.preempted_queries += num_tokens
            self.stats.preempted_hits += num_hit_tokens
        else:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    # -- allocation -----------------------------------------------------------------------------------

    def can_allocate(self, request: Request, num_new_tokens: int, new_cached: Sequence[Block] = ()) -> bool:
        return self._num_new_blocks(request, num_new_tokens, new_cached) <= self._available(new_cached)

    def allocate(self, request: Request, num_new_tokens: int, new_cached: Sequence[Block] = ()) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens beyond its computed ones, first
        taking `new_cached` (prefix hits, only on its first allocation). False, changing nothing, when
        there is no room."""
        need = self._num_new_blocks(request, num_new_tokens, new_cached)
        if need > self._available(new_cached):
            return False
        for block in new_cached:
            if block.ref_count == 0:
                del self.free_queue[block.block_id]
            block.ref_count += 1
            request.block_ids.append(block.block_id)
        for _ in range(need):
            request.block_ids.append(self._take_free_block().block_id)
        return True

    def _num_new_blocks(self, request: Request, num_new_tokens: int, new_cached: Sequence[Block]) -> int:
        # new_cached (prefix hits) come before any computed token, so they extend the computed prefix.
        total = request.num_computed_tokens + len(new_cached) * self.block_size + num_new_tokens
        return max(0, self.blocks_needed(total) - len(request.block_ids) - len(new_cached))

    def _available(self, new_cached: Sequence[Block]) -> int:
        # Reviving a cached-but-free hit takes it out of the free queue.
        return len(self.free_queue) - sum(1 for b in new_cached if b.ref_count == 0)

    def _take_free_block(self) -> Block:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:  # evict the prefix it held
            if self.cached.get(block.hash) is block:
                del self.cached[block.hash]
                self.events.record(REMOVED, block.hash)
            block.hash, block.token_ids = None, ()
        block.ref_count = 1
        return block

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's newly completed blocks (all their tokens computed) in the cache."""
        if not self.enable_prefix_caching:
            return
        self.update_block_hashes(request)
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        for i in range(request.num_cached_blocks, num_full):
            block = self.blocks[request.block_ids[i]]
            h = request.block_hashes[i]
            if block.hash is None:
                block.hash = h
                block.token_ids = tuple(
                    request.all_token_ids[i * self.block_size : (i + 1) * self.block_size]
                )
                # A duplicate computed alongside an existing entry stays private; the first one wins.
                if h not in self.cached:
                    self.cached[h] = block
                    self.events.record(STORED, h)
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its longest prefixes are evicted first."""
        for block_id in reversed(request.block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None and self.cached.get(block.hash) is not block:
                    block.hash, block.token_ids = None, ()  # an unregistered duplicate: nothing to keep
                self.free_queue[block_id] = None
        request.block_ids.clear()
        request.num_cached_blocks = 0

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks beyond the first `num_tokens` positions: slots reserved for speculative
        tokens that were rejected. Such blocks were never shared or registered, so they go to the front
        of the free queue, to be reused before any block that still holds a cached prefix."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_ids) > keep:
            block = self.blocks[request.block_ids.pop()]
            block.ref_count -= 1
            assert block.ref_count == 0 and block.hash is None, "a lookahead block was shared"
            self.free_queue[block.block_id] = None
            self.free_queue.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        for h, block in list(self.cached.items()):
            if block.ref_count == 0:
                del self.cached[h]
                self.events.record(REMOVED, h)
                block.hash, block.token_ids = None, ()
