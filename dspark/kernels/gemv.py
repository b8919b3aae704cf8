"""Few-row matrix products (GEMV, ``M <= 16`` rows) in Triton that fuse the elementwise kernels around
a decoder layer's projections, each with its PyTorch reference.

Why: at batch 1 the decode step of a small model is launch-bound. On an H200, SmolLM2-135M (hidden
576, MLP 1536, 30 layers, bf16) takes ~1.03 ms per step with 9-10 launches per layer (qkv GEMM,
rope_qk_cache, attention (+ merge), o GEMM, add_rms_norm, gate_up GEMM, silu_and_mul, down GEMM,
add_rms_norm). A cuBLAS GEMM of one row costs 3.65 µs in a CUDA graph (latency-bound: the largest,
gate_up, reads 3.5 MB), add_rms_norm 1.7 µs, silu_and_mul 2.1 µs, plus ~0.37 µs of gap per graph node.
Folding the residual add + RMSNorm into the product that consumes it, and SwiGLU into the gate|up
product, removes 3 launches per layer (90 per step):

- ``add_rms_norm_linear`` (K1): ``s = x + residual`` and ``y = (weight_norm * rmsnorm(s)) @ W_t (+ bias)``;
  returns ``(y, s)``. Replaces add_rms_norm + the qkv GEMM.
- ``add_rms_norm_gate_up_silu`` (K2): the same prologue, then the fused gate|up product and SwiGLU:
  program j computes columns ``[j*BN, (j+1)*BN)`` of both gate (``W_t[:, :I]``) and up (``W_t[:, I:]``)
  and returns ``silu(gate) * up`` ``[M, I]`` (and ``s``). Replaces add_rms_norm + gate_up GEMM +
  silu_and_mul.
- ``linear_small_m`` (K3): plain ``x @ W_t (+ bias)`` for few rows (o_proj, down_proj), to compete with
  cuBLAS's few-row kernels; the GPU benchmark (benchmarks/gpu_fastpath_check.py, part ``gemv``) decides
  whether it is worth it.

Design (bandwidth at few rows): the grid runs over N tiles of BLOCK_N columns (small, so that about
as many programs as the GPU has SMs read the weight: 132 on an H200); each program loops over K in
BLOCK_K steps, loading its ``[BLOCK_K, BLOCK_N]`` weight tile once per step and multiplying it with every
row, with fp32 accumulation: a static loop over the M rows, each a broadcast-multiply and a sum over K
(one K step for K = 576 at BLOCK_N 8).

Measured on the H200 (bf16, SmolLM2-135M shapes, µs per launch in a CUDA graph; sessions 13-15): at one
row this beats cuBLAS (a layer's four products: 18.6 µs unfused on cuBLAS vs 13.8 on the GEMVs), so
models/llama.py uses the kernels for steps of GEMV_MAX_ROWS = 1 row. At 6 rows (a verification block of
1 + 5 drafts at batch 1) a layer's four products take 40.3 µs on the row loop vs 19.1 on cuBLAS + the
unfused kernels (it reduces every row over K at every K step and selects it into the whole
accumulator). Two other ways through the rows lost as well and were deleted (session 15): a
``[rows, BLOCK_K, BLOCK_N]`` tile of partial products reduced over K once (42.4 µs; the partial
products exhaust the registers) and tl.dot on the rows padded to a 16-row tile (36.6 µs). Later trials
lost too (docs/benchmarks.md, sessions 21, 32 and 33): tensor cores with the whole K in one tile (session 21),
the partial-product tile again (32), the RMSNorm's sums of squares inside a tensor-core K loop with ``1/rms``
applied to the finished products (33: 36-41 µs per layer; the plain tensor-core product alone matches cuBLAS,
any work between a tile's load and its MMA does not), and the gate|up product with SwiGLU in its epilogue
(33: faster in isolation, no gain in the engine's verification graph). What did win for 2-16 rows
(session 35) applies the norm *after* the product: kernels/fewrow.py.

The weight may be input-major ``[K, N]`` (the default Linear layout) or a transposed view of an
output-major copy (any strides). With the norm prologue every program first computes the rows' sums
of squares of ``s`` (K is small: the rows are re-read from L1/L2 in the product loop, where each
program recomputes its slice of the normed rows, ``a = rounded(weight_norm * rounded(rmsnorm(s)))``
with ``s = rounded(x + residual)``); only the programs with pid 0 write ``s``. The row count M is a
compile-time constant (the padded batch sizes of CUDA graphs are fixed). No tensor value is read on
the host, so every wrapper can be captured in a CUDA graph.

Exactness: the same roundings as the unfused path (``fused_ops.add_rms_norm``: the residual add
rounded to the dtype, normalise in fp32, round, times the norm weight, round; the product's output
rounded to the dtype; ``fused_ops.silu_and_mul``'s epilogue: silu in fp32 with an IEEE division and
libdevice's exp on CUDA, round, times up, round), with floating-point contraction off on the GPU. Only
the summation order of the products differs from cuBLAS (and the RMSNorm mean's from add_rms_norm on
the GPU), so results match the references up to fp32 accumulation order, not bit for bit. In bf16
the products of two bf16 numbers are exact in fp32, so only the order of the fp32 sums matters.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from dspark.kernels import PDL_PREFETCH, check_device, next_pow2, pdl_wait
from dspark.kernels.fused_ops import (
    _launch_opts, add_rms_norm_reference, cast_rtne, silu_and_mul_reference, silu_mul_rounded,
)

MAX_ROWS = 16  # the row loop is unrolled: more rows belong to a GEMM
TARGET_PROGRAMS = 128  # about the SM count (H200: 132): programs wanted along N
WEIGHT_ELEMS_PER_THREAD = 64  # register budget of the weight tile(s) per K step
NORM_TILE_ELEMS = 8192  # rows x K elements of the sum-of-squares tile


# ------------------------------------------------------------------------------------- kernel
@triton.jit
def _gemv_kernel(
    x_ptr, stride_x, r_ptr, stride_r, s_ptr, stride_s, nw_ptr, eps,
    w_ptr, stride_wk, stride_wn, b_ptr, y_ptr, stride_y,
    K, N, UP,
    M: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, HAS_BIAS: tl.constexpr,
    GATE_UP: tl.constexpr, PRECISE: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
):
    """y[:, n] = a @ W[:, n] for this program's BLOCK_N columns n, a = x (plain) or
    weight_norm * rmsnorm(x + residual) (NORM). GATE_UP: also u = a @ W[:, UP + n], y = silu(y) * u.
    The product: one loop over K in BLOCK_K steps, each weight tile loaded once and multiplied with
    every row by a static loop over the M rows (BM: M padded to a power of two; rows >= M are not stored).
    PREFETCH (with PDL): the first K step's weight tile(s) load before pdl_wait, so that under programmatic
    dependent launch their load overlaps the previous kernel (no kernel writes a weight); same sums."""
    pid = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    rows = tl.arange(0, BM)
    rm = rows < M
    kb = tl.arange(0, BLOCK_K)
    if PREFETCH:
        w_pre = tl.load(w_ptr + kb[:, None] * stride_wk + n[None, :] * stride_wn,
                        mask=(kb < K)[:, None] & nm[None, :], other=0.0)
        if GATE_UP:
            wu_pre = tl.load(w_ptr + kb[:, None] * stride_wk + (n + UP)[None, :] * stride_wn,
                             mask=(kb < K)[:, None] & nm[None, :], other=0.0)
    pdl_wait(PDL)

    inv = tl.full([BM], 1.0, dtype=tl.float32)  # the rows' 1 / rms (NORM)
    if NORM:  # sum of squares of s = x + residual per row (and s itself, written by pid 0)
        ss = tl.zeros([BM], dtype=tl.float32)
        kn = tl.arange(0, NORM_BLOCK)
        for k0 in range(0, K, NORM_BLOCK):
            k = k0 + kn
            mk = rm[:, None] & (k < K)[None, :]
            s = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=mk, other=0.0)
            if HAS_RES:
                r = tl.load(r_ptr + rows[:, None] * stride_r + k[None, :], mask=mk, other=0.0)
                s = cast_rtne(s.to(tl.float32) + r.to(tl.float32), dt)  # eager: one add in the dtype
                tl.store(s_ptr + rows[:, None] * stride_s + k[None, :], s, mask=mk & (pid == 0))
            sf = s.to(tl.float32)
            ss += tl.sum(sf * sf, 1)
        inv = tl.math.rsqrt(ss / K + eps)

    acc = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BM, BLOCK_N], dtype=tl.float32)
    k_lo = 0
    if PREFETCH:  # the first K step on the prefetched tile(s)
        wu0 = w_pre
        if GATE_UP:
            wu0 = wu_pre
        acc, acc_u = _gemv_rows(acc, acc_u, w_pre.to(tl.float32), wu0.to(tl.float32), kb, kb < K, x_ptr, stride_x,
                                r_ptr, stride_r, nw_ptr, rows, inv, dt, M, NORM, HAS_RES, GATE_UP)
        k_lo = BLOCK_K
    for k0 in tl.range(k_lo, K, BLOCK_K, num_stages=NUM_STAGES):  # the K loop
        k = k0 + kb
        km = k < K
        wmask = km[:, None] & nm[None, :]
        w_off = k[:, None] * stride_wk + n[None, :] * stride_wn
        w = tl.load(w_ptr + w_off, mask=wmask, other=0.0).to(tl.float32)  # the weight first: in flight early
        wu = w
        if GATE_UP:
            wu = tl.load(w_ptr + w_off + UP * stride_wn, mask=wmask, other=0.0).to(tl.float32)
        acc, acc_u = _gemv_rows(acc, acc_u, w, wu, k, km, x_ptr, stride_x, r_ptr, stride_r, nw_ptr, rows, inv, dt, M,
                                NORM, HAS_RES, GATE_UP)

    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + n, mask=nm, other=0.0).to(tl.float32)[None, :]
    out = cast_rtne(acc, dt)  # the product's output dtype
    if GATE_UP:  # fused_ops.silu_and_mul's roundings on the rounded gate and up
        out = silu_mul_rounded(out, cast_rtne(acc_u, dt), dt, PRECISE)
    tl.store(y_ptr + rows[:, None] * stride_y + n[None, :], out, mask=rm[:, None] & nm[None, :])


@triton.jit
def _gemv_rows(acc, acc_u, w, wu, k, km, x_ptr, stride_x, r_ptr, stride_r, nw_ptr, rows, inv, dt: tl.constexpr,
               M: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, GATE_UP: tl.constexpr):
    """One K step of _gemv_kernel: the weight tile(s) w (and wu, GATE_UP) [BLOCK_K, BLOCK_N] in fp32 times each of
    the M rows' K slice k (normed: NORM), added to the rows' accumulators."""
    if NORM:
        g = tl.load(nw_ptr + k, mask=km, other=0.0).to(tl.float32)
    for m in tl.static_range(M):  # each row reduced over this K slice
        a = tl.load(x_ptr + m * stride_x + k, mask=km, other=0.0)
        if NORM:  # fused_ops.add_rms_norm's roundings, on this K slice of row m
            if HAS_RES:
                r = tl.load(r_ptr + m * stride_r + k, mask=km, other=0.0)
                a = cast_rtne(a.to(tl.float32) + r.to(tl.float32), dt)
            inv_m = tl.sum(tl.where(rows == m, inv, 0.0), 0)
            a = cast_rtne(cast_rtne(a.to(tl.float32) * inv_m, dt).to(tl.float32) * g, dt)
        af = a.to(tl.float32)[:, None]
        sel = (rows == m)[:, None]
        acc = tl.where(sel, acc + tl.sum(af * w, 0)[None, :], acc)
        if GATE_UP:
            acc_u = tl.where(sel, acc_u + tl.sum(af * wu, 0)[None, :], acc_u)
    return acc, acc_u


# ------------------------------------------------------------------------------------ configs
def _pow2(v: int, what: str) -> int:
    if v < 1 or v & (v - 1):
        raise ValueError(f"{what} must be a power of two, got {v}")
    return v


def _floor_pow2(v: int) -> int:
    return 1 << (max(v, 1).bit_length() - 1)


def gemv_config(M: int, K: int, N: int, tiles: int = 1, block_n: int | None = None, block_k: int | None = None,
                num_warps: int | None = None, num_stages: int | None = None, prefetch: bool | None = None) -> dict:
    """Launch configuration for M rows, reduction size K and N output columns per weight tile (``tiles``
    tiles per program: 2 for gate|up). Any value can be overridden (benchmarks sweep them).

    Defaults: BLOCK_N the smallest power of two >= 8 giving at most ~TARGET_PROGRAMS programs (at most
    64; 8 for SmolLM2: 120 programs for qkv, 72 for o / down, 96 of 2 tiles for gate|up). BLOCK_K as
    large as WEIGHT_ELEMS_PER_THREAD allows for the weight tile(s) per K step (one K step for K = 576 at
    BLOCK_N 8); 4 warps; cp.async pipelining (3 stages) only with several K steps (the 1-row
    measurements favour few deep loads over many shallow ones). ``prefetch``: the kernel's PREFETCH (default:
    with PDL, unless DSPARK_PDL_PREFETCH=0)."""
    nw = num_warps or 4
    bm = next_pow2(M)
    bn = _pow2(block_n, "block_n") if block_n else max(8, min(64, next_pow2(triton.cdiv(N, TARGET_PROGRAMS))))
    budget = WEIGHT_ELEMS_PER_THREAD * 32 * nw  # registers for the weight tile(s): bn * tiles per K element
    bk = _pow2(block_k, "block_k") if block_k else max(16, min(next_pow2(K), _floor_pow2(budget // (bn * tiles))))
    stages = num_stages or (1 if bk >= K else 3)
    return dict(BLOCK_N=bn, BLOCK_K=bk, NORM_BLOCK=max(16, min(next_pow2(K), max(bk, NORM_TILE_ELEMS // bm))),
                NUM_STAGES=stages, num_warps=nw, BM=bm, PREFETCH=prefetch)


# ----------------------------------------------------------------------------------- wrappers
def _rows_of(x: Tensor, K: int, name: str) -> Tensor:
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{name} has shape {tuple(x.shape)}: its last dimension must be the weight's K = {K}")
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(-1) == 1 or K == 1 else x2.contiguous()


def _check_weight(x: Tensor, w_t: Tensor, bias: Tensor | None) -> tuple[int, int]:
    if w_t.dim() != 2:
        raise ValueError(f"w_t must be a 2-D [K, N] weight, got shape {tuple(w_t.shape)}")
    if w_t.dtype != x.dtype:
        raise ValueError(f"dtype mismatch: x is {x.dtype}, w_t is {w_t.dtype}")
    if w_t.device != x.device:
        raise ValueError(f"device mismatch: x on {x.device}, w_t on {w_t.device}")
    K, N = w_t.shape
    if (K - 1) * abs(w_t.stride(0)) + (N - 1) * abs(w_t.stride(1)) >= 2**31:
        raise ValueError(f"w_t {tuple(w_t.shape)} with strides {w_t.stride()} is too large for 32-bit offsets")
    if bias is not None and (tuple(bias.shape) != (N,) or bias.device != x.device):
        raise ValueError(f"bias has shape {tuple(bias.shape)} on {bias.device}, expected ({N},) on {x.device}")
    return K, N


def _check_norm(x: Tensor, residual: Tensor | None, norm_weight: Tensor, K: int) -> None:
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    if tuple(norm_weight.shape) != (K,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} {norm_weight.dtype} must be ({K},) {x.dtype} "
                         "(the activations' dtype)")


def _check_m(M: int) -> None:
    if M > MAX_ROWS:
        raise ValueError(f"{M} rows: the GEMV kernels take at most {MAX_ROWS} rows (use a GEMM)")


def _launch(x2, r2, s2, norm_weight, eps, w_t, bias, y2, N, up, cfg, norm, gate_up):
    M, K = x2.shape
    dummy = x2
    opts = _launch_opts(x2)
    _gemv_kernel[(triton.cdiv(N, cfg["BLOCK_N"]),)](
        x2, x2.stride(0), r2 if r2 is not None else dummy, r2.stride(0) if r2 is not None else 0,
        s2 if s2 is not None else dummy, s2.stride(0) if s2 is not None else 0,
        norm_weight if norm_weight is not None else dummy, eps,
        w_t, w_t.stride(0), w_t.stride(1), bias if bias is not None else dummy, y2, y2.stride(0),
        K, N, up,
        M=M, BM=cfg["BM"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NORM_BLOCK=cfg["NORM_BLOCK"],
        NUM_STAGES=cfg["NUM_STAGES"], NORM=norm, HAS_RES=r2 is not None, HAS_BIAS=bias is not None,
        GATE_UP=gate_up, PRECISE=x2.device.type == "cuda", num_warps=cfg["num_warps"], **opts,
        PREFETCH=(opts["PDL"] and PDL_PREFETCH) if cfg["PREFETCH"] is None else cfg["PREFETCH"],
    )


def _norm_inputs(x, residual, norm_weight, w_t, bias):
    check_device(x)
    K, N = _check_weight(x, w_t, bias)
    _check_norm(x, residual, norm_weight, K)
    x2 = _rows_of(x, K, "x")
    _check_m(x2.shape[0])
    if residual is None:
        return K, N, x2, None, None, x
    r2 = _rows_of(residual, K, "residual")
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return K, N, x2, r2, s.view(-1, K), s


def add_rms_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, w_t: Tensor,
                        bias: Tensor | None = None, **config) -> tuple[Tensor, Tensor]:
    """K1: ``s = x + residual`` (rounded to x's dtype; ``s = x`` when residual is None) and
    ``y = (norm_weight * rmsnorm(s)) @ w_t (+ bias)`` in x's dtype, for at most MAX_ROWS rows of x
    ``[.., K]``; ``w_t`` ``[K, N]``. Returns ``(y [.., N], s)`` = add_rms_norm followed by the Linear.
    ``config``: overrides of gemv_config (block_n, block_k, num_warps, num_stages)."""
    K, N, x2, r2, s2, s = _norm_inputs(x, residual, norm_weight, w_t, bias)
    M = x2.shape[0]
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    if M:
        _launch(x2, r2, s2, norm_weight, eps, w_t, bias, y.view(-1, N), N, 0, gemv_config(M, K, N, **config),
                norm=True, gate_up=False)
    return y, s


def add_rms_norm_gate_up_silu(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, w_t: Tensor,
                              **config) -> tuple[Tensor, Tensor]:
    """K2: the same prologue as add_rms_norm_linear, then the fused gate|up product with ``w_t``
    ``[K, 2I]`` (gate in columns ``:I``, up in ``I:``) and SwiGLU: returns ``(silu(gate) * up [.., I], s)``
    = add_rms_norm, the gate_up Linear and silu_and_mul."""
    K, N2, x2, r2, s2, s = _norm_inputs(x, residual, norm_weight, w_t, None)
    if N2 % 2:
        raise ValueError(f"w_t has {N2} columns: a fused gate|up weight needs an even count")
    I = N2 // 2
    M = x2.shape[0]
    y = torch.empty(*x.shape[:-1], I, dtype=x.dtype, device=x.device)
    if M:
        _launch(x2, r2, s2, norm_weight, eps, w_t, None, y.view(-1, I), I, I, gemv_config(M, K, I, 2, **config),
                norm=True, gate_up=True)
    return y, s


def linear_small_m(x: Tensor, w_t: Tensor, bias: Tensor | None = None, **config) -> Tensor:
    """K3: ``x @ w_t (+ bias)`` in x's dtype for at most MAX_ROWS rows of x ``[.., K]``; ``w_t`` ``[K, N]``."""
    check_device(x)
    K, N = _check_weight(x, w_t, bias)
    x2 = _rows_of(x, K, "x")
    M = x2.shape[0]
    _check_m(M)
    y = torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    if M:
        _launch(x2, None, None, None, 0.0, w_t, bias, y.view(-1, N), N, 0, gemv_config(M, K, N, **config),
                norm=False, gate_up=False)
    return y


# --------------------------------------------------------------------------------- references
def linear_small_m_reference(x: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """The product in fp32, rounded once to x's dtype (what a GEMM with fp32 accumulation returns)."""
    y = x.float() @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def add_rms_norm_linear_reference(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, w_t: Tensor,
                                  bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """add_rms_norm_reference, then the Linear."""
    h, s = add_rms_norm_reference(x, residual, norm_weight, eps)
    return linear_small_m_reference(h, w_t, bias), s


def add_rms_norm_gate_up_silu_reference(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                                        w_t: Tensor) -> tuple[Tensor, Tensor]:
    """add_rms_norm_reference, the gate_up Linear (rounded to the dtype), then silu_and_mul."""
    h, s = add_rms_norm_reference(x, residual, norm_weight, eps)
    return silu_and_mul_reference(linear_small_m_reference(h, w_t)), s


__all__ = [
    "MAX_ROWS", "add_rms_norm_gate_up_silu", "add_rms_norm_gate_up_silu_reference", "add_rms_norm_linear",
    "add_rms_norm_linear_reference", "gemv_config", "linear_small_m", "linear_small_m_reference",
]
