"""Prefill rows (dspark/engine/cuda_graphs.py): with DSpark, a step that mixes prefill chunks with
verification rows (every admission in continuous batching) runs as one one-sync graph step, each
prefill chunk cut into q-token rows of the verification graph (KV is written before attention reads
it, so row k of a chunk sees rows < k). It must give the tokens, finish reasons and acceptance of the
eager paths (the split step, and the whole step run eagerly), for greedy and seeded-sampled requests,
chunked prefills (a chunk short of the prompt's end emits nothing), prefix-cache hits and
preemption; and the KV pool stays whole. Checked on the CPU through the fixed-shape steps."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.engine.runner import ModelRunner  # noqa: E402
from tests.engine.test_async_scheduling import _drive, _summary, prompts, spec_pair  # noqa: E402,F401

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PARAMS = [
    SamplingParams(temperature=0.4, top_p=0.9, seed=5, max_tokens=11, ignore_eos=True),
    GREEDY,
    SamplingParams(temperature=0.6, top_k=7, min_p=0.05, seed=9, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.3, seed=1, max_tokens=9, ignore_eos=True),
    GREEDY,
]


def _run(spec_pair, reqs, monkeypatch, mode: str, seats: int = 2, **kw):
    """mode: "graph" (prefill rows), "split" (graph verification + eager prefill, ModelRunner._split:
    asserted to split at least two mixed steps), "eager" (mixed steps wholly eager). Returns (summary, (drafts, accepted), (steps given prefill rows by _graph_prefill, steps
    with prefill rows launched on top of the one in flight by Scheduler.schedule_on_top))."""
    t, d = spec_pair
    llm = LLM(str(t), device="cpu", block_size=4, attention_backend="triton", max_num_seqs=4,
              async_scheduling=True, speculative_config={"model": str(d)},
              graph_prefill_tokens=0 if mode != "graph" else 512, **{"num_kv_blocks": 128, **kw})
    runner = llm.engine.runner
    runner.enable_graphs(capture=False, batch_sizes=[2, 4, 8, 16], buckets=[64, 128])
    runner.split_mixed_steps = mode == "split"
    llm.engine.scheduler.max_num_seqs = seats  # admissions mid-stream
    used, splits = [], []
    orig, orig_split = ModelRunner._graph_prefill, ModelRunner._split
    monkeypatch.setattr(ModelRunner, "_graph_prefill", lambda self, sc: used.append(orig(self, sc)) or used[-1])
    monkeypatch.setattr(ModelRunner, "_split", lambda self, sc: splits.append(orig_split(self, sc)) or splits[-1])
    got, _, _ = _drive(llm, reqs)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks  # no block leaked (cached ones are free)
    assert (sum(splits) >= 2) == (mode == "split")  # mixed steps really split, in that mode only
    st = llm.engine.spec_stats
    return _summary(got), (st.num_drafts, st.num_accepted), (sum(used), runner.graphs.stats["async_admit"])


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 12}], ids=["whole", "chunked"])
def test_prefill_rows_match_the_eager_paths(spec_pair, prompts, monkeypatch, kw):
    reqs = list(zip(prompts + prompts[:2], PARAMS))
    want, want_acc, n0 = _run(spec_pair, reqs, monkeypatch, "eager", **kw)
    if not kw:  # the split step (graph verification rows + an eager prefill sub-step) once: suite time
        split, split_acc, n1 = _run(spec_pair, reqs, monkeypatch, "split", **kw)
        assert split == want and split_acc == want_acc and n1 == (0, 0)
    got, acc, n = _run(spec_pair, reqs, monkeypatch, "graph", **kw)
    assert got == want and acc == want_acc
    # admissions really ran as prefill rows, some launched on top of the step in flight
    assert n0 == (0, 0) and sum(n) >= 3 and n[1] >= 1
    assert 0 < acc[1] < acc[0]


def test_prefill_rows_greedy_equal_plain_decoding(spec_pair, prompts, monkeypatch):
    """Greedy DSpark with prefill rows emits plain greedy decoding's tokens (lossless), four requests
    through two seats, a prompt repeated (prefix-cache hit: its chunk starts mid-prompt)."""
    t, _ = spec_pair
    reqs = [(p, GREEDY) for p in prompts + prompts[1:2]]
    plain = LLM(str(t), device="cpu", block_size=4, num_kv_blocks=128, attention_backend="triton",
                enforce_eager=True).generate([p for p, _ in reqs], GREEDY)
    got, _, (n, n_on_top) = _run(spec_pair, reqs, monkeypatch, "graph")
    in_order = [got[rid][0] for rid in sorted(got, key=lambda rid: int(rid.split("-")[1]))]  # finish order -> arrival
    assert in_order == [o.token_ids for o in plain]
    assert n + n_on_top >= 2


def test_prefill_rows_only_where_they_fit(spec_pair, prompts):
    """covers_prefill: the rows of every chunk and every verification must fit the largest graph;
    steps of decode rows only stay `covers`; no prefill rows without DSpark graphs' room for them."""
    from dspark.engine.scheduler import ScheduledRequest

    t, d = spec_pair
    llm = LLM(str(t), device="cpu", block_size=4, num_kv_blocks=128, attention_backend="triton", max_num_seqs=4,
              speculative_config={"model": str(d)})
    runner = llm.engine.runner
    runner.enable_graphs(capture=False, batch_sizes=[2, 4, 8], buckets=[64, 128])
    G = runner.graphs
    q = G.q
    eng = llm.engine
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    reqs = [eng.requests[i] for i in ids]
    short, long_ = ScheduledRequest(reqs[0], 3, 0), ScheduledRequest(reqs[2], 26, 0)
    assert G.row_counts([short, long_]) == [1, -(-26 // q)]
    assert G.covers_prefill([short]) and G.covers_prefill([short, long_]) == (1 + -(-26 // q) <= 8)
    assert not G.covers_prefill([ScheduledRequest(reqs[2], 26, 0)] * 2)  # 2 x 6 rows > 8
    G.prefill_rows = 0
    assert not G.covers_prefill([short])


# ---------------------------------------------------------------- without speculation (q = 1)
PLAIN_PARAMS = [
    SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=9, ignore_eos=True),
    GREEDY,
    SamplingParams(temperature=0.8, min_p=0.05, seed=9, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=1, max_tokens=7, ignore_eos=True),
    GREEDY,
]


def _run_plain(target, reqs, graph: bool, async_: bool = True, **kw):
    """Plain decoding through the fixed-shape decode graphs; ``graph``: prompts admitted as one-token
    prefill rows of the decode graph (else every step with a prefill chunk runs eagerly). Returns
    (summary, steps with prefill rows)."""
    llm = LLM(str(target), device="cpu", block_size=4, attention_backend="triton", max_num_seqs=4,
              async_scheduling=async_, graph_prefill_tokens=512 if graph else 0, **{"num_kv_blocks": 128, **kw})
    runner = llm.engine.runner
    runner.enable_graphs(capture=False, batch_sizes=[2, 4, 8, 16, 32], buckets=[64, 128])
    llm.engine.scheduler.max_num_seqs = 2  # admissions mid-stream
    got, _, _ = _drive(llm, reqs)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_usable_blocks  # no block leaked
    return _summary(got), runner.graphs.stats["prefill_rows"]


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 12}], ids=["whole", "chunked"])
def test_plain_prefill_rows_match_eager(spec_pair, prompts, kw):
    """Without speculation, admissions beside decoding requests run as one-token prefill rows of the
    decode graph (ModelRunner.launch): greedy and seeded-sampled requests (temperature, top-p, min-p)
    get the tokens of the eager mixed steps, with and without async scheduling; a prompt repeats (a
    prefix-cache hit: its chunk starts mid-prompt), chunked prefill's short chunks emit nothing."""
    t, _ = spec_pair
    reqs = list(zip(prompts + prompts[:2], PLAIN_PARAMS))
    want, n0 = _run_plain(t, reqs, graph=False, **kw)
    got, n = _run_plain(t, reqs, graph=True, **kw)
    assert got == want and n0 == 0 and n >= 2
    if not kw:
        got_sync, n_sync = _run_plain(t, reqs, graph=True, async_=False)
        assert got_sync == want and n_sync >= 2


