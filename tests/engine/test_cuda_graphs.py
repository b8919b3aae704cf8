"""The fixed-shape steps of dspark/engine/cuda_graphs.py, run eagerly (``capture=False``) on the CPU in
Triton's interpreter: every padding rule a CUDA graph relies on (requests padded to q rows, padding
requests on the dummy block, context buckets, the drafter's context store behind a mask) must give
the same tokens as the ordinary eager step. The capture itself needs a GPU (benchmarks/gpu_*.sh)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.engine.cuda_graphs import context_buckets, graph_batch_sizes  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.spec.drafters import random_drafter  # noqa: E402


def test_sizes_and_buckets():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert context_buckets(8192 + 6) == [512, 1024, 2048, 4096, 8192, 8198]
    assert context_buckets(300) == [300]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("cg") / "t", "llama", seed=7)


@pytest.fixture(scope="module")
def drafter(tmp_path_factory, target):
    return random_drafter(tmp_path_factory.mktemp("cg") / "d", target, target_layer_ids=[0], block_size=4)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 9, 26)]


def _run(target, prompts, params, graphs: bool, **kw):
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton",
              max_num_seqs=3, **kw)
    runner = llm.engine.runner
    if graphs:
        # Padded sizes 2 and 4 for a batch of 1-3; buckets small enough that steps change bucket.
        runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[16, 32, 64])
        assert runner.graphs is not None
    outs = llm.generate(prompts, params)
    assert llm.engine.kv.check_integrity()["in_use"] == 0
    return [o.token_ids for o in outs], llm


@pytest.mark.parametrize("mode", ["plain", "plain-sync", "dspark"])
def test_graph_steps_match_eager_greedy(target, drafter, prompts, mode):
    """plain: decode steps launched asynchronously (engine async scheduling, the default with graphs);
    plain-sync: the one-sync path without it; dspark: greedy verification + drafting on the one-sync path."""
    spec = mode == "dspark"
    kw = {"speculative_config": {"model": str(drafter)}} if spec else {}
    if mode == "plain-sync":
        kw["async_scheduling"] = False
    # Different lengths: the batch shrinks 3 -> 2 -> 1 (padded 4, 2, 2) and the longest request
    # crosses from bucket 32 to 64.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 9, 14)]
    want, _ = _run(target, prompts, params, False, **kw)
    got, llm = _run(target, prompts, params, True, **kw)
    assert got == want
    g = llm.engine.runner.graphs
    assert g.stats["target"] > 0 and (g.stats["draft"] > 0) == spec  # the graph path really ran
    # greedy: verification and drafting inputs on the device; every plain step launched asynchronously
    assert g.stats["async" if mode == "plain" else "one_sync"] == g.stats["target"]
    keys = set(g.target) | {(B, k) for B, k, _ in g.whole}  # DSpark: target graphs, or whole steps
    assert {B for B, _ in keys} == {2, 4} and {k for _, k in keys} >= {32, 64}


def test_graph_steps_match_eager_sampled(target, drafter, prompts):
    """Probabilistic drafts and standard verification at temperature 1, seeded: the graph path draws
    the same noise at the same (seed, position, stream), so the tokens are the same; some drafts
    are accepted, so committed verification rows reach the drafter's context through the mask."""
    kw = {"speculative_config": {"model": str(drafter), "draft_sample_method": "probabilistic"}}
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=i) for i in range(3)]
    want, ref = _run(target, prompts, params, False, **kw)
    got, llm = _run(target, prompts, params, True, **kw)
    assert got == want
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted)
    assert llm.engine.runner.graphs.stats["draft"] > 0 and st.num_accepted > 0


@pytest.mark.parametrize("method", ["standard", "block"])
def test_fused_verification_matches_the_torch_path(target, drafter, prompts, method):
    """The triton backend verifies probabilistic drafts with the method's fused kernel
    (kernels/rejection.py), the torch backend with verify_probabilistic: seeded temperature-1 requests
    emit the same tokens with the same acceptance counts (same Philox keys; fp32 logits agree to
    rounding; block: barring a U_i within an ulp of h_i)."""
    kw = {"speculative_config": {"model": str(drafter), "draft_sample_method": "probabilistic",
                                 "rejection_sample_method": method}}
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=i) for i in range(3)]
    got, llm = _run(target, prompts, params, False, **kw)
    from dspark.kernels.rejection import verify_block_triton, verify_standard_triton

    assert llm.engine.runner._fused_verify == {"standard": verify_standard_triton, "block": verify_block_triton}
    ref = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="torch", max_num_seqs=3,
              **kw)
    want = [o.token_ids for o in ref.generate(prompts, params)]
    assert got == want
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted) and st.num_accepted > 0


