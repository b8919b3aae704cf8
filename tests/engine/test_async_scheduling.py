"""Async scheduling (LLMEngine._step_async): decode step t + 1 is launched before step t's tokens are
read back, its input tokens taken on the device from step t's output. Run on the CPU through the
fixed-shape graph steps (``enable_graphs(capture=False)``, Triton's interpreter), which is the path
the launch/finish split runs on. What must hold: the same tokens, finish reasons and streamed deltas
as without it; requests that stop (stop token, EOS, max_tokens), get aborted or arrive while a step
is in flight; the KV pool whole afterwards; and the path really taken."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.engine.request import PENDING_TOKEN  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("async") / "t", "llama", seed=7)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 9, 26)]


def _llm(target, async_: bool, num_kv_blocks: int = 64, tok: bool = False, **kw) -> LLM:
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=num_kv_blocks, attention_backend="triton",
              async_scheduling=async_, **{"max_num_seqs": 4, **kw})
    llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[16, 32, 64])
    if tok:
        llm.engine.tokenizer = CharTok()
    return llm


class CharTok:
    """Token id -> one letter: enough for stop strings and the detokenizer; fails loudly if a pending
    placeholder is ever decoded."""

    chat_template = None

    def decode(self, ids, skip_special_tokens=True):
        assert all(i >= 0 for i in ids), "a pending placeholder reached the tokenizer"
        return "".join(chr(97 + i % 26) for i in ids)


def _check_invariants(eng) -> None:
    """After every step(): the KV pool whole; placeholders only at the end of token_ids, at most two
    with a step in flight (the step read back next and the one after it), none otherwise."""
    eng.kv.check_integrity()
    inflight = eng._inflight is not None
    for r in eng.scheduler.running:
        assert 0 <= r.num_pending <= (2 if inflight else 0)
        assert PENDING_TOKEN not in r.token_ids[:r.num_real_tokens]
        assert all(t == PENDING_TOKEN for t in r.token_ids[r.num_real_tokens:])


def _drive(llm: LLM, requests, events=None) -> tuple[dict, dict, list]:
    """Step an engine by hand: ``requests`` [(prompt, params)] added at the start, ``events`` {call
    number: fn(engine)} run before that step() call. Returns ({id: final output}, {id: streamed token
    ids}, [whether a step was in flight before each call])."""
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in requests]
    final, streamed, text, inflight = {}, {}, {}, []
    n = 0
    while len(final) < len(ids) or events:
        if events and n in events:
            ids.extend(events.pop(n)(eng) or [])
        inflight.append(eng._inflight is not None)
        for out in eng.step():
            assert PENDING_TOKEN not in out.token_ids and PENDING_TOKEN not in out.delta_token_ids
            streamed.setdefault(out.request_id, []).extend(out.delta_token_ids)
            text[out.request_id] = text.get(out.request_id, "") + out.delta_text
            assert streamed[out.request_id] == out.token_ids and text[out.request_id] == out.text
            if out.finished:
                assert out.request_id not in final, "a request reported finished twice"
                final[out.request_id] = out
        _check_invariants(eng)
        n += 1
        assert n < 500
    assert set(final) == set(ids)
    assert eng.kv.check_integrity()["in_use"] == 0 and eng._inflight is None
    return final, streamed, inflight


def _summary(final: dict) -> dict:
    return {rid: (o.token_ids, o.finish_reason, o.stop_reason, o.text) for rid, o in final.items()}


def test_stops_match_sync(target, prompts):
    """Stop tokens hit mid-sequence, EOS, different max_tokens: step t + 1 was already launched for a
    request that stops at t; its row is dropped and the request ends exactly as without async."""
    free = _llm(target, False).generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    stops = [o.token_ids[k] for o, k in zip(free, (3, 6, 1))]  # tokens the greedy runs really emit
    reqs = [(p, SamplingParams(temperature=0, max_tokens=m, stop_token_ids=[s], ignore_eos=False))
            for p, m, s in zip(prompts, (12, 9, 12), stops)]
    reqs.append((prompts[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
    want, _, _ = _drive(_llm(target, False), reqs)
    llm = _llm(target, True)
    got, streamed, inflight = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    assert [o.finish_reason for o in got.values()].count("stop") >= 2
    g = llm.engine.runner.graphs
    assert g.stats["async"] > 0 and sum(inflight) >= g.stats["async"] // 2  # steps really overlapped
    assert llm.engine._inflight is None  # nothing left dangling once every request ended


def test_abort_and_arrival_while_in_flight(target, prompts):
    """A request aborted while its next step is in flight, and one that arrives while a step is in
    flight: the others' tokens are unchanged, the aborted one reports 'abort' once, no KV leaks."""
    params = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, _llm(target, False).generate(prompts, params))}
    llm = _llm(target, True)
    seen = {}

    def abort(eng):
        seen["inflight_at_abort"] = eng._inflight is not None
        eng.abort("req-1")

    def arrive(eng):
        seen["inflight_at_arrival"] = eng._inflight is not None
        return [eng.add_request(prompts[2], params)]

    final, _, _ = _drive(llm, [(p, params) for p in prompts[:2]], {4: abort, 7: arrive})
    assert seen == {"inflight_at_abort": True, "inflight_at_arrival": True}
    assert final["req-1"].finish_reason == "abort" and len(final["req-1"].token_ids) < 14
    assert final["req-0"].token_ids == ref[tuple(prompts[0])]
    assert final["req-2"].token_ids == ref[tuple(prompts[2])]


