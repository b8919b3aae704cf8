"""Fused probabilistic speculative verification, "standard" (token-wise) and "block", in Triton.

Standard
--------
``verify_standard_triton`` computes exactly ``dspark.spec.rejection.verify_probabilistic(...,
method="standard")`` (same contract, same random keys, same tokens), which in torch is ~60 small ops
and two Philox draws per verify step. For each request b with N_b drafts it fuses

  1. acceptance: p_i(X_i), q_i(X_i) for i <= N_b, r_i = p_i(X_i) / max(q_i(X_i), tiny) (a correctly
     rounded division, ``div_rn``), U_i from the Philox words of ``uniform(seed, position,
     STREAM_ACCEPT, N)`` (column i - 1), a = length of the prefix with U_i <= r_i;
  2. the final token: Gumbel-max over the vocabulary, in tiles, with the noise
     ``gumbel(seed, position + a, STREAM_RECOVER, V)`` (column = token id), of
     norm(max(p_{a+1} - q_{a+1}, 0)), or of p_{a+1} for the bonus row (a = N_b) or a residual with no
     mass. One pass serves both: it tracks the running argmax of log(residual) + g and of
     log(p) + g, and whether the residual has mass (the reference's ``residual.sum() > 0``, which for
     non-negative terms is "some term > 0 and none is NaN"), and picks at the end; ties go to the
     lowest token id, as ``torch.argmax``;
  3. the output row X_1..X_a, Y, -1 padding, and num_emitted = a + 1.

Launches: one program handles ``block_b`` requests (1 on a GPU) and a contiguous range of vocabulary
tiles; the vocabulary of each request is split over ``splits`` programs so that a small batch still
fills the GPU (default on CUDA: about two programs per SM; six for block verification,
BLOCK_PROGRAMS_PER_SM). With one split the kernel writes the
result itself (ONE launch); with several, each program writes its partial maxima and a second small
kernel reduces them in split order and writes the result (TWO launches). The grid, the loop bounds
and the split count depend only on the shapes (B, N, V) and the device, never on tensor values: no
host synchronisation, so it can be captured in a CUDA graph.

Block
-----
``verify_block_triton`` computes ``verify_probabilistic(..., method="block")`` (Sun et al. 2024), same
contract and keys. Its acceptance needs, before τ is known, a residual mass for every draft slot,
R_i = Σ_x max(P_i p_{i+1}(x) - q_{i+1}(x), 0) for 1 <= i < N_b: a pass over the vocabulary per slot.
P_i = min(P_{i-1} r_i, 1) is a running product of N gathered ratios, rounded at every step as the
reference rounds it; every program recomputes it (N gathers) rather than passing it around.

  * mass: R_i in vocabulary tiles. The sum over the vocabulary is always taken in the same order
    whatever the layout: one ``tl.sum`` per tile of ``block_v`` tokens, then the tile sums added
    from tile 0 up. With several splits a first launch writes the tile sums ([B, tiles, N_PAD]
    f32) and every program of the second adds them in tile order; with one split the program
    computes them itself in that order. R (so τ) therefore does not depend on the split count,
    i.e. on the batch size through the default split.
  * acceptance: h_i = R_i / (R_i + 1 - P_i) (1 where that denominator is 0) for i < N_b,
    h_{N_b} = P_{N_b}, 0 past N_b; τ = the LAST i with U_i <= h_i (0 if none).
  * the final token: the standard kernel's Gumbel-max pass, of norm(max(P_τ p_{τ+1} - q_{τ+1}, 0))
    (or p_{τ+1} for the bonus τ = N_b and where the residual has no mass or is NaN), with the noise
    of position + τ; the same partial maxima and the same reduce kernel.

Launches: one split: ONE (mass, acceptance and the Gumbel-max in one program); several: THREE (tile
sums; acceptance and the partial Gumbel maxima; the shared reduction). With N <= 1 there is no mass
to compute (h_1 = P_1 = min(r_1, 1): block is standard there) and the first of the three is skipped.
Again, grid and loop bounds come from shapes only: no host synchronisation, CUDA-graph capturable.

From logits
-----------
A sampled batch's verification in the CUDA graphs (engine/cuda_graphs.py ``_verify_step``, rows at a temperature
only) passes the target's fp32 logits with each row's (t, M, Z) (``target_stats``, from
softmax.temperature_softmax_stats) instead of probabilities: every read of p_i(x) — the gathered p_i(X_i), the
mass tiles, the final token's tiles — computes exp(div_rn(x, t) - M) / Z, softmax._probs_kernel's own ops on its
own values, so p and the tokens are those of the written probabilities, bit for bit (also on an H100, session 55).
It trades the write of [B, N+1, V] fp32 (softmax's second launch) for a small per-row launch and an exponential per
element read: softmax + verification at 128 rows (batch 32, 3 drafts) block 64.8 -> 59.8 µs, standard 55.5 -> 45.9,
but at 32 rows block 31.4 -> 33.5 (H100, session 55), so the engine uses it from 128 rows
(cuda_graphs.VERIFY_FROM_LOGITS_MIN_ROWS). FROM_LOGITS doubles the compiled variants.

Draft rows
----------
``draft_rows`` [B] (int64): request b's q is row ``draft_rows[b]`` of ``draft_probs`` (any number of rows) instead
of row b. The verification graphs (engine/cuda_graphs.py ``_verify_step``) read the drafts' q where the drafter
graph wrote it — the previous step's rows of its requests, which move when requests end or are admitted — instead
of copying it into the graph's rows first (session 56: an 18.9 MB copy per batch-32 step at 3 drafts, ~16 µs on an
H100). Q_ROWS is one more constexpr: the graphs' variants of the kernels.

Compiled variants
-----------------
Triton compiles a kernel once per set of constexprs and per specialisation of its integer arguments (== 1,
divisible by 16). Eager steps verify a number of drafts and of sampled requests that changes from step to step
(confidence scheduling, dspark.md §4), and each new combination used to compile when it first came up: on an
H100, 1.3-1.7 s inside a timed bench call (session 43). So the shapes that vary are kept out of the compiled
kernel: the draft dimension is padded to ``max_drafts`` (N_PAD, OUT_PAD: the caller's block size; the padding
slots are masked, and the acceptance uniforms are counter-based, so column i - 1 is U_i whatever the width), the
reduction's split dimension to the vocabulary's tile count (S_PAD), and B, N, the tiles per split and the split
count are not specialised on. What is left is HAS_MASS (N >= 2), FINAL (one split), FROM_LOGITS and Q_ROWS, at
most sixteen kernels per method, of which ``precompile`` builds those the engine uses before serving (for a
vocabulary size that is a multiple of 16; otherwise the row strides' divisibility by 16 changes with N too, and a
few more are compiled when first used).

Draft ids outside [0, V) in real draft slots (the reference would fail on them in its gather) are
read as p_i(X_i) = q_i(X_i) = 0, so r_i = 0: the standard kernel rejects them, and in block P_i = 0
(then R_j = 0 and h_j = 0 for j >= i: τ < i). Either way such a draft is never emitted.

Numerics
--------
Randomness is the reference's, key for key (dspark.sample.rng): acceptance uniforms
uniform(seeds, positions, accept_stream, N), Gumbel noise gumbel(seeds, positions + accepted,
recover_stream, V), through the Philox/Gumbel helpers of dspark.kernels.markov_sampler. Like the
Markov sampler, the logs are libdevice's on the GPU (what torch's CUDA kernels call) and correctly
rounded float64 logs in the interpreter (``PRECISE``), and fp fusion is off on the GPU, so products
and differences such as P_τ·p - q round exactly as torch's separate ops. The integer work (Philox,
the acceptance test of standard) is bit-exact; tokens can differ from the reference only where two
scores log(dist) + g of the sampled row tie to within a last-bit rounding of the log (the
interpreter's log vs torch's CPU log; on a GPU both are libdevice's).

Block adds one more such case, in its acceptance: R_i is a float32 sum over the vocabulary in another
order than torch's (whose own order depends on the device and the CPU's vector width), so R_i can
differ from the reference's in the last bits (~1e-7 relative at V = 49,152) and h_i then by an ulp
(~6e-8 near 1; equal about half the time). U_i <= h_i flips only where U_i falls between the two
values of h_i: about 1e-8 per draft slot, after which τ and the tokens differ. Everything else in
block's acceptance (the ratios, the running P, h from R, the comparison) rounds as the reference's.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

import triton
import triton.language as tl

from dspark.kernels import check_device, next_pow2, pdl_opts, pdl_wait
from dspark.kernels.markov_sampler import _gumbel_from_words, _hi32, _lo32, _log, _philox, _precise
from dspark.kernels.paged_attention import sm_count
from dspark.sample.rng import STREAM_ACCEPT, STREAM_RECOVER

__all__ = ["verify_standard_triton", "verify_block_triton", "precompile"]

_NEG_INF = tl.constexpr(float("-inf"))
_TINY = tl.constexpr(1.1754943508222875e-38)  # torch.finfo(torch.float32).tiny, as rejection._TINY
_BELOW_ONE = tl.constexpr(0.99999994039535522)  # largest float32 below 1 (rng._BELOW_ONE_F32)
_TWO_POW_M32 = tl.constexpr(2.3283064365386963e-10)


@triton.jit
def _words_rows(seed, pos, stream, start, BLOCK_B: tl.constexpr, BLOCK: tl.constexpr):
    """[BLOCK_B, BLOCK] uint32: row r holds words start .. start + BLOCK - 1 of
    rng._random_words(seed[r], pos[r], stream) (seed, pos: [BLOCK_B] int64; start a multiple of 4).
    markov_sampler._random_words for a block of rows, built on the same ``_philox``."""
    z = tl.zeros([BLOCK_B, BLOCK // 4], tl.uint32)
    blk = (start // 4 + tl.arange(0, BLOCK // 4)).to(tl.uint32)[None, :] + z
    c1 = _lo32(pos)[:, None] + z
    c2 = (stream + tl.zeros([BLOCK_B, BLOCK // 4], tl.int32)).to(tl.uint32)
    c3 = _hi32(pos)[:, None] + z
    k0 = _lo32(seed)[:, None] + z
    k1 = _hi32(seed)[:, None] + z
    w0, w1, w2, w3 = _philox(blk, c1, c2, c3, k0, k1)
    # join(join(w0, w2), join(w1, w3))[r, n, i, j] = w_{2i + j}: row-major flattening is column order.
    return tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [BLOCK_B, BLOCK])


@triton.jit
def _emit_rows(out_ptr, nout_ptr, dt_ptr, sdt_b, rows, rm, a, final, N, OUT_PAD: tl.constexpr):
    """tokens[b] = X_1..X_a, final, -1 ...; num_emitted[b] = a + 1 (rows: [BLOCK_B] int64)."""
    j = tl.arange(0, OUT_PAD)[None, :]
    aa = a[:, None]
    xs = tl.load(dt_ptr + rows[:, None] * sdt_b + j, mask=rm[:, None] & (j < aa), other=-1).to(tl.int64)
    val = tl.where(j == aa, final[:, None].to(tl.int64), tl.where(j < aa, xs, -1))
    tl.store(out_ptr + rows[:, None] * (N + 1) + j, val, mask=rm[:, None] & (j <= N))
    tl.store(nout_ptr + rows, (a + 1).to(tl.int64), mask=rm)


@triton.jit
def _acceptance_uniforms(seed, pos, accept_stream, BLOCK_B: tl.constexpr, N_PAD: tl.constexpr):
    """[BLOCK_B, N_PAD] f32: column i - 1 holds U_i = uniform(seed, pos, accept_stream, N)[i - 1]."""
    w = _words_rows(seed, pos, accept_stream, 0, BLOCK_B, N_PAD)
    return tl.minimum((w.to(tl.float32) + 0.5) * _TWO_POW_M32, _BELOW_ONE)  # rng._open_unit


@triton.jit
def _tp_load(tp_ptr, off, mask, ts_ptr, trow, tmask, FROM_LOGITS: tl.constexpr):
    """The target probabilities at ``tp_ptr + off`` (0 where not ``mask``). FROM_LOGITS: ``tp_ptr`` holds the
    logits and ``ts_ptr`` each logits row's (t, M, Z) (softmax.temperature_softmax_stats; ``trow``: the rows'
    indices, ``tmask`` their mask, shaped to broadcast against ``off``): p = exp(div_rn(x, t) - M) / Z, the
    ops of softmax._probs_kernel on its values, so the very probabilities it would have written."""
    if FROM_LOGITS:
        x = tl.load(tp_ptr + off, mask=mask, other=0.0)
        zero = tl.zeros_like(x)
        t = tl.load(ts_ptr + 3 * trow, mask=tmask, other=1.0) + zero
        m = tl.load(ts_ptr + 3 * trow + 1, mask=tmask, other=0.0)
        z = tl.load(ts_ptr + 3 * trow + 2, mask=tmask, other=1.0)
        return tl.where(mask, tl.exp(tl.math.div_rn(x, t) - m) / z, 0.0)
    else:
        return tl.load(tp_ptr + off, mask=mask, other=0.0)


@triton.jit
def _q_base(qi_ptr, rows, rm, sdp_b, Q_ROWS: tl.constexpr):
    """[BLOCK_B] int64 offset of each request's q in the draft probabilities: row ``qi_ptr[b]`` (Q_ROWS, the
    module docstring's "Draft rows") or row b."""
    if Q_ROWS:
        return tl.load(qi_ptr + rows, mask=rm, other=0).to(tl.int64) * sdp_b
    else:
        return rows * sdp_b