def test_plain_prefill_rows_only_for_graph_rows(spec_pair, prompts):
    """A request whose token the decode graph cannot emit (top-k, penalties, logprobs) keeps the step
    eager; the tokens do not change."""
    t, _ = spec_pair
    odd = [SamplingParams(temperature=0.6, top_k=7, seed=2, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0, repetition_penalty=1.3, max_tokens=6, ignore_eos=True),
           SamplingParams(temperature=0, logprobs=2, max_tokens=6, ignore_eos=True)]
    reqs = [(prompts[0], GREEDY)] + [(p, sp) for p, sp in zip(prompts, odd)]
    want, _ = _run_plain(t, reqs, graph=False)
    got, n = _run_plain(t, reqs, graph=True)
    assert got == want and n == 0


def test_a_prompts_last_token_alone_is_a_prefill_row(spec_pair, monkeypatch):
    """A prompt chunked so that its last chunk is one token (prefill rows fill the graph rows the
    verifying requests leave) looks like a decode row without drafts. As one, a sampled request made the
    whole step leave the one-sync path for the host's verification (on the H200 that compiled kernel
    specialisations the capture had not met, at batch 128); as a prefill row (GraphSteps._decode_row) the
    step stays one-sync and the tokens are those of the eager reference, seeded sampled ones included."""
    import random

    rng = random.Random(0)
    reqs = [([rng.randrange(4, 500) for _ in range(rng.randrange(2, 40))],
             SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randrange(3, 12), ignore_eos=True))
            for i in range(8)]
    t, d = spec_pair

    def run(graph_prefill: bool):
        llm = LLM(str(t), device="cpu", block_size=4, num_kv_blocks=512, attention_backend="triton", max_num_seqs=4,
                  graph_prefill_tokens=512 if graph_prefill else 0,
                  speculative_config={"model": str(d), "draft_sample_method": "probabilistic",
                                      "rejection_sample_method": "block"})
        runner = llm.engine.runner
        runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[64, 128])
        runner.split_mixed_steps = graph_prefill
        lone, host = [], []

        def spy(fn):
            def run_step(sched, *a):
                lone.extend(s for s in sched.scheduled
                            if s.num_tokens == 1 and s.request.num_tokens == s.request.num_prompt_tokens)
                return fn(sched, *a)
            return run_step

        for name in ("execute", "launch_one_sync"):  # the two ways a step starts (the second: async, one-sync)
            monkeypatch.setattr(runner, name, spy(getattr(runner, name)))
        verify = runner._verify
        monkeypatch.setattr(runner, "_verify", lambda *a: (host.append(1), verify(*a))[1])
        got, _, _ = _drive(llm, reqs)
        return _summary(got), len(lone), len(host)

    want, _, _ = run(False)
    got, lone, host = run(True)
    assert lone >= 1  # the case happened (a prompt's last token alone in a step)
    assert host == 0  # and no step took the host's verification path
    assert got == want


def test_prefill_alone_runs_long_prompts_as_graph_steps(spec_pair, prompts, monkeypatch):
    """EngineConfig.graph_prefill_alone: with no request decoding (the first wave), chunks the graphs can
    take are cut to the graph's rows, so a prompt longer than them runs as several graph steps instead of
    one eager step; a request they cannot take (logprobs: verified on the host) is not cut and waits for a
    step of its own kind. Same tokens, finish reasons and acceptance as with the option off; no leak."""
    g = torch.Generator().manual_seed(3)
    long_prompt = torch.randint(4, 512, (90,), generator=g).tolist()  # > the 16 graph rows x q tokens
    reqs = [(long_prompt, GREEDY),
            (prompts[1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)),
            (prompts[2], PARAMS[0]), (prompts[0], PARAMS[3])]
    want, want_acc, (n_off, _) = _run(spec_pair, reqs, monkeypatch, "graph", seats=4)
    got, acc, (n_on, _) = _run(spec_pair, reqs, monkeypatch, "graph", seats=4, graph_prefill_alone=True)
    assert got == want and acc == want_acc
    assert n_on >= n_off + 2  # the long prompt's chunks (90 tokens over >= 2 graph steps) were graph steps
