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


def test_cpu_split_k_and_onednn_paths_match_the_plain_product():
    """Both CPU paths of a split-K Linear (the bmm over input slices at SPLIT_K_MAX_ROWS rows or fewer,
    oneDNN's inner product above) give the plain product, with and without a bias."""
    from dspark.layers.linear import SPLIT_K_MAX_ROWS, use_cpu_split_k

    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(64, 48, bias=True), Linear(48, 40))
    for m in model:
        m.load(torch.randn(m.weight_t.shape[1], m.weight_t.shape[0]), torch.randn(m.weight_t.shape[1])
               if m.bias is not None else None)
    xs = [torch.randn(n, 64) for n in (1, SPLIT_K_MAX_ROWS, SPLIT_K_MAX_ROWS + 1, 7)]
    want = [model(x) for x in xs]
    assert use_cpu_split_k(model, chunks=4) == 2 and all(m.split_k == 4 for m in model)
    for x, w in zip(xs, want):
        torch.testing.assert_close(model(x), w, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(xs[-1].view(7, 1, 64)), want[-1].view(7, 1, 40), rtol=1e-5, atol=1e-5)
