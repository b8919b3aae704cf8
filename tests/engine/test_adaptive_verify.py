"""Adaptive verification in the engine (LLMEngine + spec/adaptive.py): one graph set per verify length,
the length changed between steps (the async pipeline drained first). On the CPU through the fixed-shape
graph steps (Triton's interpreter), with a step-time table the test sets (on a GPU the profiled one),
switched while the requests run so that the engine moves down and up again. What must hold: greedy
tokens equal plain decoding's and the fixed-length engine's; sampled requests run through the changes
(drafts dropped or padded) with the KV pool whole; the lengths really changed."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from tests.engine.test_async_scheduling import _drive, prompts, spec_pair  # noqa: E402,F401


def _llm(spec_pair, **spec) -> LLM:
    t, d = spec_pair
    llm = LLM(str(t), device="cpu", block_size=4, num_kv_blocks=128, attention_backend="triton", max_num_seqs=4,
              speculative_config={"model": str(d), **spec})
    llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[64, 128])
    return llm


class Costs:
    """A step-time table the test flips: 'short' makes 1 draft the best, 'long' 4 drafts."""

    def __init__(self):
        self.mode = "long"

    def __call__(self, n, batch, sampled):
        return 1.0 + (10.0 * n if self.mode == "short" else 0.0)


def _adaptive(spec_pair, costs, **spec):
    llm = _llm(spec_pair, verify_lengths=[1, 2], **spec)
    eng = llm.engine
    assert sorted(eng.runner.graph_sets) == [1, 2, 4] and eng.runner.num_spec_tokens == 4
    eng.enable_adaptive_verification(costs, margin=0.0, min_steps=2, interval=1)
    eng.verify_policy.estimate.min_reached = 4  # short runs: decide after a few verifications
    return llm


def _flip(costs, mode):
    def fn(eng):
        costs.mode = mode
    return fn


@pytest.fixture(scope="module")
def plain(spec_pair, prompts):
    """Greedy decoding without speculation, 26 tokens per prompt (shorter runs are its prefixes)."""
    return [o.token_ids for o in LLM(str(spec_pair[0]), device="cpu", block_size=4, num_kv_blocks=128,
                                     attention_backend="triton", max_num_seqs=4).generate(
        prompts, SamplingParams(temperature=0, max_tokens=26, ignore_eos=True))]


def test_greedy_tokens_unchanged_while_lengths_change(spec_pair, prompts, plain):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 18, 26)]
    costs = Costs()
    llm = _adaptive(spec_pair, costs)
    got, _, inflight = _drive(llm, list(zip(prompts, params)), {2: _flip(costs, "short"), 8: _flip(costs, "long")})
    assert [got[f"req-{i}"].token_ids for i in range(3)] == [p[:n.max_tokens] for p, n in zip(plain, params)]
    eng = llm.engine
    steps = eng.spec_stats.length_steps
    assert steps.get(1, 0) >= 2 and steps.get(4, 0) >= 2, steps  # moved down to 1 draft and back up to 4
    assert eng.verify_policy.changes >= 2
    assert eng.verify_policy.host  # pipelined read-backs were timed (the policy's host / GPU model)
    assert sum(G.stats["async"] for G in eng.runner.graph_sets.values()) > 0 and any(inflight)
    assert eng.spec_stats.as_dict()["spec_verify_length_steps"] == dict(sorted(steps.items()))
    eng.kv.check_integrity()
    # what `dspark bench` records per cell of an adaptive engine: the steps by length and the changes
    from dspark.bench import matrix
    system = matrix.DsparkSystem(llm)
    assert matrix._length_steps(system) == steps and matrix._length_changes(system) == eng.verify_policy.changes >= 2


def test_sampled_requests_through_length_changes(spec_pair, prompts, plain):
    """Seeded sampled requests (probabilistic drafts, block verification) beside a greedy one: the drafts'
    q of a longer proposal verified by a shorter graph set, and fewer drafts than a longer set holds."""
    params = [SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=9, max_tokens=20, ignore_eos=True)]
    costs = Costs()
    llm = _adaptive(spec_pair, costs, draft_sample_method="probabilistic", rejection_sample_method="block")
    got, _, _ = _drive(llm, list(zip(prompts, params)), {2: _flip(costs, "short"), 9: _flip(costs, "long")})
    eng = llm.engine
    assert all(len(got[f"req-{i}"].token_ids) == 20 for i in range(3))
    steps = eng.spec_stats.length_steps
    assert steps.get(1, 0) >= 2 and steps.get(4, 0) >= 2, steps
    assert got["req-1"].token_ids == plain[1][:20]  # the greedy request is still the argmax chain
    eng.kv.check_integrity()
    assert not eng.runner.draft_probs  # nothing left behind for finished requests


def test_warm_up_runs_every_verify_length(spec_pair):
    """The warm-up runs its requests at each verify length's graph set (each set's eager side paths, a
    prefill split off a verification step, compile then, not under load: on the H200 a length first used
    in a bench cell stalled it 1.6 s) and ends at the longest, the policy on, the statistics zero."""
    llm = _llm(spec_pair, verify_lengths=[1, 2])
    eng = llm.engine
    eng.enable_adaptive_verification(Costs(), margin=0.0, min_steps=2, interval=1)
    used = []
    switch = eng.runner.use_verify_length
    eng.runner.use_verify_length = lambda n: (used.append(n), switch(n))[1]
    eng.warm_up()
    assert used[:3] == [1, 2, 4] and eng.runner.num_spec_tokens == 4 and eng.verify_policy is not None
    assert all(not any(G.stats.values()) for G in eng.runner.graph_sets.values())
    assert not eng.requests and eng.kv.num_free_blocks == eng.kv.num_usable_blocks


def test_sampled_batch_rule_in_the_engine(spec_pair, prompts, plain):
    """The sampled-batch rule (sampled_verify_length): three seeded sampled requests (min batch 2) verify
    1 draft; a greedy request joining moves the batch back to 4 drafts, and the greedy request's tokens
    are the argmax chain; when it has finished, the sampled ones go back to 1. No profile is needed: the
    graph sets alone (one per length), and the rule comes back fresh after a warm-up."""
    llm = _llm(spec_pair, sampled_verify_length=1, sampled_verify_min_batch=2,
               draft_sample_method="probabilistic", rejection_sample_method="block")
    eng = llm.engine
    assert sorted(eng.runner.graph_sets) == [1, 4] and eng.runner.step_times is None
    assert eng.verify_policy is None  # the constructor ran before the graph sets existed (CPU)
    eng.enable_sampled_batch_rule(min_steps=1, interval=1)
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2, 3)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    lengths = []
    watch = eng.runner.use_verify_length
    eng.runner.use_verify_length = lambda n: (lengths.append(n), watch(n))[1]
    got, _, _ = _drive(llm, list(zip(prompts, sampled)),
                       {4: lambda e: [e.add_request(prompts[1], greedy, request_id="greedy")]})
    assert all(len(got[f"req-{i}"].token_ids) == 30 for i in range(3))
    assert got["greedy"].token_ids == plain[1][:8]
    assert lengths[:3] == [1, 4, 1], lengths  # down, up while the greedy request runs, down again
    steps = eng.spec_stats.length_steps
    assert steps.get(1, 0) >= 3 and steps.get(4, 0) >= 2, steps
    assert eng.verify_policy.changes == len(lengths)
    eng.kv.check_integrity()
    assert not eng.runner.draft_probs
    eng.verify_policy.tick()
    eng.runner.use_verify_length = watch
    eng.warm_up()
    assert eng.verify_policy.changes == 0 and eng.verify_policy.steps == 0 and eng.runner.num_spec_tokens == 4
    assert (eng.verify_policy.min_steps, eng.verify_policy.min_batch) == (1, 2)


def test_greedy_window_of_the_batch_rule_in_the_engine(spec_pair, prompts, plain):
    """greedy_verify_batches: three greedy requests (window [3, 4]) verify 1 draft; when the shortest has finished,
    the two left (under the window) go back to 4 drafts. Greedy tokens are plain decoding's through both changes
    (the async pipeline drained at each), and the KV pool is whole."""
    llm = _llm(spec_pair, sampled_verify_length=1, sampled_verify_min_batch=4, greedy_verify_batches=[3, 4])
    eng = llm.engine
    assert sorted(eng.runner.graph_sets) == [1, 4]
    eng.enable_sampled_batch_rule(min_steps=1, interval=1)
    assert eng.verify_policy.greedy_batches == (3, 4)
    lengths = []
    watch = eng.runner.use_verify_length
    eng.runner.use_verify_length = lambda n: (lengths.append(n), watch(n))[1]
    n_tok = (26, 26, 8)
    got, _, _ = _drive(llm, [(p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                             for p, n in zip(prompts, n_tok)])
    for i, n in enumerate(n_tok):
        assert got[f"req-{i}"].token_ids == plain[i][:n], i
    assert lengths[:2] == [1, 4], lengths  # down for the three, up again for the two
    steps = eng.spec_stats.length_steps
    assert steps.get(1, 0) >= 2 and steps.get(4, 0) >= 2, steps
    eng.kv.check_integrity()
