"""DSparkProposer's Triton path (attention_backend="triton": store_context_kv, drafter_attention,
markov_sample) against its PyTorch path, under Triton's interpreter on the CPU: the context cache,
the proposals (drafts, q, confidence) greedy and sampled, and the engine end to end."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.kernels import interpreter_ready
from dspark.sample.sampler import SamplingBatch
from tests.conftest import write_tiny_checkpoint
from tests.spec.drafters import random_drafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() and not interpreter_ready(),
                                reason="Triton kernels need CUDA or the interpreter")

BLOCK = 4
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spt") / "t", "llama", num_hidden_layers=4, seed=3)


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("spt") / "d", target, target_layer_ids=[0, 2], block_size=5)


@pytest.fixture(scope="module")
def proposer(target, drafter):
    llm = LLM(str(target), device="cpu", block_size=BLOCK, num_kv_blocks=64,
              speculative_config={"model": str(drafter)})
    prop = llm.engine.runner.proposer
    assert prop.use_triton is False  # the torch backend keeps the PyTorch path
    return prop


def _context(prop, ctx_lens: list[int], seed: int):
    """Random taps for B requests with the given context lengths, block tables with distinct blocks
    (shuffled), and the slots of every context row."""
    g = torch.Generator().manual_seed(seed)
    d = prop.drafter
    m = len(d.config.target_layer_ids)
    H = d.config.hidden_size
    nb = max(1, max((c + BLOCK - 1) // BLOCK for c in ctx_lens))
    perm = torch.randperm(prop.kv.shape[2] - 1, generator=g) + 1
    tables = perm[: len(ctx_lens) * nb].view(len(ctx_lens), nb)
    pos = torch.cat([torch.arange(c) for c in ctx_lens]).long()
    rows = torch.cat([torch.full((c,), b) for b, c in enumerate(ctx_lens)]).long()
    slots = tables[rows, pos // BLOCK] * BLOCK + pos % BLOCK
    taps = torch.randn(len(pos), m * H, generator=g)
    return taps, pos, slots, tables


def _write(prop, use_triton: bool, taps, pos, slots) -> torch.Tensor:
    prop.kv.zero_()
    prop.use_triton = use_triton
    try:
        prop.write_context(taps, pos, slots)
    finally:
        prop.use_triton = False
    return prop.kv.clone()


def _propose(prop, use_triton: bool, *args):
    prop.use_triton = use_triton
    try:
        return prop.propose(*args)
    finally:
        prop.use_triton = False


def test_write_context_matches(proposer):
    taps, pos, slots, _ = _context(proposer, [7, 0, 13], seed=1)
    want = _write(proposer, False, taps, pos, slots)
    got = _write(proposer, True, taps, pos, slots)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# (context lengths, params, drafts). Top-k / top-p rows cost seconds per slot in the interpreter
# (the threshold search): few of them, few slots.
CASES = {
    "greedy-b1": ([9], [SamplingParams(temperature=0)], 4),
    "greedy-b4": ([0, 6, 13, 2], [SamplingParams(temperature=0)] * 4, 4),
    "sampled-t1-b3": ([5, 11, 0], [SamplingParams(temperature=1.0, seed=7), SamplingParams(temperature=0),
                                   SamplingParams(temperature=1.0, seed=8)], 4),
    "topk-topp-b3": ([3, 0, 17], [
        SamplingParams(temperature=0.8, top_k=20, seed=1),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.8, seed=3),
    ], 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_proposals_match_pytorch_path(name, proposer):
    ctx_lens, params, N = CASES[name]
    taps, pos, slots, tables = _context(proposer, ctx_lens, seed=len(name))
    _write(proposer, False, taps, pos, slots)  # the same cache for both paths
    V = proposer.drafter.config.vocab_size
    B = len(ctx_lens)
    g = torch.Generator().manual_seed(5)
    anchors = torch.randint(4, V, (B,), generator=g)
    anchor_pos = torch.tensor(ctx_lens)
    prob = [not p.greedy for p in params]
    batch = SamplingBatch.build(params, [p.seed or 0 for p in params], [c + 1 for c in ctx_lens],
                                [[1]] * B, [[]] * B, V, "cpu")
    args = ([None] * B, anchors, anchor_pos, tables, N, batch, prob)
    want = _propose(proposer, False, *args)
    got = _propose(proposer, True, *args)
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    if any(prob):
        torch.testing.assert_close(got.probs, want.probs, atol=1e-5, rtol=1e-4)
    else:
        assert got.probs is None and want.probs is None
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["greedy-b1", "sampled-t1-b3"])
def test_fewrow_block_pass_matches_pytorch_path(name, proposer, monkeypatch):
    """The few-row block pass (DSparkProposer.fewrow, on CUDA by default; kernels/fewrow.py, at most fewrow.ENGINE_MAX_ROWS rows: 5 and 15 here) drafts what
    the PyTorch path drafts (fp32: the norms' other rounding order is ~1e-7)."""
    from dspark.kernels import fewrow

    calls = []
    orig = fewrow.gate_up_silu
    monkeypatch.setattr(fewrow, "gate_up_silu", lambda *a, **k: calls.append(1) or orig(*a, **k))
    ctx_lens, params, N = CASES[name]
    taps, pos, slots, tables = _context(proposer, ctx_lens, seed=len(name))
    _write(proposer, False, taps, pos, slots)
    V = proposer.drafter.config.vocab_size
    B = len(ctx_lens)
    anchors = torch.randint(4, V, (B,), generator=torch.Generator().manual_seed(5))
    prob = [not p.greedy for p in params]
    batch = SamplingBatch.build(params, [p.seed or 0 for p in params], [c + 1 for c in ctx_lens],
                                [[1]] * B, [[]] * B, V, "cpu")
    args = ([None] * B, anchors, torch.tensor(ctx_lens), tables, N, batch, prob)
    saved = proposer.fewrow
    want = _propose(proposer, False, *args)
    assert not calls
    proposer.fewrow = True
    try:
        got = _propose(proposer, True, *args)
    finally:
        proposer.fewrow = saved
    assert len(calls) == proposer.drafter.config.num_hidden_layers
    assert torch.equal(got.tokens, want.tokens), (got.tokens, want.tokens)
    if any(prob):
        torch.testing.assert_close(got.probs, want.probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-4)


def test_engine_triton_backend_matches_torch_and_no_speculation(target, drafter):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (5, 14, 9)]
    kw = dict(device="cpu", block_size=BLOCK, num_kv_blocks=128)
    ref = [o.token_ids for o in LLM(str(target), **kw).generate(prompts, GREEDY)]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(target), attention_backend=backend, speculative_config={"model": str(drafter), "confidence_scheduling": False}, **kw)
        assert llm.engine.runner.proposer.use_triton is (backend == "triton")
        outs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        st = llm.engine.spec_stats
        runs[backend] = (outs, st.num_steps, st.num_drafts, st.num_accepted)
        assert outs == ref, backend
        assert st.num_drafts > 0
    assert runs["triton"] == runs["torch"]


