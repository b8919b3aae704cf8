"""Fused Markov-head sampler for a whole DSpark draft block, in Triton, with its PyTorch reference.

What it computes (the sequential part of ``DSparkProposer.propose``, dspark/spec/proposer.py): given
the backbone's base logits ``U [B, N, V]`` (fp32), the anchor token ``x_0`` of each request and the
Markov head ``W1 [V, r]`` (an embedding) and ``W2ᵀ [r, V]`` (``markov_w2.weight_t``), for k = 1..N

    logits_k = U[:, k-1] + (W1[x_{k-1}] @ W2ᵀ)          bias rounded to the weights' dtype, as
                                                          ``markov_w2(markov_w1(prev)).float()`` is
    x_k      = argmax(logits_k)                           rows that do not draft probabilistically
    x_k      = Sampler(logits_k, stream=draft_stream(k-1))   probabilistic rows: penalties ->
               temperature -> min-p -> top-k -> top-p, then Gumbel-max with the noise
               gumbel(seed, key_position, 1 + 4(k-1)), key_position = anchor position + 1 for
               every k (noise is keyed per step, the slot goes in the stream; see rng.draft_stream)
    q_k      = compute_probs(logits_k)                    probabilistic rows (0 elsewhere)

so each drafted token is the previous token of the next slot. ``markov_sample_reference`` runs
exactly that with the existing PyTorch code paths; ``markov_sample`` is the fused version and picks
the same tokens.

Design
------
- **Two launches per slot, no host synchronisation.** Slot k needs the whole argmax of slot k-1, so
  the loop over k stays on the host, but every launch reads its previous token from device memory and
  the wrapper never reads a tensor value (CUDA-graph capturable; 2N launches, N for all-greedy).
  Launch A (grid B × ⌈V/BLOCK_V⌉) computes one vocabulary tile of the logits (the rank-r mat-vec
  ``W1[prev] @ W2ᵀ`` fused with the base logits, penalties and temperature), tile partials (max and
  arg-max for greedy rows; max and Σexp for the softmax), and writes the processed logits to a
  [B, V] scratch row that stays in L2. Launch B (same grid) writes q and the tile's Gumbel-max
  candidate. Each launch ends with a **last-block reduction**: every program bumps a per-row atomic
  counter after its partials are stored (``debug_barrier`` then an acq_rel atomic), and the program
  that arrives last reduces the row (and resets the counter). So the whole vocabulary is spread over
  many SMs even at batch 1, with no third "reduce" launch. Under Triton's interpreter programs run one
  after the other, where the same code is trivially correct.
- **Drafts at a temperature only, one launch per slot** (``_markov_temp_kernel``; what DSpark drafts with, as
  sampler.draft_params drops the filters): Gumbel-max needs no normaliser, so each tile's candidate max(z + noise)
  is taken in the pass that makes z = (U + bias) / t, the row's last program picks the token, and z is left in q's
  slot with the row's (max, Σexp); one launch after the loop (``_markov_norm_kernel``) normalises every slot's q.
  The same tokens and q as the general launches (N + 1 launches instead of 2N; session 54: 96.7 against 118.5 µs
  for 3 slots at batch 32, T = 1, H100).
- **Philox4x32-10 in Triton** (``_philox``), word for word the one of dspark/sample/rng.py: 32-bit
  words as uint32, ``umulhi``/wrapping multiply, same key schedule, counter (j // 4, pos lo, stream,
  pos hi), key (seed lo, seed hi). Each program makes the Philox blocks of its tile once and
  interleaves the four output words (``tl.join``) into column order.
- **Bit-exact arithmetic where it decides tokens**: the temperature and repetition-penalty divisions
  use ``div_rn`` (Triton's ``/`` is an approximate division on NVIDIA GPUs), the Gumbel transform
  uses libdevice's ``log``/``log1p`` on the GPU (what torch's CUDA kernels call), min-p's log is
  taken by torch in the wrapper, and the Markov bias is rounded to the weights' dtype like the
  reference. Sums (the rank-r dot product, softmax normalisers) differ only in summation order.
- **Top-k / top-p / min-p as one threshold.** Each filter keeps an upper set of the temperature-scaled
  logits, so their composition keeps {z >= θ}. The last program of launch A finds θ:
    * min-p only: θ = max + log(min_p) (one pass for the normaliser).
    * top-k and/or top-p: a lower bound L for the threshold is read off the sorted tile maxima (the
      k-th largest tile maximum is <= the k-th largest logit; tile maxima whose mass already reaches
      top_p bound the top-p cut from below). One pass over the row gathers every logit >= L into a
      small buffer (``cap`` entries, 2048 by default); if they fit, they are sorted (``tl.sort``) and
      top-k / top-p are applied exactly as ``apply_top_k_top_p_min_p`` does: k-th value with ties
      kept, then softmax over the top-k set (or the min-p-masked vocabulary), ``cumsum - p`` as the
      mass before each token, dropped where it reaches top_p.
    * otherwise (very flat distributions, top_k larger than the number of tiles): an exact bisection
      over the order-preserving integer keys of the fp32 logits, one pass over the row per step,
      counting (top-k) or summing probability mass (top-p). Slower, same result.
  Launch B then keeps z >= θ, writes q = exp(z - max) / Σ_kept and samples argmax(z + gumbel) over
  the kept set.

The same two launches, without the Markov bias, serve independent rows: ``processed_probs`` (=
``compute_probs``: the target's verification rows, one per draft position) and ``sample_rows`` (=
``Sampler()``: plain top-p sampling); ``Sampler(fused=True)`` uses them on a GPU. A vocabulary sort per
row costs ~1.8 ms for 256 rows of 49,152 on the H200. There, a top-p cut whose candidates do not fit
the buffer (flat rows: thousands of tokens above the cut) is not bisected by the row's last program
(one program walking the row 30-odd times, ~1.5 ms) but found by **radix select** between the two
launches: eight launches of ``_topp_radix_kernel``, each fixing 4 bits of θ's order-preserving key with
every tile program of the row counting mass and count per digit value (a no-op for the other rows).

Where it can differ from the reference (all measure-zero on continuous inputs): exact ties at the
top-p cut (the reference's sort order decides which tied token is dropped; here both are kept), a
near-tie in the float sums behind a top-p decision or the rank-r dot product, and, in the
interpreter only, the last bit of the Gumbel noise (numpy's log vs torch's; on the GPU both use
libdevice). The confidence head is not fused: it needs only the drafted tokens, so
``σ(conf(h_k, x_{k-1}))`` for all k is one batched call after the loop.
"""

from __future__ import annotations

import os
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

import triton
import triton.language as tl
from triton.language.extra import libdevice

from dspark.kernels import check_device, next_pow2, pdl_opts, pdl_wait
from dspark.kernels.fused_ops import cast_rtne
from dspark.sample.rng import draft_stream
from dspark.sample.sampler import Sampler, SamplingBatch, compute_probs

_NEG_INF = tl.constexpr(float("-inf"))  # a constexpr: jit code may read it


