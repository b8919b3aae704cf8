"""Paged attention for decode and verification steps, in Triton, with its PyTorch reference.

Semantics (those of ``dspark.layers.attention.TorchAttentionBackend``): queries ``q [T, Hq, D]`` are
flattened over requests; request b owns query rows ``[qsl[b], qsl[b+1])`` (1 row when decoding, 1 + N
when verifying N drafts, more for a small prefill chunk) and has ``seq_lens[b]`` tokens with K/V in the
cache after this step, the new ones included (written by ``write_kv`` before attention). Query row i
of a request with n rows sits at position ``seq_len - n + i`` and sees the keys at positions <= its
own. A position p lives in cache slot ``block_table[p // page] * page + p % page`` of caches shaped
``[num_blocks, page, Hkv, D]``; query head h reads K/V head ``h // (Hq // Hkv)`` (GQA).

Design (why it looks like this):

- **One program per (request, KV head)**, whose query tile stacks every query row of the request
  times the G = Hq / Hkv query heads that share that KV head. Each K/V tile is loaded once and used
  by all of them: decode (1 × G rows) and verification ((1 + N) × G rows) read the cache exactly once
  per KV head, where one program per query head would read it G times and one per query token
  1 + N times more. The tile is at least 16 rows so ``tl.dot`` can use tensor cores.
- **K/V straight from the paged cache.** Each K/V tile gathers its rows through the block table in
  the kernel; no dense copy of the context is made.
- **Loop bounds from the request's own ``seq_len``, read at run time.** A launch has the same grid
  for any context length, so a CUDA graph captured once (at the largest context of its bucket, or
  at ``max_model_len``) replays at short context doing only short-context work.
- **Flash-decoding split of the key range.** At batch 1 there are only Hkv programs (3 for
  SmolLM2), far too few to fill a GPU; ``num_splits`` programs per (request, KV head) then each take
  one slice of the keys (sliced at run time from seq_len, so still graph-friendly) and a second small
  kernel merges their partial softmaxes by their log-sum-exp.
- **No host synchronisation.** The wrappers read only tensor shapes on the host, never values
  (no ``.item()`` / ``.tolist()``), so they can be captured in a CUDA graph. Tuning hints
  (``max_query_len``, ``max_seq_len``) are Python ints the caller already knows; they pick tile sizes
  and the split count, never correctness.
- Softmax in fp32 and base 2 (``exp2`` with log2(e) folded into the scale); fully masked rows give 0,
  not NaN.

The kernels also run under Triton's interpreter on a CPU (``TRITON_INTERPRET=1``; see
``dspark/kernels/__init__.py``), which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels import check_device, next_pow2, pdl_opts, pdl_wait
from dspark.kernels.fused_ops import _head_norm, _rope, cast_rtne

LOG2E = 1.4426950408889634  # exp(x) = exp2(x * LOG2E)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs: exact fp32 products (the default would round them to tf32 on the GPU)."""
    return "ieee" if dtype == torch.float32 else "tf32"


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def split_count(num_programs: int, sms: int, max_seq_len: int | None, block_n: int, programs_per_sm: float) -> int:
    """default_num_splits for a GPU of ``sms`` SMs."""
    splits = 1
    while splits < 32 and num_programs * splits * 2 <= programs_per_sm * sms:
        splits *= 2
    if max_seq_len is not None:
        while splits > 1 and max_seq_len < splits * block_n:
            splits //= 2
    return splits


def default_num_splits(num_programs: int, device: torch.device, max_seq_len: int | None, block_n: int,
                       programs_per_sm: float = 4) -> int:
    """How many slices of the key range each (request, KV head) program gets: up to about ``programs_per_sm``
    programs per SM, each slice at least one key tile of the longest context the caller expects. A power of
    two, at most 32 (each value is one more compiled kernel). 1 off the GPU. (Paged attention's tuned
    launch, ``tuned_launch``, asks for fewer programs per SM; the drafter kernel keeps the default 4, except
    at head_dim 512, where its launch asks 1: drafter_attention.drafter_launch.)

    Measured on an H200 (SmolLM2 shapes, bf16, context 4k): decode at batch 8 took 67.6 µs unsplit,
    23.4 µs with 4 slices, 12.5 µs with 16; at batch 32, 93.4 µs unsplit and 39.9 µs with 4 slices,
    about the same with 8 or 16."""
    if device.type != "cuda":
        return 1
    return split_count(num_programs, sm_count(device), max_seq_len, block_n, programs_per_sm)