@triton.jit
def _final_token(
    tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, qb, sdp_r,
    out_ptr, nout_ptr, pf_ptr, pi_ptr, acc_ptr,
    rows, rm, nb, seed, pos, a, scale, s, N, V, NT, TPS, S, recover_stream,
    SCALED: tl.constexpr, FINAL: tl.constexpr, PRECISE: tl.constexpr, FROM_LOGITS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, OUT_PAD: tl.constexpr,
):
    """Steps (2) and (3) of the module docstring once the accepted count a ([BLOCK_B] int32) is known:
    Gumbel-max over this program's vocabulary tiles [s TPS, min((s + 1) TPS, NT)) of log(residual) + g
    and of log(p_{a+1}) + g, residual = max(scale·p_{a+1} - q_{a+1}, 0) (SCALED, block: scale = P_a)
    or max(p_{a+1} - q_{a+1}, 0) (standard); then the output rows (FINAL: the program saw the whole
    vocabulary) or this split's partial maxima for _verify_reduce_kernel."""
    is_bonus = a == nb
    use_res = rm & (a < nb)
    prow = rows * stp_b + a.to(tl.int64) * stp_r
    trow = (rows * sts_b + a.to(tl.int64))[:, None]  # FROM_LOGITS: the logits row's (t, M, Z)
    qrow = qb + tl.where(use_res, a, 0).to(tl.int64) * sdp_r  # qb: _q_base
    rpos = pos + a.to(tl.int64)  # the emitted token's position keys its noise
    best_p = tl.full([BLOCK_B], float("-inf"), tl.float32)
    best_r = tl.full([BLOCK_B], float("-inf"), tl.float32)
    idx_p = tl.zeros([BLOCK_B], tl.int32)
    idx_r = tl.zeros([BLOCK_B], tl.int32)
    mass = tl.zeros([BLOCK_B], tl.int32)  # some residual term > 0
    nan = tl.zeros([BLOCK_B], tl.int32)  # some residual term is NaN (then residual.sum() > 0 is False)
    t_lo = s * TPS
    t_hi = tl.minimum(t_lo + TPS, NT)
    for t in range(t_lo, t_hi):
        start = t * BLOCK_V
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        cm = rm[:, None] & (cols < V)
        p = _tp_load(tp_ptr, prow[:, None] + cols, cm, ts_ptr, trow, rm[:, None], FROM_LOGITS)
        q = tl.load(dp_ptr + qrow[:, None] + cols, mask=cm & use_res[:, None], other=0.0)
        g = _gumbel_from_words(_words_rows(seed, rpos, recover_stream, start, BLOCK_B, BLOCK_V), PRECISE)
        if SCALED:
            d = scale[:, None] * p - q  # two roundings, as torch's two ops (no fp fusion)
        else:
            d = p - q
        r = tl.where(d < 0.0, 0.0, d)  # clamp(min=0), NaN kept as torch does
        mass = tl.maximum(mass, tl.max((cm & (r > 0.0)).to(tl.int32), 1))
        nan = tl.maximum(nan, tl.max((cm & (r != r)).to(tl.int32), 1))
        sp = tl.where(cm, _log(p, PRECISE) + g, _NEG_INF)
        sr = tl.where(cm, _log(r, PRECISE) + g, _NEG_INF)
        mp = tl.max(sp, 1)
        mr = tl.max(sr, 1)
        up = mp > best_p  # strict: an earlier tile keeps a tie (lowest token id wins)
        ur = mr > best_r
        idx_p = tl.where(up, start + tl.argmax(sp, 1), idx_p)
        idx_r = tl.where(ur, start + tl.argmax(sr, 1), idx_r)
        best_p = tl.where(up, mp, best_p)
        best_r = tl.where(ur, mr, best_r)

    if FINAL:  # (3) this program saw the whole vocabulary
        use_p = is_bonus | (mass == 0) | (nan != 0)
        _emit_rows(out_ptr, nout_ptr, dt_ptr, sdt_b, rows, rm, a, tl.where(use_p, idx_p, idx_r), N, OUT_PAD)
    else:
        k = rows * S + s
        tl.store(pf_ptr + 2 * k, best_p, mask=rm)
        tl.store(pf_ptr + 2 * k + 1, best_r, mask=rm)
        tl.store(pi_ptr + 4 * k, idx_p, mask=rm)
        tl.store(pi_ptr + 4 * k + 1, idx_r, mask=rm)
        tl.store(pi_ptr + 4 * k + 2, mass, mask=rm)
        tl.store(pi_ptr + 4 * k + 3, nan, mask=rm)
        tl.store(acc_ptr + rows, a, mask=rm & (s == 0))


