"""Paged KV-cache bookkeeping: a block pool with reference counts and automatic prefix caching.

The manager owns block ids, never tensors (the runner owns the KV tensors). Block 0 is reserved as a
dummy block: padding rows may point at it and nothing live is ever stored there.

Prefix caching: a full block of *committed* tokens gets a chained hash
``h_i = hash((h_{i-1}, tokens of block i))``. A new request reuses the longest run of leading blocks
whose hashes (and tokens, double-checked) match. Blocks whose ref count drops to 0 go to the tail of
a free queue but keep their hash, so they can still be hit until the allocator evicts them from the
head (least recently freed first). Only committed tokens are hashed: positions written for drafts
that were then rejected are never in the cache.

Block states (checked by ``check_integrity``):
    in use        ref_count > 0
    cached-free   ref_count == 0, in the free queue, has a hash (reusable as a prefix hit)
    free          ref_count == 0, in the free queue, no hash
    free + cached-free + in use == total usable blocks (all but the dummy block 0).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from dspark.engine.request import Request

DUMMY_BLOCK_ID = 0


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the tokens behind the hash, to double-check hits


@dataclass
class _ReqBlocks:
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # chained hashes of the leading committed blocks


def _chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks (one is the dummy block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free queue in LRU order: the head is evicted first. Dummy block 0 is never in it.
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # hash -> block id
        self.reqs: dict[str, _ReqBlocks] = {}
        # Prefix-cache statistics (tokens).
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---------------------------------------------------------------- queries
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self.reqs[request_id].block_ids

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---------------------------------------------------------------- prefix cache
    def find_cached_prefix(self, request: Request) -> tuple[list[int], int]:
        """Longest cached run of leading full blocks of the request's tokens, leaving at least one
        token to compute (its logits are needed). Returns (block ids, number of tokens they cover).
        No side effects beyond statistics."""
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        tokens = request.token_ids
        hits: list[int] = []
        parent: int | None = None
        for i in range((len(tokens) - 1) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = _chain_hash(parent, chunk)
            bid = self.cached.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:
                break
            hits.append(bid)
            parent = h
        self.prefix_queries += len(tokens)
        self.prefix_hits += len(hits) * bs
        return hits, len(hits) * bs

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    # ---------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: list[int] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Make room for KV of positions [0, num_computed + num_new + lookahead).

        ``cached_blocks`` are prefix hits from ``find_cached_prefix`` (first admission only); the
        lookahead reserves slots for draft tokens. Returns False, changing nothing, if the pool
        cannot supply the blocks."""
        rb = self.reqs.get(request.request_id)
        held = len(rb.block_ids) if rb else 0
        need = self.blocks_needed(request.num_computed_tokens + num_new_tokens + num_lookahead_tokens)
        if rb is not None and need <= held and not cached_blocks:  # the usual decode step: its blocks are there
            return True
        cached_blocks = cached_blocks or []
        num_fresh = need - held - len(cached_blocks)
        # Hits that sit in the free queue stop being free when touched.
        num_free_hits = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_fresh > self.num_free_blocks - num_free_hits:
            return False
        if rb is None:
            rb = self.reqs[request.request_id] = _ReqBlocks()
        for bid in cached_blocks:
            blk = self.blocks[bid]
            if blk.ref_count == 0:
                del self.free_queue[bid]
            blk.ref_count += 1
            rb.block_ids.append(bid)
            assert blk.hash is not None
            rb.hashes.append(blk.hash)
        for _ in range(max(num_fresh, 0)):
            rb.block_ids.append(self._pop_free())
        return True

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        blk = self.blocks[bid]
        if blk.hash is not None:  # evict a cached-free block
            if self.cached.get(blk.hash) == bid:
                del self.cached[blk.hash]
            blk.hash = None
            blk.token_ids = None
        blk.ref_count = 1
        return bid

    def _release(self, bid: int) -> None:
        blk = self.blocks[bid]
        blk.ref_count -= 1
        assert blk.ref_count >= 0, f"block {bid} released more often than taken"
        if blk.ref_count == 0:
            self.free_queue[bid] = None

    def free(self, request: Request) -> None:
        """Release all of a request's blocks (finish, abort or preemption). Tail blocks are queued
        first so they are evicted before the shared prefix."""
        rb = self.reqs.pop(request.request_id, None)
        if rb is None:
            return
        for bid in reversed(rb.block_ids):
            self._release(bid)

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Release blocks past what ``num_tokens`` positions need (roll back rejected positions)."""
        rb = self.reqs.get(request.request_id)
        if rb is None:
            return
        keep = self.blocks_needed(num_tokens)
        assert keep >= len(rb.hashes), "cannot truncate into committed, hashed blocks"
        while len(rb.block_ids) > keep:
            self._release(rb.block_ids.pop())

    def commit(self, request: Request) -> None:
        """Hash the request's full blocks of committed tokens (positions < num_computed_tokens)."""
        if not self.enable_prefix_caching:
            return
        rb = self.reqs.get(request.request_id)
        if rb is None:
            return
        bs = self.block_size
        tokens = request.token_ids
        # Never past a pending placeholder (async scheduling): its token is not known yet.
        num_full = min(request.num_computed_tokens, request.num_real_tokens) // bs
        while len(rb.hashes) < num_full:
            i = len(rb.hashes)
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = _chain_hash(rb.hashes[-1] if rb.hashes else None, chunk)
            rb.hashes.append(h)
            blk = self.blocks[rb.block_ids[i]]
            if blk.hash is None and h not in self.cached:
                blk.hash, blk.token_ids = h, chunk
                self.cached[h] = blk.block_id
            # else: the same content is already cached in another block; this copy stays unhashed.

    def reset_prefix_cache(self) -> None:
        """Forget all cached-free blocks (e.g. after weights change)."""
        for bid in self.free_queue:
            blk = self.blocks[bid]
            if blk.hash is not None:
                self.cached.pop(blk.hash, None)
                blk.hash, blk.token_ids = None, None

    # ---------------------------------------------------------------- invariants
    def check_integrity(self) -> dict[str, int]:
        """Assert the pool's invariants; return the counts of each block state."""
        refs = [0] * self.num_blocks
        for rid, rb in self.reqs.items():
            assert len(set(rb.block_ids)) == len(rb.block_ids), f"request {rid} holds a block twice"
            assert len(rb.hashes) <= len(rb.block_ids)
            for bid in rb.block_ids:
                assert bid != DUMMY_BLOCK_ID, f"request {rid} holds the dummy block"
                refs[bid] += 1
        in_use = free = cached_free = 0
        for blk in self.blocks[1:]:
            assert blk.ref_count == refs[blk.block_id], (
                f"block {blk.block_id}: ref_count {blk.ref_count} but held by {refs[blk.block_id]} requests"
            )
            in_free_queue = blk.block_id in self.free_queue
            assert in_free_queue == (blk.ref_count == 0), f"block {blk.block_id}: free queue disagrees with ref count"
            if blk.ref_count > 0:
                in_use += 1
            elif blk.hash is not None:
                cached_free += 1
            else:
                free += 1
            if blk.hash is not None:
                assert self.cached.get(blk.hash) == blk.block_id, f"block {blk.block_id}'s hash is not indexed"
        assert DUMMY_BLOCK_ID not in self.free_queue and self.blocks[0].ref_count == 0
        for h, bid in self.cached.items():
            assert self.blocks[bid].hash == h, f"cache index points at block {bid} with another hash"
        assert free + cached_free + in_use == self.num_usable_blocks
        return {"free": free, "cached_free": cached_free, "in_use": in_use, "total": self.num_usable_blocks}
