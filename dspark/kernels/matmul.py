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

It is slower than cuBLAS at large M (one tile shape for all sizes); that is the price of the mode.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels import check_device

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64


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
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w_t [K, N] (+ bias [N]) -> [..., N] in x's dtype (or into ``out``), batch-invariant."""
    check_device(x)
    K, N = w_t.shape
    assert x.shape[-1] == K, f"x {tuple(x.shape)} does not fit w_t {tuple(w_t.shape)}"
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if w_t.stride(-1) != 1:
        w_t = w_t.contiguous()
    M = x2.shape[0]
    y = out if out is not None else torch.empty(*x.shape[:-1], N, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, N)
    assert y2.stride(-1) == 1 and y2.shape[0] == M
    if M:
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only matters for fp32 inputs
        _matmul_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(N, BLOCK_N))](
            x2, w_t, bias if bias is not None else w_t, y2, M, N, K, x2.stride(0), w_t.stride(0), y2.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION=precision, BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K,
            num_warps=4,
        )
    return y


def matmul_reference(x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    y = x.float() @ w_t.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