def test_failing_fused_verification_falls_back_to_torch(target, drafter, prompts, caplog):
    """A fused kernel that fails (say, a compile error on an untested GPU) is dropped with one warning;
    verification goes on with torch ops and the same tokens."""
    kw = {"speculative_config": {"model": str(drafter), "draft_sample_method": "probabilistic"}}
    params = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=i) for i in range(3)]
    mk = lambda: LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="torch",  # noqa: E731
                     max_num_seqs=3, **kw)
    want = [o.token_ids for o in mk().generate(prompts, params)]
    llm = mk()
    calls = []

    def broken(*args, **kw):
        calls.append(1)
        raise RuntimeError("no such instruction")

    llm.engine.runner._fused_verify = {"standard": broken}
    with caplog.at_level("WARNING"):
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want and calls == [1] and llm.engine.runner._fused_verify == {}
    assert "fused verification kernel failed (RuntimeError: no such instruction)" in caplog.text


def test_graph_steps_match_eager_mixed_batch(target, drafter, prompts):
    """Greedy, seeded temperature-1 and a repetition-penalty request (which decodes without drafts,
    one real row in the verification graph) in the same steps: the general graph path."""
    kw = {"speculative_config": {"model": str(drafter), "draft_sample_method": "probabilistic"}}
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.3, logprobs=2)]
    want, _ = _run(target, prompts, params, False, **kw)
    got, llm = _run(target, prompts, params, True, **kw)
    assert got == want
    g = llm.engine.runner.graphs
    assert g.stats["target"] > g.stats["one_sync"]  # mixed steps went through the general path


def test_inputs_packed_in_one_buffer_and_one_copy(target, drafter):
    """The step's inputs (floats, seq_lens, flags, ints, block tables) are disjoint, aligned views of one
    device byte buffer with pinned twins of the same layout, so ``upload`` sends a whole step in one copy:
    exactly the bytes up to the batch's last block-table row (rows past it keep their device values)."""
    from dspark import SamplingParams as SP

    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton", max_num_seqs=3,
              speculative_config={"model": str(drafter)})
    llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[16, 32, 64])
    G = llm.engine.runner.graphs
    views = [G.floats, G.seq_lens, G.flags, G.ints, G.block_tables]
    base = G._dev_bytes.data_ptr()
    spans = sorted((v.data_ptr() - base, v.data_ptr() - base + v.numel() * v.element_size()) for v in views)
    assert all(lo % 64 == 0 for lo, _ in spans) and spans[-1][1] <= G._dev_bytes.numel()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "the sections overlap"
    assert G.block_tables.data_ptr() - base == spans[-1][0]  # block tables last: the copy stops inside them
    hi, hf, hb, hs, ht = G._pinned
    for h, d in zip((hf, hs, hb, hi, ht), views):
        assert h.shape == d.shape and h.dtype == d.dtype
    G.block_tables.fill_(-7)
    hf[:] = 0.5
    hs[:] = 3
    hb[:] = True
    hi[:] = 11
    ht[:] = 5
    G.upload(2)
    assert torch.equal(G.floats, hf) and torch.equal(G.seq_lens, hs) and torch.equal(G.flags, hb)
    assert torch.equal(G.ints, hi)
    assert (G.block_tables[:2] == 5).all() and (G.block_tables[2:] == -7).all()
    # and the engine still decodes through it (one copy per graph step)
    out = llm.generate([[5, 6, 7]], SP(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out[0].token_ids) == 6


def test_sampling_settings_rewritten_only_when_changed(target, drafter):
    """prepare_sampling leaves a pinned set alone when it already holds the same rows' settings (the same
    SamplingParams objects, seeds and flags), and rewrites it when any of them differs."""
    from dspark import SamplingParams as SP

    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton", max_num_seqs=3,
              speculative_config={"model": str(drafter)})
    llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[16, 32, 64])
    G = llm.engine.runner.graphs
    Tm, Bm = G.max_rows, G.max_batch
    p1, p2 = SP(temperature=0.7, top_p=0.9), SP(temperature=1.3)
    G.prepare_sampling(2, [0, 1], [p1, p2], [1, 2], [True, True])
    temp = G._hf[:2].copy()
    assert temp[0] == pytest.approx(0.7) and temp[1] == pytest.approx(1.3)
    G._hf[:2] = -1.0  # a rewrite would restore it
    G.prepare_sampling(2, [0, 1], [p1, p2], [1, 2], [True, True])
    assert (G._hf[:2] == -1.0).all()  # same settings: skipped
    G.prepare_sampling(2, [0, 1], [p1, SP(temperature=1.3)], [1, 2], [True, True])  # another params object
    assert G._hf[1] == pytest.approx(1.3) and G._hf[0] == pytest.approx(0.7)
    G._hf[:2] = -1.0
    G.prepare_sampling(2, [0, 1], [p1, p2], [1, 3], [True, True])  # another seed
    assert G._hi[3 * Tm + 3 * Bm + 1] == 3 and G._hf[0] == pytest.approx(0.7)
    G.prepare_sampling(2, [1], [p2], [3], [False])  # other rows
    assert G._hf[0] == 0.0 and G._hf[1] == pytest.approx(1.3) and not G._hb[Tm + 1]
    G.flip()  # the other pinned set has its own record
    G.prepare_sampling(2, [1], [p2], [3], [False])
    assert G._hf[1] == pytest.approx(1.3)


