"""The batch-invariant matmul (dspark/kernels/matmul.py) in Triton's interpreter: equal to the reference,
and each row's result the same bit for bit whatever the number of rows in the call."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.matmul import (BLOCK_K, BLOCK_M, BLOCK_N, NUM_WARPS, invariant_launch, matmul_invariant,
                                   matmul_reference)


@pytest.mark.parametrize("M,K,N,bias", [(1, 64, 96, False), (37, 130, 70, True), (129, 64, 64, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_reference(M, K, N, bias, dtype):
    g = torch.Generator().manual_seed(M + K + N)
    x = torch.randn(M, K, generator=g).to(dtype)
    w = (torch.randn(K, N, generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    got = matmul_invariant(x, w, b)
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), matmul_reference(x, w, b).float(), rtol=tol, atol=tol)


def test_rows_do_not_depend_on_the_row_count():
    # Each subset keeps its rows at the same place inside a BLOCK_M tile as in the full call. The
    # interpreter runs tl.dot as a numpy (BLAS) product, and BLAS may round a row differently by where
    # it sits in the tile (CI failed once on rows 5..10 moved to 0..5 on another CPU); on the GPU every
    # row of an MMA tile is reduced in the same order, and that is measured there (bench correctness).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * BLOCK_M, 96, generator=g)
    w = torch.randn(96, 80, generator=g)
    full = matmul_invariant(x, w)
    for lo, hi in ((0, 1), (0, 6), (BLOCK_M, BLOCK_M + 6), (0, BLOCK_M + 6), (2 * BLOCK_M, 2 * BLOCK_M + 1)):
        assert torch.equal(matmul_invariant(x[lo:hi], w), full[lo:hi]), (lo, hi)


def test_out_and_leading_dims():
    x = torch.randn(2, 3, 64)
    w = torch.randn(64, 16)
    out = torch.empty(6, 16)
    assert matmul_invariant(x.view(6, 64), w, out=out) is out
    torch.testing.assert_close(matmul_invariant(x, w), (x @ w), rtol=1e-5, atol=1e-5)


def test_fp32_output_from_half_inputs():
    # The lm_head in batch-invariant mode on CUDA: half weights and activations, the fp32 sums kept.
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g).half()
    w = (torch.randn(64, 40, generator=g) / 8).half()
    got = matmul_invariant(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x.float() @ w.float(), rtol=1e-5, atol=1e-5)


def test_launch_is_fixed_off_cuda():
    # Off CUDA (and for fp32 inputs) the tile never changes with the row count: the interpreter's numpy
    # products round a row by its place in the tile, and fp32 products were not measured on the GPU.
    for dtype in (torch.float32, torch.float16):
        for m in (1, 16, 17, 200, 1000):
            assert invariant_launch(m, 49152, torch.empty(1, dtype=dtype)) == (BLOCK_M, BLOCK_N, BLOCK_K, NUM_WARPS)