def test_kv_pressure_matches_sync(target, prompts):
    """A pool too small for every request: the scheduler preempts (never while a step is launched on
    top of another: Scheduler.can_continue refuses when blocks would run out), results unchanged."""
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 16, 12)]
    reqs = list(zip(prompts, params))
    want, _, _ = _drive(_llm(target, False, num_kv_blocks=14), reqs)
    llm = _llm(target, True, num_kv_blocks=14)
    got, _, _ = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    assert llm.engine.runner.graphs.stats["async"] > 0
    assert sum(o.stats["num_preemptions"] for o in got.values()) > 0  # the pool really ran short


@pytest.mark.parametrize("case", ["filters", "temperature"])
def test_sampled_requests_match_sync(target, prompts, case):
    """Seeded sampling (whole vocabulary; top-p; min-p) mixed with a greedy request in the same
    asynchronously launched steps: the noise is keyed by (seed, position), and the position of a
    sampled token counts the pending placeholders, so the tokens equal the synchronous engine's.
    Launched steps are drawn by the sampling graphs (StepGraphs._sample_step), the one with top-p /
    min-p while such a row is in the batch (filters) or the temperature-only one."""
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=3),
              SamplingParams(temperature=0.8, min_p=0.05, max_tokens=10, ignore_eos=True, seed=4),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=11, ignore_eos=True, seed=5),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)]
    if case == "temperature":
        params[1:3] = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True, seed=4),
                       SamplingParams(temperature=0.7, max_tokens=11, ignore_eos=True, seed=5)]
    reqs = list(zip(prompts + prompts[:1], params))
    want, _, _ = _drive(_llm(target, False), reqs)
    llm = _llm(target, True)
    got, _, _ = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    g = llm.engine.runner.graphs
    assert g.stats["async"] > 0
    assert g.stats["sample"] == g.stats["async"]  # every launched step drawn by a sampling graph (none all-greedy)
    assert {filtered for _, filtered in g.sample} == ({False, True} if case == "filters" else {False})


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, repetition_penalty=1.2),
                                    SamplingParams(temperature=0.8, top_k=5, max_tokens=6, ignore_eos=True, seed=1),
                                    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)],
                         ids=["penalty", "top-k", "logprobs"])
def test_requests_that_stay_synchronous(target, prompts, params):
    """Penalties (they count output tokens the host does not have yet), top-k (candidate sampling
    checks ties on the host) and logprobs keep a batch off the async path, with the same tokens."""
    want, _, _ = _drive(_llm(target, False), [(prompts[0], params)])
    llm = _llm(target, True)
    got, _, _ = _drive(llm, [(prompts[0], params)])
    assert _summary(got) == _summary(want) and llm.engine.runner.graphs.stats["async"] == 0