def test_precompile_verification(target, drafter, monkeypatch, caplog):
    """The warm-up builds the configured method's verification kernels for every draft count
    (kernels/rejection.py precompile: N = 1 and the block size, split and not); one that fails to build is
    dropped with the fallback's warning, and a plain engine has nothing to build."""
    kw = {"speculative_config": {"model": str(drafter), "draft_sample_method": "probabilistic"}}
    mk = lambda **extra: LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64,  # noqa: E731
                             attention_backend="triton", max_num_seqs=3, **extra)
    runner = mk(**kw).engine.runner
    assert runner.num_spec_tokens == 4 and runner.precompile_verification() == 8  # from probs and from logits
    assert mk().engine.runner.precompile_verification() == 0

    import dspark.kernels.rejection as rejection

    def broken(*args, **kwargs):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(rejection, "precompile", broken)
    with caplog.at_level("WARNING"):
        assert runner.precompile_verification() == 0
    assert "standard" not in runner._fused_verify and "block" in runner._fused_verify
    assert "fused verification kernel failed (RuntimeError: no such instruction)" in caplog.text


def test_verification_from_logits_falls_back(target, drafter, monkeypatch, caplog):
    """The "From logits" variant failing to build (precompile) or to run turns that variant off, not the method:
    verification goes on from probabilities (probs_from_stats), with the tokens of the probabilities."""
    import dspark.kernels.rejection as rejection
    from dspark.kernels.softmax import probs_from_stats, temperature_softmax_stats
    from dspark.spec.rejection import verify_probabilistic

    spec = {"model": str(drafter), "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}
    runner = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton",
                 max_num_seqs=3, speculative_config=spec).engine.runner
    real = rejection.precompile
    monkeypatch.setattr(rejection, "precompile", lambda *a, from_logits=False, **k: (
        (_ for _ in ()).throw(RuntimeError("no ldmatrix")) if from_logits else real(*a, **k)))
    with caplog.at_level("WARNING"):
        assert runner.precompile_verification() == 4
    assert not runner.verify_from_logits and "block" in runner._fused_verify
    assert "verification from logits failed to build (RuntimeError: no ldmatrix)" in caplog.text

    runner.verify_from_logits = True
    g = torch.Generator().manual_seed(0)
    B, N, V = 2, 3, runner.vocab_size
    logits = torch.randn(B * (N + 1), V, generator=g)
    stats, _ = temperature_softmax_stats(logits, torch.ones(B * (N + 1)))
    q = torch.softmax(torch.randn(B, N, V, generator=g), -1)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, N)
    rest = (drafts, q, torch.full((B,), N), torch.tensor([5, 6]), torch.tensor([10, 20]))

    def fails(*a, target_stats=None, **k):
        if target_stats is not None:
            raise RuntimeError("no such instruction")
        return rejection.verify_block_triton(*a, **k)

    monkeypatch.setitem(runner._fused_verify, "block", fails)
    got = runner._verify_probabilistic("block", logits.view(B, N + 1, V), *rest, target_stats=stats.view(B, N + 1, 3))
    assert not runner.verify_from_logits and "block" in runner._fused_verify
    want = verify_probabilistic(probs_from_stats(logits, stats).view(B, N + 1, V), *rest, method="block")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_whole_step_graphs_match_the_three_graphs(target, drafter, prompts, monkeypatch):
    """A one-sync DSpark step without prefill rows runs as one whole-step graph (StepGraphs._whole_step) up to
    WHOLE_STEP_MAX_BATCH requests (DSPARK_WHOLE_STEP=1): greedy and seeded temperature-1 requests in the same steps
    (the sampled kind, probabilistic drafts) give the tokens and acceptance the three separate graphs give, with
    async scheduling (steps launched on top of whole steps)."""
    from dspark.engine import cuda_graphs

    kw = {"speculative_config": {"model": str(drafter), "draft_sample_method": "probabilistic"}}
    params = [SamplingParams(temperature=0, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=5),
              SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=6)]
    monkeypatch.setattr(cuda_graphs, "WHOLE_STEP_MAX_BATCH", 16)  # on
    got, llm = _run(target, prompts, params, True, **kw)
    monkeypatch.setattr(cuda_graphs, "WHOLE_STEP_MAX_BATCH", 0)  # off (the default): the three graphs only
    want, ref = _run(target, prompts, params, True, **kw)
    assert got == want
    g, ref_g = llm.engine.runner.graphs, ref.engine.runner.graphs
    assert ref_g.stats["whole"] == 0 and not ref_g.whole
    # both kinds: steps with the sampled requests, and greedy-only steps (the sampled ones not yet verifying)
    assert g.stats["whole"] > 0 and {kind for _, _, kind in g.whole} == {cuda_graphs.VERIFY_GREEDY,
                                                                         cuda_graphs.VERIFY_SAMPLED}
    assert g.stats["one_sync"] == ref_g.stats["one_sync"] and g.stats["async"] == ref_g.stats["async"] > 0
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted) and st.num_accepted > 0