def test_qk_norm_drafter_matches(tmp_path):
    """A Qwen3 drafter (q/k norm before RoPE, head_dim 32): the cache and greedy/sampled proposals."""
    t = write_tiny_checkpoint(tmp_path / "t", "qwen3", num_hidden_layers=4, seed=5)
    d = random_drafter(tmp_path / "d", t, target_layer_ids=[0, 2], block_size=4)
    prop = LLM(str(t), device="cpu", block_size=BLOCK, num_kv_blocks=64,
               speculative_config={"model": str(d)}).engine.runner.proposer
    assert prop.drafter.layers[0].k_norm is not None
    ctx_lens = [6, 0, 10]
    taps, pos, slots, tables = _context(prop, ctx_lens, seed=3)
    want_kv = _write(prop, False, taps, pos, slots)
    torch.testing.assert_close(_write(prop, True, taps, pos, slots), want_kv, atol=1e-5, rtol=1e-5)
    prop.kv.copy_(want_kv)
    V = prop.drafter.config.vocab_size
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=9), SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, [p.seed or 0 for p in params], [c + 1 for c in ctx_lens],
                                [[1]] * 3, [[]] * 3, V, "cpu")
    args = ([None] * 3, torch.tensor([17, 250, 40]), torch.tensor(ctx_lens), tables, 4, batch,
            [not p.greedy for p in params])
    want, got = _propose(prop, False, *args), _propose(prop, True, *args)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.probs, want.probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got.confidence, want.confidence, atol=1e-5, rtol=1e-4)