# ---------------------------------------------------------------------------------------- kernels
@triton.jit
def _load_paged_kv(k_cache_ptr, v_cache_ptr, bt_row, pos, end, kvh, d, d_ok,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE: tl.constexpr):
    """K and V rows of positions ``pos`` (those < end; others 0) of one KV head, read through the
    request's block-table row from the paged cache. Returns (k, v, kv_ok)."""
    kv_ok = pos < end
    blk = tl.load(bt_row + pos // PAGE, mask=kv_ok, other=0).to(tl.int64)
    in_page = pos % PAGE
    kv_mask = kv_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + (blk * stride_kb + in_page * stride_kt + kvh * stride_kh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + (blk * stride_vb + in_page * stride_vt + kvh * stride_vh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    return k, v, kv_ok


@triton.jit
def _load_paged_rows(cache_ptr, bt_row, pos, end, kvh, d, d_ok, stride_b, stride_t, stride_h, PAGE: tl.constexpr):
    """_load_paged_kv for one cache: the rows of positions ``pos`` (those < end; others 0) of one KV head, for a
    cache whose values are its keys (DeepSeek-V4's one KV vector per token). Returns (rows, ok)."""
    ok = pos < end
    blk = tl.load(bt_row + pos // PAGE, mask=ok, other=0).to(tl.int64)
    rows = tl.load(cache_ptr + (blk * stride_b + pos % PAGE * stride_t + kvh * stride_h)[:, None] + d[None, :],
                   mask=ok[:, None] & d_ok[None, :], other=0.0)
    return rows, ok


@triton.jit
def _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION: tl.constexpr,
                         ROWSUM_MMA: tl.constexpr = False):
    """One K/V tile of an online softmax. q [M, D], k/v [N, D], valid [M, N]; running row max m_i
    and sum l_i [M] (log2 domain), unnormalised output acc [M, D] fp32.

    ROWSUM_MMA: the row sums of the tile's weights are taken on the tensor cores (the weights as the P·V
    product reads them, times a block of ones) instead of ``tl.sum``, whose order follows the tile's layout
    over the warps, and so its row count (a 16-row decode tile, a 32-row verification tile). A product's
    rows are summed in one order whatever the tile (docs/benchmarks.md, session 46), and the max over
    the 16 equal columns is exact: a row's sum no longer depends on its tile."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet stays at 0
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    pv = p.to(v.dtype)
    if ROWSUM_MMA:
        ones = tl.full([p.shape[1], 16], 1.0, tl.float32).to(v.dtype)  # (the interpreter has no bf16 full)
        l_i = l_i * alpha + tl.max(tl.dot(pv, ones, input_precision=DOT_PRECISION), 1)
    else:
        l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(pv, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_rows(out_ptr, lse_ptr, out_off, lse_off, row_ok, d, d_ok, m_i, l_i, acc, sink, NUM_SPLITS: tl.constexpr):
    """Write a tile's result. One split: the final output, with ``sink`` [M] (a per-row logit in the
    log2 domain, -inf for none) added to the softmax denominator only. Several splits: this slice's
    normalised output and its log-sum-exp, for ``_combine_splits_kernel``."""
    mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        m_f = tl.maximum(m_i, sink)
        m_ref = tl.where(m_f == float("-inf"), 0.0, m_f)
        a = tl.exp2(m_i - m_ref)
        l_f = l_i * a + tl.exp2(sink - m_ref)
        o = acc * (a / tl.where(l_f == 0.0, 1.0, l_f))[:, None]
        tl.store(out_ptr + out_off[:, None] + d[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(tl.where(l_i == 0.0, 1.0, l_i)))
        tl.store(out_ptr + out_off[:, None] + d[None, :], o, mask=mask)
        tl.store(lse_ptr + lse_off, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr, sink_ptr,
    stride_pr, stride_ph, stride_lr, stride_lh, stride_or, stride_oh,
    NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_SINK: tl.constexpr, ORDERED: tl.constexpr = False, PDL: tl.constexpr = False,
):
    """Merge the key-range slices of one (query row, head): weights exp2(lse_s - max), plus the sink.
    ORDERED: the slices are added one after the other, slice 0 first, and the sink last, so that empty
    trailing slices (weight 0, output 0) add exact zeros and the sums do not depend on NUM_SPLITS (a
    vector sum's order follows its length and layout); the fixed key slices of batch-invariant mode."""
    pdl_wait(PDL)
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    lse = tl.load(lse_ptr + r * stride_lr + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    if HAS_SINK:
        sink = tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634
    else:
        sink = float("-inf")
    m = tl.maximum(tl.max(lse, 0), sink)  # a max is exact in any order
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    if ORDERED:
        denom = tl.zeros([1], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for i in tl.static_range(NUM_SPLITS):
            w_i = tl.exp2(tl.load(lse_ptr + r * stride_lr + h * stride_lh + i + tl.arange(0, 1)) - m_ref)
            denom += w_i
            acc += w_i * tl.load(part_ptr + r * stride_pr + h * stride_ph + i * HEAD_DIM + d, mask=d < HEAD_DIM,
                                 other=0.0)
        denom += tl.exp2(sink - m_ref)
        o = acc / tl.where(denom == 0.0, 1.0, denom)
    else:
        w = tl.exp2(lse - m_ref)
        denom = tl.sum(w, 0) + tl.exp2(sink - m_ref)
        o = tl.load(part_ptr + r * stride_pr + h * stride_ph + s[:, None] * HEAD_DIM + d[None, :],
                    mask=s_ok[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
        o = tl.sum(w[:, None] * o, 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + r * stride_or + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit
def _rope_rows(row_ptr, pos, row_ok, d, cos_ptr, sin_ptr, stride_cs, norm_ptr, eps,
               HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """fused_ops._rope_cache_kernel's treatment of one head's rows: load rows [M, D] at row_ptr [M, 1]
    (masked by row_ok), optional per-head RMSNorm, RoPE at positions pos [M], every rounding of the eager
    path kept (HEAD_DIM a power of two)."""
    dr = (d + HEAD_DIM // 2) % HEAD_DIM
    m = row_ok[:, None]
    x = tl.load(row_ptr + d[None, :], mask=m, other=0.0)
    xr = tl.load(row_ptr + dr[None, :], mask=m, other=0.0)
    if HAS_NORM:
        x, xr = _head_norm(x, xr, norm_ptr, d, dr, eps, HEAD_DIM)
    dt = x.dtype
    c = cast_rtne(tl.load(cos_ptr + pos[:, None] * stride_cs + d[None, :]).to(tl.float32), dt).to(tl.float32)
    s = cast_rtne(tl.load(sin_ptr + pos[:, None] * stride_cs + d[None, :]).to(tl.float32), dt).to(tl.float32)
    return _rope(x, xr, c, s)


@triton.jit
def _combine_in_last_program(part_ptr, lse_ptr, final_ptr, counter_ptr, t, head, row_ok, d, d_ok,
                             stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                             NUM_SPLITS: tl.constexpr):
    """The split merge of ``_combine_splits_kernel`` without its launch: every split program of a
    query chunk, once its slice is stored, counts itself in at ``counter_ptr``; the last one to arrive
    (it sees NUM_SPLITS - 1 before its increment) merges all slices into the final output and resets
    the counter to 0 for the next launch. The barrier makes the whole program's stores precede the
    increment, whose acq_rel semantics publish them to (and order them for) the merging program; the
    merge reads the slices past L1 (``.cg``) since other SMs wrote them."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    if arrived == NUM_SPLITS - 1:
        mask = row_ok[:, None] & d_ok[None, :]
        lse_off = t * stride_lt + head * stride_lh
        m = tl.full(lse_off.shape, float("-inf"), tl.float32)
        for s in tl.static_range(NUM_SPLITS):
            m = tl.maximum(m, tl.load(lse_ptr + lse_off + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg"))
        m_ref = tl.where(m == float("-inf"), 0.0, m)
        denom = tl.zeros(lse_off.shape, tl.float32)
        acc = tl.zeros([lse_off.shape[0], d.shape[0]], tl.float32)
        part_off = t * stride_ot + head * stride_oh
        for s in tl.static_range(NUM_SPLITS):
            w = tl.exp2(tl.load(lse_ptr + lse_off + s, mask=row_ok, other=float("-inf"), cache_modifier=".cg") - m_ref)
            o = tl.load(part_ptr + (part_off + s * stride_os)[:, None] + d[None, :], mask=mask, other=0.0,
                        cache_modifier=".cg")
            denom += w
            acc += w[:, None] * o
        o = acc / tl.where(denom == 0.0, 1.0, denom)[:, None]
        tl.store(final_ptr + (t * stride_ft + head * stride_fh)[:, None] + d[None, :],
                 o.to(final_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, lse_ptr, final_ptr, counter_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, q_programs,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh, stride_os,
    stride_lt, stride_lh,
    stride_ft, stride_fh,
    k_new_ptr, sk_t, sk_h, v_new_ptr, sv_t, sv_h, pos_ptr, cos_ptr, sin_ptr, stride_cs, qn_ptr, kn_ptr, eps,
    slot_ptr,
    G: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, FUSE_COMBINE: tl.constexpr, MAX_CHUNKS: tl.constexpr,
    ROPE_IN: tl.constexpr, HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr, SPLIT_KEYS: tl.constexpr = 0,
    ROWSUM_MMA: tl.constexpr = False, SLICES_PER_PROGRAM: tl.constexpr = 1, PDL: tl.constexpr = False,
):
    """Program (b, kv head, split * q_programs + c): query chunks c, c + q_programs, ... of request b
    (BLOCK_Q query tokens × G heads each), against key slice ``split`` of what the chunk may see.
    FUSE_COMBINE (with several splits): the chunk's last split program also merges the slices into
    ``final_ptr`` (one counter per (b, kv head, chunk), MAX_CHUNKS chunks per request at most).
    ROPE_IN: fused_ops.rope_qk_cache inside this launch. q_ptr holds the raw (pre-RoPE) queries;
    the program applies the optional per-head norm and RoPE to its query rows itself, and first
    writes the rotated K and the V of the step's new tokens that fall in its own key slice, for its
    own KV head, into the cache (each program reads only old keys and keys it wrote itself, after a
    barrier; a slice shared by several query chunks is written by each of them, with the same values).
    SLICES_PER_PROGRAM (fixed slices only, no FUSE_COMBINE): the program takes that many consecutive slices one
    after the other, each from a fresh softmax state into its own partial, so a row's bits do not change, only
    the program count (fewer, longer programs where the batch already fills the GPU)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    NUM_GROUPS: tl.constexpr = (NUM_SPLITS + SLICES_PER_PROGRAM - 1) // SLICES_PER_PROGRAM
    group = tl.program_id(2) % NUM_GROUPS
    qc = tl.program_id(2) // NUM_GROUPS
    q_start = tl.load(query_start_loc_ptr + b).to(tl.int64)
    n_q = tl.load(query_start_loc_ptr + b + 1).to(tl.int64) - q_start
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int64)
    ctx_len = seq_len - n_q  # keys before the request's first new token

    r = tl.arange(0, BLOCK_M)  # tile row r = (query token r // G, head kvh * G + r % G)
    head = kvh * G + r % G
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    n = tl.arange(0, BLOCK_N)
    bt_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    no_sink = tl.full([BLOCK_M], float("-inf"), tl.float32)

    for c0 in range(qc * BLOCK_Q, n_q, q_programs * BLOCK_Q):
        qi = c0 + r // G
        row_ok = (r < BLOCK_Q * G) & (qi < n_q)
        q_pos = ctx_len + qi
        t = q_start + qi
        if ROPE_IN:  # as fused_ops._rope_cache_kernel does for q
            rp = tl.load(pos_ptr + t, mask=row_ok, other=0).to(tl.int64)
            q = _rope_rows(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh, rp, row_ok, d,
                           cos_ptr, sin_ptr, stride_cs, qn_ptr, eps, HAS_QNORM, HEAD_DIM)
        else:
            q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        # The chunk's last query sees keys < kv_end; this program takes one slice of [0, kv_end) (or
        # SLICES_PER_PROGRAM fixed ones).
        kv_end = tl.minimum(seq_len, ctx_len + c0 + BLOCK_Q)
        for si in range(SLICES_PER_PROGRAM):  # a loop, not unrolled: one slice's registers
            split = group * SLICES_PER_PROGRAM + si
            if SPLIT_KEYS > 0:  # fixed slices [s * SPLIT_KEYS, (s + 1) * SPLIT_KEYS), the last one to the end
                lo = split * SPLIT_KEYS
                hi = tl.where(split == NUM_SPLITS - 1, kv_end, tl.minimum(lo + SPLIT_KEYS, kv_end))
            else:  # NUM_SPLITS equal slices of what this chunk sees
                split_len = ((kv_end + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
                lo = split * split_len
                hi = tl.minimum(lo + split_len, kv_end)
            if ROPE_IN:  # the new tokens' K (rotated) and V of this slice, this KV head, into the cache
                for p0 in range(tl.maximum(lo, ctx_len), hi, BLOCK_N):
                    p = p0 + n
                    p_ok = p < hi
                    tk = q_start + (p - ctx_len)
                    slot = tl.load(slot_ptr + tk, mask=p_ok, other=-1).to(tl.int64)
                    w_ok = p_ok & (slot >= 0)
                    kp = tl.load(pos_ptr + tk, mask=p_ok, other=0).to(tl.int64)
                    kx = _rope_rows(k_new_ptr + tk[:, None] * sk_t + kvh * sk_h, kp, p_ok, d,
                                    cos_ptr, sin_ptr, stride_cs, kn_ptr, eps, HAS_KNORM, HEAD_DIM)
                    blk = slot // PAGE
                    cache_k = blk * stride_kb + (slot % PAGE) * stride_kt + kvh * stride_kh
                    cache_v = blk * stride_vb + (slot % PAGE) * stride_vt + kvh * stride_vh
                    tl.store(k_cache_ptr + cache_k[:, None] + d[None, :],
                             cast_rtne(kx.to(tl.float32), k_cache_ptr.dtype.element_ty), mask=w_ok[:, None])
                    vx = tl.load(v_new_ptr + tk[:, None] * sv_t + kvh * sv_h + d[None, :], mask=w_ok[:, None], other=0.0)
                    tl.store(v_cache_ptr + cache_v[:, None] + d[None, :],
                             cast_rtne(vx.to(tl.float32), v_cache_ptr.dtype.element_ty), mask=w_ok[:, None])
                tl.debug_barrier()  # this program's cache writes before its reads of them

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
            for n0 in range(lo, hi, BLOCK_N):
                pos = n0 + n
                k, v, kv_ok = _load_paged_kv(k_cache_ptr, v_cache_ptr, bt_row, pos, hi, kvh, d, d_ok, stride_kb,
                                             stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, PAGE)
                valid = kv_ok[None, :] & (pos[None, :] <= q_pos[:, None])
                m_i, l_i, acc = _online_softmax_step(q, k, v, valid, m_i, l_i, acc, qk_scale, DOT_PRECISION, ROWSUM_MMA)

            _store_rows(out_ptr, lse_ptr, t * stride_ot + head * stride_oh + split * stride_os,
                        t * stride_lt + head * stride_lh + split, row_ok, d, d_ok,
                        m_i, l_i, acc, no_sink, NUM_SPLITS)
            if FUSE_COMBINE:
                cnt = counter_ptr + (b.to(tl.int64) * tl.num_programs(1) + kvh) * MAX_CHUNKS + c0 // BLOCK_Q
                _combine_in_last_program(out_ptr, lse_ptr, final_ptr, cnt, t, head, row_ok, d, d_ok,
                                         stride_ot, stride_oh, stride_os, stride_lt, stride_lh, stride_ft, stride_fh,
                                         NUM_SPLITS)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ckb, stride_ckt, stride_ckh, stride_cvb, stride_cvt, stride_cvh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """Program t copies token t's K and V rows [Hkv, D] into its cache slot; slot < 0 is skipped."""
    pdl_wait(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM) & (slot >= 0)
    blk = slot // PAGE
    off = slot % PAGE
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(k_cache_ptr + blk * stride_ckb + off * stride_ckt + h[:, None] * stride_ckh + d[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + blk * stride_cvb + off * stride_cvt + h[:, None] * stride_cvh + d[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------- wrappers
def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, "caches are [num_blocks, page, Hkv, D]"
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1, "cache rows must be contiguous in head_dim"


def combine_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor, sinks: torch.Tensor | None,
                   ordered: bool = False) -> None:
    """out [R, H, D] from slices part [R, H, S, D] (normalised) and lse [R, H, S] (log2 domain); ``ordered``:
    slice by slice (_combine_splits_kernel's ORDERED)."""
    R, H, S, D = part.shape
    if R == 0:
        return
    _combine_splits_kernel[(R, H)](
        part, lse, out, sinks if sinks is not None else lse,
        part.stride(0), part.stride(1), lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=S, BLOCK_S=next_pow2(S), HEAD_DIM=D, BLOCK_D=next_pow2(D), HAS_SINK=sinks is not None,
        ORDERED=ordered, num_warps=1 if D <= 64 else 2, **pdl_opts(part),
    )


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64, padded with the dummy block 0
    seq_lens: torch.Tensor,  # [B] tokens with K/V after this step (the new ones included)
    query_start_loc: torch.Tensor,  # [B + 1] request b owns query rows [qsl[b], qsl[b+1])
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    split_keys: int | None = None,
    rowsum_mma: bool = False,
    slices_per_program: int | None = None,
    block_n: int | None = None,
    block_m: int | None = None,
    fuse_combine: bool | None = None,
    rope: dict | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tuning: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new query rows over its paged K/V -> [T, Hq, D].

    Every row must belong to a request (rows past ``qsl[B]`` are left unwritten). A padding request
    (say seq_len 1 on the dummy block 0) costs one tiny program and gives finite output.

    Hints, all optional and only for speed: ``max_query_len`` (the most query rows of one request;
    default ``ceil(T / B)``, exact for uniform batches) sizes the query tile, and when given also
    spreads longer requests' query chunks over several programs; ``max_seq_len`` (e.g. the context
    bucket a CUDA graph is captured for) caps the split count; ``num_splits`` / ``block_n`` override
    the key-range split count and key tile size, ``block_m`` (a power of two >= 16 and >= the GQA
    group) the query tile's rows; ``num_warps`` (default 4) / ``num_stages`` (default Triton's) the
    launch (benchmarks/kernel_attention_bench.py --paged-sweep). On the GPU, when none of ``block_n`` /
    ``num_splits`` / ``num_warps`` / ``num_stages`` is given, ``PAGED_TUNING`` (``tuned_launch``) picks
    them from the query tile and the program count unless ``tuning=False``. Batch-invariant mode fixes
    the key slices (``split_keys``) and both tiles (so the table never applies there): the tile shape decides
    how Triton lays the tile out over the warps, and so the order in which a row's softmax sum is
    reduced — a one-token decode (16-row tile) and a 1 + N-token verification (32 rows) would
    otherwise round the same row differently (``rowsum_mma`` below removes that dependence).

    ``split_keys`` (batch-invariant mode; a multiple of the key tile): fixed key slices instead, slice s being
    keys [s * split_keys, (s + 1) * split_keys) whatever the step, ``ceil(max_seq_len / split_keys)`` of them
    (``max_seq_len`` required), merged slice by slice (``combine_splits(ordered=True)``). A row then sums the
    same tiles in the same slices whether it is decoded alone or verified beside N others, or in a batch of
    any size: a slice past the row's keys adds exact zeros. Equal slices of what the step sees (the default)
    move their bounds with the step's length and the split count with the batch. ``rowsum_mma``: the softmax
    row sums on the tensor cores (``_online_softmax_step``'s ROWSUM_MMA), so that the query tile no longer
    decides a row's bits and need not be pinned. ``slices_per_program`` (with ``split_keys``; a power of two): each
    program takes that many consecutive slices, each into its own partial, so the same bits with fewer programs
    (default 1: the engine's rule, ``invariant_attention_launch``, found it slower at every batch; a sweep knob).

    ``rope``: fused_ops.rope_qk_cache in the same launch (``q`` then holds the raw queries, a strided
    view of the qkv projection is fine): a dict with ``k``, ``v`` [T, Hkv, D] (raw new keys, values),
    ``positions`` [T], ``cos``, ``sin_signed`` (RotaryEmbedding's [P, D] tables), ``slot_mapping``
    [T] (negative: not written), and optional ``q_norm``, ``k_norm`` (per-head weights), ``eps``.
    Same queries, cache contents and output as rope_qk_cache followed by this function.

    With a key split, the slices are merged by the attention launch itself (its last program per
    query chunk, ``_combine_in_last_program``) when ``max_query_len`` is given (it bounds the chunk
    counters) and ``fuse_combine`` is not False (default: ``FUSE_COMBINE``); else by a second launch.
    """
    T, Hq, D = q.shape
    _check_cache(k_cache, v_cache)
    _, page, Hkv, Dk = k_cache.shape
    assert Dk == D and Hq % Hkv == 0, f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}"
    assert q.stride(2) == 1
    B = seq_lens.shape[0]
    assert query_start_loc.shape[0] == B + 1 and block_tables.shape[0] == B
    G = Hq // Hkv
    check_device(q)
    if out is None:
        out = q.new_empty(T, Hq, D)
    assert out.shape == q.shape and out.stride(2) == 1
    if T == 0 or B == 0:
        return out
    mq = max(max_query_len if max_query_len is not None else -(-T // B), 1)
    if block_m is None:
        block_m = min(next_pow2(max(16, mq * G)), max(64, next_pow2(G)))
    elif block_m < max(16, G) or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= max(16, G={G}), got {block_m}")
    block_q = block_m // G
    q_programs = -(-mq // block_q) if max_query_len is not None else 1
    if split_keys is not None:
        if max_seq_len is None or num_splits is not None or block_n is None or split_keys % block_n:
            raise ValueError(f"split_keys ({split_keys}) needs max_seq_len, a block_n dividing it and no num_splits")
        num_splits = max(1, -(-max_seq_len // split_keys))
        fuse_combine = bool(fuse_combine)  # off unless asked: FUSE_COMBINE's merge is in slice order too
        if rowsum_mma and q.is_cuda and num_warps is None and num_stages is None:
            launch = invariant_attention_launch(block_m, B * Hkv * q_programs * num_splits, sm_count(q.device),
                                                split_keys // block_n)
            num_warps, num_stages = launch["num_warps"], launch["num_stages"]
            if slices_per_program is None:
                slices_per_program = launch["slices_per_program"]
        spp = slices_per_program or 1
        while spp > 1 and num_splits % spp:  # whole groups only (both are powers of two in the engine)
            spp //= 2
        if spp > 1 and fuse_combine:
            raise ValueError("slices_per_program > 1 does not combine inside the launch (fuse_combine)")
        slices_per_program = spp
    elif slices_per_program not in (None, 1):
        raise ValueError(f"slices_per_program ({slices_per_program}) needs split_keys")
    else:
        slices_per_program = 1
    if tuning and block_n is None and num_splits is None and num_warps is None and num_stages is None:
        tuned = tuned_launch(block_m, B * Hkv * q_programs, max_seq_len, sm_count(q.device) if q.is_cuda else None)
        block_n, num_splits, num_stages = tuned.get("block_n"), tuned.get("num_splits"), tuned.get("num_stages")
    block_n = block_n or (64 if block_m == 16 else 128)  # bigger query tiles amortise bigger key tiles
    if q.is_cuda and block_n < 16:  # (the CPU tests use 8: many key tiles on small inputs, in the interpreter)
        raise ValueError(f"block_n ({block_n}) must be at least 16 on a GPU: p @ v's key tile is a tensor-core "
                         "product's inner dimension (benchmarks/offline_compile.py found 8 not compiling for sm_90)")
    splits = num_splits or default_num_splits(B * Hkv * q_programs, q.device, max_seq_len, block_n)
    max_chunks = -(-mq // block_q)
    fuse = False
    counters = lse = out  # placeholders when unused
    if splits == 1:
        target = out
        so = (out.stride(0), out.stride(1), 0, 0, 0)
    else:
        target = torch.empty(T, Hq, splits, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(T, Hq, splits, dtype=torch.float32, device=q.device)
        so = (target.stride(0), target.stride(1), target.stride(2), lse.stride(0), lse.stride(1))
        fuse = (FUSE_COMBINE if fuse_combine is None else fuse_combine) and max_query_len is not None
        if fuse:
            counters = _counters(B * Hkv * max_chunks, q.device)
            fuse = counters is not None
    if rope is not None:
        if D & (D - 1):
            raise ValueError(f"RoPE in the attention launch needs a power-of-two head_dim, got {D}")
        rk, rv, cos, sin = rope["k"], rope["v"], rope["cos"], rope["sin_signed"]
        assert rk.shape == rv.shape == (T, Hkv, D) and rk.stride(2) == 1 and rv.stride(2) == 1
        sin = sin.to(cos.dtype)
        if cos.stride(-1) != 1 or sin.stride() != cos.stride():
            cos, sin = cos.contiguous(), sin.contiguous()
        qn, kn = rope.get("q_norm"), rope.get("k_norm")
        rope_args = (rk, rk.stride(0), rk.stride(1), rv, rv.stride(0), rv.stride(1), rope["positions"], cos, sin,
                     cos.stride(0), qn if qn is not None else cos, kn if kn is not None else cos,
                     float(rope.get("eps", 1e-6)), rope["slot_mapping"])
    else:
        rope_args = (q, 0, 0, q, 0, 0, seq_lens, q, q, 0, q, q, 0.0, seq_lens)
    _paged_attention_kernel[(B, Hkv, splits // slices_per_program * q_programs)](
        q, k_cache, v_cache, target, lse, out, counters, block_tables, seq_lens, query_start_loc,
        scale * LOG2E, q_programs,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), *so, out.stride(0), out.stride(1), *rope_args,
        G=G, PAGE=page, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        BLOCK_D=next_pow2(D), NUM_SPLITS=splits, DOT_PRECISION=dot_precision(q.dtype),
        FUSE_COMBINE=fuse, MAX_CHUNKS=max_chunks if fuse else 1,  # a constexpr: unfused, one value, one compile
        ROPE_IN=rope is not None, HAS_QNORM=rope is not None and rope.get("q_norm") is not None,
        HAS_KNORM=rope is not None and rope.get("k_norm") is not None, SPLIT_KEYS=split_keys or 0,
        ROWSUM_MMA=rowsum_mma, SLICES_PER_PROGRAM=slices_per_program,
        # fp32 RoPE products must not be contracted into FMAs (fused_ops' exactness note); in bf16/fp16 the
        # explicit roundings already keep them apart, and the attention math keeps its FMAs.
        num_warps=num_warps or 4, **({"num_stages": num_stages} if num_stages else {}),
        **({"enable_fp_fusion": False} if rope is not None and q.is_cuda and q.dtype == torch.float32
                        else {}), **pdl_opts(q),
    )
    if splits > 1 and not fuse:
        combine_splits(target, lse, out, None, ordered=split_keys is not None)
    return out


# The launch rule the wrapper applies on the GPU when no launch parameter is forced (``tuned_launch``),
# fitted to benchmarks/paged_tuning_sweep.py on the H200 (the RoPE-fused launch the engine runs, ragged
# contexts in a bucket; docs/benchmarks.md "H200 session 31"): the key range is split to about
# ``programs_per_sm`` programs per SM, a slice of at least ``long_slice`` keys of the bucket takes 128-key
# tiles with 2 pipeline stages, a shorter one 64-key tiles with 3. Applied from ``min_programs``
# (request, KV head) programs on (batch 128 with SmolLM2's 3 KV heads) and to 16- and 32-row query tiles
# (decode and verification steps; prefill chunks were not swept) only: in the engine, batch 32 steps got
# 0.05-0.15 ms slower with the rule (session 31, three processes against one) though the sweep had it
# faster there — likely because the sweep replayed one kernel on one set of caches, which stay in the
# H200's 50 MB L2 up to ~batch 32 at 1k context, where the engine reads them from HBM (the sweep now
# flushes the L2 by default) — while batch 128, whose caches exceed the L2 in the sweep too, got
# 0.11-0.14 ms faster (plain decode 2.00 -> 1.86 ms per step).
PAGED_TUNING = {"programs_per_sm": 1.5, "long_slice": 1024, "block_m": (16, 32), "min_programs": 384}


def tuned_launch(block_m: int, num_programs: int, max_seq_len: int | None, sms: int | None) -> dict:
    """PAGED_TUNING's block_n / num_stages / num_splits for a launch of ``num_programs`` (request, KV
    head, query chunk) programs with a ``block_m``-row query tile, captured for keys up to
    ``max_seq_len``, on a GPU of ``sms`` SMs; {} (the defaults) off the rule's ground."""
    if (block_m not in PAGED_TUNING["block_m"] or max_seq_len is None or sms is None
            or num_programs < PAGED_TUNING["min_programs"]):
        return {}
    per_sm = PAGED_TUNING["programs_per_sm"]
    splits = split_count(num_programs, sms, max_seq_len, 64, per_sm)
    if max_seq_len // splits >= PAGED_TUNING["long_slice"]:
        return {"block_n": 128, "num_stages": 2, "num_splits": split_count(num_programs, sms, max_seq_len, 128, per_sm)}
    return {"block_n": 64, "num_stages": 3, "num_splits": splits}


def invariant_attention_launch(block_m: int, num_programs: int, sms: int, tiles_per_slice: int = 1) -> dict:
    """num_warps, num_stages and slices_per_program of the invariant attention (fixed key slices, 64-key tiles,
    ``rowsum_mma``) for a launch of ``num_programs`` (request, KV head, query chunk, slice) programs over slices of
    ``tiles_per_slice`` key tiles (1 up to a max_model_len of 4,096, then 2, ...: invariant_split_keys), none of which
    changes a row's bits: on an H100 every one of 16 warp/stage pairs (1-8 warps, 1-4 stages) gave the same bits for
    every row at 64- and 128-key slices, and the slices' merge inside the launch did too
    (benchmarks/invariance_check.py --parts attention --sweep, docs/benchmarks.md session 47); slices taken one
    after the other by one program are computed as by one program each. So they follow the step:
    - one stage for one-tile slices, two for longer ones: with 128-key slices (two tiles) in the engine (session 50,
      H100, plain decode step, 1k context) 2 stages took 0.763 / 0.871 / 1.334 ms at batch 1 / 8 / 32 against one
      stage's 0.791 / 0.883 / 1.352 (the default launch: 0.725 / 0.850 / 1.281).
    - 4 warps, but 2 for verification tiles (32 rows) over more than
      4 programs per SM, which were 14 % faster at batch 32 (16.8 against 19.5 µs, 64-key slices, 1k context);
      decode tiles (16 rows) were fastest with 4 at both batches.
    - one slice per program. Taking two (``slices_per_program``, each slice its own one-tile loop) was predicted
      to close the batch-32 gap to 128-key slices; in the engine (session 50, H100, plain decode step, batch 32,
      1k context, random weights) it made the step slower, 1.403 ms against 1.362 with one slice (default launch
      1.283). A variant that ran a program's slices as one pipelined loop over their tiles, storing each slice's
      partial at its end, kept the bits but was slower still (H200: 1.47-1.82 ms for 2-16 slices per program at
      batch 32, 1.08-2.1x the batch-1 step where forced there), so it was dropped."""
    busy = num_programs > 4 * sms
    return {"num_warps": 2 if block_m == 32 and busy else 4,
            "num_stages": (1 if tiles_per_slice == 1 else 2) if block_m <= 32 else None, "slices_per_program": 1}


# The split merge inside the attention launch (one launch per layer instead of two: at batch 1 on an
# H200 a step is launch-bound, see docs/benchmarks.md). Module-level so benchmarks can compare.
FUSE_COMBINE = False  # measured slower on the H200 (see docs/benchmarks.md, session 11): off by default
_COUNTER_BUFS: dict[torch.device, torch.Tensor] = {}


def _counters(n: int, device: torch.device) -> torch.Tensor | None:
    """A zeroed int32 buffer of at least n arrival counters, kept per device and reused by every
    launch (each launch leaves its counters at 0 again). Grown only outside CUDA graph capture (the
    graphs' warm-up runs size it); None if it would have to grow during a capture."""
    buf = _COUNTER_BUFS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        buf = _COUNTER_BUFS[device] = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
    return buf


def write_kv(
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, page, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] cache slot of each token; < 0: not written
) -> None:
    """Store new K/V rows at their cache slots in one launch (K and V together). A negative slot
    skips the row, so padded rows of a captured batch need no dummy slot (slot 0 works too)."""
    T, Hkv, D = k.shape
    _check_cache(k_cache, v_cache)
    assert v.shape == k.shape and k_cache.shape[2:] == (Hkv, D) and k.stride(2) == 1 and v.stride(2) == 1
    check_device(k)
    if T == 0:
        return
    _write_kv_kernel[(T,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=Hkv, HEAD_DIM=D, PAGE=k_cache.shape[1], BLOCK_H=next_pow2(Hkv), BLOCK_D=next_pow2(D),
        num_warps=1 if Hkv * D <= 512 else 4, **pdl_opts(k),
    )


# -------------------------------------------------------------------------------------- reference
def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention, one request at a time in fp32: gather its keys through the block table,
    mask causally, softmax. Plain and slow (host loop); rows outside every request are zero."""
    T, Hq, D = q.shape
    _, page, Hkv, _ = k_cache.shape
    G = Hq // Hkv
    kc = k_cache.reshape(-1, Hkv, D)
    vc = v_cache.reshape(-1, Hkv, D)
    out = torch.zeros_like(q)
    qsl = query_start_loc.tolist()
    for b, L in enumerate(seq_lens.tolist()):
        start, end = qsl[b], qsl[b + 1]
        n = end - start
        if n == 0:
            continue
        pos = torch.arange(L, device=q.device)
        slots = block_tables[b, pos // page].long() * page + pos % page
        k = kc[slots].float().repeat_interleave(G, dim=1)  # [L, Hq, D]
        v = vc[slots].float().repeat_interleave(G, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        q_pos = L - n + torch.arange(n, device=q.device)
        s = s.masked_fill(~(pos[None, :] <= q_pos[:, None]), float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v).to(q.dtype)
    return out


__all__ = ["paged_attention", "paged_attention_ref", "tuned_launch", "invariant_attention_launch", "PAGED_TUNING", "write_kv", "combine_splits", "check_device", "LOG2E"]

