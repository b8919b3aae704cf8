"""One-sync DSpark steps of sampled requests (ModelRunner.launch_one_sync with sampled rows): target,
verification and drafter queued on the device with one read-back, the sampled requests verified by
StepGraphs._verify_step. They must give exactly the tokens (and acceptance counts) of the host-scheduled path
(run_target, _verify, run_draft), which computes the same distributions with the same keys: checked
on the CPU through the fixed-shape graph steps, for T = 1, top-p, top-k, min-p, seeded requests mixed
with greedy ones in one batch, both draft methods and both verification methods."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.engine import cuda_graphs  # noqa: E402
from tests.engine.test_async_scheduling import _drive, _summary, prompts, spec_pair  # noqa: E402,F401


def _llm(spec_pair, one_sync: bool, graph_prefill_tokens: int = 512, **spec) -> LLM:
    t, d = spec_pair
    llm = LLM(str(t), device="cpu", block_size=4, num_kv_blocks=128, attention_backend="triton", max_num_seqs=4,
              async_scheduling=True, graph_prefill_tokens=graph_prefill_tokens,
              speculative_config={"model": str(d), **spec})
    llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[64, 128])
    llm.engine.runner.one_sync_sampled = one_sync
    return llm


# low temperatures: the tiny random target is nearly uniform at T = 1, which would reject every draft
PARAMS = {
    "sampled": [SamplingParams(temperature=t, seed=s, max_tokens=12, ignore_eos=True)
                for t, s in ((0.3, 1), (1.0, 2), (0.5, 3))],
    "mixed": [SamplingParams(temperature=0.4, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.6, top_k=7, min_p=0.05, seed=9, max_tokens=14, ignore_eos=True)],
    # temperature only: verified by the sampled verification graph (StepGraphs._verify_step), greedy beside it
    "mixed_t": [SamplingParams(temperature=0.4, seed=5, max_tokens=12, ignore_eos=True),
                SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                SamplingParams(temperature=0.6, seed=9, max_tokens=14, ignore_eos=True)],
}


@pytest.mark.parametrize("case,spec,filter_rows", [
    ("sampled", {}, 512),
    ("mixed", {"draft_sample_method": "greedy"}, 512),
    ("mixed", {"rejection_sample_method": "block"}, 0),  # filtered rows over the graphs' cap: run eagerly
    ("mixed_t", {"rejection_sample_method": "block"}, 512),
    # probabilistic drafts: the verification reads their q where the drafter graph wrote it (q_rows, session 56)
    ("sampled", {"draft_sample_method": "probabilistic"}, 512),
    ("mixed_t", {"draft_sample_method": "probabilistic", "rejection_sample_method": "block"}, 512),
])
def test_one_sync_sampled_steps_match_the_host_path(spec_pair, prompts, case, spec, filter_rows, monkeypatch):
    from dspark.kernels import softmax

    monkeypatch.setattr(cuda_graphs, "FILTER_GRAPH_ROWS", filter_rows)
    monkeypatch.setattr(cuda_graphs, "VERIFY_FROM_LOGITS_MIN_ROWS", 0)  # these graphs have a few rows
    calls = []  # the sampled verification graph's softmax stats (VERIFY_SAMPLED reads the logits: "From logits")
    stats = softmax.temperature_softmax_stats
    monkeypatch.setattr(softmax, "temperature_softmax_stats", lambda *a, **k: calls.append(1) or stats(*a, **k))
    reqs = list(zip(prompts, PARAMS[case]))
    ref = _llm(spec_pair, False, **spec)
    want, _, _ = _drive(ref, reqs)
    llm = _llm(spec_pair, True, **spec)
    got, _, _ = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    assert bool(calls) == (case in ("sampled", "mixed_t"))
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted)
    assert 0 < st.num_accepted < st.num_drafts
    one_sync, ref_one_sync = llm.engine.runner.graphs.stats["one_sync"], ref.engine.runner.graphs.stats["one_sync"]
    verify_steps = st.num_steps / len(reqs)
    assert one_sync >= 0.8 * verify_steps  # the path really taken: (nearly) every verification step
    if case == "sampled":
        assert ref_one_sync == 0
    # the verification graph that took the sampled rows, or none (the same step run eagerly)
    g = llm.engine.runner.graphs
    kinds = {kind for _, kind in g.verify} | {kind for _, _, kind in g.whole}  # its own graph, or in a whole step
    want_kind = {"sampled": cuda_graphs.VERIFY_SAMPLED, "mixed_t": cuda_graphs.VERIFY_SAMPLED,
                 "mixed": cuda_graphs.VERIFY_FILTERED if filter_rows else None}[case]
    assert kinds - {cuda_graphs.VERIFY_GREEDY} == ({want_kind} if want_kind is not None else set())
    assert not llm.engine.runner.draft_probs and not ref.engine.runner.draft_probs  # released at the end


def test_sampled_requests_pipeline_full_blocks_up_to_max_tokens(spec_pair, prompts):
    """A sampled request keeps full verification blocks up to max_tokens (ModelRunner._num_drafts), so
    with async scheduling its one-sync steps are launched on top of each other (the keys' positions and
    the drafts' q taken from the step in flight on the device) right to the end: the tokens equal the
    host path's (synchronous, one step at a time), every output stops exactly at max_tokens, and no
    verification step fell back to the Sampler."""
    params = [SamplingParams(temperature=t, seed=s, max_tokens=n, ignore_eos=True)
              for t, s, n in ((0.3, 4, 7), (0.5, 6, 15), (1.0, 8, 11))]
    reqs = list(zip(prompts, params))
    ref = _llm(spec_pair, False)
    want, _, _ = _drive(ref, reqs)
    llm = _llm(spec_pair, True)
    got, _, inflight = _drive(llm, reqs)
    assert _summary(got) == _summary(want)
    assert [len(got[f"req-{i}"].token_ids) for i in range(3)] == [7, 15, 11]
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted)
    g = llm.engine.runner.graphs
    assert g.stats["async"] >= 3 and sum(inflight) >= g.stats["async"]  # launched on top of each other
    assert ref.engine.runner.graphs.stats["async"] == 0
    assert st.num_drafts == 4 * st.num_steps  # every verification step a full block (q = 5)
    assert not llm.engine.runner.draft_probs
    llm.engine.kv.check_integrity()


def test_draft_q_shares_the_proposal_when_rows_are_in_order():
    """_draft_q returns the proposal's q itself when request j is its row j (no [P, N, V] copy), and
    gathers (one-hot for greedy drafts) otherwise; both give the same q where it is read."""
    from dspark.engine.runner import ModelRunner

    class R:
        def __init__(self, rid):
            self.request_id = rid

    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cpu")
    src = torch.rand(3, 4, 10)
    runner.draft_probs = {"a": (src, 0), "b": (src, 1), "c": (src, 2)}
    drafts = torch.randint(0, 10, (3, 4))
    q = runner._draft_q([R("a"), R("b"), R("c")], drafts, 4, 10)
    assert q.data_ptr() == src.data_ptr() and torch.equal(q, src)
    q2 = runner._draft_q([R("b"), R("a"), R("x")], drafts, 4, 10)  # out of order, one greedy request
    assert torch.equal(q2[0], src[1]) and torch.equal(q2[1], src[0])
    assert torch.equal(q2[2], torch.nn.functional.one_hot(drafts[2], 10).float())


def test_keep_draft_q_clones_only_the_entries_a_later_step_still_reads():
    """The drafter graph's q buffer is shared by every step (draft_q is a view of it, session 56): before a
    step launched with nothing in flight rewrites it, the draft_probs entries in it whose requests that
    step does not verify get their own copy (one per source), the verified ones and entries elsewhere
    stay as they are."""
    from dspark.engine.runner import ModelRunner

    runner = ModelRunner.__new__(ModelRunner)
    buf = torch.rand(4, 3, 10)
    other = torch.rand(2, 3, 10)
    view = buf[:3]
    runner.draft_probs = {"a": (view, 0), "b": (view, 1), "c": (view, 2), "d": (other, 1)}
    want = {k: t[b].clone() for k, (t, b) in runner.draft_probs.items()}
    runner._keep_draft_q(buf, {"a"})
    assert runner.draft_probs["a"][0] is view and runner.draft_probs["d"][0] is other
    kept_b, kept_c = runner.draft_probs["b"][0], runner.draft_probs["c"][0]
    assert kept_b is kept_c and kept_b.data_ptr() != buf.data_ptr()  # one copy, out of the buffer
    buf.fill_(-1.0)  # the drafter graph's next replay
    assert torch.equal(runner.draft_probs["b"][0][1], want["b"]) and torch.equal(kept_c[2], want["c"])
    assert torch.equal(runner.draft_probs["d"][0][1], want["d"])


def test_q_rows_and_staged_q_land_where_the_verification_reads_them():
    """StepGraphs.write_q_rows names, in the pinned inputs, the row of ``probs`` where each sampled graph row's
    q is (the drafter graph's row, or a staged one); stage_q copies q from elsewhere to the staged rows. The
    verification graph reads probs at q_rows (kernels/rejection.py, "Draft rows")."""
    g = cuda_graphs.StepGraphs.__new__(cuda_graphs.StepGraphs)
    g.n_spec, g.max_rows, g.max_batch, g.staged = 3, 8, 4, 4
    g._hi = torch.zeros(3 * 8 + 7 * 4, dtype=torch.int64).numpy()
    g.probs = torch.zeros(8, 3, 10)
    g.write_q_rows([1, 3], [2, 0])
    assert g._hi[3 * 8 + 6 * 4:].tolist() == [0, 2, 0, 0]
    g.write_q_rows([0, 2], [4, 5])  # staged rows
    assert g._hi[3 * 8 + 6 * 4:].tolist() == [4, 2, 5, 0]
    dq = torch.rand(2, 5, 10)  # more drafts than the graph verifies: the first n_spec are kept
    g.stage_q(dq)
    assert torch.equal(g.probs[4:6], dq[:, :3]) and not g.probs[:4].any() and not g.probs[6:].any()
