"""The fused standard-verification kernel (dspark.kernels.rejection) vs the torch reference
``verify_probabilistic(..., "standard")``: token for token on random ragged batches (drafts in and out
of the target's support, one-hot q as greedy drafts give, q == p, residuals with no mass, garbage in
the padding), on every launch layout (one program per request or a block of requests, one launch
or a vocabulary split over several programs plus a reduction), and a chi-square test that it is
lossless.

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py). The acceptance test is exact in
both (integer Philox words, a correctly rounded division); the final token is a Gumbel-max whose
logs may differ in the last bit between the interpreter (correctly rounded) and torch's CPU log, so
a token may differ only where the top two scores log(dist) + g tie to within that rounding:
``_assert_same`` accepts exactly that case, checked explicitly, and nothing else.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels import interpreter_ready  # noqa: E402
from dspark.kernels.rejection import verify_standard_triton  # noqa: E402
from dspark.sample.rng import STREAM_RECOVER, gumbel  # noqa: E402
from dspark.spec.rejection import verify_probabilistic  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not interpreter_ready(), reason="Triton interpreter not active in this process"),
    # log(0) = -inf is intended (tokens outside the support); numpy warns about it in the interpreter.
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread_module"),  # tiny tensors: intra-op threads only add overhead
]


# ------------------------------------------------------------------------------------------- inputs
def _softmax(shape: tuple[int, ...], g: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    return torch.softmax(torch.randn(*shape, generator=g) * scale, dim=-1)


def _inputs(B: int, N: int, V: int, seed: int) -> tuple[torch.Tensor, ...]:
    """A ragged batch whose rows mix every situation the verifier meets (row kinds cycle over b, slot
    kinds over (b, i)), with garbage (-1 tokens, NaN probabilities) past each row's drafts."""
    g = torch.Generator().manual_seed(seed)
    p = _softmax((B, N + 1, V), g)
    # Half the target rows have a restricted support (top-k/top-p style zeros).
    support = torch.rand(B, N + 1, V, generator=g) > 0.4
    support[..., 0] = True
    restrict = (torch.arange(B * (N + 1)).view(B, N + 1) % 2 == 1).unsqueeze(-1)
    p = torch.where(restrict & ~support, 0.0, p)
    p = p / p.sum(-1, keepdim=True)
    # q: a perturbation of p (high acceptance), an unrelated distribution (low acceptance), one-hot
    # (greedy drafts), q == p (always accepted), or q = 2p (ratio 1/2 but the residual max(p - q, 0)
    # has no mass: the reference falls back to p there).
    q_near = torch.softmax(p.clamp(min=1e-30).log()[:, :N] + 0.7 * torch.randn(B, N, V, generator=g), dim=-1)
    q = torch.empty(B, N, V)
    drafts = torch.empty(B, N, dtype=torch.int64)
    for b in range(B):
        for i in range(N):
            kind = (3 * b + i) % 6
            if kind == 0:
                qi = q_near[b, i]
            elif kind == 1:
                qi = _softmax((V,), g, 1.0)
            elif kind == 2:  # greedy draft: one-hot at a token of q_near (maybe outside p's support)
                qi = torch.zeros(V)
                qi[torch.multinomial(q_near[b, i], 1, generator=g)] = 1.0
            elif kind == 3:
                qi = p[b, i].clone()
            elif kind == 4:
                qi = 2.0 * p[b, i]
            else:  # q_near, but the draft forced outside the target's support when it has one
                qi = q_near[b, i]
            q[b, i] = qi
            drafts[b, i] = torch.multinomial(qi, 1, generator=g)
            if kind == 5 and bool((p[b, i] == 0).any()):
                drafts[b, i] = int(torch.nonzero(p[b, i] == 0)[0])
    num_drafts = torch.randint(0, N + 1, (B,), generator=g)
    num_drafts[0] = N  # at least one full row (and with B > 1, usually a shorter one)
    if B > 1:
        num_drafts[1] = 0
    pad = torch.arange(N).unsqueeze(0) >= num_drafts.unsqueeze(1)  # [B, N]
    drafts = torch.where(pad, -1, drafts)
    q = torch.where(pad.unsqueeze(-1), float("nan"), q)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    positions = torch.randint(0, 2**33, (B,), generator=g)  # past 2^32 too (the counter's high word)
    return p, drafts, q, num_drafts, seeds, positions


