"""Paged decode/verification attention kernel vs its PyTorch reference, and the reference vs the
engine's TorchAttentionBackend on the same batch (so the kernel's semantics are the engine's).
Runs in Triton's interpreter on the CPU (see conftest.py): shapes are kept small."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from dspark.kernels.paged_attention import paged_attention, paged_attention_ref, write_kv  # noqa: E402
from dspark.layers.attention import BatchLayout, TorchAttentionBackend  # noqa: E402


@dataclass
class Batch:
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new K/V rows
    v: torch.Tensor
    k_cache: torch.Tensor  # [num_blocks, page, Hkv, D], context already written
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [B, max_blocks]
    seq_lens: torch.Tensor  # [B]
    qsl: torch.Tensor  # [B + 1]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T]
    page: int


def make_batch(seq_lens: list[int], q_lens: list[int], *, heads: tuple[int, int], head_dim: int, page: int,
               pad_requests: int = 0, seed: int = 0) -> Batch:
    """Random caches and a ragged batch laid out as the runner lays it out; requests own distinct
    random blocks (never block 0). ``pad_requests`` extra requests decode one row at seq_len 1 on the
    dummy block 0, as a padded CUDA-graph batch would."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    seq_lens = list(seq_lens) + [1] * pad_requests
    q_lens = list(q_lens) + [1] * pad_requests
    n_blocks = [-(-s // page) for s in seq_lens[:len(seq_lens) - pad_requests]]
    width = max(n_blocks + [1]) + 1  # one spare column of padding
    num_blocks = 1 + sum(n_blocks) + 3
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(len(seq_lens), width, dtype=torch.int64)
    for b, n in enumerate(n_blocks):
        table[b, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    k_cache = torch.randn(num_blocks, page, Hkv, head_dim, generator=g)
    v_cache = torch.randn(num_blocks, page, Hkv, head_dim, generator=g)
    qsl = torch.tensor([0] + q_lens).cumsum(0)
    T = int(qsl[-1])
    positions = torch.cat([torch.arange(s - n, s) for s, n in zip(seq_lens, q_lens)])
    req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(q_lens))
    slot_mapping = table[req, positions // page] * page + positions % page
    return Batch(
        q=torch.randn(T, Hq, head_dim, generator=g), k=torch.randn(T, Hkv, head_dim, generator=g),
        v=torch.randn(T, Hkv, head_dim, generator=g), k_cache=k_cache, v_cache=v_cache, block_tables=table,
        seq_lens=torch.tensor(seq_lens), qsl=qsl, positions=positions, slot_mapping=slot_mapping, page=page,
    )


def written(b: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches after this step's K/V rows are stored (as the engine does before attending)."""
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    kc.view(-1, *kc.shape[2:]).index_copy_(0, b.slot_mapping, b.k)
    vc.view(-1, *vc.shape[2:]).index_copy_(0, b.slot_mapping, b.v)
    return kc, vc


# (name, seq_lens, q_lens): ragged, lengths of 1, non-multiples of the page and of the key tile (16)
CASES = [
    ("decode", [1, 5, 17, 40], [1, 1, 1, 1]),
    ("verify", [6, 9, 23, 38], [6, 6, 6, 6]),  # 1 + N rows, N = 5; the first request has no context
    ("mixed", [3, 12, 30, 21], [1, 6, 11, 3]),  # decode, verification, a prefill chunk, a short one
]
HEADS = [((2, 2), 32), ((9, 3), 64)]  # GQA ratio 1; SmolLM2 (9 query heads over 3 KV heads, D 64)


@pytest.mark.parametrize("name,seq_lens,q_lens", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("heads,head_dim", HEADS, ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_kernel_matches_reference(name, seq_lens, q_lens, heads, head_dim, num_splits):
    b = make_batch(seq_lens, q_lens, heads=heads, head_dim=head_dim, page=4, pad_requests=1)
    kc, vc = written(b)
    scale = head_dim**-0.5
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, scale)
    out = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, scale, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_query_chunks_over_several_programs():
    """A request longer than one query tile: its chunks loop inside a program (no hint) or spread over
    programs (``max_query_len``), with int32 metadata and a page larger than the key tile."""
    b = make_batch([37, 9], [29, 2], heads=(9, 3), head_dim=64, page=16)
    kc, vc = written(b)
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    i32 = dict(block_tables=b.block_tables.int(), seq_lens=b.seq_lens.int(), query_start_loc=b.qsl.int())
    for hint in (None, 29):
        out = paged_attention(b.q, kc, vc, **i32, scale=0.125, max_query_len=hint, block_n=8)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name,seq_lens,q_lens", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("heads,head_dim", HEADS, ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("num_splits", [2, 3])
def test_split_merge_in_the_attention_launch(name, seq_lens, q_lens, heads, head_dim, num_splits):
    """With a key split and ``max_query_len``, the last split program of each query chunk merges the
    slices (no second launch): same output as the two-launch path and the reference, twice in a row
    (each launch must leave its arrival counters at 0 for the next), and the counters all 0 after."""
    from dspark.kernels import paged_attention as pa

    b = make_batch(seq_lens, q_lens, heads=heads, head_dim=head_dim, page=4, pad_requests=1)
    kc, vc = written(b)
    scale = head_dim**-0.5
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, scale)
    kw = dict(max_query_len=max(q_lens), num_splits=num_splits, block_n=16)
    two = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, scale, fuse_combine=False, **kw)
    for _ in range(2):
        one = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, scale, fuse_combine=True, **kw)
        torch.testing.assert_close(one, ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-6)
    assert int(pa._COUNTER_BUFS[b.q.device].abs().sum()) == 0


def test_split_merge_in_the_launch_with_query_chunks():
    """Several query chunks per request, each merged by its own counter (MAX_CHUNKS > 1), spread over
    programs by the hint."""
    b = make_batch([37, 9], [29, 2], heads=(9, 3), head_dim=64, page=16)
    kc, vc = written(b)
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    out = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, max_query_len=29, num_splits=3,
                          block_n=8, fuse_combine=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def _rope_case(b: Batch, dtype: torch.dtype, norm: bool, seed: int = 0):
    """Raw q/k/v as strided views of one fused qkv projection, RoPE tables, optional q/k norms."""
    from dspark.layers.basic import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    T, Hq, D = b.q.shape
    Hkv = b.k.shape[1]
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
    q, k, v = (x.view(T, -1, D) for x in qkv.split([Hq * D, Hkv * D, Hkv * D], -1))
    rope = RotaryEmbedding(D, 10000.0, 128)
    qn, kn = (torch.randn(D, generator=g).to(dtype) for _ in range(2)) if norm else (None, None)
    return q, k, v, dict(k=k, v=v, positions=b.positions, cos=rope.cos, sin_signed=rope.sin_signed,
                         slot_mapping=b.slot_mapping, q_norm=qn, k_norm=kn, eps=1e-6)


@pytest.mark.parametrize("name,seq_lens,q_lens", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("norm", [False, True], ids=["llama", "qk-norm"])
def test_rope_and_cache_write_in_the_attention_launch(name, seq_lens, q_lens, dtype, num_splits, norm):
    """``rope=``: the RoPE (+ per-head q/k norm) and K/V cache write of fused_ops.rope_qk_cache done by
    the attention launch itself gives bit-identical caches and output to rope_qk_cache followed by
    the attention, with the key range split or not and a padding request on the dummy block."""
    from dspark.kernels.fused_ops import rope_qk_cache

    b = make_batch(seq_lens, q_lens, heads=(9, 3), head_dim=64, page=4, pad_requests=1)
    q, k, v, rope = _rope_case(b, dtype, norm)
    kc1, vc1 = b.k_cache.to(dtype), b.v_cache.to(dtype)
    kc2, vc2 = kc1.clone(), vc1.clone()
    qr, _ = rope_qk_cache(q, k, v, b.positions, rope["cos"], rope["sin_signed"], kc1, vc1, b.slot_mapping,
                          rope["q_norm"], rope["k_norm"], 1e-6)
    kw = dict(max_query_len=max(q_lens), num_splits=num_splits, block_n=16)
    want = paged_attention(qr, kc1, vc1, b.block_tables, b.seq_lens, b.qsl, 0.125, **kw)
    got = paged_attention(q, kc2, vc2, b.block_tables, b.seq_lens, b.qsl, 0.125, rope=rope, **kw)
    assert torch.equal(kc2, kc1) and torch.equal(vc2, vc1)  # every new K/V row written, nothing else
    assert torch.equal(got, want)


def test_rope_in_the_launch_with_query_chunks():
    """A prefill-like request over several query chunks and programs: chunks that share a key slice
    each write its new K/V (same values) before reading them."""
    from dspark.kernels.fused_ops import rope_qk_cache

    b = make_batch([37, 9], [29, 2], heads=(9, 3), head_dim=64, page=16)
    q, k, v, rope = _rope_case(b, torch.float32, False, seed=1)
    kc1, vc1 = b.k_cache.clone(), b.v_cache.clone()
    kc2, vc2 = kc1.clone(), vc1.clone()
    qr, _ = rope_qk_cache(q, k, v, b.positions, rope["cos"], rope["sin_signed"], kc1, vc1, b.slot_mapping)
    for splits in (1, 3):
        kw = dict(max_query_len=29, num_splits=splits, block_n=8)
        want = paged_attention(qr, kc1, vc1, b.block_tables, b.seq_lens, b.qsl, 0.125, **kw)
        got = paged_attention(q, kc2, vc2, b.block_tables, b.seq_lens, b.qsl, 0.125, rope=rope, **kw)
        assert torch.equal(kc2, kc1) and torch.equal(got, want)


@pytest.mark.parametrize("name,seq_lens,q_lens", CASES, ids=[c[0] for c in CASES])
def test_fixed_query_tile_of_batch_invariant_mode(name, seq_lens, q_lens):
    """block_m fixed at 64 (batch-invariant mode: decode, verification and prefill rows share one tile
    layout) covers every row, however few or many a request has; bad sizes are refused."""
    b = make_batch(seq_lens, q_lens, heads=(9, 3), head_dim=64, page=4, pad_requests=1)
    kc, vc = written(b)
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    out = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, max_query_len=max(q_lens),
                          num_splits=1, block_n=64, block_m=64)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for bad in (8, 48):
        with pytest.raises(ValueError, match="block_m"):
            paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, block_m=bad)


@pytest.mark.parametrize("name,seq_lens,q_lens", CASES, ids=[c[0] for c in CASES])
def test_fixed_key_slices_match_the_reference(name, seq_lens, q_lens):
    """split_keys (batch-invariant mode): fixed key slices, merged in order; more slices than the keys need
    (a larger bucket) and a hint below the longest context (the last slice runs to the end) stay exact."""
    b = make_batch(seq_lens, q_lens, heads=(9, 3), head_dim=64, page=4, pad_requests=1)
    kc, vc = written(b)
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    for max_seq_len in (64, 128, 16):
        out = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, max_query_len=max(q_lens),
                              max_seq_len=max_seq_len, split_keys=16, block_n=8, block_m=64)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    for bad in (dict(split_keys=12, block_n=8), dict(split_keys=16), dict(split_keys=16, block_n=8, num_splits=2)):
        with pytest.raises(ValueError, match="split_keys"):
            paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, max_seq_len=64, **bad)