def test_stop_strings_and_max_model_len_match_sync(target, prompts):
    """Stop strings (found by the detokenizer after the read-back, while the next step is in flight),
    with and without include_stop_str_in_output, and the max_model_len stop: as without async."""
    four = prompts + [prompts[1][:8]]
    free, _, _ = _drive(_llm(target, False, tok=True),
                        [(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for p in four])
    texts = [free[f"req-{i}"].text for i in range(4)]
    G = dict(temperature=0, ignore_eos=True)
    reqs = [(four[0], SamplingParams(max_tokens=12, stop=[texts[0][4:6]], **G)),
            (four[1], SamplingParams(max_tokens=12, stop=[texts[1][2:5]], include_stop_str_in_output=True, **G)),
            (four[2], SamplingParams(max_tokens=30, **G)),  # 26 + 14 = max_model_len 40: 'length'
            (four[3], SamplingParams(temperature=0.9, seed=3, max_tokens=9, stop=[texts[3][0:1]]))]
    want, _, _ = _drive(_llm(target, False, tok=True, max_model_len=40), reqs)
    llm = _llm(target, True, tok=True, max_model_len=40)
    got, _, _ = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    assert llm.engine.runner.graphs.stats["async"] > 0
    assert [o.finish_reason for o in want.values()].count("stop") >= 2


def test_prefix_hit_admission_and_abort_everything(target, prompts):
    """A prompt already cached in full arrives while a step is in flight (admitted with one row, then
    launched asynchronously); then every request is aborted while a step is in flight: each reports
    'abort' once, nothing stays in flight, no block leaks, and the engine serves the next request."""
    P = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    short = prompts[1][:8]  # block-aligned: cached in full after the first request
    again = {5: lambda eng: [eng.add_request(short, P), eng.add_request(prompts[1], P)]}
    want, _, _ = _drive(_llm(target, False), [(short, P), (prompts[1], P)], dict(again))
    llm = _llm(target, True)
    got, _, _ = _drive(llm, [(short, P), (prompts[1], P)], dict(again))
    assert _summary(got) == _summary(want) and llm.engine.kv.prefix_hit_rate > 0
    eng = llm.engine
    for p in prompts:
        eng.add_request(p, P)
    for _ in range(3):
        eng.step()
    assert eng._inflight is not None
    for rid in list(eng.requests):
        eng.abort(rid)
    outs = eng.step()  # the aborts are reported by the next step()
    assert sorted(o.finish_reason for o in outs) == ["abort"] * 3 and eng._inflight is None and not eng.requests
    assert eng.kv.check_integrity()["in_use"] == 0
    final, _, _ = _drive(llm, [(short, P)])
    assert [o.token_ids for o in final.values()] == [want["req-0"].token_ids]


def test_overlap_while_requests_wait_for_a_seat(target, prompts):
    """Under load (more requests than max_num_seqs), steps still overlap: a request that schedule()
    could not seat does not stop the pipeline (Scheduler._may_admit)."""
    P = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = [(p, P) for p in prompts + prompts[:1]]
    want, _, _ = _drive(_llm(target, False, max_num_seqs=2), reqs)
    llm = _llm(target, True, max_num_seqs=2)
    on_top, orig = [], llm.engine.runner.launch
    llm.engine.runner.launch = lambda sched, kv, prev: (on_top.append(prev is not None), orig(sched, kv, prev))[1]
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    final = {}
    while len(final) < len(ids):
        waiting = len(eng.scheduler.waiting)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        if waiting and on_top and on_top[-1]:
            break  # a step was launched on top of another while requests waited
    else:
        pytest.fail("no step overlapped while requests waited")
    while eng.has_unfinished() or eng.requests:
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert _summary(final) == _summary(want)


# ------------------------------------------------------------------------------------------ DSpark
@pytest.fixture(scope="module")
def spec_pair(tmp_path_factory):
    """A target that often repeats its last token and a drafter that always drafts the anchor again
    (a Markov head of 10 x identity): some blocks are accepted whole, some partly, some not at all,
    so consecutive verification steps start at varied offsets."""
    import json

    from dspark.config import ModelConfig
    from dspark.models.dspark_drafter import (DrafterConfig, drafter_config_dict, random_drafter_state_dict,
                                              write_drafter)

    root = tmp_path_factory.mktemp("async-spec")
    t = write_tiny_checkpoint(root / "t", "llama", seed=3, tie_word_embeddings=True, initializer_range=0.1)
    tc = ModelConfig.from_hf(json.loads((t / "config.json").read_text()))
    cfg = drafter_config_dict(tc, target_layer_ids=[0], block_size=4, mask_token_id=3, markov_rank=tc.vocab_size)
    sd = random_drafter_state_dict(DrafterConfig.from_dict(cfg), 0, std=0.2)
    sd["markov_head.markov_w1.weight"] = torch.eye(tc.vocab_size) * 10.0
    sd["markov_head.markov_w2.weight"] = torch.eye(tc.vocab_size) * 10.0
    return t, write_drafter(root / "d", cfg, sd)
