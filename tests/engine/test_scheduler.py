"""Scheduler: token budget, chunked prefill, max_num_seqs, preemption, speculative slots and rollback."""

from dspark.config import EngineConfig
from dspark.engine.kv_cache import KVCacheManager
from dspark.engine.request import Request, RequestStatus
from dspark.engine.scheduler import Scheduler
from dspark.sampling_params import SamplingParams


def make(num_blocks=64, block_size=4, lookahead=0, **kw) -> Scheduler:
    cfg = EngineConfig(max_model_len=kw.pop("max_model_len", 256), block_size=block_size, **kw)
    return Scheduler(cfg, KVCacheManager(num_blocks, block_size), num_lookahead_tokens=lookahead)


def req(rid, n, max_tokens=100, start=0) -> Request:
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), 0, eos_token_ids=(999,))


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    new = {x.request.request_id: [token] for x in out.scheduled if x.samples}
    s.update(out, new)
    s.kv.check_integrity()
    return out


def test_chunked_prefill_under_token_budget():
    s = make(max_num_batched_tokens=10)
    r = req("a", 25)
    s.add(r)
    sizes = [step(s).num_tokens for _ in range(3)]
    assert sizes == [10, 10, 5]
    assert r.num_output_tokens == 1 and r.num_computed_tokens == 25  # sampled only after the last chunk
    out = step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1)]


def test_decode_and_prefill_share_a_step_and_running_goes_first():
    s = make(max_num_batched_tokens=8)
    a, b = req("a", 3), req("b", 20, start=100)
    s.add(a)
    step(s)
    s.add(b)
    out = step(s)
    assert [(x.request.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 7)]


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(f"r{i}", 3, start=10 * i))
    out = step(s)
    assert len(out.scheduled) == 2 and len(s.waiting) == 2


def test_preemption_frees_blocks_and_recomputes():
    s = make(num_blocks=5, block_size=4, max_num_batched_tokens=64)  # 4 usable blocks
    a, b = req("a", 7, max_tokens=8), req("b", 7, max_tokens=8, start=50)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 2 blocks each, 8 tokens each after sampling
    assert a.num_tokens == 8 and b.num_tokens == 8
    step(s)  # position 7: still 2 blocks each
    out = step(s)  # position 8: a needs a 3rd block, none is free: b (newest) is preempted
    assert out.preempted == [b] and b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.stats.num_preemptions == 1 and "b" not in s.kv.reqs
    # b is recomputed later from all its tokens (prompt + output so far) once a finishes.
    while not a.is_finished:
        step(s)
    while not b.is_finished:
        step(s)
    assert b.num_output_tokens == 8 and s.kv.check_integrity()["in_use"] == 0


def test_request_larger_than_cache_finishes_with_length():
    s = make(num_blocks=3, block_size=4)  # 2 usable blocks = 8 tokens
    r = req("a", 6, max_tokens=100)
    s.add(r)
    for _ in range(10):
        if r.is_finished:
            break
        step(s)
    assert r.is_finished and r.finish_reason == "length"
    assert s.kv.check_integrity()["in_use"] == 0


def test_stops_on_eos_stop_token_max_tokens_and_max_model_len():
    s = make(max_model_len=12)
    a = req("a", 3, max_tokens=2)
    b = Request("b", [1, 2], SamplingParams(max_tokens=50, stop_token_ids=[7]), 0, (999,))
    c = req("c", 4, max_tokens=50, start=20)
    s.add(a), s.add(b), s.add(c)
    step(s, token=7)
    assert b.finish_reason == "stop" and b.stop_reason == 7
    step(s, token=5)
    assert a.finish_reason == "length" and a.num_output_tokens == 2
    while not c.is_finished:
        step(s, token=5)
    assert c.finish_reason == "length" and c.num_tokens == 12
    d = req("d", 3)
    s.add(d)
    step(s, token=999)
    assert d.finish_reason == "stop" and d.stop_reason == 999


def test_speculative_lookahead_multi_token_query_and_rollback():
    """The engine's hooks for speculation: drafts are scheduled as extra query tokens of a decoding
    request, KV slots are reserved for them, and rejected positions roll back unhashed."""
    s = make(block_size=4, lookahead=3)
    r = req("a", 6)
    s.add(r)
    step(s, token=60)  # prefill; r has 7 tokens, 6 computed
    r.spec_token_ids = [61, 62, 63]
    out = s.schedule()
    (x,) = out.scheduled
    assert x.num_tokens == 4 and x.num_spec_tokens == 3 and x.samples
    # positions 6..9 scheduled, plus 3 lookahead slots reserved -> 13 positions -> 4 blocks
    assert len(s.kv.block_ids("a")) == 4
    # One draft accepted, then a recovered token: two tokens emitted, two drafts rolled back.
    s.update(out, {"a": [61, 70]})
    assert r.token_ids[-2:] == [61, 70] and r.num_computed_tokens == 8 and r.spec_token_ids == []
    # Hashed blocks hold committed tokens only: positions < 8 -> blocks 0 and 1.
    assert len(s.kv.reqs["a"].hashes) == 2
    cached_tokens = {s.kv.blocks[b].token_ids for b in s.kv.cached.values()}
    assert cached_tokens == {(0, 1, 2, 3), (4, 5, 60, 61)}
    s.kv.check_integrity()
