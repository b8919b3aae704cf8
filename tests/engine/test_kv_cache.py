"""KV block pool: ref counts, prefix hashing of committed tokens only, LRU eviction, rollback."""

import pytest

from dspark.engine.kv_cache import DUMMY_BLOCK_ID, KVCacheManager
from dspark.engine.request import Request
from dspark.sampling_params import SamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=100), seed=0, eos_token_ids=())


def run_prefill(kv: KVCacheManager, r: Request) -> None:
    hits, n = kv.find_cached_prefix(r)
    r.num_computed_tokens = n
    assert kv.allocate_slots(r, r.num_tokens - n, hits)
    r.num_computed_tokens = r.num_tokens
    kv.commit(r)


def test_allocate_and_free_keeps_counts():
    kv = KVCacheManager(num_blocks=9, block_size=4)
    r = req("a", list(range(10)))
    assert kv.allocate_slots(r, 10)
    assert len(kv.block_ids("a")) == 3 and DUMMY_BLOCK_ID not in kv.block_ids("a")
    assert kv.check_integrity() == {"free": 5, "cached_free": 0, "in_use": 3, "total": 8}
    kv.free(r)
    assert kv.check_integrity()["in_use"] == 0


def test_allocation_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4)  # 3 usable blocks
    a, b = req("a", list(range(8))), req("b", list(range(100, 108)))
    assert kv.allocate_slots(a, 8)
    before = kv.check_integrity()
    assert not kv.allocate_slots(b, 8)
    assert kv.check_integrity() == before and "b" not in kv.reqs


def test_prefix_hit_requires_committed_full_blocks_and_leaves_one_token():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = req("a", list(range(10)))  # blocks [0..3] [4..7] full, [8, 9] partial
    run_prefill(kv, a)
    b = req("b", list(range(10)) + [99])
    hits, n = kv.find_cached_prefix(b)
    assert n == 8 and hits == kv.block_ids("a")[:2]
    # A prompt identical to a cached one still computes its last token.
    c = req("c", list(range(8)))
    hits, n = kv.find_cached_prefix(c)
    assert n == 4
    # A different first block breaks the chain even if later blocks match.
    d = req("d", [7, 7, 7, 7] + list(range(4, 10)))
    assert kv.find_cached_prefix(d) == ([], 0)
    kv.check_integrity()


def test_uncommitted_positions_are_never_hashed():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    r = req("a", list(range(6)))
    assert kv.allocate_slots(r, 6, num_lookahead_tokens=4)  # 10 positions -> 3 blocks
    r.num_computed_tokens = 3  # only 3 committed
    kv.commit(r)
    assert not kv.cached
    r.token_ids += [50, 51]  # e.g. drafts accepted later
    r.num_computed_tokens = 8
    kv.commit(r)
    assert len(kv.cached) == 2
    kv.check_integrity()


def test_shared_blocks_are_ref_counted_and_survive_one_owner():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = req("a", list(range(12)))
    run_prefill(kv, a)
    b = req("b", list(range(12)) + [5])
    run_prefill(kv, b)
    shared = kv.block_ids("a")[:3]
    assert kv.block_ids("b")[:3] == shared
    assert all(kv.blocks[x].ref_count == 2 for x in shared)
    kv.free(a)
    assert all(kv.blocks[x].ref_count == 1 for x in shared)
    kv.check_integrity()
    kv.free(b)
    counts = kv.check_integrity()
    assert counts["cached_free"] == 3 and counts["in_use"] == 0


def test_cached_free_blocks_are_hit_then_evicted_lru():
    kv = KVCacheManager(num_blocks=5, block_size=4)  # 4 usable
    a = req("a", list(range(9)))
    run_prefill(kv, a)
    kv.free(a)
    b = req("b", list(range(9)))
    hits, n = kv.find_cached_prefix(b)
    assert n == 8
    b.num_computed_tokens = n
    assert kv.allocate_slots(b, 1, hits)  # hits leave the free queue
    assert kv.check_integrity()["in_use"] == 3
    kv.free(b)
    # A new, unrelated request takes every block: cached ones are evicted, hashes dropped.
    c = req("c", list(range(100, 116)))
    assert kv.allocate_slots(c, 16)
    assert not kv.cached
    kv.check_integrity()


def test_free_queue_evicts_tail_blocks_first():
    kv = KVCacheManager(num_blocks=10, block_size=2)
    a = req("a", list(range(8)))
    run_prefill(kv, a)
    ids = kv.block_ids("a")
    kv.free(a)
    assert list(kv.free_queue)[-4:] == list(reversed(ids))


def test_truncate_releases_rejected_tail_blocks():
    kv = KVCacheManager(num_blocks=20, block_size=4)
    r = req("a", list(range(5)))
    assert kv.allocate_slots(r, 5, num_lookahead_tokens=7)  # 12 positions -> 3 blocks
    assert len(kv.block_ids("a")) == 3
    r.num_computed_tokens = 5
    kv.truncate(r, 6)
    assert len(kv.block_ids("a")) == 2
    kv.check_integrity()


def test_integrity_check_catches_corruption():
    kv = KVCacheManager(num_blocks=6, block_size=4)
    r = req("a", list(range(4)))
    assert kv.allocate_slots(r, 4)
    kv.blocks[kv.block_ids("a")[0]].ref_count += 1
    with pytest.raises(AssertionError):
        kv.check_integrity()