# ----------------------------------------------------------------------------------------- Philox
@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 tensors (mutually broadcastable): the four output words."""
    m0 = tl.full((), 0xD2511F53, tl.uint32)
    m1 = tl.full((), 0xCD9E8D57, tl.uint32)
    w0 = tl.full((), 0x9E3779B9, tl.uint32)
    w1 = tl.full((), 0xBB67AE85, tl.uint32)
    for r in tl.static_range(10):
        if r > 0:
            k0 = k0 + w0
            k1 = k1 + w1
        hi0 = tl.umulhi(c0, m0)
        lo0 = c0 * m0
        hi1 = tl.umulhi(c2, m1)
        lo1 = c2 * m1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


@triton.jit
def _lo32(x):
    """Low 32 bits of an int64 as uint32."""
    return (x & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _hi32(x):
    """High 32 bits of an int64 as uint32 (the arithmetic shift's sign bits are masked off)."""
    return ((x >> 32) & 0xFFFFFFFF).to(tl.uint32)


@triton.jit
def _random_words(seed, pos, stream, start, BLOCK: tl.constexpr):
    """[BLOCK] uint32 words j = start .. start + BLOCK - 1 of rng._random_words(seed, pos, stream);
    start must be a multiple of 4. One Philox block per 4 columns, words interleaved into order."""
    blk = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)
    c1 = _lo32(pos)
    c3 = _hi32(pos)
    c2 = (stream + tl.zeros([BLOCK // 4], tl.int32)).to(tl.uint32)  # stream may arrive as a constexpr
    w0, w1, w2, w3 = _philox(blk, c1, c2, c3, _lo32(seed), _hi32(seed))
    # join(join(w0, w2), join(w1, w3))[n, i, j] = w_{2i + j}: row-major flattening is column order.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK])


@triton.jit
def _log(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log(x)  # what torch's CUDA log calls (logf)
    else:
        # Interpreter (no libdevice): the correctly rounded fp32 result, via float64.
        return tl.log(x.to(tl.float64)).to(tl.float32)


@triton.jit
def _log1p(x, PRECISE: tl.constexpr):
    if PRECISE:
        return libdevice.log1p(x)
    else:
        # Interpreter: no log1p. In float64, log(y) * x / (y - 1) with y = 1 + x (Goldberg's trick:
        # the rounding of y cancels) is far below fp32's precision, so the fp32 result is exact.
        x64 = x.to(tl.float64)
        y = 1.0 + x64
        d = tl.where(y == 1.0, 1.0, y - 1.0)
        return tl.where(y == 1.0, x64, tl.log(y) * (x64 / d)).to(tl.float32)


@triton.jit
def _gumbel_from_words(words, PRECISE: tl.constexpr):
    """rng.gumbel's transform: v = open_unit(~w) = 1 - u, noise = -log(-log1p(-v))."""
    v = ((words ^ 0xFFFFFFFF).to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
    v = tl.minimum(v, 0.99999994039535522)  # largest float32 below 1
    return -_log(-_log1p(-v, PRECISE), PRECISE)


@triton.jit
def _philox_test_kernel(c_ptr, k_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    c0 = tl.load(c_ptr + 4 * i, mask=m, other=0).to(tl.uint32)
    c1 = tl.load(c_ptr + 4 * i + 1, mask=m, other=0).to(tl.uint32)
    c2 = tl.load(c_ptr + 4 * i + 2, mask=m, other=0).to(tl.uint32)
    c3 = tl.load(c_ptr + 4 * i + 3, mask=m, other=0).to(tl.uint32)
    k0 = tl.load(k_ptr + 2 * i, mask=m, other=0).to(tl.uint32)
    k1 = tl.load(k_ptr + 2 * i + 1, mask=m, other=0).to(tl.uint32)
    w0, w1, w2, w3 = _philox(c0, c1, c2, c3, k0, k1)
    tl.store(out_ptr + 4 * i, w0.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * i + 1, w1.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * i + 2, w2.to(tl.int64), mask=m)
    tl.store(out_ptr + 4 * i + 3, w3.to(tl.int64), mask=m)


@triton.jit
def _gumbel_test_kernel(seeds_ptr, pos_ptr, out_ptr, stream, n, PRECISE: tl.constexpr, BLOCK: tl.constexpr):
    b = tl.program_id(0)
    start = tl.program_id(1) * BLOCK
    seed = tl.load(seeds_ptr + b)
    pos = tl.load(pos_ptr + b)
    words = _random_words(seed, pos, stream, start, BLOCK)
    cols = start + tl.arange(0, BLOCK)
    tl.store(out_ptr + b * n + cols, _gumbel_from_words(words, PRECISE), mask=cols < n)


def _precise(t: Tensor) -> bool:
    return t.device.type == "cuda"


def philox4x32_triton(counter: Tensor, key: Tensor) -> Tensor:
    """rng.philox4x32 in Triton: counter [n, 4], key [n, 2] int64 words -> [n, 4] int64 words."""
    check_device(counter)
    counter = counter.to(torch.int64).contiguous()
    key = key.to(device=counter.device, dtype=torch.int64).contiguous()
    n = counter.shape[0]
    out = torch.empty(n, 4, dtype=torch.int64, device=counter.device)
    BLOCK = 256
    _philox_test_kernel[(triton.cdiv(n, BLOCK),)](counter, key, out, n, BLOCK=BLOCK)
    return out


@triton.jit
def _words_kernel(seeds_ptr, pos_ptr, cols_ptr, out_ptr, stream, n, HAS_COLS: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    """Row b, entries i: word col of rng._random_words(seed_b, pos_b, stream), col = i or cols[b, i]."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    if HAS_COLS:
        col = tl.load(cols_ptr + b * n + i, mask=m, other=0).to(tl.int64)
    else:
        col = i.to(tl.int64)
    seed = tl.load(seeds_ptr + b)
    pos = tl.load(pos_ptr + b)
    c2 = (stream + tl.zeros([BLOCK], tl.int32)).to(tl.uint32)
    w0, w1, w2, w3 = _philox((col >> 2).to(tl.uint32), _lo32(pos) + tl.zeros([BLOCK], tl.uint32), c2,
                             _hi32(pos) + tl.zeros([BLOCK], tl.uint32), _lo32(seed), _hi32(seed))
    sel = col & 3
    w = tl.where(sel == 0, w0, tl.where(sel == 1, w1, tl.where(sel == 2, w2, w3)))
    tl.store(out_ptr + b * n + i, w.to(tl.int64), mask=m)


def philox_words_triton(seeds: Tensor, positions: Tensor, stream: int, n: int | None = None,
                        cols: Tensor | None = None) -> Tensor:
    """rng._random_words (cols None: words 0..n-1 of each row) or rng._random_words_at (words at cols
    [B, K]) in one launch: [B, n or K] int64, bit for bit (Philox is integer arithmetic). The float
    transforms stay in torch (rng.py), so noise drawn through this is identical to the torch path."""
    check_device(seeds)
    seeds = seeds.to(torch.int64).contiguous()
    positions = positions.to(device=seeds.device, dtype=torch.int64).contiguous()
    B = seeds.shape[0]
    if cols is not None:
        cols = cols.to(device=seeds.device, dtype=torch.int64).contiguous()
        n = cols.shape[1]
    out = torch.empty(B, n, dtype=torch.int64, device=seeds.device)
    if B and n:
        BLOCK = 256 if n > 128 else max(16, next_pow2(n))
        _words_kernel[(B, triton.cdiv(n, BLOCK))](seeds, positions, cols if cols is not None else seeds, out,
                                                  stream & 0xFFFFFFFF, n, HAS_COLS=cols is not None, BLOCK=BLOCK,
                                                  **pdl_opts(seeds))
    return out


def gumbel_triton(seeds: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """rng.gumbel in Triton: [B, n] float32 noise for (seeds[b], positions[b], stream, column)."""
    check_device(seeds)
    seeds = seeds.to(torch.int64).contiguous()
    positions = positions.to(device=seeds.device, dtype=torch.int64).contiguous()
    B = seeds.shape[0]
    out = torch.empty(B, n, dtype=torch.float32, device=seeds.device)
    BLOCK = 256
    _gumbel_test_kernel[(B, triton.cdiv(n, BLOCK))](seeds, positions, out, stream, n, PRECISE=_precise(seeds),
                                                     BLOCK=BLOCK)
    return out


# ------------------------------------------------------------------------ threshold helpers
@triton.jit
def _key(x):
    """Order-preserving int32 key of fp32 values (x < y <=> key(x) < key(y) for non-NaN x, y)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _unkey(k):
    """Inverse of _key (int32 key -> fp32 value)."""
    bits = tl.where(k >= 0, k, k ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mass_ge(z_row, V, thr, m, BLOCK_S: tl.constexpr):
    """Σ exp(z - m) over the row's logits z >= thr (one pass)."""
    acc = tl.zeros([BLOCK_S], tl.float32)
    for j0 in range(0, V, BLOCK_S):
        cols = j0 + tl.arange(0, BLOCK_S)
        z = tl.load(z_row + cols, mask=cols < V, other=_NEG_INF, cache_modifier=".cg")
        acc += tl.where((cols < V) & (z >= thr), tl.exp(z - m), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _bisect(z_row, V, lo, hi, target, floor, m, n_lo, stop,
            USE_MASS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Largest key t in [lo, hi) with F(t) >= target, F(t) = count (or Σ exp(z - m), USE_MASS) of the
    logits z >= floor whose key is >= t. Requires F(lo) >= target > F(hi) (int64 keys); n_lo = the
    number of logits >= floor with key >= lo. Each step halves the key interval, then snaps both ends
    to actual logits, so it ends after about log2(#logits in the interval) passes over the row. With
    stop > 0 it ends early, once at most `stop` logits are >= lo (a lower bound is all that is needed).
    Returns (lo, n_lo)."""
    it = 0
    while (hi - lo > 1) & (n_lo > stop) & (it < 96):
        mid = lo + (hi - lo) // 2
        f = tl.zeros([BLOCK_S], tl.float32)
        cnt = tl.zeros([BLOCK_S], tl.int32)
        kmin = tl.zeros([BLOCK_S], tl.int64) + hi
        kmax = tl.zeros([BLOCK_S], tl.int64) + lo
        for j0 in range(0, V, BLOCK_S):
            cols = j0 + tl.arange(0, BLOCK_S)
            z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"), cache_modifier=".cg")
            kz = _key(z).to(tl.int64)
            live = (cols < V) & (z >= floor)
            ge = live & (kz >= mid)
            if USE_MASS:
                f += tl.where(ge, tl.exp(z - m), 0.0)
            else:
                f += ge.to(tl.float32)
            cnt += ge.to(tl.int32)
            kmin = tl.minimum(kmin, tl.where(ge, kz, hi))
            kmax = tl.maximum(kmax, tl.where(live & (kz < mid) & (kz >= lo), kz, lo))
        if tl.sum(f, 0) >= target:
            lo = tl.min(kmin, 0)  # F(lo) = F(mid): no logit between mid and it
            n_lo = tl.sum(cnt, 0)
        else:
            hi = tl.max(kmax, 0) + 1  # F(hi) = F(mid) < target
        it += 1
    return lo, n_lo


@triton.jit
def _gather(z_row, cand_row, V, lb, thr_min, M, CAP: tl.constexpr, BLOCK_S: tl.constexpr):
    """One pass over the row: copy the logits >= lb (the first CAP of them) to cand_row; returns
    (their number, Σ exp(z - M) over z >= thr_min)."""
    n = 0
    zmin = tl.zeros([BLOCK_S], tl.float32)
    for j0 in range(0, V, BLOCK_S):
        cols = j0 + tl.arange(0, BLOCK_S)
        z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"), cache_modifier=".cg")
        live = cols < V
        zmin += tl.where(live & (z >= thr_min), tl.exp(z - M), 0.0)
        sel = live & (z >= lb)
        slot = n + tl.cumsum(sel.to(tl.int32), 0) - 1
        tl.store(cand_row + slot, z, mask=sel & (slot < CAP))
        n += tl.sum(sel.to(tl.int32), 0)
    return n, tl.sum(zmin, 0)


@triton.jit
def _sorted_threshold(cand_row, n, thr_min, M, zmin, topk, topp, has_k, has_p, SIZE: tl.constexpr):
    """(θ, Σ_{z >= θ} exp(z - M)) from the n <= SIZE candidate logits in cand_row, which hold every
    logit at or above the cut (and the whole top-k set): min-p, top-k (k-th value, ties kept), then
    top-p on the softmax over the top-k set (or over the min-p-masked row, normaliser zmin), a token
    dropped once the mass before it reaches top_p — apply_top_k_top_p_min_p's steps."""
    ci = tl.arange(0, SIZE)
    s = tl.load(cand_row + ci, mask=ci < n, other=float("-inf"), cache_modifier=".cg")
    s = tl.sort(s, descending=True)
    s = tl.where(s >= thr_min, s, float("-inf"))
    kth = tl.full((), float("-inf"), tl.float32)
    zn = zmin
    if has_k:
        kth = tl.max(tl.where(ci == topk - 1, s, float("-inf")), 0)  # -inf: fewer than k left
        s = tl.where(s >= kth, s, float("-inf"))
        zn = tl.sum(tl.exp(s - M), 0)
    theta = tl.maximum(kth, thr_min)
    if has_p:
        p = tl.exp(s - M) / zn
        before = tl.cumsum(p, 0) - p
        keep = (before < topp) & (s > float("-inf"))
        theta = tl.min(tl.where(keep, s, float("inf")), 0)
    zk = tl.sum(tl.where(s >= theta, tl.exp(s - M), 0.0), 0)
    return theta, zk


@triton.jit
def _row_threshold(z_row, cand_row, V, NT, part_max_row, M, Z, topk, topp, log_min_p,
                   NT_PAD: tl.constexpr, CAP: tl.constexpr, SMALL_CAP: tl.constexpr, BLOCK_S: tl.constexpr,
                   DEFER: tl.constexpr):
    """(θ, Σ_{z >= θ} exp(z - M), path) of one sampled row: min-p -> top-k -> top-p as in
    sampler.apply_top_k_top_p_min_p, the kept set being {z >= θ}. M, Z: max and Σexp(z - M) of the
    row. path (for tests): 0 no search, 1 sorted candidates, 2 exact bisection. DEFER 1: a top-p cut
    whose candidates overflow the buffer (or under a top-k set larger than CAP) is left to the parallel
    radix passes (_topp_radix_kernel), which returns (the top-k / min-p floor, top_p, 3); DEFER 2: every
    top-p cut without top-k is; DEFER 0: none (bisection here)."""
    thr_min = M + log_min_p  # -inf when min-p is off
    has_k = topk < V
    has_p = topp < 1.0
    theta = thr_min
    zk = Z
    path = tl.full((), 0, tl.int32)
    if (DEFER == 2) & has_p & (topk >= V):
        # top-p without top-k: the radix passes find the cut over the whole row, in parallel
        path = tl.full((), 3, tl.int32)
        zk = topp
    elif has_k | has_p:
        neg_inf_key = _key(tl.full((), float("-inf"), tl.float32)).to(tl.int64)
        top_key = _key(M).to(tl.int64) + 1  # F(top_key) = 0
        # 1. A lower bound L for the cut from the tile maxima (a tiny list: sorted in registers).
        #    top-k: the k-th largest tile maximum is <= the k-th largest logit. top-p: tile maxima
        #    whose mass reaches top_p (with a margin over rounding; Z >= the min-p-masked normaliser)
        #    put the cut at or above the smallest of them. The block must hold the whole top-k set
        #    (its softmax normalises top-p), or, without top-k, every logit above the top-p cut.
        tt = tl.arange(0, NT_PAD)
        tmax = tl.load(part_max_row + tt, mask=tt < NT, other=float("-inf"), cache_modifier=".cg")
        ts = tl.sort(tmax, descending=True)
        if has_k:
            lb = tl.max(tl.where(tt == topk - 1, ts, float("-inf")), 0)
        else:
            cum = tl.cumsum(tl.where(ts >= thr_min, tl.exp(ts - M), 0.0), 0)
            lb = tl.max(tl.where(cum >= topp * Z * 1.0001, ts, float("-inf")), 0)
        lb = tl.maximum(lb, thr_min)
        n, zmin = _gather(z_row, cand_row, V, lb, thr_min, M, CAP, BLOCK_S)
        # 2. Too many candidates: raise L by bisection until they fit (or the exact cut is reached).
        if n > CAP:
            lo = tl.where(lb > float("-inf"), _key(lb).to(tl.int64), neg_inf_key)
            if has_k:
                if topk <= CAP:
                    lo, n = _bisect(z_row, V, lo, top_key, topk.to(tl.float32), thr_min, M, n, CAP,
                                    False, BLOCK_S)
            elif DEFER == 0:
                target = tl.minimum(topp * 1.0001, 1.0) * zmin
                lo, n = _bisect(z_row, V, lo, top_key, target, thr_min, M, n, CAP, True, BLOCK_S)
            lb = tl.maximum(_unkey(lo.to(tl.int32)), thr_min)
            if n <= CAP:
                n, zmin = _gather(z_row, cand_row, V, lb, thr_min, M, CAP, BLOCK_S)
        if n <= CAP:
            # 3. Sorted candidates: apply_top_k_top_p_min_p on the head of the sorted row (a short
            #    sort when the candidates are few, the usual case).
            path = tl.full((), 1, tl.int32)
            tl.debug_barrier()  # the buffer was written by other threads of this program
            if n <= SMALL_CAP:
                theta, zk = _sorted_threshold(cand_row, n, thr_min, M, zmin, topk, topp, has_k, has_p, SMALL_CAP)
            else:
                theta, zk = _sorted_threshold(cand_row, n, thr_min, M, zmin, topk, topp, has_k, has_p, CAP)
        else:
            # 4. Exact bisection over the row (huge top_k, or a top-p set larger than CAP).
            path = tl.full((), 2, tl.int32)
            theta_k = thr_min
            zn = zmin
            if has_k:
                lo = tl.where(thr_min > float("-inf"), _key(thr_min).to(tl.int64), neg_inf_key)
                n_live = tl.sum(tl.zeros([BLOCK_S], tl.int32), 0)
                for j0 in range(0, V, BLOCK_S):
                    cols = j0 + tl.arange(0, BLOCK_S)
                    z = tl.load(z_row + cols, mask=cols < V, other=float("-inf"), cache_modifier=".cg")
                    n_live += tl.sum(((cols < V) & (z >= thr_min)).to(tl.int32), 0)
                if n_live >= topk:
                    kth_key, n_live = _bisect(z_row, V, lo, top_key, topk.to(tl.float32), thr_min, M, n_live, 0,
                                              False, BLOCK_S)
                    theta_k = tl.maximum(_unkey(kth_key.to(tl.int32)), thr_min)
                zn = _mass_ge(z_row, V, theta_k, M, BLOCK_S)
            theta = theta_k
            if has_p & (DEFER > 0):
                path = tl.full((), 3, tl.int32)
                zk = topp
            else:
                if has_p:
                    lo = tl.where(theta_k > float("-inf"), _key(theta_k).to(tl.int64), neg_inf_key)
                    p_key, n_p = _bisect(z_row, V, lo, top_key, topp * zn, theta_k, M, V, 0, True, BLOCK_S)
                    theta = tl.maximum(_unkey(p_key.to(tl.int32)), theta_k)
                zk = _mass_ge(z_row, V, theta, M, BLOCK_S)
    else:
        if log_min_p > float("-inf"):
            zk = _mass_ge(z_row, V, thr_min, M, BLOCK_S)
    return theta, zk, path


@triton.jit
def _first_argmax(pmax_row, pidx_row, NT, NT_PAD: tl.constexpr):
    """The row's arg-max from its NT tile partials (max, index): the first tile's on ties, so the first
    index overall, as torch.argmax."""
    tt = tl.arange(0, NT_PAD)
    tm = tt < NT
    m = tl.load(pmax_row + tt, mask=tm, other=_NEG_INF, cache_modifier=".cg")
    i = tl.load(pidx_row + tt, mask=tm, other=0, cache_modifier=".cg")
    first = tl.min(tl.where(tm & (m == tl.max(m, 0)), tt, NT_PAD), 0)
    return tl.sum(tl.where(tt == first, i, 0), 0)


# --------------------------------------------------------------------------------- kernels
@triton.jit
def _slot_logits(base_ptr, stride_base, prev_ptr, stride_prev, w1_ptr, stride_w1, w2_ptr, stride_w2, bias_ptr,
                 stride_bias, b, cols, cm, R, HAS_MARKOV: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
                 BIAS_IN: tl.constexpr):
    """One vocabulary tile of slot k's logits, base + W1[prev] @ W2ᵀ (fp32; -inf past V)."""
    logits = tl.load(base_ptr + b * stride_base + cols, mask=cm, other=_NEG_INF)
    if BIAS_IN:  # the Markov bias [B, V] was computed by one GEMM for the whole batch
        logits = logits + tl.load(bias_ptr + b * stride_bias + cols, mask=cm, other=0.0).to(tl.float32)
    elif HAS_MARKOV:
        prev = tl.load(prev_ptr + b * stride_prev)
        acc = tl.zeros([BLOCK_V], tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rr = r0 + tl.arange(0, BLOCK_R)
            rm = rr < R
            a = tl.load(w1_ptr + prev * stride_w1 + rr, mask=rm, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + rr[:, None] * stride_w2 + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
            acc += tl.sum(a[:, None] * w.to(tl.float32), 0)
        # markov_w2(markov_w1(prev)) is produced in the weights' dtype, then .float()
        logits = logits + cast_rtne(acc, w2_ptr.dtype.element_ty).to(tl.float32)
    return logits


@triton.jit
def _markov_logits_kernel(
    base_ptr, stride_base,  # [B, V] slice of the base logits (slot k), fp32, unit column stride
    prev_ptr, stride_prev,  # [B] previous token (anchor or draft k-1), int64
    w1_ptr, stride_w1,  # [V, R] Markov W1
    w2_ptr, stride_w2,  # [R, V] Markov W2ᵀ, unit column stride
    bias_ptr, stride_bias,  # [B, V] precomputed W1[prev] @ W2ᵀ (BIAS_IN)
    flags_ptr, temp_ptr, topk_ptr, topp_ptr, lminp_ptr,  # [B] row settings
    rep_ptr, freq_ptr, pres_ptr, ocnt_ptr, pcnt_ptr,  # penalties ([B] and [B, V] int32 counts)
    z_ptr,  # [B, V] fp32 scratch: processed logits of sampled rows
    pmax_ptr, pidx_ptr, pmz_ptr, pse_ptr,  # [B, NT_PAD] tile partials
    cand_ptr,  # [B, CAP] fp32 scratch
    row_ptr,  # [B, 4] fp32: θ, max, Σ_kept exp(z - max)
    cnt_ptr,  # [B] int32 arrival counters (all 0 between launches)
    tok_ptr, stride_tok,  # [B] int64 output: draft token of greedy rows
    V, R, NT,
    HAS_MARKOV: tl.constexpr, HAS_PEN: tl.constexpr, HAS_REP: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, NT_PAD: tl.constexpr, CAP: tl.constexpr,
    SMALL_CAP: tl.constexpr, BLOCK_S: tl.constexpr, BIAS_IN: tl.constexpr, DEFER: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    flags = tl.load(flags_ptr + b)
    prob = (flags & 1) != 0
    sampled = (flags & 2) != 0
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cm = cols < V

    logits = _slot_logits(base_ptr, stride_base, prev_ptr, stride_prev, w1_ptr, stride_w1, w2_ptr, stride_w2,
                          bias_ptr, stride_bias, b, cols, cm, R, HAS_MARKOV, BLOCK_V, BLOCK_R, BIAS_IN)
    pl = logits
    if HAS_PEN:  # sampler.apply_penalties, for probabilistic rows only
        oc = tl.load(ocnt_ptr + b * V + cols, mask=cm, other=0)
        if HAS_REP:
            pc = tl.load(pcnt_ptr + b * V + cols, mask=cm, other=0)
            rp = tl.load(rep_ptr + b)
            seen = (pc > 0) | (oc > 0)
            pl = tl.where(seen, tl.where(pl > 0, tl.math.div_rn(pl, tl.zeros_like(pl) + rp), pl * rp), pl)
        pl = pl - tl.load(freq_ptr + b) * oc.to(tl.float32) - tl.load(pres_ptr + b) * (oc > 0).to(tl.float32)
        pl = tl.where(prob, pl, logits)

    # Greedy partials: first arg-max of the tile.
    tl.store(pmax_ptr + b * NT_PAD + t, tl.max(pl, 0))
    tl.store(pidx_ptr + b * NT_PAD + t, t * BLOCK_V + tl.argmax(pl, 0))
    # Sampled rows: temperature-scaled logits to scratch, tile max and Σexp.
    temp = tl.load(temp_ptr + b)
    temp = tl.where(sampled, temp, 1.0)
    z = tl.math.div_rn(pl, tl.zeros_like(pl) + temp)
    tl.store(z_ptr + b * V + cols, z, mask=cm & sampled)
    zmax = tl.max(z, 0)
    tl.store(pmz_ptr + b * NT_PAD + t, zmax)
    tl.store(pse_ptr + b * NT_PAD + t, tl.sum(tl.exp(z - zmax), 0))

    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    if arrived == NT - 1:  # the last program of row b reduces it
        tl.store(cnt_ptr + b, 0)
        greedy_tok = _first_argmax(pmax_ptr + b * NT_PAD, pidx_ptr + b * NT_PAD, NT, NT_PAD)
        tt = tl.arange(0, NT_PAD)
        tm = tt < NT
        if sampled:
            mz = tl.load(pmz_ptr + b * NT_PAD + tt, mask=tm, other=_NEG_INF, cache_modifier=".cg")
            se = tl.load(pse_ptr + b * NT_PAD + tt, mask=tm, other=0.0, cache_modifier=".cg")
            M = tl.max(mz, 0)
            Z = tl.sum(tl.where(tm, se * tl.exp(mz - M), 0.0), 0)
            theta, zk, path = _row_threshold(z_ptr + b * V, cand_ptr + b * CAP, V, NT, pmz_ptr + b * NT_PAD, M, Z,
                                       tl.load(topk_ptr + b), tl.load(topp_ptr + b), tl.load(lminp_ptr + b),
                                       NT_PAD, CAP, SMALL_CAP, BLOCK_S, DEFER)
            tl.store(row_ptr + b * 4, theta)
            tl.store(row_ptr + b * 4 + 1, M)
            tl.store(row_ptr + b * 4 + 2, zk)
            tl.store(row_ptr + b * 4 + 3, path.to(tl.float32))
        else:
            tl.store(tok_ptr + b * stride_tok, greedy_tok.to(tl.int64))


@triton.jit
def _topp_radix_kernel(
    z_ptr,  # [R, V] fp32 processed logits
    row_ptr,  # [R, 4] fp32: (floor, max, top_p, 3) of a deferred row, (floor, max, mass top-p must reach, 3)
              # after the first pass, (θ, max, Σ_kept, 4) after the last
    pref_ptr, above_ptr,  # [R] int64 / fp32: the key digits found so far, the mass of the keys above them
    part_ptr,  # [R, NT_PAD, 2 * 16] fp32: per tile, mass and count of each next digit
    cnt_ptr,  # [R] int32 arrival counters
    V, NT,
    SHIFT: tl.constexpr, BLOCK_V: tl.constexpr, NT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One radix digit (4 bits, from the top: SHIFT = 28, 24, .., 0) of the exact top-p cut of the rows
    _row_threshold deferred (path 3); other rows return at once. The cut is the largest key t with
    Σ_{key >= t} exp(z - M) >= target over the logits at or above the floor (``_bisect``'s F), target =
    top_p × their whole mass (summed by the first pass). Every
    tile program sums, per value d of the next 4-bit digit, the mass and count of its logits whose
    higher digits equal the ones found so far; the last program of the row adds the tiles up and keeps
    the lowest non-empty digit whose higher digits' mass (plus the mass above) stays below the target —
    so the digit of t. Eight launches spread the search over the row's NT programs, where a bisection
    in one program walks the row 30-odd times (~1.5 ms at V = 49,152 on the H200)."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    if tl.load(row_ptr + b * 4 + 3) == 3.0:
        floor = tl.load(row_ptr + b * 4)
        M = tl.load(row_ptr + b * 4 + 1)
        if SHIFT == 28:
            pref = tl.full((), 0, tl.int64)
        else:
            pref = tl.load(pref_ptr + b)
        cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
        z = tl.load(z_ptr + b * V + cols, mask=cols < V, other=_NEG_INF)
        ukey = _key(z).to(tl.int64) + 2147483648  # unsigned order, in [0, 2^32)
        live = (cols < V) & (z >= floor) & (z > _NEG_INF)
        if SHIFT < 28:
            live = live & ((ukey >> (SHIFT + 4)) == pref)
        digit = ((ukey >> SHIFT) & 15).to(tl.int32)
        e = tl.where(live, tl.exp(z - M), 0.0)
        dd = tl.arange(0, 16)
        mass = tl.zeros([16], tl.float32)
        count = tl.zeros([16], tl.float32)
        for v in tl.static_range(16):  # 1-D sums per digit value (a [BLOCK_V, 16] one-hot spills registers)
            hit = live & (digit == v)
            mass = tl.where(dd == v, tl.sum(tl.where(hit, e, 0.0), 0), mass)
            count = tl.where(dd == v, tl.sum(hit.to(tl.float32), 0), count)
        part = part_ptr + (b * NT_PAD + t) * 32
        tl.store(part + dd, mass)
        tl.store(part + 16 + dd, count)
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
        if arrived == NT - 1:
            tl.store(cnt_ptr + b, 0)
            tt = tl.arange(0, NT_PAD)
            base = part_ptr + (b * NT_PAD + tt[:, None]) * 32 + dd[None, :]
            tm = (tt < NT)[:, None]
            m = tl.sum(tl.load(base, mask=tm, other=0.0, cache_modifier=".cg"), 0)  # [16]
            c = tl.sum(tl.load(base + 16, mask=tm, other=0.0, cache_modifier=".cg"), 0)
            if SHIFT == 28:
                above = tl.full((), 0.0, tl.float32)
                target = tl.load(row_ptr + b * 4 + 2) * tl.sum(m, 0)  # top_p × the mass above the floor
                tl.store(row_ptr + b * 4 + 2, target)
            else:
                above = tl.load(above_ptr + b)
                target = tl.load(row_ptr + b * 4 + 2)
            # mass of the digits above each digit d (within the digits found so far), then the digit of t
            higher = tl.sum(tl.where(dd[None, :] > dd[:, None], m[None, :], 0.0), 1)
            ok = (above + higher < target) & (c > 0)
            d = tl.min(tl.where(ok, dd, 16), 0)
            above = above + tl.sum(tl.where(dd == d, higher, 0.0), 0)
            pref = pref * 16 + d
            if SHIFT == 0:
                theta = _unkey((pref - 2147483648).to(tl.int32))
                tl.store(row_ptr + b * 4, theta)
                tl.store(row_ptr + b * 4 + 2, above + tl.sum(tl.where(dd == d, m, 0.0), 0))
                tl.store(row_ptr + b * 4 + 3, 4.0)  # path 4: radix select
            else:
                tl.store(pref_ptr + b, pref)
                tl.store(above_ptr + b, above)


@triton.jit
def _markov_sample_kernel(
    z_ptr, row_ptr, flags_ptr, seeds_ptr, pos_ptr, stream,
    q_ptr, stride_q,  # [B, V] slice of q (slot k); written when WRITE_Q
    pmax_ptr, pidx_ptr, cnt_ptr,
    tok_ptr, stride_tok,  # [B] int64: read (greedy rows' token, for one-hot q) and written (sampled rows)
    V, NT,
    WRITE_Q: tl.constexpr, SAMPLE: tl.constexpr, PRECISE: tl.constexpr, BLOCK_V: tl.constexpr,
    NT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    flags = tl.load(flags_ptr + b)
    prob = (flags & 1) != 0
    sampled = (flags & 2) != 0
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cm = cols < V
    if sampled:
        theta = tl.load(row_ptr + b * 4)
        M = tl.load(row_ptr + b * 4 + 1)
        zk = tl.load(row_ptr + b * 4 + 2)
        # z may be q itself (filtered_probs): this program reads its tile before writing it
        z = tl.load(z_ptr + b * V + cols, mask=cm, other=_NEG_INF)
        kept = cm & (z >= theta)
        if WRITE_Q:
            tl.store(q_ptr + b * stride_q + cols, tl.where(kept, tl.exp(z - M) / zk, 0.0), mask=cm)
        if SAMPLE:
            words = _random_words(tl.load(seeds_ptr + b), tl.load(pos_ptr + b), stream, t * BLOCK_V, BLOCK_V)
            score = tl.where(kept, z + _gumbel_from_words(words, PRECISE), _NEG_INF)
            tl.store(pmax_ptr + b * NT_PAD + t, tl.max(score, 0))
            tl.store(pidx_ptr + b * NT_PAD + t, t * BLOCK_V + tl.argmax(score, 0))
            tl.debug_barrier()
            arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
            if arrived == NT - 1:
                tl.store(cnt_ptr + b, 0)
                tok = _first_argmax(pmax_ptr + b * NT_PAD, pidx_ptr + b * NT_PAD, NT, NT_PAD)
                tl.store(tok_ptr + b * stride_tok, tok.to(tl.int64))
    else:
        if WRITE_Q:  # one-hot for probabilistic rows at temperature 0, zeros for the others
            tok = tl.load(tok_ptr + b * stride_tok)
            tok = tl.where(prob, tok, -1)
            tl.store(q_ptr + b * stride_q + cols, (cols == tok).to(tl.float32), mask=cm)


@triton.jit
def _markov_temp_kernel(
    base_ptr, stride_base, prev_ptr, stride_prev, w1_ptr, stride_w1, w2_ptr, stride_w2, bias_ptr, stride_bias,
    flags_ptr, temp_ptr, seeds_ptr, pos_ptr, stream,
    z_ptr, stride_z,  # [B, V] slice of q (slot k): the scaled logits z of sampled rows, normalised afterwards
    pmax_ptr, pidx_ptr, pmz_ptr, pse_ptr,  # [B, NT_PAD] tile partials
    stat_ptr, stride_stat,  # [B, 2] slice (slot k) of the rows' (max, Σexp(z - max)), for _markov_norm_kernel
    cnt_ptr,  # [B] int32 arrival counters (all 0 between launches)
    tok_ptr, stride_tok,  # [B] int64 output: the slot's draft token
    w1row_ptr,  # with W1_ROWS: [B, R] output, W1's row of each row's token (the next slot's bias GEMM multiplies it)
    V, R, NT,
    HAS_MARKOV: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, NT_PAD: tl.constexpr,
    BIAS_IN: tl.constexpr, PRECISE: tl.constexpr, W1_ROWS: tl.constexpr, R_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """One slot of rows at a temperature only (no filter, no penalty), in one launch: sampled rows' Gumbel-max
    needs no normaliser, so each tile's candidate (the max of z + noise) is taken in the pass that makes z, and
    the row's last program picks the token; q is left as z plus the row's (max, Σexp) and normalised for every
    slot at once after the loop. Other rows: the first arg-max of the logits."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    sampled = (tl.load(flags_ptr + b) & 2) != 0
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cm = cols < V
    logits = _slot_logits(base_ptr, stride_base, prev_ptr, stride_prev, w1_ptr, stride_w1, w2_ptr, stride_w2,
                          bias_ptr, stride_bias, b, cols, cm, R, HAS_MARKOV, BLOCK_V, BLOCK_R, BIAS_IN)
    if sampled:
        z = tl.math.div_rn(logits, tl.zeros_like(logits) + tl.load(temp_ptr + b))
        tl.store(z_ptr + b * stride_z + cols, z, mask=cm)
        zmax = tl.max(z, 0)
        tl.store(pmz_ptr + b * NT_PAD + t, zmax)
        tl.store(pse_ptr + b * NT_PAD + t, tl.sum(tl.exp(z - zmax), 0))
        words = _random_words(tl.load(seeds_ptr + b), tl.load(pos_ptr + b), stream, t * BLOCK_V, BLOCK_V)
        score = z + _gumbel_from_words(words, PRECISE)  # -inf past V
    else:
        score = logits
    tl.store(pmax_ptr + b * NT_PAD + t, tl.max(score, 0))
    tl.store(pidx_ptr + b * NT_PAD + t, t * BLOCK_V + tl.argmax(score, 0))

    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + b, 1, sem="acq_rel", scope="gpu")
    if arrived == NT - 1:  # the last program of row b reduces it
        tl.store(cnt_ptr + b, 0)
        tok = _first_argmax(pmax_ptr + b * NT_PAD, pidx_ptr + b * NT_PAD, NT, NT_PAD)
        tl.store(tok_ptr + b * stride_tok, tok.to(tl.int64))
        if W1_ROWS:
            rr = tl.arange(0, R_PAD)
            rm = rr < R
            tl.store(w1row_ptr + b * R + rr, tl.load(w1_ptr + tok.to(tl.int64) * stride_w1 + rr, mask=rm), mask=rm)
        if sampled:
            tt = tl.arange(0, NT_PAD)
            tm = tt < NT
            mz = tl.load(pmz_ptr + b * NT_PAD + tt, mask=tm, other=_NEG_INF, cache_modifier=".cg")
            se = tl.load(pse_ptr + b * NT_PAD + tt, mask=tm, other=0.0, cache_modifier=".cg")
            M = tl.max(mz, 0)
            tl.store(stat_ptr + b * stride_stat, M)
            tl.store(stat_ptr + b * stride_stat + 1, tl.sum(tl.where(tm, se * tl.exp(mz - M), 0.0), 0))


@triton.jit
def _markov_norm_kernel(q_ptr, stat_ptr, flags_ptr, tok_ptr, V, N, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    """q of every slot (row r = b * N + k of [B * N, V]) after _markov_temp_kernel's loop: exp(z - M) / Z in place
    for sampled rows, the one-hot of the token for probabilistic rows at temperature 0, zeros for the others."""
    pdl_wait(PDL)
    r = tl.program_id(0)
    t = tl.program_id(1)
    flags = tl.load(flags_ptr + r // N)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cm = cols < V
    if (flags & 2) != 0:
        z = tl.load(q_ptr + r * V + cols, mask=cm, other=_NEG_INF)
        q = tl.exp(z - tl.load(stat_ptr + r * 2)) / tl.load(stat_ptr + r * 2 + 1)
    else:
        tok = tl.where((flags & 1) != 0, tl.load(tok_ptr + r), -1)
        q = (cols == tok).to(tl.float32)
    tl.store(q_ptr + r * V + cols, q, mask=cm)


@triton.jit
def _row_flags_kernel(prob_ptr, temp_ptr, flags_ptr, cnt_ptr, B, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """_RowSettings' flags (prob | (prob & temperature > 0) << 1) and zeroed arrival counters of B rows."""
    pdl_wait(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < B
    p = (tl.load(prob_ptr + i, mask=m, other=0) != 0).to(tl.int32)
    hot = (tl.load(temp_ptr + i, mask=m, other=0.0) > 0.0).to(tl.int32)
    tl.store(flags_ptr + i, p | ((p & hot) << 1), mask=m)
    tl.store(cnt_ptr + i, tl.zeros_like(p), mask=m)


# --------------------------------------------------------------------------------- wrappers
class _RowSettings:
    """The per-row settings and scratch buffers the two kernels share, for B rows of V logits.
    ``prob``: [B] bool, rows whose tokens are drawn from (or whose q is) the processed distribution;
    the others take the raw argmax."""

    def __init__(self, batch: SamplingBatch, prob: Tensor, any_prob: bool, B: int, V: int, dev, cap: int,
                 block_v: int, filters: bool = True) -> None:
        if cap < 2 or cap & (cap - 1):
            raise ValueError(f"cap must be a power of two >= 2, got {cap}")
        self.cap, self.block_v = cap, block_v
        self.small_cap = min(cap, max(16, min(256, cap // 4)))  # sort size when the candidates are few
        self.NT = triton.cdiv(V, block_v)
        self.NT_PAD = next_pow2(self.NT)
        self.temperature = batch.temperature.to(device=dev, dtype=torch.float32)
        # flags: bit 0 the row's q is the processed distribution (prob), bit 1 it samples (prob, temperature > 0);
        # cnt: the kernels' arrival counters, 0. One launch (it was seven torch ops in the drafter graph).
        self.flags = torch.empty(B, dtype=torch.int32, device=dev)
        self.cnt = torch.empty(B, dtype=torch.int32, device=dev)
        if B:
            blk = min(next_pow2(B), 1024)
            _row_flags_kernel[(triton.cdiv(B, blk),)](prob, self.temperature, self.flags, self.cnt, B, BLOCK=blk,
                                                     num_warps=4, **pdl_opts(prob))
        # ``filters`` False (markov_sample's temperature-only slots): no filter settings, no threshold scratch —
        # ops the drafter graph would otherwise replay every step for nothing
        if filters:
            self.top_k = batch.top_k.to(dev).clamp(max=V).to(torch.int32)
            self.top_p = batch.top_p.to(device=dev, dtype=torch.float32)
            self.log_min_p = batch.min_p.to(device=dev, dtype=torch.float32).log()
        self.seeds = batch.seeds.to(dev)
        self.has_pen = any_prob and not batch.no_penalties
        self.has_rep = self.has_pen and batch.prompt_counts is not None
        if self.has_pen:
            self.rep, self.freq, self.pres = batch.repetition_penalty, batch.frequency_penalty, batch.presence_penalty
            self.ocnt = batch.output_counts.to(torch.int32).contiguous()
            self.pcnt = batch.prompt_counts.to(torch.int32).contiguous() if self.has_rep else self.ocnt
        else:
            self.rep = self.freq = self.pres = self.temperature
            self.ocnt = self.pcnt = self.flags
        f32 = dict(dtype=torch.float32, device=dev)
        self.pmax = torch.empty(B, self.NT_PAD, **f32)
        self.pidx = torch.empty(B, self.NT_PAD, dtype=torch.int32, device=dev)
        self.pmz = torch.empty(B, self.NT_PAD, **f32)
        self.pse = torch.empty(B, self.NT_PAD, **f32)
        if filters:
            self.cand = torch.empty(B if any_prob else 1, cap, **f32)
            self.row = torch.empty(B, 4, **f32)
        self.precise = dev.type == "cuda"
        # No fused multiply-adds on the GPU: the penalty arithmetic must round like torch's separate ops.
        self.opts = {"enable_fp_fusion": False, **pdl_opts(self.flags)} if self.precise else pdl_opts(self.flags)

    def settings(self) -> tuple:
        """_markov_logits_kernel's flags_ptr .. pcnt_ptr."""
        return (self.flags, self.temperature, self.top_k, self.top_p, self.log_min_p, self.rep, self.freq,
                self.pres, self.ocnt, self.pcnt)

    def scratch(self) -> tuple:
        """_markov_logits_kernel's pmax_ptr .. cnt_ptr."""
        return self.pmax, self.pidx, self.pmz, self.pse, self.cand, self.row, self.cnt

    def logits_meta(self) -> dict:
        return dict(BLOCK_V=self.block_v, NT_PAD=self.NT_PAD, CAP=self.cap, SMALL_CAP=self.small_cap, BLOCK_S=1024)


# markov_sample's (block_v, num_warps). On the H200 (session 28, benchmarks/kernel_ops_bench.py --only markov
# --markov-tiles, V = 49,152, gamma = 7, CUDA-graph ms for the whole block) 2048 x 8 warps against the earlier
# 256 x 4: greedy 0.285 -> 0.167 (B = 32) and 0.838 -> 0.386 (B = 128); T = 1 0.406 -> 0.257 and
# 1.242 -> 0.647; top-p 0.95 2.02 -> 1.99 and 3.69 -> 2.61; top-k + top-p 0.99 -> 0.74 and 1.96 -> 1.18.
# Fewer, larger tiles: a row's programs meet at one atomic counter, and its partials are a 24-entry
# reduction instead of 192. (1024 x 4 was as fast greedy and at T = 1, slower with top-p.)
MARKOV_TILE_CUDA = (2048, 8)
# Triton's interpreter: one program per row and slot at the tests' vocabularies (its time goes by the number of
# programs, not their width; the kernel tests pass smaller tiles to cover the multi-tile paths)
MARKOV_TILE_CPU = (1024, 4)

# Drafts at a temperature only (what DSpark drafts with: sampler.draft_params drops top-k / top-p / min-p) take
# _markov_temp_kernel (one launch per slot, _markov_norm_kernel once after the loop) instead of the two general
# launches per slot; DSPARK_MARKOV_TEMP_ONLY=0 keeps the general ones (the A/B switch).
MARKOV_TEMP_ONLY = os.environ.get("DSPARK_MARKOV_TEMP_ONLY", "1") != "0"

# Independent rows (processed_probs / sample_rows): which top-p cuts the radix passes find (_row_threshold's
# DEFER: 1 those whose candidates overflow the buffer, 2 every one without top-k) and their tile size.
TOPP_RADIX = 1
RADIX_BLOCK = 1024


def _process_rows(logits: Tensor, batch: SamplingBatch, stream: int | None, probs_out: Tensor | None,
                  block_v: int, cap: int, num_warps: int, paths: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """One Markov-free slot of the fused sampler over R independent rows: (tokens [R], q [R, V] or None)."""
    check_device(logits)
    R, V = logits.shape
    dev = logits.device
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    tokens = torch.empty(R, dtype=torch.int64, device=dev)
    if probs_out is not None and (probs_out.shape != (R, V) or not probs_out.is_contiguous()
                                  or probs_out.dtype != torch.float32):
        raise ValueError(f"probs_out must be a contiguous float32 {(R, V)} tensor")
    if R == 0:
        return tokens, probs_out
    rs = _RowSettings(batch, torch.ones(R, dtype=torch.bool, device=dev), True, R, V, dev, cap, block_v)
    defer = TOPP_RADIX
    # q, when asked for, doubles as the scratch of the processed logits (each program reads its tile of
    # z before writing the same tile of q)
    z = probs_out if probs_out is not None else torch.empty(R, V, dtype=torch.float32, device=dev)
    _markov_logits_kernel[(R, rs.NT)](
        logits, logits.stride(0), tokens, 1, logits, 0, logits, 0, logits, 0,
        *rs.settings(), z, *rs.scratch(), tokens, 1, V, 1, rs.NT,
        HAS_MARKOV=False, HAS_PEN=rs.has_pen, HAS_REP=rs.has_rep, BLOCK_R=1, BIAS_IN=False, DEFER=defer,
        **rs.logits_meta(), num_warps=num_warps, **rs.opts,
    )
    if not batch.no_top_p:
        # rows whose top-p cut needs an exact search over the row (path 3): eight radix digits, each spread
        # over the row's tiles (programs of the other rows return at once)
        pref = torch.empty(R, dtype=torch.int64, device=dev)
        above = torch.empty(R, dtype=torch.float32, device=dev)
        radix_v = max(block_v, RADIX_BLOCK)  # larger tiles than the logits pass: fewer programs per launch
        NT_R = triton.cdiv(V, radix_v)
        part = torch.empty(R, next_pow2(NT_R), 32, dtype=torch.float32, device=dev)
        for shift in range(28, -1, -4):
            _topp_radix_kernel[(R, NT_R)](z, rs.row, pref, above, part, rs.cnt, V, NT_R, SHIFT=shift,
                                          BLOCK_V=radix_v, NT_PAD=next_pow2(NT_R), num_warps=num_warps,
                                          **pdl_opts(z))
    if paths is not None:
        paths.copy_(torch.where((rs.flags & 2) != 0, rs.row[:, 3].to(torch.int32), -1))
    positions = batch.positions.to(device=dev, dtype=torch.int64) if stream is not None else tokens
    _markov_sample_kernel[(R, rs.NT)](
        z, rs.row, rs.flags, rs.seeds if stream is not None else tokens, positions, stream or 0,
        z, z.stride(0), rs.pmax, rs.pidx, rs.cnt, tokens, 1, V, rs.NT,
        WRITE_Q=probs_out is not None, SAMPLE=stream is not None, PRECISE=rs.precise, BLOCK_V=block_v,
        NT_PAD=rs.NT_PAD, num_warps=num_warps, **rs.opts,
    )
    return tokens, probs_out


def processed_probs(logits: Tensor, batch: SamplingBatch, *, probs_out: Tensor | None = None, block_v: int = 256,
                    cap: int = 2048, num_warps: int = 4, _paths: Tensor | None = None) -> Tensor:
    """``sampler.compute_probs(logits, batch)`` in two launches (ten with top-p rows: the radix select),
    without sorting the vocabulary: [R, V]
    fp32, the distribution each of the R rows is sampled from (penalties, temperature, min-p, top-k,
    top-p found as one threshold as in the module docstring; greedy rows one-hot of the penalised
    argmax). ``probs_out``: a contiguous [R, V] fp32 tensor to write into (a CUDA graph's buffer).
    Differs from the reference only where the module docstring says (exact ties at the top-p cut,
    rounding of the sums behind a top-p decision)."""
    if probs_out is None:
        probs_out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return _process_rows(logits, batch, None, probs_out, block_v, cap, num_warps, _paths)[1]


def sample_rows(logits: Tensor, batch: SamplingBatch, stream: int, *, block_v: int = 256, cap: int = 2048,
                num_warps: int = 4) -> Tensor:
    """``Sampler()(logits, batch, stream)`` in two launches (ten with top-p rows), without sorting the
    vocabulary: [R] int64, greedy rows the penalised argmax, the others Gumbel-max over the processed
    logits keyed by (seed, position, stream) — the same draw, token for token, but for the module
    docstring's ties."""
    return _process_rows(logits, batch, stream, None, block_v, cap, num_warps, None)[0]


def _as_row_mask(probabilistic, prob_mask: Tensor | None, B: int, device) -> tuple[Tensor, bool]:
    if isinstance(probabilistic, Tensor):
        raise TypeError("pass probabilistic as a list of bools (its any() must be known on the host)")
    flags = list(probabilistic)
    if len(flags) != B:
        raise ValueError(f"probabilistic has {len(flags)} entries for {B} rows")
    if prob_mask is None:  # a host-to-device copy (pageable: not capturable in a CUDA graph)
        prob_mask = torch.tensor(flags, dtype=torch.bool).to(device, non_blocking=True)
    return prob_mask.to(device=device, dtype=torch.bool), any(flags)


def markov_sample(
    base_logits: Tensor,
    anchors: Tensor,
    w1: Tensor | None,
    w2_t: Tensor | None,
    batch: SamplingBatch,
    key_positions: Tensor,
    probabilistic: list[bool],
    *,
    block_v: int | None = None,
    cap: int = 2048,
    num_warps: int | None = None,
    prob_mask: Tensor | None = None,
    bias_gemm: bool | None = None,
    probs_out: Tensor | None = None,
    temp_only: bool | None = None,
    _paths: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Draft N tokens per row with the Markov head, fused (see the module docstring).

    base_logits [B, N, V] fp32; anchors [B] int64; w1 [V, r] and w2_t [r, V] (``markov_w1.weight``,
    ``markov_w2.weight_t``; None for a drafter without a Markov head); batch: the rows' SamplingBatch;
    key_positions [B] int64: the position the draft noise is keyed by (anchor position + 1);
    probabilistic: per row, whether it drafts by sampling (else argmax of the logits).
    Returns (tokens [B, N] int64, q [B, N, V] fp32 or None when no row is probabilistic), the same as
    ``markov_sample_reference``. ``cap`` bounds the sorted candidate buffer of top-k/top-p rows.
    ``block_v`` / ``num_warps``: the vocabulary tile of one program and its warps (default
    MARKOV_TILE_CUDA on a GPU, MARKOV_TILE_CPU in Triton's interpreter).
    ``prob_mask``: optionally the same flags as a [B] bool tensor already on the device (saves a
    host-to-device copy, e.g. inside a CUDA graph). ``bias_gemm``: compute each slot's Markov bias
    with one torch GEMM for the whole batch instead of inside the kernel (default: on a GPU from 4 rows
    on, where re-reading W2 per row costs more than the extra launch; always on a CPU, where Triton's
    interpreter runs the in-kernel mat-vec in Python: the kernel tests choose both paths explicitly).
    ``probs_out``: a contiguous [B, N, V] fp32 tensor that receives q (a CUDA graph's shared buffer)
    instead of a new one.
    ``temp_only``: for a batch without top-k, top-p, min-p and penalties (the drafts' settings,
    sampler.draft_params), one launch per slot (``_markov_temp_kernel``) and one for every slot's q after the
    loop, the same tokens and q; default MARKOV_TEMP_ONLY where the batch allows it. False: the general launches.
    ``_paths`` (tests): a [B, N] int32 tensor that receives, for sampled rows, how θ was found
    (0 no filter search, 1 sorted candidates, 2 bisection; processed_probs / sample_rows: 4 radix
    select); -1 for other rows.
    """
    check_device(base_logits)
    B, N, V = base_logits.shape
    dev = base_logits.device
    tile = MARKOV_TILE_CUDA if dev.type == "cuda" else MARKOV_TILE_CPU
    block_v = tile[0] if block_v is None else block_v
    num_warps = tile[1] if num_warps is None else num_warps
    if base_logits.dtype != torch.float32:
        raise TypeError("base_logits must be float32 (the drafter's lm_head output)")
    if base_logits.stride(-1) != 1:
        base_logits = base_logits.contiguous()
    prob, any_prob = _as_row_mask(probabilistic, prob_mask, B, dev)
    tokens = torch.empty(B, N, dtype=torch.int64, device=dev)
    probs = None
    if any_prob:
        probs = probs_out if probs_out is not None else torch.empty(B, N, V, dtype=torch.float32, device=dev)
        if probs.shape != (B, N, V) or not probs.is_contiguous():
            raise ValueError(f"probs_out must be a contiguous {(B, N, V)} tensor")
    if B == 0 or N == 0:
        return tokens, probs

    has_markov = w1 is not None and w2_t is not None and w1.shape[-1] > 0
    if has_markov:
        R = w1.shape[1]
        if w1.stride(1) != 1:
            w1 = w1.contiguous()
        if w2_t.stride(1) != 1:
            w2_t = w2_t.contiguous()
    else:
        R = 1
        w1 = w2_t = base_logits  # never read
    if bias_gemm is None:
        bias_gemm = B >= 4 or base_logits.device.type != "cuda"
    plain = batch.no_top_k and batch.no_top_p and batch.no_min_p and (batch.no_penalties or not any_prob)
    if temp_only is None:
        # Greedy drafting with the bias inside the kernel (batch < 4) stays on the general kernel: its slots
        # were 7 % faster there (H100, session 54: γ = 3 / 7 at batch 1, 36.7 / 70.4 against 39.4 / 74.3 µs);
        # everywhere else the one-launch slots win (T = 1 batch 32, γ = 3: 96.7 against 118.5 µs).
        temp_only = MARKOV_TEMP_ONLY and plain and _paths is None and (any_prob or bias_gemm)
    elif temp_only and not plain:
        raise ValueError("temp_only needs a batch without top-k, top-p, min-p and penalties")
    rs = _RowSettings(batch, prob, any_prob, B, V, dev, cap, block_v, filters=not temp_only)
    key_positions = key_positions.to(device=dev, dtype=torch.int64)
    BLOCK_R = min(next_pow2(R), 32)
    stats = torch.empty(B, N, 2, dtype=torch.float32, device=dev) if temp_only else None
    z = None if temp_only else torch.empty(B if any_prob else 1, V, dtype=torch.float32, device=dev)
    # The bias GEMM of slot k > 0 multiplies W1's rows of slot k - 1's tokens: _markov_temp_kernel writes them
    # (``w1_rows``), instead of an index kernel per slot (on a strided column of ``tokens``: most likely the two
    # 3.9 µs scatter/gather kernels of session 56's batch-32 drafter graph, against 1.7 µs for the contiguous
    # anchors' gather). The same values: the same GEMM, the same bias.
    w1_rows = (torch.empty(max(N - 1, 0), B, R, dtype=w1.dtype, device=dev)
               if temp_only and has_markov and bias_gemm else None)

    for k in range(N):
        prev = anchors if k == 0 else tokens[:, k - 1]
        base_k = base_logits[:, k]
        tok_k = tokens[:, k]
        # Several rows: one GEMM reads W2 once for all of them (the in-kernel mat-vec would re-read
        # it per row); it is also bit for bit the reference's bias.
        bias = None
        if has_markov and bias_gemm:
            bias = torch.matmul(F.embedding(prev, w1) if k == 0 or w1_rows is None else w1_rows[k - 1], w2_t)
        keep = w1_rows is not None and k < N - 1  # the next slot's W1 rows
        bias_arg = bias if bias is not None else base_k
        if temp_only:
            q_k = probs[:, k] if any_prob else base_k  # never written without sampled rows
            _markov_temp_kernel[(B, rs.NT)](
                base_k, base_k.stride(0), prev, prev.stride(0), w1, w1.stride(0), w2_t, w2_t.stride(0),
                bias_arg, bias_arg.stride(0), rs.flags, rs.temperature, rs.seeds, key_positions, draft_stream(k),
                q_k, q_k.stride(0), rs.pmax, rs.pidx, rs.pmz, rs.pse, stats[:, k], stats.stride(0), rs.cnt,
                tok_k, tok_k.stride(0), w1_rows[k] if keep else w1, V, R, rs.NT,
                HAS_MARKOV=has_markov, BLOCK_V=block_v, BLOCK_R=BLOCK_R, NT_PAD=rs.NT_PAD, BIAS_IN=bias is not None,
                PRECISE=rs.precise, W1_ROWS=keep, R_PAD=next_pow2(R), num_warps=num_warps, **rs.opts,
            )
            continue
        _markov_logits_kernel[(B, rs.NT)](
            base_k, base_k.stride(0), prev, prev.stride(0), w1, w1.stride(0), w2_t, w2_t.stride(0),
            bias_arg, bias_arg.stride(0), *rs.settings(), z, *rs.scratch(), tok_k, tok_k.stride(0),
            V, R, rs.NT,
            HAS_MARKOV=has_markov, HAS_PEN=rs.has_pen, HAS_REP=rs.has_rep, BLOCK_R=BLOCK_R,
            BIAS_IN=bias is not None, DEFER=0, **rs.logits_meta(), num_warps=num_warps, **rs.opts,
        )
        if _paths is not None:
            _paths[:, k] = torch.where((rs.flags & 2) != 0, rs.row[:, 3].to(torch.int32), -1)
        if any_prob:
            q_k = probs[:, k]
            _markov_sample_kernel[(B, rs.NT)](
                z, rs.row, rs.flags, rs.seeds, key_positions, draft_stream(k), q_k, q_k.stride(0),
                rs.pmax, rs.pidx, rs.cnt, tok_k, tok_k.stride(0), V, rs.NT,
                WRITE_Q=True, SAMPLE=True, PRECISE=rs.precise, BLOCK_V=block_v, NT_PAD=rs.NT_PAD,
                num_warps=num_warps, **rs.opts,
            )
    if temp_only and any_prob:
        _markov_norm_kernel[(B * N, rs.NT)](probs, stats, rs.flags, tokens, V, N, BLOCK_V=block_v,
                                            num_warps=num_warps, **pdl_opts(probs))
    return tokens, probs


def markov_sample_reference(
    base_logits: Tensor,
    anchors: Tensor,
    w1: Tensor | None,
    w2_t: Tensor | None,
    batch: SamplingBatch,
    key_positions: Tensor,
    probabilistic: list[bool],
) -> tuple[Tensor, Tensor | None]:
    """The Markov loop of DSparkProposer.propose with the existing PyTorch code paths (same
    arguments and results as ``markov_sample``)."""
    B, N, V = base_logits.shape
    dev = base_logits.device
    prob_rows = torch.tensor(list(probabilistic), dtype=torch.bool, device=dev)
    any_prob = any(probabilistic)
    tokens = torch.empty(B, N, dtype=torch.long, device=dev)
    probs = torch.zeros(B, N, V, device=dev) if any_prob else None
    step_batch = replace(batch, positions=key_positions)
    sampler = Sampler()
    prev = anchors
    for k in range(N):
        if w1 is None or w2_t is None:
            logits = base_logits[:, k] + torch.zeros((), device=dev)
        else:  # DSparkDrafter.markov_bias: markov_w2(markov_w1(prev)).float()
            logits = base_logits[:, k] + torch.matmul(F.embedding(prev, w1), w2_t).float()
        tok = logits.argmax(dim=-1)
        if any_prob:
            q = compute_probs(logits, step_batch)
            sampled = sampler(logits, step_batch, stream=draft_stream(k))
            tok = torch.where(prob_rows, sampled, tok)
            probs[:, k] = torch.where(prob_rows[:, None], q, 0.0)
        tokens[:, k] = tok
        prev = tok
    return tokens, probs


__all__ = ["markov_sample", "markov_sample_reference", "processed_probs", "sample_rows", "philox4x32_triton", "gumbel_triton"]