def _decode_and_verify_row(split_kw: dict, verify_batch: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output of one query row (a request's token at position 90, 90 keys before it) decoded alone
    in a bucket of 128, and the same row verified as the first of 8 new tokens (98 keys) beside a longer
    request in a bucket of 256 (or alone, ``verify_batch`` False), on the same cache."""
    b = make_batch([98, 150], [8, 5], heads=(9, 3), head_dim=64, page=4, seed=5)
    kc, vc = written(b)
    one = dict(block_tables=b.block_tables[:1], qsl=torch.tensor([0, 1]), seq_lens=torch.tensor([91]))
    dec = paged_attention(b.q[:1], kc, vc, one["block_tables"], one["seq_lens"], one["qsl"], 0.125,
                          max_query_len=1, max_seq_len=128, block_n=16, block_m=64, **split_kw)
    rows = slice(0, 13) if verify_batch else slice(0, 8)
    nb = 2 if verify_batch else 1
    ver = paged_attention(b.q[rows], kc, vc, b.block_tables[:nb], b.seq_lens[:nb], b.qsl[:nb + 1], 0.125,
                          max_query_len=8, max_seq_len=256, block_n=16, block_m=64, **split_kw)
    return dec[0], ver[0]


def test_row_sums_on_the_tensor_cores_match_the_reference():
    """rowsum_mma: the softmax row sums as a product with ones (layout-free on the GPU) give the reference's
    outputs, with fixed slices or the default split, and a row the same bits decoded or verified (in the
    interpreter with the query tile pinned: its numpy products may round a row by the tile's shape)."""
    b = make_batch([6, 9, 23, 38], [1, 6, 11, 3], heads=(9, 3), head_dim=64, page=4, pad_requests=1)
    kc, vc = written(b)
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    for kw in (dict(split_keys=16, max_seq_len=64), dict(num_splits=3)):
        out = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, max_query_len=11,
                              block_n=8, rowsum_mma=True, **kw)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    dec, ver = _decode_and_verify_row({"split_keys": 32, "rowsum_mma": True}, verify_batch=True)
    assert torch.equal(dec, ver)
    # half precision: the weights enter the sum as the P·V product reads them (rounded to fp16)
    half = paged_attention(b.q.half(), kc.half(), vc.half(), b.block_tables, b.seq_lens, b.qsl, 0.125,
                           max_query_len=11, max_seq_len=64, split_keys=16, block_n=8, rowsum_mma=True)
    torch.testing.assert_close(half.float(), ref, atol=3e-3, rtol=3e-3)


def test_several_slices_per_program_keep_the_bits():
    """slices_per_program: a program takes consecutive fixed slices one after the other, each from a fresh softmax
    state into its own partial, so every row has the bits of one slice per program (fp16 caches, ragged requests,
    a padding request, a bucket above the longest context); a group size that does not divide the slices is
    lowered to one that does; it needs fixed slices and no merge inside the launch."""
    b = make_batch([6, 9, 23, 38], [1, 6, 11, 3], heads=(9, 3), head_dim=64, page=4, pad_requests=1)
    kc, vc = written(b)
    q, kc, vc = b.q.half(), kc.half(), vc.half()
    args = (q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    kw = dict(max_query_len=11, max_seq_len=64, split_keys=8, block_n=8, block_m=64, rowsum_mma=True)
    one = paged_attention(*args, **kw)
    for spp in (2, 4, 3):  # 3 does not divide the 8 slices: halved until it does (1)
        assert torch.equal(paged_attention(*args, slices_per_program=spp, **kw), one), spp
    ref = paged_attention_ref(b.q, *written(b), b.block_tables, b.seq_lens, b.qsl, 0.125)
    torch.testing.assert_close(one.float(), ref, atol=3e-3, rtol=3e-3)
    with pytest.raises(ValueError, match="needs split_keys"):
        paged_attention(*args, max_query_len=11, slices_per_program=2)
    with pytest.raises(ValueError, match="fuse_combine"):
        paged_attention(*args, slices_per_program=2, fuse_combine=True, **kw)


@pytest.mark.parametrize("verify_batch", [False, True])
def test_fixed_key_slices_give_a_row_the_same_bits_decoded_or_verified(verify_batch):
    """The batch-invariant property of split_keys: the decoded row and the verified row agree bit for bit
    (another bucket: twice the slices, the extra ones empty). The control: equal slices of what each step
    sees (the default split: 3 slices of 32 keys for the decode step, of 48 for the verification step) put
    the bounds elsewhere, and the row's sums round differently."""
    dec, ver = _decode_and_verify_row({"split_keys": 32}, verify_batch)
    assert torch.equal(dec, ver)
    dec, ver = _decode_and_verify_row({"num_splits": 3}, verify_batch)
    torch.testing.assert_close(dec, ver, atol=1e-5, rtol=1e-5)
    assert not torch.equal(dec, ver)


@pytest.mark.parametrize("name,seq_lens,q_lens", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_torch_backend(name, seq_lens, q_lens):
    """The engine's backend writes the new K/V and attends; write_kv + the reference (and the kernel)
    on the same batch give the same rows, the padding request included."""
    b = make_batch(seq_lens, q_lens, heads=(9, 3), head_dim=64, page=4, pad_requests=1)
    layout = BatchLayout(positions=b.positions, slot_mapping=b.slot_mapping, query_start_loc=b.qsl.tolist(),
                         seq_lens=b.seq_lens.tolist(), block_tables=b.block_tables, block_size=b.page)
    backend = TorchAttentionBackend()
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    want = backend.forward(b.q, b.k, b.v, kc, vc, backend.prepare(layout), 0.125)

    kc2, vc2 = b.k_cache.clone(), b.v_cache.clone()
    write_kv(b.k, b.v, kc2, vc2, b.slot_mapping)
    assert torch.equal(kc2, kc) and torch.equal(vc2, vc)
    ref = paged_attention_ref(b.q, kc2, vc2, b.block_tables, b.seq_lens, b.qsl, 0.125)
    torch.testing.assert_close(ref, want, atol=2e-5, rtol=1e-5)
    out = paged_attention(b.q, kc2, vc2, b.block_tables, b.seq_lens, b.qsl, 0.125, block_n=16)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-5)


def test_write_kv_skips_negative_slots_and_strided_inputs():
    g = torch.Generator().manual_seed(1)
    kc = torch.randn(5, 4, 3, 16, generator=g)
    vc = torch.randn(5, 4, 3, 16, generator=g)
    kv = torch.randn(6, 2 * 3 * 16 + 7, generator=g)  # k and v as views of one projection output
    k = kv[:, :48].view(6, 3, 16)
    v = kv[:, 48:96].view(6, 3, 16)
    slots = torch.tensor([7, -1, 0, 19, -1, 12])
    want_k, want_v = kc.clone(), vc.clone()
    keep = slots >= 0
    want_k.view(-1, 3, 16).index_copy_(0, slots[keep], k[keep])
    want_v.view(-1, 3, 16).index_copy_(0, slots[keep], v[keep])
    write_kv(k, v, kc, vc, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_half_precision():
    """fp16 inputs (tensor-core dtype on the GPU): products in fp16, softmax and sums in fp32."""
    b = make_batch([7, 20], [1, 4], heads=(9, 3), head_dim=64, page=4)
    kc, vc = written(b)
    args = (b.q.half(), kc.half(), vc.half(), b.block_tables, b.seq_lens, b.qsl, 0.125)
    out = paged_attention(*args, block_n=16)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), paged_attention_ref(*args).float(), atol=2e-3, rtol=2e-3)


def test_invariant_launch_rule():
    """invariant_attention_launch (docs/benchmarks.md sessions 47 and 50): one slice per program; one stage for
    one-tile slices, two for longer ones; 2 warps for busy verification tiles, else 4. None of it changes bits."""
    from dspark.kernels.paged_attention import invariant_attention_launch as rule

    assert rule(16, 48, 132) == {"num_warps": 4, "num_stages": 1, "slices_per_program": 1}  # batch-1 decode
    assert rule(32, 1536, 132) == {"num_warps": 2, "num_stages": 1, "slices_per_program": 1}  # batch-32 verify
    assert rule(16, 1536, 132) == {"num_warps": 4, "num_stages": 1, "slices_per_program": 1}
    assert rule(16, 48, 132, tiles_per_slice=2)["num_stages"] == 2  # 128-key slices (max_model_len > 4,096)
    assert rule(64, 48, 132, tiles_per_slice=2)["num_stages"] is None  # prefill tiles: Triton's default


def test_tuned_launch_rule():
    """PAGED_TUNING's rule on an H200-sized GPU (132 SMs): from 384 programs (batch 128) on, ~1.5 programs
    per SM (no split there) with 64-key tiles and 3 stages for short buckets, 128-key tiles and 2 stages
    for slices of >= 1,024 bucket keys; smaller launches (measured misleadingly, see PAGED_TUNING),
    prefill-sized query tiles, unknown buckets and non-GPU devices keep the defaults."""
    from dspark.kernels.paged_attention import PAGED_TUNING, tuned_launch

    assert tuned_launch(16, 384, 512, 132) == {"block_n": 64, "num_stages": 3, "num_splits": 1}  # decode B=128
    assert tuned_launch(16, 384, 1024, 132) == {"block_n": 128, "num_stages": 2, "num_splits": 1}
    assert tuned_launch(32, 384, 512, 132) == {"block_n": 64, "num_stages": 3, "num_splits": 1}  # verify B=128
    assert tuned_launch(32, 768, 2048, 132) == {"block_n": 128, "num_stages": 2, "num_splits": 1}
    assert tuned_launch(16, 96, 2048, 132) == tuned_launch(16, 383, 2048, 132) == {}  # below min_programs
    assert tuned_launch(64, 384, 2048, 132) == {}
    assert tuned_launch(16, 384, None, 132) == {} and tuned_launch(16, 384, 2048, None) == {}
    # the split rule itself where it would apply to smaller launches: ~1.5 programs per SM, a key tile per slice
    old, PAGED_TUNING["min_programs"] = PAGED_TUNING["min_programs"], 0
    try:
        assert tuned_launch(16, 3, 2048, 132) == {"block_n": 64, "num_stages": 3, "num_splits": 32}
        assert tuned_launch(16, 3, 512, 132) == {"block_n": 64, "num_stages": 3, "num_splits": 8}
        assert tuned_launch(16, 24, 2048, 132) == {"block_n": 64, "num_stages": 3, "num_splits": 8}
        assert tuned_launch(16, 96, 2048, 132) == {"block_n": 128, "num_stages": 2, "num_splits": 2}
    finally:
        PAGED_TUNING["min_programs"] = old


@pytest.mark.parametrize("block_m,programs,bucket", [(16, 384, 256), (16, 384, 2048), (32, 384, 512)])
def test_tuned_settings_match_the_reference(block_m, programs, bucket):
    """Each kind of setting the rule picks (64- or 128-key tiles, split or not) gives the reference's
    output on a ragged batch (the interpreter ignores the stage count; the GPU sweep checks those)."""
    from dspark.kernels.paged_attention import tuned_launch

    kw = tuned_launch(block_m, programs, bucket, 132)
    kw.pop("num_stages")
    q_len = 1 if block_m == 16 else 8
    b = make_batch([200, 131, 77], [q_len] * 3, heads=(9, 3), head_dim=64, page=16, pad_requests=1)
    kc, vc = written(b)
    ref = paged_attention_ref(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125)
    out = paged_attention(b.q, kc, vc, b.block_tables, b.seq_lens, b.qsl, 0.125, max_query_len=q_len, **kw)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
