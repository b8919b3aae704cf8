"""The batch-invariant matmul (dspark/kernels/matmul.py) in Triton's interpreter: equal to the reference,
and each row's result the same bit for bit whatever the number of rows in the call."""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.matmul import matmul_invariant, matmul_reference


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
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=g)
    w = torch.randn(96, 80, generator=g)
    full = matmul_invariant(x, w)
    for rows in ([0], [5, 6, 7, 8, 9, 10], list(range(64, 70))):
        assert torch.equal(matmul_invariant(x[rows], w), full[rows])


def test_out_and_leading_dims():
    x = torch.randn(2, 3, 64)
    w = torch.randn(64, 16)
    out = torch.empty(6, 16)
    assert matmul_invariant(x.view(6, 64), w, out=out) is out
    torch.testing.assert_close(matmul_invariant(x, w), (x @ w), rtol=1e-5, atol=1e-5)