def test_whole_step_graphs_are_on_by_default_where_captured(monkeypatch):
    """Whole-step graphs (session 64's H100 A/B: +2-6 % at batch 1-8, the same tokens) are on by default for captured
    graph sets (CUDA) and off for capture=False, the CPU tests' graph steps; DSPARK_WHOLE_STEP=1 / 0 sets them on /
    off for both (read when the module is imported: a fresh interpreter per setting)."""
    import subprocess
    import sys

    from dspark.engine import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "WHOLE_STEP_MAX_BATCH", None)
    assert (cuda_graphs.whole_step_max_batch(True), cuda_graphs.whole_step_max_batch(False)) == (16, 0)
    code = ("from dspark.engine import cuda_graphs as c; "
            "print(c.WHOLE_STEP_MAX_BATCH, c.whole_step_max_batch(True), c.whole_step_max_batch(False))")
    env = {k: v for k, v in os.environ.items() if k != "DSPARK_WHOLE_STEP"}
    for setting, want in ((None, "None 16 0"), ("1", "16 16 16"), ("0", "0 0 0")):
        e = env if setting is None else {**env, "DSPARK_WHOLE_STEP": setting}
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True)
        assert out.stdout.split("\n")[-2] == want, (setting, out.stdout)


def test_whole_step_times_split_by_the_last_three_graph_step(target, drafter):
    """A whole-step graph's GPU time (two events) is split into verification and drafting by the drafter's share
    in the last step of its (batch size, kind) timed with three events; before any such step, all verification."""

    class Ev:  # a CUDA event's elapsed_time (ms) from a timestamp in seconds
        def __init__(self, t):
            self.t = t

        def elapsed_time(self, other):
            return (other.t - self.t) * 1e3

    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, max_num_seqs=3,
              speculative_config={"model": str(drafter)})
    r = llm.engine.runner
    assert r._step_times([Ev(0.0), Ev(2.0)], (2, 0)) == (2.0, 0.0)
    assert r._step_times([Ev(0.0), Ev(3.0), Ev(4.0)], (2, 0)) == (3.0, 1.0)  # sets the share: 1/4
    assert r._step_times([Ev(1.0), Ev(3.0)], (2, 0)) == (1.5, 0.5)
    assert r._step_times([Ev(1.0), Ev(3.0)], (4, 0)) == (2.0, 0.0)  # another batch size: not measured yet
    assert r._step_times([Ev(0.0), Ev(1.0), Ev(3.0)], None) == (1.0, 2.0)  # a step no whole graph could run
    assert r._draft_share == {(2, 0): 0.25}