def _scores(p, drafts, q, num_drafts, seeds, positions, accepted: torch.Tensor,
            recover_stream: int = STREAM_RECOVER) -> torch.Tensor:
    """[B, V] float64 log(dist) + g of the reference's final Gumbel-max (rejection._sample_residual)."""
    B, N, V = q.shape
    rows = torch.arange(B)
    pa = p[rows, accepted]
    dist = pa
    if N:
        residual = (pa - q[rows, accepted.clamp(max=N - 1)]).clamp(min=0.0)
        use_p = (accepted == num_drafts) | ~(residual.sum(-1) > 0)
        dist = torch.where(use_p.unsqueeze(1), pa, residual)
    return dist.double().log() + gumbel(seeds, positions + accepted, recover_stream, V).double()


def _assert_same(inputs, ours, ref, recover_stream: int = STREAM_RECOVER) -> int:
    """ours == ref, except a final token that differs on a float near-tie (asserted: both tokens'
    scores within 1e-5 of each other, the top two of the row). Returns the number of such ties."""
    tokens, emitted = ours
    ref_tokens, ref_emitted = ref
    assert tokens.dtype == torch.int64 and emitted.dtype == torch.int64
    assert tokens.shape == ref_tokens.shape and emitted.shape == ref_emitted.shape
    assert torch.equal(emitted, ref_emitted), (emitted, ref_emitted)  # the acceptance test is exact
    if torch.equal(tokens, ref_tokens):
        return 0
    accepted = ref_emitted - 1
    rows = torch.arange(tokens.shape[0])
    final, ref_final = tokens[rows, accepted], ref_tokens[rows, accepted]
    others = tokens.clone()
    others[rows, accepted] = ref_tokens[rows, accepted]
    assert torch.equal(others, ref_tokens), "mismatch outside the final token"
    scores = _scores(*inputs, accepted, recover_stream)
    bad = torch.nonzero(final != ref_final).flatten().tolist()
    for b in bad:
        top2 = scores[b].topk(2).values
        gap = float(scores[b, ref_final[b]] - scores[b, final[b]])
        assert abs(gap) < 1e-5 and float(top2[0] - top2[1]) < 1e-5, (b, gap, top2)
    print(f"{len(bad)} final token(s) differ on a float near-tie of the top two scores")
    return len(bad)


