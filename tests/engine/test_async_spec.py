"""Async scheduling with DSpark (LLMEngine._step_async_spec): verification block t + 1 is launched
before block t is read back, its rows placed on the device from t's accepted count. On the CPU through
the fixed-shape graph steps (Triton's interpreter). Apart from tests/engine/test_async_scheduling.py
(whose fixtures it shares) so that `make test`'s workers, which take whole files, share the load."""

from __future__ import annotations

import os
import types

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from tests.engine.test_async_scheduling import _drive, _summary, prompts, spec_pair  # noqa: E402,F401


def _spec_llm(spec_pair, async_: bool) -> LLM:
    t, d = spec_pair
    llm = LLM(str(t), device="cpu", block_size=4, num_kv_blocks=128, attention_backend="triton", max_num_seqs=4,
              async_scheduling=async_, speculative_config={"model": str(d)})
    llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[64, 128])
    return llm


@pytest.fixture(scope="module")
def sync_greedy(spec_pair, prompts):
    """The synchronous DSpark engine's greedy outputs, 40 tokens each (shared: one engine run fewer)."""
    return _spec_llm(spec_pair, False).generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))


def test_dspark_steps_launched_on_top_of_each_other(spec_pair, prompts, sync_greedy):
    """Greedy DSpark with async scheduling: block t + 1 is launched before block t is read back, its
    rows placed on the device from t's accepted count. Same tokens, finish reasons and acceptance as
    the synchronous engine; stops mid-sequence (the next block's rows discarded); KV pool whole."""
    stop = sync_greedy[2].token_ids[25]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=33, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, stop_token_ids=[stop])]
    reqs = list(zip(prompts, params))
    ref = _spec_llm(spec_pair, False)
    want, _, _ = _drive(ref, reqs)
    llm = _spec_llm(spec_pair, True)
    got, _, inflight = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted)
    assert 0 < st.num_accepted < st.num_drafts  # partial acceptance: steps started at varied offsets
    g = llm.engine.runner.graphs
    assert g.stats["async"] >= 5 and sum(inflight) >= g.stats["async"]
    assert ref.engine.runner.graphs.stats["async"] == 0


def test_greedy_dspark_pipeline_runs_up_to_max_tokens(spec_pair, prompts):
    """A greedy request keeps full verification blocks up to max_tokens (ModelRunner._num_drafts; the
    tokens past it are dropped), so async scheduling goes on launching blocks while a request is within
    3q tokens of its max_tokens (Scheduler.schedule_on_top), where it used to fall back to synchronous
    steps for the whole batch. Tokens and text equal those without speculation (greedy DSpark is
    lossless; a synchronous DSpark run as a second reference only repeated that, at a third of the
    test's time); every output stops exactly at max_tokens."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (21, 30, 39)]
    reqs = list(zip(prompts, params))
    plain = LLM(str(spec_pair[0]), device="cpu", block_size=4, num_kv_blocks=128, attention_backend="triton",
                max_num_seqs=4).generate(prompts, params)
    llm = _spec_llm(spec_pair, True)
    sched, q = llm.engine.scheduler, llm.engine.runner.graphs.q
    calls = []
    on_top = sched.schedule_on_top

    def recording(out, q_, *args):
        near = any(s.request.num_output_tokens + 3 * q_ >= s.request.params.max_tokens for s in out.scheduled)
        nxt = on_top(out, q_, *args)
        calls.append((nxt is not None, near))
        return nxt

    sched.schedule_on_top = recording
    got, _, _ = _drive(llm, reqs)
    assert [(got[f"req-{i}"].token_ids, got[f"req-{i}"].text) for i in range(3)] == [(o.token_ids, o.text) for o in plain]
    assert [len(got[f"req-{i}"].token_ids) for i in range(3)] == [21, 30, 39]
    assert all(got[f"req-{i}"].finish_reason == "length" for i in range(3))
    assert q == 5 and any(ok and near for ok, near in calls), calls  # pipelined within 3q of max_tokens
    llm.engine.kv.check_integrity()


def test_dspark_abort_while_in_flight(spec_pair, prompts, sync_greedy):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref = {tuple(p): o.token_ids for p, o in zip(prompts, sync_greedy)}
    seen = {}

    def abort(eng):
        seen["inflight"] = eng._inflight is not None
        eng.abort("req-1")

    final, _, _ = _drive(_spec_llm(spec_pair, True), [(p, params) for p in prompts], {4: abort})
    assert seen == {"inflight": True}
    assert final["req-1"].finish_reason == "abort"
    assert final["req-0"].token_ids == ref[tuple(prompts[0])] and final["req-2"].token_ids == ref[tuple(prompts[2])]


class _Done:
    """A stand-in for a dropped step's CUDA event (on the CPU ``done`` is None: nothing to wait for)."""

    def __init__(self) -> None:
        self.waited = 0

    def synchronize(self) -> None:
        self.waited += 1


def test_dropped_step_is_not_waited_for_until_its_set_is_written(spec_pair, prompts, sync_greedy, monkeypatch):
    """One request at a time (the batch-1 bench's shape), each ending on a stop token with the next block
    already launched: the engine drops that block without reading it back (ModelRunner.drop) and admits
    the next request at once; the dropped block's pinned set is waited for only by its next writer
    (StepGraphs.hold: flip into it, or a synchronous step's prepare_target). Same outputs as synchronous
    DSpark; the KV pool whole (_drive checks it every step)."""
    stops = [o.token_ids[k] for o, k in zip(sync_greedy, (17, 22, 30))]
    reqs = [(p, SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[s])) for p, s in zip(prompts, stops)]
    want, _, _ = _drive(_spec_llm(spec_pair, False), reqs)
    llm = _spec_llm(spec_pair, True)
    llm.engine.scheduler.max_num_seqs = 1
    runner = llm.engine.runner
    dropped = []
    monkeypatch.setattr(runner, "drop", lambda step: dropped.append(step) or type(runner).drop(runner, step))
    got, _, _ = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    assert [o.finish_reason for o in got.values()] == ["stop"] * 3
    assert len(dropped) >= 2 and llm.engine._inflight is None

    g = runner.graphs
    done = _Done()
    g.hold(done)  # the set of the step launched last
    held = g._set
    g.flip()  # into the other set: no wait
    assert done.waited == 0
    g.flip()  # back into the held set: its writer waits once
    g.flip()
    g.flip()
    assert done.waited == 1
    done2 = _Done()
    g.hold(done2)
    assert g._set == held
    # a synchronous step writes the current set without a flip (one request verifying a block at 10)
    one = types.SimpleNamespace(num_tokens=g.q, num_spec_tokens=g.q - 1, samples=True)
    g.prepare_target([one], [5] * g.q, [10], [[1, 2, 3, 4, 5]])
    assert done2.waited == 1 and not g._held
