"""The batch-invariant matmul (dspark/kernels/matmul.py) in Triton's interpreter: equal to the reference,
and each row's result the same bit for bit whatever the number of rows in the call."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.matmul import BLOCK_M, matmul_invariant, matmul_reference


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
