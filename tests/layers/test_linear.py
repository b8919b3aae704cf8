"""layers/linear.py: the output-major re-layout (a CUDA option) keeps every product's values."""

from __future__ import annotations

import torch

from dspark.layers.linear import Linear, use_output_major


def test_output_major_relayout_keeps_the_products():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(24, 40, bias=True), Linear(40, 8))
    for m in model:
        m.load(torch.randn(m.weight_t.shape[1], m.weight_t.shape[0]), torch.randn(m.weight_t.shape[1])
               if m.bias is not None else None)
    x = torch.randn(5, 24)
    want = model(x)
    assert use_output_major(model) == 2
    w = model[0].weight_t
    assert w.shape == (24, 40) and w.stride() == (1, 24)  # a [40, 24] contiguous tensor seen transposed
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert use_output_major(model) == 0  # already re-laid: left alone
