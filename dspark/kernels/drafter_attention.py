"""DSpark drafter attention in Triton: the block's γ query rows over [paged context K/V ‖ block K/V].

Semantics (those of ``DSparkDrafter.block_hidden`` / ``DrafterLayer.forward`` in the engine's drafting
step, see docs dspark.md §1.1): a request's block has γ query rows (``q [B, γ, Hq, D]``, after RoPE);
its keys and values are its context entries at positions ``[0, ctx_len)`` (``ctx_len`` = the anchor's
position), read from the drafter's paged cache ``[num_blocks, page, Hkv, D]`` through the target's
block table, followed by the block's own γ rows (``k_block / v_block [B, γ, Hkv, D]``). The mask is
``[ctx_valid ‖ ones(γ)]``, the same for every query row: each block row sees the whole context and
all γ block rows, itself and the rows after it included (bidirectional in the block, no causal part).
Optionally a per-head attention sink (a learned logit, DeepSeek-V4's drafter) joins the softmax
denominator only: ``o = Σ_j e^{s_j} v_j / (Σ_j e^{s_j} + e^{sink_h})``.

When the values are the keys (``kv_shared``: the same tensors passed for both, as DeepSeek-V4 keeps one KV
vector per token, MQA), both kernels gather each context tile once and use it twice. At seed 001's shape that is
11-15 % faster at batch 1, 4 and 12 alike (H200, session 45, ``kernel_attention_bench.py --seed-grid --kv-shared``).

Why the shared-tile kernel (seed 001's "v2"): every query row of a request attends to the same keys,
so one program per (request, KV head) stacks all γ × G query rows (G = Hq / Hkv heads sharing the KV
head: 15 rows for SmolLM2 at γ = 5) into one tile and streams each context K/V tile once, through
``tl.dot``.

Why row tiles: the stack is γ × G rows of head_dim columns, and its fp32 accumulator (with the query rows)
stays in registers through the key loop. SmolLM2's 21 × 64 fits one tile easily; DeepSeek-V4-Flash's
drafter (seed 001's shape: 64 query heads, 32 per GPU at TP 2, one 512-wide KV head, γ = 5 block rows, a
128-token sliding window, per-head sinks) stacks 160-320 rows × 512, far past any register file. The rows
are then cut into ``row_tiles`` tiles of ``block_m`` consecutive rows (``drafter_launch``: at most
DRAFTER_ROW_TILE values per tile; at head_dim 512 16 or 32 rows by batch), one program per (request, KV head × row
tile, key slice), each streaming the context once: the request's context is read once per row tile
(the tiles of one KV head are neighbours in the grid, so likely from L2 after the first) instead of once
per (row, head), and the split count is chosen for all these programs. SmolLM2's shapes keep one tile
and exactly the launch they had. Seed 001 (vLLM PR, RTX PRO 6000 Blackwell, V4-Flash shape)
measured v1 (naive) at 24.7 µs at batch 1 and 201.8 µs at batch 12, v2 (shared tile) at 14.8 and 15.2
µs: 13.3x at batch 12 (``benchmarks/kernel_attention_bench.py --seed-shape`` times this kernel there).

The naive kernel (one program per (draft row, query head), seed 001's "v1") rereads the
whole context γ × Hq times; it is kept only to measure against. Like the paged decode kernel, the loop
bound comes from each request's ``ctx_len`` at run time and the key range can be split over several
programs (flash-decoding) when the batch is too small to fill the GPU; the wrappers never read tensor
values on the host, so a drafting step that uses them can be captured in one CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels import pdl_opts, pdl_wait
from dspark.kernels.paged_attention import (
    LOG2E,
    _load_paged_kv,
    _load_paged_rows,
    _online_softmax_step,
    _store_rows,
    check_device,
    combine_splits,
    default_num_splits,
    dot_precision,
    next_pow2,
)
from dspark.layers.attention import context_slots


@triton.jit
def _drafter_attention_kernel(
    q_ptr, kb_ptr, vb_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, sink_ptr,
    block_tables_ptr, ctx_lens_ptr,
    qk_scale,
    stride_qb, stride_qi, stride_qh,
    stride_kbb, stride_kbi, stride_kbh,
    stride_vbb, stride_vbi, stride_vbh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oi, stride_oh, stride_os,
    stride_lb, stride_li, stride_lh,
    GAMMA: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_SINK: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_SHARED: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (b, kv head × row tile, split): rows [t·BLOCK_M, (t + 1)·BLOCK_M) of the γ × G query rows
    of request b for that KV head (row tile t), against slice ``split`` of its context; split 0 also
    takes the γ block rows. KV_SHARED: the values are the keys (one gather per tile)."""
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    row_tiles = (GAMMA * G + BLOCK_M - 1) // BLOCK_M  # a constexpr: with one tile, kvh and r fold as before
    kvh = tl.program_id(1) // row_tiles
    split = tl.program_id(2)
    ctx_len = tl.load(ctx_lens_ptr + b).to(tl.int64)

    # stacked row r = (block row r // G, head kvh * G + r % G)
    r = tl.program_id(1) % row_tiles * BLOCK_M + tl.arange(0, BLOCK_M)
    qi = r // G
    head = kvh * G + r % G
    row_ok = r < GAMMA * G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + qi[:, None] * stride_qi + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    # The block's own rows: every query row sees all γ of them. Only split 0 takes them (masked
    # loads elsewhere fetch nothing), so they count once per row (each row is in one row tile).
    j = tl.arange(0, BLOCK_G)
    j_ok = (j < GAMMA) & (split == 0)
    jd_mask = j_ok[:, None] & d_ok[None, :]
    kb = tl.load(kb_ptr + b * stride_kbb + j[:, None] * stride_kbi + kvh * stride_kbh + d[None, :], mask=jd_mask, other=0.0)
    if KV_SHARED:
        vb = kb
    else:
        vb = tl.load(vb_ptr + b * stride_vbb + j[:, None] * stride_vbi + kvh * stride_vbh + d[None, :], mask=jd_mask,
                     other=0.0)
    m_i, l_i, acc = _online_softmax_step(q, kb, vb, j_ok[None, :], m_i, l_i, acc, qk_scale, DOT_PRECISION)

    # The context, positions [0, ctx_len), paged; this program takes slice `split` of it.
    split_len = ((ctx_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, ctx_len)
    n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + n
        if KV_SHARED:
            k, kv_ok = _load_paged_rows(k_cache_ptr, bt_row, pos, hi, kvh, d, d_ok, stride_kb, stride_kt, stride_kh,
                                        PAGE)
            v = k
        else:
            k, v, kv_ok = _load_paged_kv(k_cache_ptr, v_cache_ptr, bt_row, pos, hi, kvh, d, d_ok, stride_kb,
                                         stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
        m_i, l_i, acc = _online_softmax_step(q, k, v, kv_ok[None, :],
                                             m_i, l_i, acc, qk_scale, DOT_PRECISION)

    if HAS_SINK and NUM_SPLITS == 1:  # with splits, the combine kernel adds the sink once
        sink = tl.load(sink_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    else:
        sink = tl.full([BLOCK_M], float("-inf"), tl.float32)
    _store_rows(out_ptr, lse_ptr, b * stride_ob + qi * stride_oi + head * stride_oh + split * stride_os,
                b * stride_lb + qi * stride_li + head * stride_lh + split, row_ok, d, d_ok,
                m_i, l_i, acc, sink, NUM_SPLITS)


@triton.jit
def _drafter_attention_naive_kernel(
    q_ptr, kb_ptr, vb_ptr, k_cache_ptr, v_cache_ptr, out_ptr, sink_ptr,
    block_tables_ptr, ctx_lens_ptr,
    qk_scale,
    stride_qb, stride_qi, stride_qh,
    stride_kbb, stride_kbi, stride_kbh,
    stride_vbb, stride_vbi, stride_vbh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ob, stride_oi, stride_oh,
    GAMMA: tl.constexpr, G: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_SINK: tl.constexpr,
    KV_SHARED: tl.constexpr,
):
    """Program (b * γ + i, head): one query vector against the whole context and block, on CUDA cores.
    KV_SHARED: the values are the keys."""
    b = (tl.program_id(0) // GAMMA).to(tl.int64)
    i = tl.program_id(0) % GAMMA
    h = tl.program_id(1)
    kvh = h // G
    ctx_len = tl.load(ctx_lens_ptr + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + b * stride_qb + i * stride_qi + h * stride_qh + d, mask=d_ok, other=0.0).to(tl.float32)

    j = tl.arange(0, BLOCK_G)
    j_ok = j < GAMMA
    jd_mask = j_ok[:, None] & d_ok[None, :]
    kb = tl.load(kb_ptr + b * stride_kbb + j[:, None] * stride_kbi + kvh * stride_kbh + d[None, :], mask=jd_mask, other=0.0)
    if KV_SHARED:
        vb = kb
    else:
        vb = tl.load(vb_ptr + b * stride_vbb + j[:, None] * stride_vbi + kvh * stride_vbh + d[None, :], mask=jd_mask,
                     other=0.0)
    sb = tl.where(j_ok, tl.sum(kb.to(tl.float32) * q[None, :], 1) * qk_scale, float("-inf"))
    m_i = tl.max(sb, 0)  # finite: γ >= 1 block rows are always visible
    pb = tl.exp2(sb - m_i)
    l_i = tl.sum(pb, 0)
    acc = tl.sum(pb[:, None] * vb.to(tl.float32), 0)

    n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b * stride_bt
    for n0 in range(0, ctx_len, BLOCK_N):
        pos = n0 + n
        if KV_SHARED:
            k, kv_ok = _load_paged_rows(k_cache_ptr, bt_row, pos, ctx_len, kvh, d, d_ok, stride_kb, stride_kt,
                                        stride_kh, PAGE)
            v = k
        else:
            k, v, kv_ok = _load_paged_kv(k_cache_ptr, v_cache_ptr, bt_row, pos, ctx_len, kvh, d, d_ok, stride_kb,
                                         stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
        s = tl.where(kv_ok, tl.sum(k.to(tl.float32) * q[None, :], 1) * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new

    if HAS_SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        l_i = l_i * tl.exp2(m_i - m_f) + tl.exp2(sink - m_f)
        acc = acc * tl.exp2(m_i - m_f)
    tl.store(out_ptr + b * stride_ob + i * stride_oi + h * stride_oh + d,
             (acc / l_i).to(out_ptr.dtype.element_ty), mask=d_ok)


def _check(q, k_block, v_block, k_cache, v_cache, block_tables, ctx_lens, sinks) -> tuple[int, int, int, int, int]:
    B, gamma, Hq, D = q.shape
    _, page, Hkv, Dk = k_cache.shape
    assert k_cache.shape == v_cache.shape and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert Dk == D and Hq % Hkv == 0, f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
    assert k_block.shape == v_block.shape == (B, gamma, Hkv, D)
    assert q.stride(3) == 1 and k_block.stride(3) == 1 and v_block.stride(3) == 1
    assert block_tables.shape[0] == B and ctx_lens.shape == (B,)
    assert sinks is None or sinks.shape == (Hq,)
    check_device(q)
    return B, gamma, Hq, Hkv, D


def kv_shared(k_block, v_block, k_cache, v_cache) -> bool:
    """Whether the values are the keys: the same views of the same memory (DeepSeek-V4's attention keeps one
    vector per token for both, MQA). The kernels then gather each context tile once instead of twice."""
    def same(a, b):
        return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
                          and a.dtype == b.dtype)
    return same(k_block, v_block) and same(k_cache, v_cache)


def _kv_args(k_block, v_block, k_cache, v_cache, block_tables) -> tuple[int, ...]:
    return (*k_block.stride()[:3], *v_block.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_tables.stride(0))


# The shared-tile kernel's key tile, warps and pipeline stages (the split count: default_num_splits). Swept
# on the H200 in session 29 (benchmarks/kernel_attention_bench.py --drafter-sweep; docs/benchmarks.md): 64
# keys x 4 warps with the default splits was within 0.2 µs of the best of 18 settings at batch 12 (γ 5 and
# 7); 8 warps lost nearly everywhere. Session 37 (--drafter-floor: splits x key tile x warps x stages, 48
# launches at batch 12, context 1,000-3,000) found 2 warps and 2 stages 11-14 % faster than 4 warps and
# Triton's default 3 stages at batch 12, and --drafter-scaling faster or equal in all 24 cells of batch 1-32 x
# context 128-4,000 (batch 1: -0.2 to -0.4 µs; batch 12 at 1,000 keys: 9.9 -> 8.8 µs).
DRAFTER_TUNING = {"block_n": 64, "num_warps": 2, "num_stages": 2}

# Past SmolLM2's shapes (timed in session 43, below): a row tile holds at most DRAFTER_ROW_TILE and
# a K or V tile DRAFTER_KEY_TILE values of BLOCK_D columns, and the warps grow with the row tile so that a
# thread holds at most 32 accumulator values, as over SmolLM2's 32 x 64 tile at 2 warps. The query rows and
# their fp32 accumulator stay in registers through the whole key loop, the K and V tiles of each pipeline
# stage in shared memory. Compiled for the H200 (sm_90, Triton 3.6, ptxas -v; not run) at head_dim 512 (V4's
# drafter, where one tile of all 160-320 rows would be 256-512 x 512): 16-row tiles at 8 warps take 168
# registers and no spills, with 32-key tiles 83 KB of shared memory; 32-row tiles hit the 255-register limit
# and spill ~100 B per thread at 8 warps (~200 B at 4), 64-row ones (tensor-core wgmma there) 2-5 KB;
# 64-key tiles need 150-360 KB of shared memory. So: 16 rows, 32 keys, 8 warps at head_dim 512 (64 rows, 8
# warps at 128, where a 64-row tile spills at 2 warps). SmolLM2 (21 rows x 64) stays one 32-row tile with
# DRAFTER_TUNING's launch, compiled to the same instructions as before row tiles existed.
# Timed at seed 001's shape on an H100 (session 43, --seed-shape; docs/benchmarks.md): every launch correct, but
# at batch 12 this rule was 1.5-2.0x slower than the best of the sweep (4 key splits of 16-row tiles at 8 warps).
# Session 44 (--seed-grid: two tile shapes x splits 1-8 x batch 1 / 4 / 12, Hq 32 / 64, context 128 / 512) gave
# the rule used now at head_dim >= WIDE_HEAD_DIM: WIDE_TILES (16 rows x 32 keys x 4 warps below
# WIDE_LARGE_MIN_BATCH requests, 32 x 64 x 8 from there; 32-row tiles lose at batch 1 at short context, 15.0 vs
# 10.5 us, and win from batch 4) and the split count that brings the programs to about one per SM
# (WIDE_PROGRAMS_PER_SM, where the general rule asks 4 per SM: at batch 12, 4 splits cost 1.5-3x one or two).
# Predicted from the grid (H100, 132 SMs, the H200's count): within 20 % of the best of the 9 launches timed in
# each of the 12 cells (the best in 7); against the old default 2-3 % slower at batch 1 at context 128, 1.3-1.4x
# faster at 512, 1.1-1.6x at batch 4 and 1.9-2.4x at batch 12 (docs/benchmarks.md, session 44). Re-timed as the
# default in session 45 (H100 and H200): every cell within 2 % of the prediction.
# Session 45 also tried, at this shape, a kernel that splits the 512 output columns across programs (so that 64-
# and 128-row tensor-core tiles fit; commit 1105382, reverted): it spilled 0.3-1.3 KB per thread and was 0.93x the
# default's time at batch 12, context 128, and 1.1-1.5x slower elsewhere, so it is not here.
# Head dims between 128 and 512 keep the register-based rule below (not timed).
WIDE_HEAD_DIM = 512
WIDE_TILES = {"small": {"block_m": 16, "block_n": 32, "num_warps": 4},
              "large": {"block_m": 32, "block_n": 64, "num_warps": 8}}
WIDE_LARGE_MIN_BATCH = 4
WIDE_PROGRAMS_PER_SM = 1
DRAFTER_PROGRAMS_PER_SM = 4  # default_num_splits's default, everywhere else
DRAFTER_ROW_TILE = 8192
DRAFTER_KEY_TILE = 16384
ACC_PER_WARP = 32 * 32


def drafter_launch(gamma: int, G: int, head_dim: int, block_m: int | None = None, batch: int = 1) -> dict:
    """The shared-tile kernel's default launch for ``batch`` requests of γ block rows of G query heads per KV
    head: ``block_m`` (rows per tile: the whole γ × G stack in one tile of at least 16 rows for ``tl.dot``, cut
    into tiles of DRAFTER_ROW_TILE / BLOCK_D rows when larger; at head_dim >= WIDE_HEAD_DIM, WIDE_TILES by
    batch), ``row_tiles``, ``block_n``, ``num_warps``, ``num_stages`` and ``programs_per_sm`` (what the split
    count aims at: ``default_num_splits``). A given ``block_m`` (a power of two >= 16) replaces the rule's, with
    the register-based key tile and warps."""
    block_d = next_pow2(head_dim)
    if block_m is not None and (block_m < 16 or block_m & (block_m - 1)):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    if block_m is None and block_d >= WIDE_HEAD_DIM:
        tile = WIDE_TILES["small" if batch < WIDE_LARGE_MIN_BATCH else "large"]
        return {**tile, "row_tiles": -(-gamma * G // tile["block_m"]), "num_stages": DRAFTER_TUNING["num_stages"],
                "programs_per_sm": WIDE_PROGRAMS_PER_SM}
    if block_m is None:
        block_m = min(next_pow2(max(16, gamma * G)), max(16, DRAFTER_ROW_TILE // block_d))
    return {"block_m": block_m, "row_tiles": -(-gamma * G // block_m),
            "block_n": min(DRAFTER_TUNING["block_n"], max(16, DRAFTER_KEY_TILE // block_d)),
            "num_warps": max(DRAFTER_TUNING["num_warps"], block_m * block_d // ACC_PER_WARP),
            "num_stages": DRAFTER_TUNING["num_stages"], "programs_per_sm": DRAFTER_PROGRAMS_PER_SM}


def drafter_attention(
    q: torch.Tensor,  # [B, γ, Hq, D] block query rows (after RoPE)
    k_block: torch.Tensor,  # [B, γ, Hkv, D] the block's own keys
    v_block: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D] the drafter layer's context cache
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] the target's block ids (the drafter shares them)
    ctx_lens: torch.Tensor,  # [B] context entries of each request: positions [0, ctx_len)
    scale: float,
    sinks: torch.Tensor | None = None,  # [Hq] per-head sink logits, or None
    *,
    max_ctx_len: int | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared-tile drafter attention -> [B, γ, Hq, D]. ``max_ctx_len`` (a hint: the context bucket a
    graph is captured for) caps the split count; ``num_splits`` / ``block_m`` (the row tile, a power of
    two >= 16) / ``block_n`` / ``num_warps`` / ``num_stages`` override the default launch
    (``drafter_launch``: DRAFTER_TUNING, row tiles and more warps past DRAFTER_ROW_TILE)."""
    B, gamma, Hq, Hkv, D = _check(q, k_block, v_block, k_cache, v_cache, block_tables, ctx_lens, sinks)
    G = Hq // Hkv
    if out is None:
        out = q.new_empty(B, gamma, Hq, D)
    assert out.shape == q.shape and out.is_contiguous()
    if B == 0:
        return out
    launch = drafter_launch(gamma, G, D, block_m, batch=B)
    block_n = block_n or launch["block_n"]
    splits = num_splits or default_num_splits(B * Hkv * launch["row_tiles"], q.device, max_ctx_len, block_n,
                                              launch["programs_per_sm"])
    if splits == 1:
        target, lse = out, out  # lse unused
        so = (*out.stride()[:3], 0, 0, 0, 0)
    else:
        target = torch.empty(B, gamma, Hq, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, gamma, Hq, splits, dtype=torch.float32, device=q.device)
        so = (*target.stride()[:4], *lse.stride()[:3])
    _drafter_attention_kernel[(B, Hkv * launch["row_tiles"], splits)](
        q, k_block, v_block, k_cache, v_cache, target, lse, sinks if sinks is not None else q,
        block_tables, ctx_lens, scale * LOG2E,
        *q.stride()[:3], *_kv_args(k_block, v_block, k_cache, v_cache, block_tables), *so,
        GAMMA=gamma, G=G, PAGE=k_cache.shape[1], HEAD_DIM=D,
        BLOCK_M=launch["block_m"], BLOCK_G=next_pow2(max(16, gamma)), BLOCK_N=block_n,
        BLOCK_D=next_pow2(D), NUM_SPLITS=splits, HAS_SINK=sinks is not None,
        DOT_PRECISION=dot_precision(q.dtype), KV_SHARED=kv_shared(k_block, v_block, k_cache, v_cache),
        num_warps=num_warps or launch["num_warps"],
        num_stages=num_stages or launch["num_stages"], **pdl_opts(q),
    )
    if splits > 1:
        combine_splits(target.view(B * gamma, Hq, splits, D), lse.view(B * gamma, Hq, splits),
                       out.view(B * gamma, Hq, D), sinks)
    return out


def drafter_attention_naive(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    *,
    block_n: int | None = None,
) -> torch.Tensor:
    """One program per (draft row, query head): rereads the context γ × Hq times. For comparison. Its K
    and V tiles sit in registers (no tl.dot): the default key tile, 64 up to head_dim 128, shrinks past
    it to keep 64 × 128 values per tile (16 keys at head_dim 512)."""
    B, gamma, Hq, Hkv, D = _check(q, k_block, v_block, k_cache, v_cache, block_tables, ctx_lens, sinks)
    out = q.new_empty(B, gamma, Hq, D)
    if B == 0:
        return out
    block_n = block_n or max(1, 64 * 128 // max(128, next_pow2(D)))
    _drafter_attention_naive_kernel[(B * gamma, Hq)](
        q, k_block, v_block, k_cache, v_cache, out, sinks if sinks is not None else q,
        block_tables, ctx_lens, scale * LOG2E,
        *q.stride()[:3], *_kv_args(k_block, v_block, k_cache, v_cache, block_tables), *out.stride()[:3],
        GAMMA=gamma, G=Hq // Hkv, PAGE=k_cache.shape[1], HEAD_DIM=D,
        BLOCK_G=next_pow2(gamma), BLOCK_N=block_n, BLOCK_D=next_pow2(D), HAS_SINK=sinks is not None,
        KV_SHARED=kv_shared(k_block, v_block, k_cache, v_cache), num_warps=2,
    )
    return out


def drafter_attention_ref(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The engine's drafting-step attention in fp32: gather the context as ``DSparkProposer.propose``
    does (``context_slots``), append the block, mask with ``[ctx_valid ‖ ones(γ)]`` as
    ``DSparkDrafter.block_hidden`` does, softmax (with the sink as one more logit, then dropped)."""
    B, gamma, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    slots, valid = context_slots(block_tables.long(), ctx_lens, page)  # [B, C]
    keys = torch.cat([k_cache.reshape(-1, Hkv, D)[slots], k_block], 1).float()  # [B, C + γ, Hkv, D]
    values = torch.cat([v_cache.reshape(-1, Hkv, D)[slots], v_block], 1).float()
    mask = torch.cat([valid, valid.new_ones(B, gamma)], 1)  # [B, C + γ]
    keys, values = keys.repeat_interleave(G, dim=2), values.repeat_interleave(G, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.float(), keys) * scale
    s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.float()[None, :, None, None].expand(B, Hq, gamma, 1)], -1)
    p = torch.softmax(s, -1)[..., : keys.shape[1]]
    return torch.einsum("bhij,bjhd->bihd", p, values).to(q.dtype)


__all__ = ["drafter_attention", "drafter_attention_naive", "drafter_attention_ref", "drafter_launch", "kv_shared",
           "DRAFTER_TUNING", "DRAFTER_ROW_TILE", "DRAFTER_KEY_TILE"]