@triton.jit(do_not_specialize=["sdt_b", "B", "N", "TPS", "S"])  # "Compiled variants" in the module docstring
def _verify_standard_kernel(
    tp_ptr, stp_b, stp_r,  # target probs [B, N+1, V] f32, unit stride over V (FROM_LOGITS: the logits)
    ts_ptr, sts_b,  # FROM_LOGITS: each logits row's (t, M, Z) [B, sts_b, 3] f32 (_tp_load)
    dt_ptr, sdt_b,  # draft tokens [B, N] int64
    dp_ptr, sdp_b, sdp_r,  # draft probs [B, N, V] f32, unit stride over V (Q_ROWS: [any, N, V])
    qi_ptr,  # Q_ROWS: each request's row of the draft probs [B] int64 (_q_base)
    nd_ptr, seed_ptr, pos_ptr,  # [B] int64
    out_ptr, nout_ptr,  # FINAL: tokens [B, N+1] int64 (contiguous), num_emitted [B] int64
    pf_ptr, pi_ptr, acc_ptr,  # not FINAL: partials [B, S, 2] f32, [B, S, 4] int32, a [B] int32
    B, N, V, NT, TPS, S,
    accept_stream, recover_stream,
    FINAL: tl.constexpr, PRECISE: tl.constexpr, FROM_LOGITS: tl.constexpr, Q_ROWS: tl.constexpr,
    BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, N_PAD: tl.constexpr, OUT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    s = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rm = rows < B
    qb = _q_base(qi_ptr, rows, rm, sdp_b, Q_ROWS)
    nb = tl.load(nd_ptr + rows, mask=rm, other=0)
    nb = tl.minimum(tl.maximum(nb, 0), N).to(tl.int32)
    seed = tl.load(seed_ptr + rows, mask=rm, other=0)
    pos = tl.load(pos_ptr + rows, mask=rm, other=0)

    # (1) Acceptance: a = length of the prefix of drafts with U_i <= p_i(X_i) / q_i(X_i).
    j = tl.arange(0, N_PAD)[None, :] + tl.zeros([BLOCK_B, N_PAD], tl.int32)
    valid = rm[:, None] & (j < nb[:, None])
    x = tl.load(dt_ptr + rows[:, None] * sdt_b + j, mask=valid, other=0).to(tl.int64)
    inv = valid & (x >= 0) & (x < V)  # a valid draft is a token id; out-of-range ones are rejected
    px = _tp_load(tp_ptr, rows[:, None] * stp_b + j * stp_r + x, inv, ts_ptr, rows[:, None] * sts_b + j, inv,
                  FROM_LOGITS)
    qx = tl.load(dp_ptr + qb[:, None] + j * sdp_r + x, mask=inv, other=0.0)
    ratio = tl.math.div_rn(px, tl.maximum(qx, _TINY, propagate_nan=tl.PropagateNan.ALL))
    u = _acceptance_uniforms(seed, pos, accept_stream, BLOCK_B, N_PAD)
    accept = valid & (u <= ratio)
    a = tl.min(tl.where(accept, N_PAD, j), 1)  # first rejection (or N_b: no valid draft past it)
    a = tl.minimum(a, nb)

    # (2), (3): the final token of norm(max(p_{a+1} - q_{a+1}, 0)) or p_{a+1}, and the output
    # (``scale`` is read only with SCALED: any tensor will do here).
    _final_token(tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, qb, sdp_r, out_ptr, nout_ptr, pf_ptr,
                 pi_ptr, acc_ptr, rows, rm, nb, seed, pos, a, ratio, s, N, V, NT, TPS, S, recover_stream,
                 SCALED=False, FINAL=FINAL, PRECISE=PRECISE, FROM_LOGITS=FROM_LOGITS, BLOCK_B=BLOCK_B,
                 BLOCK_V=BLOCK_V, OUT_PAD=OUT_PAD)


@triton.jit
def _block_running_p(
    tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, qb, sdp_r, rows, rm, nb, N, V,
    FROM_LOGITS: tl.constexpr, BLOCK_B: tl.constexpr, N_PAD: tl.constexpr,
):
    """[BLOCK_B, N_PAD] f32, column i - 1 = P_i for i = 1..N (0 past N; P_0 = 1 is implicit):
    P_i = min(P_{i-1} r_i, 1), r_i as the standard acceptance computes it and 1 in padding slots
    (where P stays), one slot after the other: the reference's running product, rounded alike."""
    j = tl.arange(0, N_PAD)[None, :]
    run = tl.full([BLOCK_B], 1.0, tl.float32)
    big_p = tl.zeros([BLOCK_B, N_PAD], tl.float32)
    for i in range(N):
        valid = rm & (i < nb)
        x = tl.load(dt_ptr + rows * sdt_b + i, mask=valid, other=0).to(tl.int64)
        inv = valid & (x >= 0) & (x < V)  # out-of-range ids read as p = q = 0: r_i = 0, P_i = 0
        px = _tp_load(tp_ptr, rows * stp_b + i * stp_r + x, inv, ts_ptr, rows * sts_b + i, inv, FROM_LOGITS)
        qx = tl.load(dp_ptr + qb + i * sdp_r + x, mask=inv, other=0.0)
        ratio = tl.math.div_rn(px, tl.maximum(qx, _TINY, propagate_nan=tl.PropagateNan.ALL))
        run = tl.where(valid, tl.minimum(run * ratio, 1.0, propagate_nan=tl.PropagateNan.ALL), run)
        big_p = tl.where(j == i, run[:, None], big_p)
    return big_p


@triton.jit
def _block_mass_tile(
    tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dp_ptr, qb, sdp_r, rows, rm, nb, big_p, t, N, V,
    FROM_LOGITS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, N_PAD: tl.constexpr,
):
    """[BLOCK_B, N_PAD] f32, column i - 1 = vocabulary tile t's share of
    R_i = Σ_x max(P_i·p_{i+1}(x) - q_{i+1}(x), 0) for 1 <= i < N_b, and 0 elsewhere (those rows are
    not read: R_i is used only below N_b, and q_{i+1} past N_b is padding). One ``tl.sum`` per slot
    over the tile; the caller adds the tile sums in tile order."""
    j = tl.arange(0, N_PAD)[None, :]
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)[None, :]
    part = tl.zeros([BLOCK_B, N_PAD], tl.float32)
    for i in range(1, N):  # R_i reads target row i (p_{i+1}) and draft row i (q_{i+1})
        cm = (rm & (i < nb))[:, None] & (cols < V)
        big_pi = tl.sum(tl.where(j == i - 1, big_p, 0.0), 1)  # P_i (a sum of one term: exact)
        p = _tp_load(tp_ptr, (rows * stp_b + i * stp_r)[:, None] + cols, cm, ts_ptr, (rows * sts_b + i)[:, None],
                     rm[:, None], FROM_LOGITS)
        q = tl.load(dp_ptr + (qb + i * sdp_r)[:, None] + cols, mask=cm, other=0.0)
        d = big_pi[:, None] * p - q  # two roundings, as the reference's two ops (no fp fusion)
        r = tl.where(d < 0.0, 0.0, d)  # clamp(min=0), NaN kept
        part = tl.where(j == i - 1, tl.sum(tl.where(cm, r, 0.0), 1)[:, None], part)
    return part