# ---------------------------------------------------------------------------------------- exactness
LAYOUTS = {  # kwargs of verify_standard_triton
    "one_launch": {},  # block_b requests per program, the whole vocabulary: the kernel writes the result
    "per_row_split": dict(block_b=1, block_v=32, splits=3),  # GPU-like: a program per (request, split)
    "block_split": dict(block_b=2, block_v=16, splits=64),  # ragged last split, one tile per split
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("B,N,V", [(1, 0, 50), (1, 5, 300), (3, 0, 97), (3, 1, 300), (3, 5, 50),
                                   (5, 1, 64), (5, 5, 131), (5, 0, 300), (1, 1, 77)])
def test_matches_reference(B: int, N: int, V: int, layout: str) -> None:
    inputs = _inputs(B, N, V, seed=1000 * B + 10 * N + V)
    ref = verify_probabilistic(*inputs, "standard")
    ours = verify_standard_triton(*inputs, **LAYOUTS[layout])
    # Exact on this machine; a near-tie (at most one here) would be accepted only as checked above.
    assert _assert_same(inputs, ours, ref) <= 1


def test_many_outcomes_one_batch() -> None:
    """64 requests x 5 drafts: accepted counts 0..4 (5 too where a row allows it), recovered and bonus
    tokens, the no-mass fallback, in one batch, on the one-launch and the split layouts."""
    inputs = _inputs(64, 5, 200, seed=7)
    ref = verify_probabilistic(*inputs, "standard")
    accepted = ref[1] - 1
    assert set(accepted.tolist()) >= set(range(5))
    assert bool(((accepted == inputs[3]) & (inputs[3] > 0)).any()) and bool((accepted < inputs[3]).any())
    # The q = 2p slots (kind 4) were rejected in some rows: the residual fallback was exercised.
    p, _, q, _, _, _ = inputs
    rows = torch.arange(64)
    rejected = accepted < inputs[3]
    qa = q[rows, accepted.clamp(max=4)]
    no_mass = rejected & ~((p[rows, accepted] - qa).clamp(min=0).sum(-1) > 0)
    assert bool(no_mass.any())
    ties = _assert_same(inputs, verify_standard_triton(*inputs), ref)
    ties += _assert_same(inputs, verify_standard_triton(*inputs, block_b=8, block_v=64, splits=2), ref)
    assert ties <= 1


def test_strided_and_streams() -> None:
    """Probability tensors that are slices (row strides not V), draft tokens as a column slice, and
    non-default streams."""
    B, N, V = 4, 3, 90
    p, drafts, q, nd, seeds, pos = _inputs(B, N, V, seed=3)
    p_big = torch.zeros(B, N + 3, V + 5)
    p_big[:, 1:N + 2, :V] = p
    q_big = torch.zeros(B, 2 * N, V + 3)
    q_big[:, ::2, :V] = q
    d_big = torch.zeros(B, N + 2, dtype=torch.int64)
    d_big[:, 1:N + 1] = drafts
    args = (p_big[:, 1:N + 2, :V], d_big[:, 1:N + 1], q_big[:, ::2, :V], nd, seeds, pos)
    ref = verify_probabilistic(*args, "standard", accept_stream=6, recover_stream=7)
    ours = verify_standard_triton(*args, accept_stream=6, recover_stream=7, block_v=32, splits=2)
    assert _assert_same((p, drafts, q, nd, seeds, pos), ours, ref, recover_stream=7) <= 1
    default = verify_probabilistic(p, drafts, q, nd, seeds, pos, "standard")
    assert not torch.equal(default[0], ref[0])  # the streams matter


def test_empty_batch() -> None:
    tokens, emitted = verify_standard_triton(torch.zeros(0, 4, 10), torch.zeros(0, 3, dtype=torch.int64),
                                             torch.zeros(0, 3, 10), torch.zeros(0, dtype=torch.int64),
                                             torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert tokens.shape == (0, 4) and emitted.shape == (0,)


# ------------------------------------------------------------------------------------- statistics
def _dist(weights: list[float]) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


# Pearson chi-square upper 0.1% points, scipy.stats.chi2.ppf(0.999, df) (scipy is not in the venv;
# tests/spec/test_rejection.py derives the same values by bisection on torch.special.gammaincc).
CHI2_999 = {4: 18.467, 5: 20.515}


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom; cells of probability 0 must be empty."""
    counts, probs = counts.double(), probs.double()
    zero = probs <= 0
    assert float(counts[zero].sum()) == 0, "a token with target probability 0 was emitted"
    expected = probs[~zero] * counts.sum()
    return float(((counts[~zero] - expected) ** 2 / expected).sum()), int((~zero).sum()) - 1


def test_lossless_chi_square() -> None:
    """20,000 requests (one batch, one seed each) with the same p_1..p_3 and q_1, q_2 over V = 6:
    the first emitted token ~ p_1, the second (where X_1 was accepted) ~ p_2, the bonus ~ p_3, and
    P(X_1 accepted) = Σ min(p_1, q_1)."""
    T, V = 20_000, 6
    p = torch.stack([_dist([5, 0, 3, 2, 6, 3]), _dist([1, 4, 4, 2, 1, 8]), _dist([3, 3, 1, 1, 2, 10])])
    q = torch.stack([_dist([2, 4, 1, 6, 3, 4]), _dist([3, 3, 3, 1, 1, 9])])
    g = torch.Generator().manual_seed(11)
    drafts = torch.stack([torch.multinomial(q[i], T, replacement=True, generator=g) for i in range(2)], dim=1)
    seeds = torch.arange(T, dtype=torch.int64) * 1_000_003 + 17
    positions = (torch.arange(T, dtype=torch.int64) * 7919) % 1_000_000
    inputs = (p.expand(T, 3, V), drafts, q.expand(T, 2, V), torch.full((T,), 2, dtype=torch.int64), seeds, positions)
    # block_b: 20 programs, which the interpreter runs one by one.
    tokens, emitted = verify_standard_triton(*inputs, block_b=1024)
    assert _assert_same(inputs, (tokens, emitted), verify_probabilistic(*inputs, "standard")) <= 2

    # The test has power: a sampler that resamples from p (not the residual) after a rejection emits
    # min(p, q) + (1 - Σ min(p, q)) p; its expected chi-square here is far above the critical value.
    overlap = torch.minimum(p[0], q[0])
    naive = overlap + (1 - overlap.sum()) * p[0]
    assert float(T * ((naive - p[0]) ** 2 / p[0].clamp(min=1e-9)).sum()) > 10 * CHI2_999[5]

    stat, df = _chi2(torch.bincount(tokens[:, 0], minlength=V), p[0])
    assert df == 4 and stat < CHI2_999[df], f"token 1: chi2 {stat:.1f}"
    second = emitted >= 2
    stat, df = _chi2(torch.bincount(tokens[second, 1], minlength=V), p[1])
    assert df == 5 and stat < CHI2_999[df], f"token 2: chi2 {stat:.1f}"
    bonus = emitted == 3
    stat, df = _chi2(torch.bincount(tokens[bonus, 2], minlength=V), p[2])
    assert df == 5 and stat < CHI2_999[df], f"bonus token: chi2 {stat:.1f}"

    rate = float(second.double().mean())
    expected = float(overlap.sum())
    se = (expected * (1 - expected) / T) ** 0.5
    assert abs(rate - expected) < 4 * se, (rate, expected, se)
