"""Few-row (a decode or verification step's 2-256 rows, in programs of 16-64 rows) tensor-core products of a
decoder layer with the RMSNorms and SwiGLU moved into their epilogues, each with its PyTorch reference.

Why: a verification step at batch 1 (1 + 7 rows) runs each layer as cuBLAS GEMMs plus two add_rms_norm
launches and one silu_and_mul (9-10 launches per layer); the one-row decode step folds those into its
GEMVs (kernels/gemv.py), so verification costs 1.34x decode on the H200 (session 32; issue 5 asks 1.25x).
Sessions 13-33 tried seven few-row designs that put the norm *before* the product (a prologue, or its sum
of squares inside the K loop) and all lost: any work between a tile's load and its MMA stalls the
pipelined loads (docs/benchmarks.md, session 33). Here the K loop is a bare ``tl.dot`` and everything
else happens once the products are done:

    RMSNorm(s) @ W = (1 / rms(s)) * ((g * s) @ W)        g: the norm weight, rms over the hidden size

so the producer of ``s`` (the o_proj or down_proj product, whose epilogue adds the residual) also stores
``z = g * s`` for the next product and the per-tile sums of squares of ``s``; the consumer multiplies
its finished products by ``1 / rms`` from those sums. The sums are written per program (``[tiles, row_tile]``
fp32, each program its column tile's rows) and summed in a fixed order by the consumer: no atomics, so results
do not depend on scheduling.
A layer (the first layer's qkv takes the already normed embeddings):

    q = qkv_rope_cache(z_in, W_qkv, sumsq_in, ...)   (q/k norm, RoPE, K/V cache write)  -> attention
    s1, z1, p1 = linear_residual(o, W_o, h_in, g_post)
    act = gate_up_silu(z1, W_gate_up, p1)
    h_out, z2, p2 = linear_residual(act, W_down, s1, g_next_input)   (h_out: the layer's output, a tap)

5 launches per layer (6 with an attention key split) against the GEMM path's 9 (10); ``linear`` is the
qkv product without the RoPE epilogue (a head_dim under 32; the drafter's block pass). down_proj
(K = 1,536) runs split-K: see _fewrow_kernel.

Rounding: the residual add, the products' outputs and SwiGLU round as fused_ops does (the product
rounded to the dtype, the add in the dtype, silu in fp32 then rounded). The norm rounds differently from
``add_rms_norm``: ``round(g * s)`` enters the product and ``1 / rms`` scales its fp32 sums, where the
reference rounds ``s / rms`` and then ``g * that``. So results match the reference to the dtype's
precision, not bit for bit (as cuBLAS against the GEMVs already does); fp32 inputs match to ~1e-6.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

import triton
import triton.language as tl

from dspark.kernels import PDL_PREFETCH, check_device, next_pow2, pdl_wait
from dspark.kernels.fused_ops import (
    _cache_strides, _launch_opts, _rope, add_rms_norm_reference, cast_rtne, rope_qk_cache, silu_and_mul_reference,
    silu_mul_rounded,
)

BM = 16  # the smallest row tile (one MMA tile of rows; steps of up to 16 rows: row_tile)
# The rows one program multiplies (its BM; program_rows): a step's row tile (16, 32, 64) up to PROGRAM_ROWS, more
# rows in row blocks of PROGRAM_ROWS on the grid's third axis, so a step of 128 or 256 rows runs 64-row programs (the largest
# that beat cuBLAS, session 51) 2 or 4 times over. One program of 128 rows (8 warps: 4 spill;
# benchmarks/offline_compile.py --fewrow) made verification at batch 32 (128 rows) slower than cuBLAS: the target's
# step 1.49 against 1.39 ms (H200, session 52, DSPARK_FEWROW_MAX_ROWS=128 before row blocks). Row blocks of 64 (H100,
# session 52, session 35's launch settings): a layer's chain 26.9 against cuBLAS's 27.8 µs at 128 rows, 28.5 against
# 26.9 at 96, 36.5 against 28.7 at 256; the batch-32 verification step 1.405 against 1.403 ms. With the settings for
# 32-64-row programs (WIDE_TUNING; H100, session 53): 25.3 against 27.8 µs at 128 rows, 25.9 against 27.0 at 96, 34.3
# against 28.6 at 256 (so steps of up to 128 rows come here: ENGINE_MAX_ROWS).
PROGRAM_ROWS = int(os.environ.get("DSPARK_FEWROW_BLOCK_M", "64"))
# The steps the engine gives these kernels (LlamaForCausalLM.fewrow_max_rows, DSparkProposer's block pass): up to
# 128 rows, so a verification at batch 1-16 and plain decoding at batch 2-128 run 5 launches per layer instead of
# cuBLAS and the unfused layer's 9. Session 35 measured 16 rows (one tile); session 51 (H100) the tiles of 32 and
# 64 rows with the same launch settings: per layer (products, norms, SwiGLU, RoPE; fewrow_chain_bench.py) 23.2
# against cuBLAS's 25.8 µs at 32 rows and 23.5 against 26.3 at 64 (8 warps: slower), in the engine's step graphs
# (gpu_graphs_check.py steps, 1k context) plain decode at batch 32 1.274 -> 1.205 ms and verification at batch 8
# 1.130 -> 1.035 ms, every other step unchanged. End to end (H200, session 52, `dspark bench`, 3 runs): plain batch
# 32 +4 %, DSpark batch 8 +5-7 %, against DSPARK_FEWROW_MAX_ROWS=16 (the old limit). Up to 128 rows (two row blocks
# of 64; H100, session 53, against 64, `dspark bench` in one call): the target's GPU time per step of DSpark batch 32
# at T = 1 (4 rows a request: the sampled-batch rule) 1.348 -> 1.300 ms with 128 prompts a cell, 1.401 -> 1.361 with
# 512, and of DSpark batch 16 greedy (8 rows a request) 1.141 -> 1.101; steps of 256 rows stay on cuBLAS.
ENGINE_MAX_ROWS = int(os.environ.get("DSPARK_FEWROW_MAX_ROWS", "128"))
# Launch settings for programs of 32-64 rows from session 52's sweep at 64 rows (fewrow_config, qkv_rope_config):
# a layer's chain 23.40 -> 21.73 µs at 64 rows, 22.51 -> 21.65 at 32 (H100; cuBLAS 26.28 / 25.70); at 16 rows the
# same settings lose (20.52 against 18.86), so smaller programs keep session 35's. DSPARK_FEWROW_WIDE_TUNING=0:
# session 35's settings at every size (the A/B).
WIDE_TUNING = os.environ.get("DSPARK_FEWROW_WIDE_TUNING", "1") != "0"
TARGET_PROGRAMS = 128  # about the SM count (H200: 132): programs wanted for split-K


@triton.jit
def _fewrow_kernel(
    a_ptr, stride_a, w_ptr, stride_wk, stride_wn, y_ptr, stride_y,
    pin_ptr, n_pin, eps,  # SCALE: per-tile sums of squares [n_pin, RT] of the rows the input was made from
    r_ptr, stride_r, z_ptr, stride_z, g_ptr, pout_ptr,  # RESID: residual in, z = g * s out, sums out [tiles, RT]
    ws_ptr, cnt_ptr,  # SPLIT > 1: fp32 partial products [SPLIT, tiles, row blocks, (2,) BM, BLOCK_N]; arrival
    # counters [row blocks, tiles]
    pos_ptr, cos_ptr, sin_ptr, stride_cs, qn_ptr, kn_ptr, qk_eps,  # ROPE: positions, tables, q/k norm weights
    kc_ptr, vc_ptr, sc_slot, sc_head, slot_ptr, Q_SIZE, KV_SIZE,  # ROPE: the paged K/V caches and slots
    M, K, N, UP, K_PER, RT, n_max,  # n_max: the weight's last column (PF_K)
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, P_PAD: tl.constexpr, SPLIT: tl.constexpr,
    BM: tl.constexpr, SCALE: tl.constexpr, GATE_UP: tl.constexpr, RESID: tl.constexpr, HAS_G: tl.constexpr,
    PRECISE: tl.constexpr, IEEE: tl.constexpr, ROPE: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
    PDL: tl.constexpr, PF_K: tl.constexpr, PF_KSTEP: tl.constexpr, PF_N: tl.constexpr, PF_NSTEP: tl.constexpr,
):
    """y[rows, n] = a[rows] @ W[:, n] for this program's BM rows (row block program_id(2)) and BLOCK_N
    columns: a bare tensor-core K loop, then
    SCALE (times 1 / rms of the input's source rows), GATE_UP (silu(y) * (a @ W[:, UP + n])) or RESID
    (s = y + residual stored in y; z = g * s and the tile's sums of squares of s).

    SPLIT > 1 (split-K, for more programs than the N tiles alone give): program (pid, j) multiplies the
    K slice ``[j * K_PER, (j + 1) * K_PER)``, stores its fp32 tile in the workspace and counts its arrival;
    the last of a tile's SPLIT programs to arrive sums the SPLIT tiles in slice order (deterministic),
    runs the epilogue and resets the counter for the next launch.

    ROPE (the qkv product, BLOCK_N = D / 2): each program also multiplies its partner half-head (the
    other half of the same head: columns n + D/2 for a first half, n - D/2 for a second), so the epilogue
    has both halves that rotate-half RoPE pairs (and a q/k norm sums over): it rotates q and k, stores q
    in y and writes k and v into the paged caches at the rows' slots (fused_ops.rope_qk_cache's work).

    PF_K > 0 (with PDL): before pdl_wait, the program's weight slice (and its second tile's) is prefetched into
    the L2 (one address per 128-byte line: PF_K x PF_N lines PF_KSTEP / PF_NSTEP elements apart), so that its
    load from HBM overlaps the previous kernel; the K loop then reads it from the L2."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    rb = tl.program_id(2)
    dt = a_ptr.dtype.element_ty
    rows = rb * BM + tl.arange(0, BM)
    rm = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    kb = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    if ROPE:
        UP = BLOCK_N - 2 * BLOCK_N * (pid % 2)  # the partner half-head's columns
    k_lo = j * K_PER
    if PF_K > 0:
        _prefetch_l2(w_ptr, stride_wk, stride_wn, k_lo, K, pid * BLOCK_N, n_max, PF_K, PF_KSTEP, PF_N, PF_NSTEP)
        if GATE_UP or ROPE:
            _prefetch_l2(w_ptr, stride_wk, stride_wn, k_lo, K, pid * BLOCK_N + UP, n_max, PF_K, PF_KSTEP, PF_N,
                         PF_NSTEP)
    pdl_wait(PDL)
    for k0 in tl.range(k_lo, k_lo + K_PER, BLOCK_K, num_stages=NUM_STAGES):
        k = k0 + kb
        km = k < K
        a = tl.load(a_ptr + rows[:, None] * stride_a + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w_off = k[:, None] * stride_wk + n[None, :] * stride_wn
        wmask = km[:, None] & nm[None, :]
        w = tl.load(w_ptr + w_off, mask=wmask, other=0.0)
        if IEEE:  # fp32 inputs, or Triton's CPU interpreter (whose tl.dot mishandles bf16): exact fp32 products
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if GATE_UP or ROPE:
            wu = tl.load(w_ptr + w_off + UP * stride_wn, mask=wmask, other=0.0)
            if IEEE:
                acc_u = tl.dot(a.to(tl.float32), wu.to(tl.float32), acc_u, input_precision="ieee")
            else:
                acc_u = tl.dot(a, wu, acc_u)

    if SPLIT > 1:
        n_tiles = tl.num_programs(0)
        n_rb = tl.num_programs(2)
        t = tl.arange(0, BM)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tile = 2 * BM * BLOCK_N
        mine = pid * n_rb + rb  # this (column tile, row block)'s partial tiles and counter
        tl.store(ws_ptr + (j * n_tiles * n_rb + mine) * tile + t, acc)
        if GATE_UP or ROPE:
            tl.store(ws_ptr + (j * n_tiles * n_rb + mine) * tile + BM * BLOCK_N + t, acc_u)
        tl.debug_barrier()  # every thread's stores precede the (releasing) arrival
        arrived = tl.atomic_add(cnt_ptr + mine, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT - 1:  # the last arrival: the sum in slice order, then the epilogue
            acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
            for i in tl.static_range(SPLIT):
                acc += tl.load(ws_ptr + (i * n_tiles * n_rb + mine) * tile + t, cache_modifier=".cg")
                if GATE_UP or ROPE:
                    acc_u += tl.load(ws_ptr + (i * n_tiles * n_rb + mine) * tile + BM * BLOCK_N + t,
                                     cache_modifier=".cg")
            tl.store(cnt_ptr + mine, 0)
            if ROPE:
                _rope_epilogue(acc, acc_u, rows, rm, n, y_ptr, stride_y, pin_ptr, n_pin, eps, pos_ptr, cos_ptr,
                               sin_ptr, stride_cs, qn_ptr, kn_ptr, qk_eps, kc_ptr, vc_ptr, sc_slot, sc_head,
                               slot_ptr, Q_SIZE, KV_SIZE, pid, K, RT, BLOCK_N, P_PAD, D, SCALE, QK_NORM)
            else:
                _epilogue(acc, acc_u, rows, rm, n, nm, y_ptr, stride_y, pin_ptr, n_pin, eps, r_ptr, stride_r,
                          z_ptr, stride_z, g_ptr, pout_ptr, pid, K, RT, P_PAD, SCALE, GATE_UP, RESID, HAS_G,
                          PRECISE)
    elif ROPE:
        _rope_epilogue(acc, acc_u, rows, rm, n, y_ptr, stride_y, pin_ptr, n_pin, eps, pos_ptr, cos_ptr, sin_ptr,
                       stride_cs, qn_ptr, kn_ptr, qk_eps, kc_ptr, vc_ptr, sc_slot, sc_head, slot_ptr, Q_SIZE,
                       KV_SIZE, pid, K, RT, BLOCK_N, P_PAD, D, SCALE, QK_NORM)
    else:
        _epilogue(acc, acc_u, rows, rm, n, nm, y_ptr, stride_y, pin_ptr, n_pin, eps, r_ptr, stride_r, z_ptr,
                  stride_z, g_ptr, pout_ptr, pid, K, RT, P_PAD, SCALE, GATE_UP, RESID, HAS_G, PRECISE)


@triton.jit
def _prefetch_l2(w_ptr, stride_wk, stride_wn, k0, K, n0, n_max, PF_K: tl.constexpr, PF_KSTEP: tl.constexpr,
                 PF_N: tl.constexpr, PF_NSTEP: tl.constexpr):
    """prefetch.global.L2 of the weight's rows k0 + i * PF_KSTEP (i < PF_K) x columns n0 + c * PF_NSTEP (c < PF_N),
    clamped into the weight (a repeated line costs nothing more). A hint: no value is read."""
    k = tl.minimum(k0 + tl.arange(0, PF_K) * PF_KSTEP, K - 1)
    n = tl.minimum(n0 + tl.arange(0, PF_N) * PF_NSTEP, n_max)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                              [w_ptr + k[:, None] * stride_wk + n[None, :] * stride_wn], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _inv_rms(pin_ptr, n_pin, rows, rm, eps, K, RT, P_PAD: tl.constexpr):
    """1 / rms of the rows z was made from, their per-tile sums of squares ([n_pin, RT]) summed in a fixed
    order: [BM, 1] (rows past M read as 0: their sums may be unwritten)."""
    p = tl.arange(0, P_PAD)
    part = tl.load(pin_ptr + p[:, None] * RT + rows[None, :], mask=(p < n_pin)[:, None] & rm[None, :], other=0.0)
    return tl.math.rsqrt(tl.sum(part, 0) / K + eps)[:, None]


@triton.jit
def _rope_epilogue(acc, acc_p, rows, rm, n, y_ptr, stride_y, pin_ptr, n_pin, eps, pos_ptr, cos_ptr, sin_ptr,
                   stride_cs, qn_ptr, kn_ptr, qk_eps, kc_ptr, vc_ptr, sc_slot, sc_head, slot_ptr, Q_SIZE, KV_SIZE,
                   pid, K, RT, BLOCK_N: tl.constexpr, P_PAD: tl.constexpr, D: tl.constexpr,
                   SCALE: tl.constexpr, QK_NORM: tl.constexpr):
    """fused_ops.rope_qk_cache on this program's half-head of the rounded qkv product (x) and its
    partner half (xp), with the same roundings: q/k norm over the whole head, RoPE, q stored, k / v
    written to the caches (rows with a negative slot or past M skipped)."""
    dt = y_ptr.dtype.element_ty
    if SCALE:
        inv = _inv_rms(pin_ptr, n_pin, rows, rm, eps, K, RT, P_PAD)
        acc = acc * inv
        acc_p = acc_p * inv
    x = cast_rtne(acc, dt)  # the qkv product's output in the dtype
    xp = cast_rtne(acc_p, dt)
    n0 = pid * BLOCK_N
    d = n % D  # this half's dims within the head
    dr = (d + D // 2) % D  # the partner's
    rm2 = rm[:, None]
    if n0 < Q_SIZE + KV_SIZE:  # q or k: per-head norm, RoPE
        if QK_NORM:
            xf = x.to(tl.float32)
            pf = xp.to(tl.float32)
            hinv = tl.math.rsqrt((tl.sum(xf * xf, 1) + tl.sum(pf * pf, 1)) / D + qk_eps)[:, None]
            if n0 < Q_SIZE:
                w = tl.load(qn_ptr + d).to(tl.float32)[None, :]
                wr = tl.load(qn_ptr + dr).to(tl.float32)[None, :]
            else:
                w = tl.load(kn_ptr + d).to(tl.float32)[None, :]
                wr = tl.load(kn_ptr + dr).to(tl.float32)[None, :]
            x = cast_rtne(cast_rtne(xf * hinv, dt).to(tl.float32) * w, dt)
            xp = cast_rtne(cast_rtne(pf * hinv, dt).to(tl.float32) * wr, dt)
        pos = tl.load(pos_ptr + rows, mask=rm, other=0).to(tl.int64)
        c = cast_rtne(tl.load(cos_ptr + pos[:, None] * stride_cs + d[None, :]).to(tl.float32), dt).to(tl.float32)
        s = cast_rtne(tl.load(sin_ptr + pos[:, None] * stride_cs + d[None, :]).to(tl.float32), dt).to(tl.float32)
        x = _rope(x, xp, c, s)
    if n0 < Q_SIZE:
        tl.store(y_ptr + rows[:, None] * stride_y + n[None, :], x, mask=rm2)
    else:
        slot = tl.load(slot_ptr + rows, mask=rm, other=-1).to(tl.int64)
        ok = rm2 & (slot >= 0)[:, None]
        if n0 < Q_SIZE + KV_SIZE:
            off = slot[:, None] * sc_slot + ((n0 - Q_SIZE) // D) * sc_head + d[None, :]
            tl.store(kc_ptr + off, cast_rtne(x.to(tl.float32), kc_ptr.dtype.element_ty), mask=ok)
        else:
            off = slot[:, None] * sc_slot + ((n0 - Q_SIZE - KV_SIZE) // D) * sc_head + d[None, :]
            tl.store(vc_ptr + off, cast_rtne(x.to(tl.float32), vc_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _epilogue(acc, acc_u, rows, rm, n, nm, y_ptr, stride_y, pin_ptr, n_pin, eps, r_ptr, stride_r, z_ptr, stride_z,
              g_ptr, pout_ptr, pid, K, RT, P_PAD: tl.constexpr, SCALE: tl.constexpr,
              GATE_UP: tl.constexpr, RESID: tl.constexpr, HAS_G: tl.constexpr, PRECISE: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    if SCALE:  # 1 / rms of the rows z was made from
        inv = _inv_rms(pin_ptr, n_pin, rows, rm, eps, K, RT, P_PAD)
        acc = acc * inv
        acc_u = acc_u * inv
    out = cast_rtne(acc, dt)  # the product's output in the dtype
    if GATE_UP:  # fused_ops.silu_and_mul's roundings on the rounded gate and up
        out = silu_mul_rounded(out, cast_rtne(acc_u, dt), dt, PRECISE)
    om = rm[:, None] & nm[None, :]
    if RESID:  # s = product + residual (the eager add in the dtype), its sums of squares, z = g * s
        r = tl.load(r_ptr + rows[:, None] * stride_r + n[None, :], mask=om, other=0.0)
        out = cast_rtne(out.to(tl.float32) + r.to(tl.float32), dt)
        sf = tl.where(om, out.to(tl.float32), 0.0)
        tl.store(pout_ptr + pid * RT + rows, tl.sum(sf * sf, 1))
        if HAS_G:
            g = tl.load(g_ptr + n, mask=nm, other=0.0).to(tl.float32)
            tl.store(z_ptr + rows[:, None] * stride_z + n[None, :], cast_rtne(sf * g[None, :], dt), mask=om)
    tl.store(y_ptr + rows[:, None] * stride_y + n[None, :], out, mask=om)


# ------------------------------------------------------------------------------------ configs
def _env_int(name: str) -> int | None:
    v = os.environ.get(name)
    return int(v) if v else None


def fewrow_config(K: int, N: int, tiles: int = 1, block_n: int | None = None, block_k: int | None = None,
                  num_warps: int | None = None, num_stages: int | None = None, split: int | None = None,
                  rows: int = 1, block_m: int | None = None) -> dict:
    """Launch configuration for reduction size K and N output columns (``tiles`` weight tiles per
    program: 2 for gate|up) of a step of ``rows`` rows. Overrides: the arguments, else
    DSPARK_FEWROW_{BLOCK_N,BLOCK_K,WARPS,STAGES,SPLIT,BLOCK_M}.

    Defaults, for a weight streamed from HBM (a model's layers do not stay in L2), from the H200 sweep of
    session 35 (benchmarks/fewrow_chain_bench.py --sweep, 8 rows, SmolLM2's shapes, µs per launch among
    30 layers' weights; cuBLAS in brackets): qkv 576 -> 960 BLOCK_N 16, BLOCK_K 128, 6 stages 3.20 (3.31);
    o 576 -> 576 BLOCK_N 16, BLOCK_K 64, 6 stages 3.25 (3.14); gate|up 576 -> 2 x 1,536 with SwiGLU
    BLOCK_N 32, BLOCK_K 64, 6 stages 4.88 (4.14 without SwiGLU); down 1,536 -> 576 BLOCK_N 32, BLOCK_K 128,
    split-K 6, 3 stages 4.24 (5.01). So: one K slice while K takes at most 9 K steps of 64 (split-K did not
    help there), else BLOCK_K 128 and slices of 2 steps up to ~TARGET_PROGRAMS programs; BLOCK_N 32 for
    two weight tiles or long K, else 16; the slice's K steps in flight (3-6 stages).

    Programs of 32 or more rows (WIDE_TUNING; H100 sweep of session 52 at 64 rows, `--sweep --quick`):
    BLOCK_N 16 always and 6 stages: gate|up 5.86 -> 5.13 µs (cuBLAS 4.48 without SwiGLU), down (so split-K
    3 of 4 K steps) 5.99 -> 5.08 (5.07); o unchanged (3.38; 3.17)."""
    long_k = K > 9 * 64
    bm = program_rows(rows, block_m)
    wide = WIDE_TUNING and bm >= 32
    bn = block_n or _env_int("DSPARK_FEWROW_BLOCK_N") or (16 if wide or not (tiles == 2 or long_k) else 32)
    bk = block_k or _env_int("DSPARK_FEWROW_BLOCK_K") or (128 if long_k else 64)
    for v, what in ((bn, "block_n"), (bk, "block_k")):
        if v < 16 or v & (v - 1):
            raise ValueError(f"{what} must be a power of two >= 16 (an MMA tile), got {v}")
    steps = triton.cdiv(K, bk)
    n_tiles = triton.cdiv(N, bn)
    sp = split or _env_int("DSPARK_FEWROW_SPLIT") or (max(1, min(TARGET_PROGRAMS // n_tiles, steps // 2))
                                                      if long_k else 1)
    per = triton.cdiv(steps, max(1, min(sp, steps)))  # K steps per slice; no empty slice
    sp = triton.cdiv(steps, per)
    stages = num_stages or _env_int("DSPARK_FEWROW_STAGES") or (6 if wide else min(6, max(3, per)))
    # 8 warps for 128-row tiles: at 4 the SmolLM2 products' 128-row launches spill 168-748 B per thread (sm_90,
    # benchmarks/offline_compile.py --fewrow); at 64 rows 8 warps measured slower than 4 (session 51)
    nw = num_warps or _env_int("DSPARK_FEWROW_WARPS") or (8 if bm >= 128 else 4)
    return dict(BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=nw, SPLIT=sp, K_PER=per * bk, TILES=tiles,
                BM=bm)


def qkv_rope_config(K: int, N: int, D: int, **config) -> dict:
    """qkv_rope_cache's launch configuration: fewrow_config with BLOCK_N half a head (always) and two
    weight tiles per program (a half-head and its partner). Those tiles give few programs (SmolLM2: 30),
    so for K of at most 9 K steps of 64 (not fewrow_config's long K) split-K 3 and 6 stages: 4.25 against
    4.50 µs per launch at 8 rows (H200, session 36, fewrow_chain_bench.py --sweep --kinds qkvr; split-K
    did not help linear's K = 576 products, which have 36-60 tiles). Programs of 32 or more rows (WIDE_TUNING)
    one K slice: 6.42 -> 5.55 µs at 64 rows (cuBLAS + rope_qk_cache 6.09; H100, session 52). The env overrides
    still apply."""
    config.pop("block_n", None)
    wide = WIDE_TUNING and program_rows(config.get("rows", 1), config.get("block_m")) >= 32
    if K <= 9 * 64:
        config.setdefault("split", _env_int("DSPARK_FEWROW_SPLIT") or (1 if wide else 3))
        config.setdefault("num_stages", _env_int("DSPARK_FEWROW_STAGES") or 6)
    return fewrow_config(K, N, 2, block_n=D // 2, **config)


class Workspace:
    """Split-K scratch of one device: fp32 partial tiles and the per-tile arrival counters (zero between
    launches: each launch's last arrivals reset theirs). Kernels on one stream share it; it grows only
    outside CUDA-graph capture, so a model allocates it before capturing (``workspace(device, ...)``)."""

    def __init__(self, device: torch.device, floats: int, counters: int) -> None:
        self.ws = torch.empty(floats, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(counters, dtype=torch.int32, device=device)


_WORKSPACES: dict[torch.device, Workspace] = {}


def workspace(device: torch.device, floats: int = 1 << 20, counters: int = 4096) -> Workspace:
    """The device's split-K workspace, grown to at least ``floats`` partial values and ``counters``."""
    device = torch.device(device)
    w = _WORKSPACES.get(device)
    if w is None or w.ws.numel() < floats or w.cnt.numel() < counters:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the few-row split-K workspace must grow before CUDA-graph capture: call "
                               "dspark.kernels.fewrow.workspace(device, floats, counters) first")
        w = _WORKSPACES[device] = Workspace(device, max(floats, w.ws.numel() if w else 0),
                                            max(counters, w.cnt.numel() if w else 0))
    return w


# ----------------------------------------------------------------------------------- wrappers
class SumSq:
    """Per-tile sums of squares of the rows of ``s`` ``[tiles, row_tile(rows)]`` (fp32), written by
    linear_residual: what a consumer needs to apply RMSNorm(s) after its product."""

    __slots__ = ("partials", "hidden")

    def __init__(self, partials: Tensor, hidden: int) -> None:
        self.partials = partials
        self.hidden = hidden


def row_tile(rows: int) -> int:
    """A step's rows rounded up to a power of two of at least 16: the width of its SumSq ``[tiles, row_tile]``
    (the producer of a SumSq and its consumer see the same rows, so they agree on the layout whatever rows
    each of their programs takes) and the most rows one program takes (program_rows)."""
    return max(BM, next_pow2(rows))


def program_rows(rows: int, block_m: int | None = None) -> int:
    """The rows one program multiplies (the kernel's BM) in a step of ``rows`` rows: the step's row tile up to
    ``block_m`` (else PROGRAM_ROWS: DSPARK_FEWROW_BLOCK_M, 64); more rows take row blocks of that many (the
    grid's third axis), each program a BM x BLOCK_N tile."""
    bm = block_m or PROGRAM_ROWS
    if bm < BM or bm & (bm - 1):
        raise ValueError(f"block_m must be a power of two >= {BM} (an MMA tile), got {bm}")
    return min(row_tile(rows), bm)


def _rows(x: Tensor, K: int, name: str) -> Tensor:
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: expected [rows, {K}] (the weight's K)")
    return x if x.stride(1) == 1 else x.contiguous()


def _weight(x: Tensor, w_t: Tensor) -> tuple[int, int]:
    check_device(x)
    if w_t.dim() != 2 or w_t.dtype != x.dtype or w_t.device != x.device:
        raise ValueError(f"w_t must be a 2-D [K, N] weight of x's dtype and device, got {tuple(w_t.shape)} "
                         f"{w_t.dtype} on {w_t.device} (x: {x.dtype} on {x.device})")
    return w_t.shape


def _launch(a, w_t, y, N, up, cfg, sumsq=None, eps=0.0, residual=None, z=None, g=None, pout=None, gate_up=False,
            rope=None):
    M, K = a.shape
    dummy = a
    bm = cfg["BM"]
    n_rb = triton.cdiv(M, bm)  # row blocks
    r = rope or {}
    n_pin = sumsq.partials.shape[0] if sumsq is not None else 0
    n_tiles = triton.cdiv(N, cfg["BLOCK_N"])
    ws = cnt = dummy
    opts = _launch_opts(a)
    if cfg["SPLIT"] > 1:
        w = workspace(a.device, cfg["SPLIT"] * n_tiles * n_rb * 2 * bm * cfg["BLOCK_N"], n_tiles * n_rb)
        ws, cnt = w.ws, w.cnt
    _fewrow_kernel[(n_tiles, cfg["SPLIT"], n_rb)](
        a, a.stride(0), w_t, w_t.stride(0), w_t.stride(1), y, y.stride(0),
        sumsq.partials if sumsq is not None else dummy, n_pin, eps,
        residual if residual is not None else dummy, residual.stride(0) if residual is not None else 0,
        z if z is not None else dummy, z.stride(0) if z is not None else 0,
        g if g is not None else dummy, pout if pout is not None else dummy, ws, cnt,
        r.get("positions", dummy), r.get("cos", dummy), r.get("sin", dummy), r.get("stride_cs", 0),
        r.get("q_norm", dummy), r.get("k_norm", dummy), r.get("qk_eps", 0.0), r.get("k_cache", dummy),
        r.get("v_cache", dummy), r.get("sc_slot", 0), r.get("sc_head", 0), r.get("slots", dummy),
        r.get("q_size", 0), r.get("kv_size", 0),
        M, K, N, up, cfg["K_PER"], row_tile(M), w_t.shape[1] - 1,
        BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["NUM_STAGES"], P_PAD=next_pow2(max(n_pin, 1)),
        SPLIT=cfg["SPLIT"], BM=bm, SCALE=sumsq is not None, GATE_UP=gate_up, RESID=residual is not None,
        HAS_G=g is not None, PRECISE=a.device.type == "cuda", IEEE=a.dtype == torch.float32 or a.device.type != "cuda",
        ROPE=rope is not None, D=r.get("D", 2), QK_NORM=r.get("q_norm") is not None,
        num_warps=cfg["num_warps"], **opts, **_prefetch_grid(w_t, cfg, opts["PDL"]),
    )


def _prefetch_grid(w_t: Tensor, cfg: dict, pdl: bool) -> dict:
    """_fewrow_kernel's PF_* constexprs: with PDL (and PDL_PREFETCH), one address per 128-byte line of a program's
    weight slice (K_PER rows x BLOCK_N columns) along the weight's contiguous dimension; else PF_K 0 (none)."""
    if not (pdl and PDL_PREFETCH) or 1 not in w_t.stride():
        return dict(PF_K=0, PF_KSTEP=1, PF_N=1, PF_NSTEP=1)
    line = max(1, 128 // w_t.element_size())
    if w_t.stride(0) == 1:  # output-major copy: each column's K slice is contiguous
        return dict(PF_K=next_pow2(triton.cdiv(cfg["K_PER"], line)), PF_KSTEP=line, PF_N=cfg["BLOCK_N"], PF_NSTEP=1)
    return dict(PF_K=next_pow2(cfg["K_PER"]), PF_KSTEP=1, PF_N=next_pow2(triton.cdiv(cfg["BLOCK_N"], line)),
                PF_NSTEP=line)


def _check_sumsq(sumsq: SumSq | None, K: int, rows: int) -> None:
    if sumsq is not None and sumsq.hidden != K:
        raise ValueError(f"the sums of squares are over {sumsq.hidden} columns, the product's K is {K}")
    if sumsq is not None and sumsq.partials.shape[1] != row_tile(rows):
        raise ValueError(f"the sums of squares were made for row tiles of {sumsq.partials.shape[1]}, "
                         f"the product's {rows} rows take tiles of {row_tile(rows)}")


def linear(x: Tensor, w_t: Tensor, sumsq: SumSq | None = None, eps: float = 0.0, **config) -> Tensor:
    """``x @ w_t`` in x's dtype; with ``sumsq`` (x = z = g * s of a linear_residual)
    the product times ``1 / rms(s)``, i.e. ``rms_norm(s, g) @ w_t``."""
    K, N = _weight(x, w_t)
    a = _rows(x, K, "x")
    _check_sumsq(sumsq, K, a.shape[0])
    y = torch.empty(a.shape[0], N, dtype=x.dtype, device=x.device)
    if a.shape[0]:
        _launch(a, w_t, y, N, 0, fewrow_config(K, N, rows=a.shape[0], **config), sumsq=sumsq, eps=eps)
    return y


def gate_up_silu(x: Tensor, w_t: Tensor, sumsq: SumSq | None = None, eps: float = 0.0, **config) -> Tensor:
    """``silu(gate) * up`` of the fused gate|up product (``w_t`` ``[K, 2I]``, gate in columns ``:I``),
    normed like ``linear`` with ``sumsq``: replaces a norm, the gate_up GEMM and silu_and_mul."""
    K, N2 = _weight(x, w_t)
    if N2 % 2:
        raise ValueError(f"w_t has {N2} columns: a fused gate|up weight needs an even count")
    a = _rows(x, K, "x")
    _check_sumsq(sumsq, K, a.shape[0])
    I = N2 // 2
    y = torch.empty(a.shape[0], I, dtype=x.dtype, device=x.device)
    if a.shape[0]:
        _launch(a, w_t, y, I, I, fewrow_config(K, I, 2, rows=a.shape[0], **config), sumsq=sumsq, eps=eps,
                gate_up=True)
    return y


def linear_residual(x: Tensor, w_t: Tensor, residual: Tensor, norm_weight: Tensor | None,
                    **config) -> tuple[Tensor, Tensor | None, SumSq]:
    """``s = round(x @ w_t) + residual`` (rounded to the dtype, the eager residual add) and, for the
    next product, ``z = norm_weight * s`` (None without a norm weight) and the sums of squares of s.
    Returns ``(s, z, sumsq)``."""
    K, N = _weight(x, w_t)
    a = _rows(x, K, "x")
    if residual.shape != (a.shape[0], N) or residual.dtype != x.dtype:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must be [{a.shape[0]}, {N}] {x.dtype}")
    if norm_weight is not None and (tuple(norm_weight.shape) != (N,) or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be ({N},) {x.dtype}")
    r = residual if residual.stride(1) == 1 else residual.contiguous()
    cfg = fewrow_config(K, N, rows=a.shape[0], **config)
    tiles = triton.cdiv(N, cfg["BLOCK_N"])
    s = torch.empty(a.shape[0], N, dtype=x.dtype, device=x.device)
    z = torch.empty_like(s) if norm_weight is not None else None
    # every program writes all its tile's rows
    partials = torch.empty(tiles, row_tile(a.shape[0]), dtype=torch.float32, device=x.device)
    if a.shape[0]:
        _launch(a, w_t, s, N, 0, cfg, residual=r, z=z, g=norm_weight, pout=partials)
    return s, z, SumSq(partials, N)


def o_proj_and_mlp(o: Tensor, w_o: Tensor, h: Tensor, post_norm: Tensor, post_eps: float, w_gate_up: Tensor,
                   w_down: Tensor, next_norm: Tensor | None) -> tuple[Tensor, Tensor | None, SumSq]:
    """A decoder layer after its attention, in three launches: o_proj + the residual add (and the
    post-attention norm's z and sums), gate|up normed + SwiGLU, down_proj + the residual add. Returns
    ``(h_out, z, sumsq)`` as linear_residual does for down_proj (z = next_norm * h_out, None without)."""
    s1, z1, sumsq1 = linear_residual(o, w_o, h, post_norm)
    act = gate_up_silu(z1, w_gate_up, sumsq1, post_eps)
    return linear_residual(act, w_down, s1, next_norm)


def qkv_rope_cache(x: Tensor, w_t: Tensor, sumsq: SumSq | None, eps: float, positions: Tensor, cos: Tensor,
                   sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor, num_heads: int,
                   num_kv_heads: int, q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                   qk_eps: float = 1e-6, **config) -> Tensor:
    """``linear`` (the fused qkv projection, q | k | v columns of ``num_heads`` / ``num_kv_heads`` heads)
    followed by fused_ops.rope_qk_cache in its epilogue: optional per-head q/k RMSNorm, rotate-half RoPE
    at ``positions`` from RotaryEmbedding's ``cos`` / ``sin_signed`` tables, k and v written into the
    paged caches ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` (negative: skipped). Returns
    the rotated q ``[rows, num_heads, D]``. One launch instead of two; BLOCK_N is half a head."""
    K, N = _weight(x, w_t)
    a = _rows(x, K, "x")
    _check_sumsq(sumsq, K, a.shape[0])
    M = a.shape[0]
    if N % (num_heads + 2 * num_kv_heads):
        raise ValueError(f"w_t has {N} columns: not (num_heads + 2 * num_kv_heads) = "
                         f"{num_heads + 2 * num_kv_heads} heads of one size")
    D = N // (num_heads + 2 * num_kv_heads)
    if D & (D - 1) or D < 32:
        raise ValueError(f"head_dim {D} must be a power of two >= 32 (half a head is one MMA tile)")
    if tuple(k_cache.shape[-2:]) != (num_kv_heads, D) or k_cache.dtype != v_cache.dtype:
        raise ValueError(f"K/V caches {tuple(k_cache.shape)} {k_cache.dtype} / {v_cache.dtype} do not hold "
                         f"{num_kv_heads} heads of {D}")
    sc_slot, sc_head = _cache_strides(k_cache)
    if _cache_strides(v_cache) != (sc_slot, sc_head):
        raise ValueError("K and V caches must have the same layout")
    if positions.shape != (M,) or slot_mapping.shape != (M,):
        raise ValueError(f"positions {tuple(positions.shape)} and slot_mapping {tuple(slot_mapping.shape)} "
                         f"must have one entry per row ({M})")
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin_signed = sin_signed.to(cos.dtype)
    if sin_signed.stride() != cos.stride():
        sin_signed, cos = sin_signed.contiguous(), cos.contiguous()
    cfg = qkv_rope_config(K, N, D, rows=M, **config)
    q = torch.empty(M, num_heads, D, dtype=x.dtype, device=x.device)
    if M:
        rope = dict(positions=positions, cos=cos, sin=sin_signed, stride_cs=cos.stride(0), q_norm=q_norm,
                    k_norm=k_norm, qk_eps=qk_eps, k_cache=k_cache, v_cache=v_cache, sc_slot=sc_slot,
                    sc_head=sc_head, slots=slot_mapping, q_size=num_heads * D, kv_size=num_kv_heads * D, D=D)
        _launch(a, w_t, q.view(M, num_heads * D), N, 0, cfg, sumsq=sumsq, eps=eps, rope=rope)
    return q


def qkv_rope_cache_reference(x: Tensor, w_t: Tensor, sumsq: SumSq | None, eps: float, positions: Tensor,
                             cos: Tensor, sin_signed: Tensor, k_cache: Tensor, v_cache: Tensor,
                             slot_mapping: Tensor, num_heads: int, num_kv_heads: int, q_norm: Tensor | None = None,
                             k_norm: Tensor | None = None, qk_eps: float = 1e-6, **config) -> Tensor:
    """The two launches it replaces: ``linear`` then fused_ops.rope_qk_cache."""
    qkv = linear(x, w_t, sumsq, eps, **config)
    T, D = qkv.shape[0], qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    return rope_qk_cache(q.view(T, num_heads, D), k.view(T, num_kv_heads, D), v.view(T, num_kv_heads, D), positions,
                         cos, sin_signed, k_cache, v_cache, slot_mapping, q_norm, k_norm, qk_eps)[0]


def norm_input(h: Tensor, norm_weight: Tensor) -> tuple[Tensor, SumSq]:
    """``(z, sumsq)`` for rows h that no linear_residual produced (the embeddings): eager torch ops, for
    tests and references; the engine norms its first layer's input with fused_ops.add_rms_norm."""
    hf = h.float()
    partials = torch.zeros(1, row_tile(h.shape[0]), dtype=torch.float32, device=h.device)
    partials[0, : h.shape[0]] = (hf * hf).sum(-1)
    return (hf * norm_weight.float()).to(h.dtype), SumSq(partials, h.shape[1])


# --------------------------------------------------------------------------------- references
def linear_reference(s: Tensor, norm_weight: Tensor | None, eps: float, w_t: Tensor) -> Tensor:
    """``rms_norm(s, norm_weight) @ w_t`` (plain ``s @ w_t`` without a norm weight), fp32 sums."""
    h = add_rms_norm_reference(s, None, norm_weight, eps)[0] if norm_weight is not None else s
    return (h.float() @ w_t.float()).to(s.dtype)


def gate_up_silu_reference(s: Tensor, norm_weight: Tensor | None, eps: float, w_t: Tensor) -> Tensor:
    return silu_and_mul_reference(linear_reference(s, norm_weight, eps, w_t))


def linear_residual_reference(x: Tensor, w_t: Tensor, residual: Tensor) -> Tensor:
    return (x.float() @ w_t.float()).to(x.dtype) + residual


__all__ = [
    "ENGINE_MAX_ROWS", "PROGRAM_ROWS", "WIDE_TUNING", "SumSq", "row_tile", "program_rows", "fewrow_config",
    "gate_up_silu", "o_proj_and_mlp", "gate_up_silu_reference", "linear", "linear_reference",
    "linear_residual", "linear_residual_reference", "norm_input", "qkv_rope_cache", "qkv_rope_cache_reference",
]
