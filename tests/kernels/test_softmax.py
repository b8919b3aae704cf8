"""kernels/softmax.py (temperature softmax + arg-max in two launches) against its reference and the sampler's
compute_probs, under Triton's interpreter on the CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels.softmax import temperature_softmax_argmax, temperature_softmax_argmax_reference  # noqa: E402
from dspark.sample.sampler import Sampler, SamplingBatch, compute_probs  # noqa: E402
from dspark.sampling_params import SamplingParams as P  # noqa: E402


def _logits(R: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(R, V, generator=g) * 3.0
    x[0, V - 1] = x[0].max() + 4.0  # the maximum in the last (partial) tile
    if R > 2:
        x[2, 5] = x[2, V - 2] = x[2].max() + 1.0  # a tie across tiles: the first index wins
    return x


@pytest.mark.parametrize(("R", "V", "block_v"), [(5, 1003, 128), (3, 257, 64), (1, 64, 64), (7, 2000, 512)])
@pytest.mark.parametrize("one_hot", [False, True])
def test_matches_reference(R: int, V: int, block_v: int, one_hot: bool) -> None:
    x = _logits(R, V, R * V)
    t = torch.tensor([1.0, 0.0, 0.6, 1.7, 1.0, 0.3, 2.5][:R])
    probs, am = temperature_softmax_argmax(x, t, one_hot_greedy=one_hot, block_v=block_v)
    ref_p, ref_am = temperature_softmax_argmax_reference(x, t, one_hot_greedy=one_hot)
    assert torch.equal(am, ref_am), (am, ref_am)
    torch.testing.assert_close(probs, ref_p, rtol=0, atol=1e-6)
    torch.testing.assert_close(probs.sum(-1), torch.ones(R), rtol=0, atol=1e-5)


def test_buffers_strided_rows_and_errors() -> None:
    """Written into given buffers (a graph's), from rows with a stride (a view of a larger buffer), bf16 input."""
    big = _logits(6, 600, 1)
    x = big[::2, :500]  # row stride 1200, unit column stride
    t = torch.tensor([1.0, 0.5, 2.0])
    probs, am = torch.full((3, 500), float("nan")), torch.full((3,), -1, dtype=torch.int64)
    p2, a2 = temperature_softmax_argmax(x, t, probs_out=probs, argmax_out=am, block_v=128)
    assert p2 is probs and a2 is am
    ref_p, ref_am = temperature_softmax_argmax_reference(x, t)
    assert torch.equal(am, ref_am)
    torch.testing.assert_close(probs, ref_p, rtol=0, atol=1e-6)
    pb, ab = temperature_softmax_argmax(x.bfloat16(), t, block_v=128)
    rb, rab = temperature_softmax_argmax_reference(x.bfloat16(), t)
    assert torch.equal(ab, rab)
    torch.testing.assert_close(pb, rb, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="temperature"):
        temperature_softmax_argmax(x, t[:2])
    with pytest.raises(ValueError, match="probs_out"):
        temperature_softmax_argmax(x, t, probs_out=torch.empty(3, 499))
    with pytest.raises(ValueError, match="argmax_out"):
        temperature_softmax_argmax(x, t, argmax_out=torch.empty(3, dtype=torch.int32))


def test_is_compute_probs_of_a_temperature_only_batch() -> None:
    """What Sampler(fused=True).probs / probs_argmax use it for: compute_probs of a batch at temperatures only,
    ``all_random`` (the verification graph's rows: softmax for t = 0 too) or not (one-hot for t = 0)."""
    V = 1003
    x = _logits(4, V, 7)
    params = [P(temperature=1.0), P(temperature=0.0), P(temperature=0.7), P(temperature=1.3)]
    batch = SamplingBatch.build(params, [1, 2, 3, 4], [9] * 4, [[]] * 4, [[]] * 4, V, "cpu")
    assert batch.no_top_k and batch.no_top_p and batch.no_min_p and batch.no_penalties and not batch.all_random
    for b in (batch, SamplingBatch(**{**batch.__dict__, "all_random": True})):
        probs, am = temperature_softmax_argmax(x, b.temperature, one_hot_greedy=not b.all_random, block_v=128)
        torch.testing.assert_close(probs, compute_probs(x, b), rtol=0, atol=1e-6)
        assert torch.equal(am, x.argmax(-1))
    # off the GPU the sampler keeps torch's ops (the kernel is taken for CUDA tensors only)
    p, a = Sampler(fused=True).probs_argmax(x, batch)
    assert torch.equal(p, compute_probs(x, batch)) and torch.equal(a, x.argmax(-1))


# ------------------------------------------------------------------ temperature_sample (the plain step's draw)
from dspark.kernels.softmax import temperature_sample, temperature_sample_reference  # noqa: E402


@pytest.mark.parametrize(("R", "V", "block_v"), [(6, 1003, 128), (3, 257, 64), (1, 64, 64), (7, 2000, 512)])
@pytest.mark.parametrize("stream", [0, 3])
def test_sample_matches_reference(R: int, V: int, block_v: int, stream: int) -> None:
    x = _logits(R, V, 3 * R + V)
    t = torch.tensor([1.0, 0.0, 0.6, 1.7, 1.0, 0.3, 2.5][:R])
    seeds = torch.tensor([11, -5, 2**40 + 3, 7, 11, 0, 123456789][:R], dtype=torch.int64)
    pos = torch.tensor([0, 17, 2**33 + 5, 400, 1, 9, 31][:R], dtype=torch.int64)
    tok = temperature_sample(x, t, seeds, pos, stream, block_v=block_v)
    ref = temperature_sample_reference(x, t, seeds, pos, stream)
    assert torch.equal(tok, ref), (tok, ref)
    if R > 1:  # the greedy row is the raw argmax (row 0 has its maximum in the last partial tile)
        assert tok[1] == x[1].argmax()
    # greedy only: the first argmax, ties across tiles included
    assert torch.equal(temperature_sample(x, None, block_v=block_v), x.argmax(-1))


def test_sample_is_the_samplers_draw() -> None:
    """Sampler.__call__ (torch's Gumbel-max, what it runs off the GPU) of a temperature-only batch, all-random
    or mixed, draws the same tokens; the draws follow the seeds (another seed, other tokens)."""
    V = 1003
    x = _logits(5, V, 5) / 3.0  # flatter rows: the draws spread
    params = [P(temperature=1.0), P(temperature=0.0), P(temperature=0.7), P(temperature=1.3), P(temperature=1.0)]
    batch = SamplingBatch.build(params, [1, 2, 3, 4, 5], [9, 10, 11, 12, 13], [[]] * 5, [[]] * 5, V, "cpu")
    random = SamplingBatch.build(params[:1] + params[2:], [1, 3, 4, 5], [9, 11, 12, 13], [[]] * 4, [[]] * 4, V, "cpu")
    assert not batch.all_random and random.all_random
    for b, xb in ((batch, x), (random, x[[0, 2, 3, 4]])):
        for stream in (0, 2):
            tok = temperature_sample(xb, b.temperature, b.seeds, b.positions, stream, block_v=128)
            assert torch.equal(tok, Sampler()(xb, b, stream)), stream
    draws = {tuple(temperature_sample(x, batch.temperature, batch.seeds + s, batch.positions, 0, block_v=128)
                   .tolist()) for s in range(8)}
    assert len(draws) > 1
    greedy = SamplingBatch.build([P(temperature=0.0)] * 5, [0] * 5, [9] * 5, [[]] * 5, [[]] * 5, V, "cpu")
    assert torch.equal(Sampler(fused=True)(x, greedy), x.argmax(-1)) and torch.equal(Sampler(fused=True).argmax(x),
                                                                                     x.argmax(-1))


def test_sample_buffers_strided_bf16_and_errors() -> None:
    big = _logits(6, 600, 2)
    x = big[::2, :500]
    t = torch.tensor([1.0, 0.0, 2.0])
    seeds, pos = torch.tensor([1, 2, 3]), torch.tensor([5, 6, 7])
    out = torch.full((3,), -1, dtype=torch.int64)
    assert temperature_sample(x, t, seeds, pos, 0, out=out, block_v=128) is out
    assert torch.equal(out, temperature_sample_reference(x, t, seeds, pos, 0))
    xb = x.bfloat16()
    assert torch.equal(temperature_sample(xb, t, seeds, pos, 0, block_v=128),
                       temperature_sample_reference(xb, t, seeds, pos, 0))
    with pytest.raises(ValueError, match="temperature"):
        temperature_sample(x, t[:2], seeds, pos)
    with pytest.raises(ValueError, match="seeds and positions"):
        temperature_sample(x, t)
    with pytest.raises(ValueError, match="out"):
        temperature_sample(x, t, seeds, pos, out=torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        temperature_sample(x[0], None)


def test_softmax_stats_against_torch() -> None:
    """temperature_softmax_stats: per row (t, max(x / t), Σ exp(x / t - max)) to float32 rounding, t = 1 for
    greedy rows, the first arg-max exactly (ties across tiles); probs_from_stats gives softmax(x / t)."""
    from dspark.kernels.softmax import probs_from_stats, temperature_softmax_stats

    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 499, generator=g) * 4
    x[2, 10] = x[2, 300] = x[2].max() + 1  # a tie across tiles: the first wins
    t = torch.tensor([1.0, 0.0, 0.6, 2.5, 1.0])
    stats, am = temperature_softmax_stats(x, t)
    te = torch.where(t == 0, torch.ones_like(t), t)
    z = x / te[:, None]
    assert torch.equal(stats[:, 0], te)
    assert torch.equal(stats[:, 1], z.max(-1).values)
    torch.testing.assert_close(stats[:, 2], torch.exp(z - z.max(-1, keepdim=True).values).sum(-1), rtol=1e-5, atol=0)
    assert torch.equal(am, x.argmax(-1)) and int(am[2]) == 10
    torch.testing.assert_close(probs_from_stats(x, stats), torch.softmax(z, -1), rtol=1e-5, atol=1e-7)
    s2, a2 = torch.empty(5, 3), torch.empty(5, dtype=torch.int64)
    out = temperature_softmax_stats(x, t, stats_out=s2, argmax_out=a2)
    assert out[0] is s2 and out[1] is a2 and torch.equal(s2, stats)
    with pytest.raises(ValueError, match="temperature must be"):
        temperature_softmax_stats(x, t[:2])
    with pytest.raises(ValueError, match="stats_out"):
        temperature_softmax_stats(x, t, stats_out=torch.empty(5, 2))
