"""A batch-invariant matrix product in Triton: ``y = x @ w_t (+ bias)`` where row i of y depends on row
i of x alone, never on how many other rows the call has.

Why: cuBLAS picks its kernel (tile sizes, split-K) from the problem's shape, so a verification step
(1 + N rows per request) and a decode step (one row) sum the same row's products in different orders;
in bf16 that changes a rounding now and then, the change grows through the layers, and greedy
speculative output then differs from plain output at near-ties (docs/benchmarks.md: 26/64 identical on
the H200). With ``EngineConfig.batch_invariant`` every target Linear goes through this kernel instead:

- one configuration for every call (tile sizes are constants, ``M`` is not specialised on), so each
  row is computed by the same instructions in the same order whatever M is;
- no split-K: each output tile runs over K in BLOCK_K steps from 0, accumulating in fp32;
- fp32 inputs use exact fp32 products (``ieee``), bf16/fp16 inputs the tensor cores, fp32 accumulate.

Which launch parameters keep a row's sums, measured on an H100 (session 46,
``benchmarks/invariance_check.py``; docs/benchmarks.md): with bf16 inputs and fp32 accumulation, every launch
that walks K from 0 in order gave the same bits for every row as the 64 x 64 x 64 launch — row tiles of 16 to
128, column tiles of 16 to 128, K steps of 32 to 128, 1 to 8 warps, 2 to 4 stages, on 1, 7, 64 and 333 rows
and on shuffled rows, at SmolLM2's five products (the lm_head with fp32 output too): the tensor cores
(mma.sync for 16-row tiles, wgmma from 64) add a tile's k16 products the same way, and the K loop adds the
chunks in order. So with half-precision inputs on CUDA the tile is picked by the row count
(``invariant_launch``: at one row 0.5-1.7 µs faster per product than the fixed tile); elsewhere (fp32 inputs,
the CPU interpreter, whose numpy products round by a row's place in the tile) it stays fixed. What must not
change is the K order: no split-K, K from 0.

Not split-K, and slower than cuBLAS from ~256 rows (one K order for all sizes); that is the price of the mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels import check_device

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64  # the fixed launch (fp32, the CPU)
NUM_WARPS = 4


def invariant_launch(M: int, N: int, x: torch.Tensor) -> tuple[int, int, int, int]:
    """(BM, BN, BK, num_warps) for an ``M``-row product with ``N`` columns. Half-precision inputs on CUDA: the
    fastest launch of benchmarks/invariance_check.py's H100 sweep by rows (SmolLM2's products; within ~0.1 µs
    of the best per shape up to 128 rows, and of the best of the sweep above); every one of them was measured
    to give the fixed launch's bits. Else the fixed launch."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS
    if M <= 16:
        return (16, 64, 64, 4) if N > 8192 else (16, 32, 64, 2)
    if M <= 128:
        return (64, 64, 64, 4) if N > 8192 else (64, 16 if N <= 1024 else 32, 64, 4)
    if M <= 512:
        return 64, 64, 64, 4
    return 64, 128, 64, 4


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wk, stride_ym,
                   HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pm = tl.program_id(0)
    pn = tl.program_id(1)
    rm = (pm * BM + tl.arange(0, BM)).to(tl.int64)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def matmul_invariant(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ w_t [K, N] (+ bias [N]) -> [..., N] in ``out_dtype`` (default x's; fp32 from half inputs:
    the fp32 sums unrounded, as the lm_head's logits want), or into ``out``, batch-invariant."""
    check_device(x)
    K, N = w_t.shape
    assert x.shape[-1] == K, f"x {tuple(x.shape)} does not fit w_t {tuple(w_t.shape)}"
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w_t.stride(-1) != 1:
        w_t = w_t.contiguous()
    M = x2.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=out_dtype or x.dtype, device=x.device)
    y2 = y.view(-1, N)
    assert y2.stride(-1) == 1 and y2.shape[0] == M
    if M:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs
        bm, bn, bk, warps = invariant_launch(M, N, x2)
        _matmul_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn))](
            x2, w_t, bias if bias is not None else w_t, y2, M, N, K, x2.stride(0), w_t.stride(0), y2.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION=precision, BM=bm, BN=bn, BK=bk, num_warps=warps,
        )
    return y


def matmul_reference(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
