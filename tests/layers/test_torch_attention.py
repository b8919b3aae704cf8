"""layers/attention.py helpers of the torch backend."""

from __future__ import annotations

import torch

from dspark.layers.attention import gather_rows


def test_gather_rows_is_advanced_indexing():
    torch.manual_seed(0)
    t = torch.randn(50, 3, 4)
    for index in (torch.tensor([3, 0, 49, 3]), torch.randint(0, 50, (8, 13)), torch.zeros(2, 0, dtype=torch.long)):
        got = gather_rows(t, index)
        assert got.shape == (*index.shape, 3, 4)
        assert torch.equal(got, t[index])