@triton.jit(do_not_specialize=["sdt_b", "B", "N", "TPS"])
def _block_mass_kernel(
    tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, sdp_b, sdp_r, qi_ptr, nd_ptr,
    part_ptr,  # tile sums [B, NT, N_PAD] f32
    B, N, V, NT, TPS,
    FROM_LOGITS: tl.constexpr, Q_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr,
    N_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Block verification with the vocabulary split, launch 1 of 3: the tile sums of R_1..R_{N-1} for
    this program's requests and tiles [s TPS, min((s + 1) TPS, NT))."""
    pdl_wait(PDL)
    s = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rm = rows < B
    qb = _q_base(qi_ptr, rows, rm, sdp_b, Q_ROWS)
    nb = tl.minimum(tl.maximum(tl.load(nd_ptr + rows, mask=rm, other=0), 0), N).to(tl.int32)
    big_p = _block_running_p(tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, qb, sdp_r, rows, rm, nb,
                             N, V, FROM_LOGITS, BLOCK_B, N_PAD)
    j = tl.arange(0, N_PAD)[None, :]
    t_lo = s * TPS
    t_hi = tl.minimum(t_lo + TPS, NT)
    for t in range(t_lo, t_hi):
        part = _block_mass_tile(tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dp_ptr, qb, sdp_r, rows, rm, nb, big_p, t,
                                N, V, FROM_LOGITS, BLOCK_B, BLOCK_V, N_PAD)
        tl.store(part_ptr + (rows[:, None] * NT + t) * N_PAD + j, part, mask=rm[:, None])


@triton.jit(do_not_specialize=["sdt_b", "B", "N", "TPS", "S"])
def _verify_block_kernel(
    tp_ptr, stp_b, stp_r,  # target probs [B, N+1, V] f32, unit stride over V (FROM_LOGITS: the logits)
    ts_ptr, sts_b,  # FROM_LOGITS: each logits row's (t, M, Z) [B, sts_b, 3] f32 (_tp_load)
    dt_ptr, sdt_b,  # draft tokens [B, N] int64
    dp_ptr, sdp_b, sdp_r,  # draft probs [B, N, V] f32, unit stride over V (Q_ROWS: [any, N, V])
    qi_ptr,  # Q_ROWS: each request's row of the draft probs [B] int64 (_q_base)
    nd_ptr, seed_ptr, pos_ptr,  # [B] int64
    out_ptr, nout_ptr,  # FINAL: tokens [B, N+1] int64 (contiguous), num_emitted [B] int64
    part_ptr,  # not FINAL (and HAS_MASS): _block_mass_kernel's tile sums [B, NT, N_PAD] f32
    pf_ptr, pi_ptr, acc_ptr,  # not FINAL: partials [B, S, 2] f32, [B, S, 4] int32, τ [B] int32
    B, N, V, NT, TPS, S,
    accept_stream, recover_stream,
    FINAL: tl.constexpr, HAS_MASS: tl.constexpr, PRECISE: tl.constexpr, FROM_LOGITS: tl.constexpr,
    Q_ROWS: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, N_PAD: tl.constexpr, OUT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    s = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rm = rows < B
    qb = _q_base(qi_ptr, rows, rm, sdp_b, Q_ROWS)
    nb = tl.minimum(tl.maximum(tl.load(nd_ptr + rows, mask=rm, other=0), 0), N).to(tl.int32)
    seed = tl.load(seed_ptr + rows, mask=rm, other=0)
    pos = tl.load(pos_ptr + rows, mask=rm, other=0)

    # (1) P_1..P_N and R_1..R_{N-1}: the tile sums added in tile order, whoever computed them.
    big_p = _block_running_p(tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, qb, sdp_r, rows, rm, nb,
                             N, V, FROM_LOGITS, BLOCK_B, N_PAD)
    j = tl.arange(0, N_PAD)[None, :]
    mass = tl.zeros([BLOCK_B, N_PAD], tl.float32)
    if HAS_MASS:
        if FINAL:
            for t in range(0, NT):
                mass += _block_mass_tile(tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dp_ptr, qb, sdp_r, rows, rm, nb,
                                         big_p, t, N, V, FROM_LOGITS, BLOCK_B, BLOCK_V, N_PAD)
        else:
            for t in range(0, NT):
                mass += tl.load(part_ptr + (rows[:, None] * NT + t) * N_PAD + j, mask=rm[:, None], other=0.0)

    # (2) h_i and τ = the last i <= N_b with U_i <= h_i (0 if none).
    slot = j + 1  # i, 1-based
    nbc = nb[:, None]
    den = mass + (1.0 - big_p)  # >= 0; 0 only where R_i = 0 and P_i = 1, where h_i = 1
    h_mid = tl.where(den > 0.0, tl.math.div_rn(mass, tl.maximum(den, _TINY)), 1.0)
    h = tl.where(slot < nbc, h_mid, tl.where(slot == nbc, big_p, 0.0))  # h_{N_b} = P_{N_b}; 0 past N_b
    u = _acceptance_uniforms(seed, pos, accept_stream, BLOCK_B, N_PAD)
    tau = tl.max(tl.where(rm[:, None] & (u <= h), slot, 0), 1)  # U > 0: h = 0 is never hit
    scale = tl.where(tau == 0, 1.0, tl.sum(tl.where(slot == tau[:, None], big_p, 0.0), 1))  # P_τ, exact

    # (3) the final token of norm(max(P_τ·p_{τ+1} - q_{τ+1}, 0)) or p_{τ+1}, and the output.
    _final_token(tp_ptr, stp_b, stp_r, ts_ptr, sts_b, dt_ptr, sdt_b, dp_ptr, qb, sdp_r, out_ptr, nout_ptr, pf_ptr,
                 pi_ptr, acc_ptr, rows, rm, nb, seed, pos, tau, scale, s, N, V, NT, TPS, S, recover_stream,
                 SCALED=True, FINAL=FINAL, PRECISE=PRECISE, FROM_LOGITS=FROM_LOGITS, BLOCK_B=BLOCK_B,
                 BLOCK_V=BLOCK_V, OUT_PAD=OUT_PAD)


@triton.jit
def _first_argmax(best, idx, sm, S_PAD: tl.constexpr):
    """[BLOCK_B] index of the split maxima's winner: the largest, the lowest split on a tie."""
    ss = tl.arange(0, S_PAD)[None, :]
    top = tl.max(best, 1)
    first = tl.min(tl.where(sm & (best == top[:, None]), ss, S_PAD), 1)
    return tl.sum(tl.where(ss == first[:, None], idx, 0), 1)


@triton.jit(do_not_specialize=["sdt_b", "B", "N", "S"])
def _verify_reduce_kernel(
    dt_ptr, sdt_b, nd_ptr, out_ptr, nout_ptr, pf_ptr, pi_ptr, acc_ptr, B, N, S,
    BLOCK_B: tl.constexpr, S_PAD: tl.constexpr, OUT_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """The split partial maxima -> the output rows; ``acc`` holds the accepted count (standard: a,
    block: τ), so both methods share it."""
    pdl_wait(PDL)
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    rm = rows < B
    nb = tl.minimum(tl.maximum(tl.load(nd_ptr + rows, mask=rm, other=0), 0), N).to(tl.int32)
    a = tl.load(acc_ptr + rows, mask=rm, other=0)
    k = rows[:, None] * S + tl.arange(0, S_PAD)[None, :]
    sm = rm[:, None] & (tl.arange(0, S_PAD)[None, :] < S)
    best_p = tl.load(pf_ptr + 2 * k, mask=sm, other=float("-inf"))
    best_r = tl.load(pf_ptr + 2 * k + 1, mask=sm, other=float("-inf"))
    idx_p = tl.load(pi_ptr + 4 * k, mask=sm, other=0)
    idx_r = tl.load(pi_ptr + 4 * k + 1, mask=sm, other=0)
    mass = tl.max(tl.load(pi_ptr + 4 * k + 2, mask=sm, other=0), 1)
    nan = tl.max(tl.load(pi_ptr + 4 * k + 3, mask=sm, other=0), 1)
    use_p = (a == nb) | (mass == 0) | (nan != 0)
    final = tl.where(use_p, _first_argmax(best_p, idx_p, sm, S_PAD), _first_argmax(best_r, idx_r, sm, S_PAD))
    _emit_rows(out_ptr, nout_ptr, dt_ptr, sdt_b, rows, rm, a, final, N, OUT_PAD)


# Block verification's default split: about this many programs per SM. H100, session 53
# (kernel_rejection_bench.py --sweep, CUDA-graph µs of the whole verification, block_v 1024): 2 per SM (as
# standard's) against 6: B = 32, 3 drafts 47.0 -> 38.3 (9 -> 24 splits; 48 splits 41.0); B = 16, 3 drafts 31.1
# -> 28.1; B = 8, 7 drafts 44.1 -> 34.7; B = 1 the same (20.1). The split count changes no token.
BLOCK_PROGRAMS_PER_SM = int(os.environ.get("DSPARK_BLOCK_VERIFY_PROGRAMS_PER_SM", "6"))


def _launch(batch: int, n: int, vocab: int, cuda: bool, sms: int, block_v: int | None, block_b: int | None,
            splits: int | None, max_drafts: int | None, programs_per_sm: int = 2) -> dict:
    """The launch of one verification: tile sizes, grid, split count and the constexprs, from the shapes, the
    device and the tuning knobs only (see the verify functions; "Compiled variants" in the module docstring)."""
    if block_v is None:
        block_v = 1024 if cuda else 128
    block_v = max(16, next_pow2(min(block_v, max(vocab, 1))))
    if block_b is None:
        block_b = 1 if cuda else min(64, next_pow2(batch))
    block_b = next_pow2(block_b)
    nt = triton.cdiv(vocab, block_v)
    n_prog = triton.cdiv(batch, block_b)
    if splits is None:
        splits = triton.cdiv(programs_per_sm * sms, n_prog) if cuda else 1
    tps = triton.cdiv(nt, max(1, min(splits, nt)))  # tiles per split
    n_split = max(1, triton.cdiv(nt, tps))  # no empty split
    width = max(n, max_drafts or 0)
    return {"block_v": block_v, "block_b": block_b, "nt": nt, "n_prog": n_prog, "tps": tps, "n_split": n_split,
            "final": n_split == 1, "has_mass": n >= 2, "n_pad": max(4, next_pow2(width)),
            "out_pad": next_pow2(width + 1), "s_pad": next_pow2(nt)}


def _verify_triton(
    method: str,
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
    accept_stream: int,
    recover_stream: int,
    block_v: int | None,
    block_b: int | None,
    splits: int | None,
    num_warps: int,
    max_drafts: int | None = None,
    target_stats: Tensor | None = None,
    draft_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """verify_standard_triton / verify_block_triton: the checks, conversions, layout and launches."""
    check_device(target_probs)
    batch, n = draft_tokens.shape
    vocab = target_probs.shape[-1]
    assert target_probs.shape == (batch, n + 1, vocab), (target_probs.shape, draft_tokens.shape)
    if target_stats is not None and (target_stats.shape != (batch, n + 1, 3) or target_stats.dtype != torch.float32
                                     or target_stats.stride(2) != 1 or target_stats.stride(1) != 3):
        raise ValueError(f"target_stats must be float32 [{batch}, {n + 1}, 3] with rows of 3 contiguous values "
                         f"(softmax.temperature_softmax_stats), got {tuple(target_stats.shape)} "
                         f"{target_stats.dtype} strides {target_stats.stride()}")
    if draft_rows is None:
        assert draft_probs.shape == (batch, n, vocab), (draft_probs.shape, draft_tokens.shape)
    elif (draft_probs.dim() != 3 or draft_probs.shape[1:] != (n, vocab) or draft_rows.shape != (batch,)
          or draft_rows.dtype != torch.int64 or draft_rows.device != target_probs.device):
        raise ValueError(f"draft_rows must be int64 [{batch}] on {target_probs.device} rows of draft_probs [rows, {n}, "
                         f"{vocab}], got {tuple(draft_rows.shape)} {draft_rows.dtype} on {draft_rows.device} and "
                         f"{tuple(draft_probs.shape)}")
    dev = target_probs.device
    tokens = torch.empty(batch, n + 1, dtype=torch.int64, device=dev)
    num_emitted = torch.empty(batch, dtype=torch.int64, device=dev)
    if batch == 0:
        return tokens, num_emitted

    def _f32(t: Tensor) -> Tensor:
        t = t.to(torch.float32)
        return t if t.stride(-1) == 1 else t.contiguous()

    target_probs = _f32(target_probs)
    draft_probs = _f32(draft_probs)
    draft_tokens = draft_tokens.to(torch.int64)
    if n == 0:  # nothing to read there; any valid pointer
        draft_tokens, draft_probs, sdt_b, sdp_b, sdp_r = num_emitted, target_probs, 0, 0, 0
    else:
        if draft_tokens.stride(1) != 1:
            draft_tokens = draft_tokens.contiguous()
        sdt_b, sdp_b, sdp_r = draft_tokens.stride(0), draft_probs.stride(0), draft_probs.stride(1)
    num_drafts = num_drafts.to(device=dev, dtype=torch.int64).contiguous()
    seeds = seeds.to(device=dev, dtype=torch.int64).contiguous()
    positions = positions.to(device=dev, dtype=torch.int64).contiguous()

    cuda = dev.type == "cuda"
    L = _launch(batch, n, vocab, cuda, sm_count(dev) if cuda else 1, block_v, block_b, splits, max_drafts,
                BLOCK_PROGRAMS_PER_SM if method == "block" else 2)
    block_v, block_b, nt, n_prog, tps, n_split, final = (L[k] for k in ("block_v", "block_b", "nt", "n_prog", "tps",
                                                                         "n_split", "final"))
    n_pad, out_pad = L["n_pad"], L["out_pad"]
    opts = {"enable_fp_fusion": False} if cuda else {}  # round like torch's separate ops
    pdl = pdl_opts(seeds)
    opts.update(pdl)
    if final:
        pf = pi = acc = num_emitted  # never written
    else:
        pf = torch.empty(batch, n_split, 2, dtype=torch.float32, device=dev)
        pi = torch.empty(batch, n_split, 4, dtype=torch.int32, device=dev)
        acc = torch.empty(batch, dtype=torch.int32, device=dev)
    from_logits = target_stats is not None
    stats, sts_b = (target_stats, target_stats.stride(0) // 3) if from_logits else (target_probs, 0)
    q_rows = draft_rows is not None and n > 0
    probs = (target_probs, target_probs.stride(0), target_probs.stride(1), stats, sts_b, draft_tokens, sdt_b,
             draft_probs, sdp_b, sdp_r, draft_rows.contiguous() if q_rows else num_emitted)
    streams = (accept_stream & 0xFFFFFFFF, recover_stream & 0xFFFFFFFF)
    if method == "standard":
        _verify_standard_kernel[(n_prog, n_split)](
            *probs, num_drafts, seeds, positions, tokens, num_emitted, pf, pi, acc,
            batch, n, vocab, nt, tps, n_split, *streams,
            FINAL=final, PRECISE=_precise(target_probs), FROM_LOGITS=from_logits, Q_ROWS=q_rows,
            BLOCK_B=block_b, BLOCK_V=block_v, N_PAD=n_pad, OUT_PAD=out_pad,
            num_warps=num_warps, **opts,
        )
    else:
        has_mass = L["has_mass"]  # R_i exists for 1 <= i < N
        part = num_emitted  # never read unless written below
        if has_mass and not final:
            part = torch.empty(batch, nt, n_pad, dtype=torch.float32, device=dev)
            _block_mass_kernel[(n_prog, n_split)](
                *probs, num_drafts, part, batch, n, vocab, nt, tps, FROM_LOGITS=from_logits, Q_ROWS=q_rows,
                BLOCK_B=block_b, BLOCK_V=block_v, N_PAD=n_pad, num_warps=num_warps, **opts,
            )
        _verify_block_kernel[(n_prog, n_split)](
            *probs, num_drafts, seeds, positions, tokens, num_emitted, part, pf, pi, acc,
            batch, n, vocab, nt, tps, n_split, *streams,
            FINAL=final, HAS_MASS=has_mass, PRECISE=_precise(target_probs), FROM_LOGITS=from_logits,
            Q_ROWS=q_rows, BLOCK_B=block_b, BLOCK_V=block_v, N_PAD=n_pad, OUT_PAD=out_pad,
            num_warps=num_warps, **opts,
        )
    if not final:
        _verify_reduce_kernel[(n_prog,)](
            draft_tokens, sdt_b, num_drafts, tokens, num_emitted, pf, pi, acc, batch, n, n_split,
            BLOCK_B=block_b, S_PAD=L["s_pad"], OUT_PAD=out_pad, num_warps=num_warps, **pdl,
        )
    return tokens, num_emitted


def verify_standard_triton(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
    accept_stream: int = STREAM_ACCEPT,
    recover_stream: int = STREAM_RECOVER,
    *,
    block_v: int | None = None,
    block_b: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    max_drafts: int | None = None,
    target_stats: Tensor | None = None,
    draft_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``verify_probabilistic(target_probs, draft_tokens, draft_probs, num_drafts, seeds, positions,
    "standard", accept_stream, recover_stream)``, fused (see the module docstring).

    target_probs [B, N+1, V] f32; draft_tokens [B, N] int64; draft_probs [B, N, V] f32; num_drafts,
    seeds, positions [B] int64 (num_drafts[b] in [0, N]; values outside are clamped). All on one
    device. The probability tensors need unit stride over V (else they are copied); other dtypes are
    converted (a copy: pass the documented dtypes inside a CUDA graph).
    Returns (tokens [B, N+1] int64 padded with -1, num_emitted [B] int64).

    Tuning (defaults by device): ``block_v`` vocabulary tile (1024 on CUDA, 128 in the interpreter);
    ``block_b`` requests per program (1 on CUDA; up to 64 in the interpreter, where wide tiles are
    cheap and programs are not); ``splits`` programs per request over the vocabulary (CUDA: enough
    for ~2 programs per SM; interpreter: 1). One split is one launch, more are two. ``max_drafts``: the
    most drafts the caller ever verifies (its block size); every N up to it then runs the same compiled
    kernel (the module docstring's "Compiled variants"). It changes no token.

    ``target_stats`` [B, N+1, 3] f32 (softmax.temperature_softmax_stats of the rows, viewed per request): then
    ``target_probs`` holds the target's fp32 logits and each probability is made where it is read, with the ops
    that would have written it (the module docstring's "From logits"): the same tokens as from
    ``temperature_softmax_argmax``'s probabilities, without writing or reading those.

    ``draft_rows`` [B] int64: request b's q is ``draft_probs[draft_rows[b]]`` ([rows, N, V], any number of rows),
    as if ``draft_probs.index_select(0, draft_rows)`` were passed (the module docstring's "Draft rows").
    """
    return _verify_triton("standard", target_probs, draft_tokens, draft_probs, num_drafts, seeds, positions,
                          accept_stream, recover_stream, block_v, block_b, splits, num_warps, max_drafts,
                          target_stats, draft_rows)


def verify_block_triton(
    target_probs: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor,
    num_drafts: Tensor,
    seeds: Tensor,
    positions: Tensor,
    accept_stream: int = STREAM_ACCEPT,
    recover_stream: int = STREAM_RECOVER,
    *,
    block_v: int | None = None,
    block_b: int | None = None,
    splits: int | None = None,
    num_warps: int = 4,
    max_drafts: int | None = None,
    target_stats: Tensor | None = None,
    draft_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``verify_probabilistic(target_probs, draft_tokens, draft_probs, num_drafts, seeds, positions,
    "block", accept_stream, recover_stream)``, fused (see the module docstring): the same arguments,
    defaults and tuning knobs as ``verify_standard_triton``. One split is one launch, more are three
    (two with N <= 1). The vocabulary tile ``block_v`` also fixes the summation order of the residual
    masses R_i (hence, to the last bit, τ): the split count does not, so with the default layout
    (``block_b`` 1 on CUDA) a request's tokens do not depend on the rest of its batch.
    """
    return _verify_triton("block", target_probs, draft_tokens, draft_probs, num_drafts, seeds, positions,
                          accept_stream, recover_stream, block_v, block_b, splits, num_warps, max_drafts,
                          target_stats, draft_rows)


def precompile(method: str, vocab: int, max_drafts: int, device: torch.device | str, from_logits: bool = False,
               draft_rows: bool = False) -> int:
    """Build, before serving, every kernel ``method``'s verification can need for up to ``max_drafts`` drafts at
    any batch size: N = 1 and N = max_drafts (without and with HAS_MASS), each with the vocabulary split and
    in one split (FINAL), on one-request dummy inputs (the batch size is not specialised on). Returns the
    number of verifications run. The engine calls it at warm-up (LLMEngine.warm_up, ModelRunner), where
    eager steps would otherwise compile these while serving (the module docstring's "Compiled variants").
    ``from_logits``: the variants reading logits and ``target_stats`` instead; ``draft_rows``: the variants
    reading each request's q at a row of its own (the verification graphs')."""
    fn = {"standard": verify_standard_triton, "block": verify_block_triton}[method]
    dev = torch.device(device)
    runs = 0
    for n in sorted({1, max_drafts}):
        probs = torch.full((1, n + 1, vocab), 1.0 / vocab, device=dev)
        q = torch.full((1, n, vocab), 1.0 / vocab, device=dev)
        one = torch.ones(1, dtype=torch.int64, device=dev)
        stats = torch.tensor([[[1.0, 0.0, float(vocab)]] * (n + 1)], device=dev) if from_logits else None
        tp = torch.zeros_like(probs) if from_logits else probs  # zero logits with those stats: the same uniform p
        rows = torch.zeros(1, dtype=torch.int64, device=dev) if draft_rows else None
        for splits in (None, 1):
            fn(tp, torch.zeros(1, n, dtype=torch.int64, device=dev), q, one * n, one, one, splits=splits,
               max_drafts=max_drafts, target_stats=stats, draft_rows=rows)
            runs += 1
    return runs
