"""The Triton attention backend against the PyTorch reference backend: ragged batches through both
backends (prefill chunks, decode and verification rows, padding), then whole engines on a tiny
random Llama, greedy, with chunked prefill and DSpark speculation — identical tokens. Also the config
and CLI plumbing of ``attention_backend``. On a machine without CUDA the kernels run in Triton's
interpreter (dspark/kernels/__init__.py turns it on), so shapes and token counts are kept small."""

from __future__ import annotations

import logging
import os

import pytest
import torch

# Interpreter mode must be on before triton is first imported (as in tests/kernels/conftest.py), so
# these tests run the kernels on CPU tensors, on a GPU machine too.
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.config import EngineConfig  # noqa: E402
from dspark.layers.attention import BatchLayout, TorchAttentionBackend  # noqa: E402
from dspark.layers.triton_attention import TritonAttentionBackend, seq_len_hint  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.spec.drafters import OracleProposer, random_drafter  # noqa: E402


def ragged_layout(seq_lens: list[int], q_lens: list[int], page: int, pad_requests: int, seed: int):
    """A step as the runner lays it out: requests own distinct random blocks (never block 0), tables
    padded with the dummy block 0 plus a spare column; ``pad_requests`` extra requests decode one row
    at seq_len 1 on block 0 (slot 0), as a padded batch would. Returns (layout, num_blocks)."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = list(seq_lens) + [1] * pad_requests
    q_lens = list(q_lens) + [1] * pad_requests
    real = len(seq_lens) - pad_requests
    n_blocks = [-(-s // page) for s in seq_lens[:real]]
    num_blocks = 1 + sum(n_blocks) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(n_blocks) + 1, dtype=torch.int64)
    for b, n in enumerate(n_blocks):
        table[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    slots = table[req, positions // page] * page + positions % page
    layout = BatchLayout(positions=positions, slot_mapping=slots, query_start_loc=qsl, seq_lens=seq_lens,
                         block_tables=table, block_size=page)
    return layout, num_blocks


# (name, seq_lens, q_lens): context + new rows; lengths not multiples of the page or of a key tile
BATCHES = [
    ("decode", [1, 6, 19, 40], [1, 1, 1, 1]),  # uniform: one group in the torch backend
    ("verify", [6, 13, 30], [6, 6, 6]),  # 1 + N rows, N = 5; the first request has no context
    ("mixed", [23, 9, 31, 70, 5], [1, 4, 13, 70, 5]),  # decode, verify, chunk after context, long prefill, prefill
]
HEADS = [((4, 2), 16), ((9, 3), 64)]  # the tiny test model's shape; SmolLM2's (G = 3, D = 64)


@pytest.mark.parametrize("name,seq_lens,q_lens", BATCHES, ids=[b[0] for b in BATCHES])
@pytest.mark.parametrize("heads,head_dim", HEADS, ids=["g2d16", "g3d64"])
def test_backend_matches_torch_backend(name, seq_lens, q_lens, heads, head_dim):
    page = 4 if head_dim == 16 else 16
    layout, num_blocks = ragged_layout(seq_lens, q_lens, page, pad_requests=1, seed=len(seq_lens) + head_dim)
    Hq, Hkv = heads
    T = layout.query_start_loc[-1]
    g = torch.Generator().manual_seed(7)
    # q/k/v as the model makes them: k and v are strided views of one fused projection.
    q = torch.randn(T, Hq, head_dim, generator=g)
    kv = torch.randn(T, 2 * Hkv * head_dim + 8, generator=g)
    k = kv[:, : Hkv * head_dim].view(T, Hkv, head_dim)
    v = kv[:, Hkv * head_dim: 2 * Hkv * head_dim].view(T, Hkv, head_dim)
    cache = torch.randn(2, num_blocks, page, Hkv, head_dim, generator=g)  # random context already "written"
    scale = head_dim**-0.5

    ref_backend = TorchAttentionBackend()
    ref_cache = cache.clone()
    want = ref_backend.forward(q, k, v, ref_cache[0], ref_cache[1], ref_backend.prepare(layout), scale)

    backend = TritonAttentionBackend("cpu")
    meta = backend.prepare(layout)
    # the context hint rounded up as the graphs' buckets are (seq_len_hint: one launch setting per bucket)
    assert meta.max_query_len == max(q_lens) and meta.max_seq_len == seq_len_hint(max(seq_lens)) >= max(seq_lens)
    got_cache = cache.clone()
    got = backend.forward(q, k, v, got_cache[0], got_cache[1], meta, scale)
    assert torch.equal(got_cache, ref_cache)  # the same K/V rows at the same slots, nothing else touched
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_metadata_is_built_once_per_step_from_host_lists():
    layout, _ = ragged_layout([9, 4], [3, 1], page=4, pad_requests=0, seed=0)
    meta = TritonAttentionBackend("cpu").prepare(layout)
    assert meta.seq_lens.dtype == meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [9, 4] and meta.query_start_loc.tolist() == [0, 3, 4]
    assert (meta.max_query_len, meta.max_seq_len) == (3, 512)  # seq_len_hint(9): the smallest bucket
    assert meta.slot_mapping is layout.slot_mapping and meta.block_tables is layout.block_tables


# ------------------------------------------------------------------------------- whole engine
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tri") / "t", "llama", seed=5)  # hidden 64, 2 layers


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(4, 512, (9,), generator=g).tolist()
    return [shared + torch.randint(4, 512, (n,), generator=g).tolist() if i % 2 else
            torch.randint(4, 512, (n,), generator=g).tolist() for i, n in enumerate([5, 14, 23, 1])]


ENGINE_CONFIGS = {
    "batched": {},
    "chunked-prefill": dict(max_num_batched_tokens=6),  # prompts split over steps, mixed with decodes
    # Random DSpark drafter: verification rows (1 + 4) in the same steps as prefill chunks (its drafts
    # are all rejected, so every verification also rolls the cache back).
    "speculative": dict(max_num_batched_tokens=12),
}


@pytest.mark.parametrize("name", list(ENGINE_CONFIGS))
def test_engine_outputs_match_torch_backend(name, target, prompts, tmp_path_factory):
    kw = dict(device="cpu", block_size=4, num_kv_blocks=96, **ENGINE_CONFIGS[name])
    if name == "speculative":
        d = random_drafter(tmp_path_factory.mktemp("tri") / "d", target, target_layer_ids=[0], block_size=5)
        kw["speculative_config"] = {"model": str(d), "confidence_scheduling": False}
    ref_llm = LLM(str(target), **kw)
    assert isinstance(ref_llm.engine.runner.backend, TorchAttentionBackend)  # the default ("auto")
    want = [o.token_ids for o in ref_llm.generate(prompts, GREEDY)]
    llm = LLM(str(target), attention_backend="triton", **kw)
    assert isinstance(llm.engine.runner.backend, TritonAttentionBackend)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == want
    if name == "speculative":  # verification really ran, with the same outcomes under both backends
        st, ref_st = llm.engine.spec_stats, ref_llm.engine.spec_stats
        assert st.num_drafts > 0 and (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted)


def test_engine_with_accepted_drafts_matches_torch_backend(target, prompts):
    """An oracle proposes the reference's own continuation: every draft is accepted, so verification
    rows are committed and later steps attend over them."""
    want = [o.token_ids for o in LLM(str(target), device="cpu", block_size=4).generate(prompts, GREEDY)]
    oracle = OracleProposer({tuple(p): w for p, w in zip(prompts, want)}, num_slots=3)
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=96, attention_backend="triton",
              speculative_config={"num_speculative_tokens": 3}, proposer_factory=oracle)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert llm.engine.spec_stats.num_accepted == llm.engine.spec_stats.num_drafts > 0


# ------------------------------------------------------------------------------- config and CLI
def test_config_names_unknown_backend():
    with pytest.raises(ValueError, match=r"unknown attention_backend 'flash': use one of auto, torch, triton"):
        EngineConfig(attention_backend="flash")
    assert EngineConfig().resolved_attention_backend == "torch"  # auto = torch on a CPU
    assert EngineConfig(device="cuda", attention_backend="auto").resolved_attention_backend == "triton"
    assert EngineConfig(attention_backend="triton").resolved_attention_backend == "triton"


def test_cli_flags(target, capsys):
    from dspark.cli import _engine_kwargs, build_parser

    a = build_parser().parse_args(["generate", "--no-spec", "--attention-backend", "triton"])
    assert _engine_kwargs(a)["attention_backend"] == "triton" and not _engine_kwargs(a)["invariant_attention"]
    a = build_parser().parse_args(["generate", "--attention-backend", "triton", "--invariant-attention"])
    assert _engine_kwargs(a)["invariant_attention"]
    assert build_parser().parse_args(["generate"]).attention_backend == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--attention-backend", "flash"])
    err = capsys.readouterr().err
    assert "--attention-backend" in err and "'flash'" in err

    from dspark.server.cli import add_serve_arguments, build_engine
    import argparse

    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        [str(target), "--device", "cpu", "--attention-backend", "triton", "--kv-cache-memory-gb", "0.01"])
    engine = build_engine(args, logging.getLogger("test"))
    assert engine.config.attention_backend == "triton"
    assert isinstance(engine.runner.backend, TritonAttentionBackend) and engine.runner.backend._fixed == {}
    args = add_serve_arguments(argparse.ArgumentParser()).parse_args(
        [str(target), "--device", "cpu", "--attention-backend", "triton", "--kv-cache-memory-gb", "0.01",
         "--invariant-attention"])
    engine = build_engine(args, logging.getLogger("test"))
    assert engine.config.invariant_attention and engine.runner.backend._fixed["split_keys"] == 64


def test_seq_len_hint_follows_the_graph_buckets():
    """Eager steps' context hint: the smallest power-of-two bucket from 512 that holds the step (a launch
    setting per bucket, not one per length, so no compile inside a live step)."""
    from dspark.engine.cuda_graphs import SMALLEST_BUCKET, context_buckets

    assert SMALLEST_BUCKET == 512
    assert [seq_len_hint(n) for n in (0, 1, 512, 513, 1024, 1500, 4097)] == [512, 512, 512, 1024, 1024, 2048, 8192]
    buckets = context_buckets(8192)
    assert all(seq_len_hint(n) in buckets for n in range(1, 8193, 97))


def test_batch_invariant_key_slices_are_fixed_per_engine():
    """The invariant attention's key slice depends on the engine's max_model_len only (so plain and DSpark
    engines of one configuration slice alike): 64 keys up to 4,096 tokens, then at most 64 slices. Off CUDA
    the query tile is pinned (the interpreter) and the default mode keeps the plain launch."""
    from dspark.layers.triton_attention import invariant_split_keys

    assert [invariant_split_keys(n) for n in (None, 512, 2048, 4096, 4097, 8192, 32768)] == [64, 64, 64, 64,
                                                                                             128, 128, 512]
    fixed = TritonAttentionBackend("cpu", batch_invariant=True, max_model_len=8192)._fixed
    assert fixed == {"split_keys": 128, "block_n": 64, "rowsum_mma": True, "block_m": 64}
    assert TritonAttentionBackend("cpu")._fixed == {}
