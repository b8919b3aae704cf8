"""The fused verification kernels (dspark.kernels.rejection) vs the torch reference
``verify_probabilistic``, "standard" and "block": token for token on random ragged batches (drafts in
and out of the target's support, one-hot q as greedy drafts give, q == p, residuals with no mass,
garbage in the padding), on every launch layout (one program per request or a block of requests, one
launch or a vocabulary split over several programs plus a reduction), and chi-square tests that they
are lossless.

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py). The standard acceptance test is
exact in both (integer Philox words, a correctly rounded division); the final token is a Gumbel-max
whose logs may differ in the last bit between the interpreter (correctly rounded) and torch's CPU
log, so a token may differ only where the top two scores log(dist) + g tie to within that rounding:
``_assert_same`` accepts exactly that case, checked explicitly, and nothing else. Block acceptance
has one more such case: its residual masses R_i are float32 sums over the vocabulary in another order
than torch's, so h_i may differ by an ulp and U_i <= h_i flip where U_i is that close to h_i
(``_assert_same_block`` accepts a different τ only there, checked against h_i in float64).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels import interpreter_ready, next_pow2  # noqa: E402
from dspark.kernels.rejection import verify_block_triton, verify_standard_triton  # noqa: E402
from dspark.sample.rng import STREAM_ACCEPT, STREAM_RECOVER, gumbel, uniform  # noqa: E402
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


def _inputs(B: int, N: int, V: int, seed: int, kinds: tuple[int, ...] = (0, 1, 2, 3, 4, 5),
            spread: float = 0.7, sharp: float = 2.0) -> tuple[torch.Tensor, ...]:
    """A ragged batch whose rows mix every situation the verifier meets (row kinds cycle over b, slot
    kinds over (b, i), among ``kinds``), with garbage (-1 tokens, NaN probabilities) past each row's
    drafts. ``spread``: the noise of the perturbation of p that kinds 0, 2 and 5 draw from (small: the
    drafts are mostly accepted); ``sharp``: the scale of the target's logits (large: a peaked p, whose
    top token a greedy draft usually is)."""
    g = torch.Generator().manual_seed(seed)
    p = _softmax((B, N + 1, V), g, sharp)
    # Half the target rows have a restricted support (top-k/top-p style zeros).
    support = torch.rand(B, N + 1, V, generator=g) > 0.4
    support[..., 0] = True
    restrict = (torch.arange(B * (N + 1)).view(B, N + 1) % 2 == 1).unsqueeze(-1)
    p = torch.where(restrict & ~support, 0.0, p)
    p = p / p.sum(-1, keepdim=True)
    # q: a perturbation of p (high acceptance), an unrelated distribution (low acceptance), one-hot
    # (greedy drafts), q == p (always accepted), or q = 2p (ratio 1/2 but the residual max(p - q, 0)
    # has no mass: the reference falls back to p there).
    q_near = torch.softmax(p.clamp(min=1e-30).log()[:, :N] + spread * torch.randn(B, N, V, generator=g), dim=-1)
    q = torch.empty(B, N, V)
    drafts = torch.empty(B, N, dtype=torch.int64)
    for b in range(B):
        for i in range(N):
            kind = kinds[(3 * b + i) % len(kinds)]
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
            recover_stream: int = STREAM_RECOVER, scale: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float64 log(dist) + g of the reference's final Gumbel-max (rejection._sample_residual);
    ``scale`` [B] multiplies p in the residual (block: P_tau)."""
    B, N, V = q.shape
    rows = torch.arange(B)
    pa = p[rows, accepted]
    dist = pa
    if N:
        sp = pa if scale is None else scale.unsqueeze(1) * pa
        residual = (sp - q[rows, accepted.clamp(max=N - 1)]).clamp(min=0.0)
        use_p = (accepted == num_drafts) | ~(residual.sum(-1) > 0)
        dist = torch.where(use_p.unsqueeze(1), pa, residual)
    return dist.double().log() + gumbel(seeds, positions + accepted, recover_stream, V).double()


def _assert_same(inputs, ours, ref, recover_stream: int = STREAM_RECOVER, scale: torch.Tensor | None = None) -> int:
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
    scores = _scores(*inputs, accepted, recover_stream, scale)
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


def _strided(p, drafts, q, q_fill: float) -> tuple[torch.Tensor, ...]:
    """(p, drafts, q) as views of larger tensors: probability rows whose stride is not V, q on every
    other row of a buffer filled with ``q_fill`` elsewhere, the drafts a column slice."""
    B, N, V = q.shape
    p_big = torch.zeros(B, N + 3, V + 5)
    p_big[:, 1:N + 2, :V] = p
    q_big = torch.full((B, 2 * N, V + 3), q_fill)
    q_big[:, ::2, :V] = q
    d_big = torch.zeros(B, N + 2, dtype=torch.int64)
    d_big[:, 1:N + 1] = drafts
    return p_big[:, 1:N + 2, :V], d_big[:, 1:N + 1], q_big[:, ::2, :V]


def test_strided_and_streams() -> None:
    """Probability tensors that are slices (row strides not V), draft tokens as a column slice, and
    non-default streams."""
    p, drafts, q, nd, seeds, pos = _inputs(4, 3, 90, seed=3)
    args = _strided(p, drafts, q, 0.0) + (nd, seeds, pos)
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


# -------------------------------------------------------------------------------------------- block
_TINY = torch.finfo(torch.float32).tiny


def _block_acceptance(inputs, accept_stream: int = STREAM_ACCEPT) -> tuple[torch.Tensor, ...]:
    """The reference's block acceptance quantities for ``inputs``: P [B, N+1] f32 (P_0..P_N, rounded
    as verify_probabilistic rounds them), h [B, N] float64 (its float32 terms max(P_i p - q, 0) summed
    in float64: no summation order to speak of) and U [B, N] f32."""
    p, drafts, q, nd, seeds, positions = inputs
    B, N, V = q.shape
    valid = torch.arange(N).unsqueeze(0) < nd.unsqueeze(1)
    tok = torch.where(valid, drafts, 0).unsqueeze(2)
    ratio = torch.where(valid, p[:, :N].gather(2, tok).squeeze(2) / q.gather(2, tok).squeeze(2).clamp(min=_TINY), 1.0)
    big_p = [torch.ones(B)]
    for i in range(N):
        big_p.append(torch.minimum(big_p[-1] * ratio[:, i], torch.ones(B)))
    big_p = torch.stack(big_p, dim=1)  # [B, N+1]
    h = torch.zeros(B, N, dtype=torch.float64)
    for i in range(1, N + 1):  # h_i at column i - 1
        pi = big_p[:, i]
        if i < N:
            mass = (pi.unsqueeze(1) * p[:, i] - q[:, i]).clamp(min=0.0).double().sum(-1)
            den = mass + (1.0 - pi).double()
            mid = torch.where(den > 0, mass / den.clamp(min=_TINY), 1.0)
        else:
            mid = torch.zeros(B, dtype=torch.float64)
        h[:, i - 1] = torch.where(i < nd, mid, torch.where(i == nd, pi.double(), 0.0))
    return big_p, h, uniform(seeds, positions, accept_stream, N)


def _assert_same_block(inputs, ours, ref, accept_stream: int = STREAM_ACCEPT,
                       recover_stream: int = STREAM_RECOVER) -> tuple[int, int]:
    """ours == ref for block verification, except (1) a different τ where some U_i (i <= N_b) lies
    within 1e-6 of h_i (float32 sums of R_i in another order than torch's: h_i may differ by an ulp),
    asserted, and (2) a final token on a Gumbel near-tie, as ``_assert_same`` (with scale P_τ).
    Returns the numbers of both kinds of tie."""
    tokens, emitted = ours
    ref_tokens, ref_emitted = ref
    big_p, h, u = _block_acceptance(inputs, accept_stream)
    nd = inputs[3]
    flips = torch.nonzero(emitted != ref_emitted).flatten().tolist()
    for b in flips:
        n_b = int(nd[b])
        gap = float((u[b, :n_b].double() - h[b, :n_b]).abs().min()) if n_b else float("inf")
        assert gap < 1e-6, (b, gap, emitted[b], ref_emitted[b])  # the acceptance test tied, nothing else
    if flips:
        print(f"{len(flips)} row(s) differ in τ on a near-tie U_i ≈ h_i")
        keep = emitted == ref_emitted
        tokens = torch.where(keep.unsqueeze(1), tokens, ref_tokens)
        emitted = torch.where(keep, emitted, ref_emitted)
    scale = big_p.gather(1, (ref_emitted - 1).unsqueeze(1)).squeeze(1)  # P_τ
    return len(flips), _assert_same(inputs, (tokens, emitted), ref, recover_stream, scale)


BLOCK_LAYOUTS = {  # kwargs of verify_block_triton; with splits, block_v is set to make 2 to 8 tiles
    "one_launch": dict(block_v=512),  # mass, acceptance and Gumbel-max in one program per block of rows
    "per_row_split": dict(block_b=1, splits=3),  # GPU-like: tile sums; partial maxima; the reduction
    "block_split": dict(block_b=16, splits=3),  # 2 or 3 splits, the last one ragged where there are 3
}


def _block_layout(layout: str, V: int) -> dict:
    kw = dict(BLOCK_LAYOUTS[layout])
    if "splits" in kw:
        kw["block_v"] = max(16, next_pow2(V) // 8)
    return kw


@pytest.mark.parametrize("B,N,V,layout", [
    (1, 0, 17, "one_launch"), (1, 6, 5000, "per_row_split"), (3, 1, 1000, "per_row_split"),
    (3, 4, 17, "per_row_split"), (3, 6, 5000, "one_launch"), (8, 4, 1000, "one_launch"),
    (8, 6, 17, "block_split"), (8, 1, 5000, "block_split"), (33, 6, 1000, "block_split"),
    (33, 4, 5000, "one_launch"), (33, 0, 1000, "block_split"),
])
def test_block_matches_reference(B: int, N: int, V: int, layout: str) -> None:
    """Every row kind of ``_inputs`` (ragged counts with 0 and N, NaN padding, one-hot q, q == p,
    residuals with no mass, drafts outside p's support), B in {1, 3, 8, 33}, N in {0, 1, 4, 6}, V in
    {17, 1000, 5000}, one launch and both split layouts."""
    inputs = _inputs(B, N, V, seed=1000 * B + 10 * N + V)
    ref = verify_probabilistic(*inputs, "block")
    flips, ties = _assert_same_block(inputs, verify_block_triton(*inputs, **_block_layout(layout, V)), ref)
    # Exact on this machine; a tie of either kind (at most one here) would be accepted only as checked.
    assert flips + ties <= 1


@pytest.mark.parametrize("kinds,spread,sharp", [((0,), 0.3, 2.0), ((2,), 0.3, 6.0), ((0, 2, 3), 0.4, 4.0)],
                         ids=["near_q", "greedy_drafts", "mixed"])
def test_block_many_outcomes(kinds: tuple[int, ...], spread: float, sharp: float) -> None:
    """64 requests x 6 drafts that are often accepted (q near p; one-hot q, a greedy drafter's, against
    a peaked target; both with q == p slots): many values of τ (all of 0..6 for q near p), block
    accepting more than standard in some rows (τ past the first rejection: the LAST i with
    U_i <= h_i), bonus and recovered tokens; one launch and split."""
    B, N, V = 64, 6, 300
    inputs = _inputs(B, N, V, seed=sum(kinds) + 77, kinds=kinds, spread=spread, sharp=sharp)
    ref = verify_probabilistic(*inputs, "block")
    tau = ref[1] - 1
    assert len(set(tau.tolist())) == N + 1 if kinds == (0,) else len(set(tau.tolist())) >= 5
    assert bool((tau > verify_probabilistic(*inputs, "standard")[1] - 1).any())
    assert bool(((tau == inputs[3]) & (tau > 0)).any()) and bool((tau < inputs[3]).any())
    flips, ties = _assert_same_block(inputs, verify_block_triton(*inputs, block_v=128), ref)
    more = _assert_same_block(inputs, verify_block_triton(*inputs, block_b=32, block_v=64, splits=2), ref)
    assert flips + ties + sum(more) <= 1


def test_block_strided_and_streams() -> None:
    """Slices as in test_strided_and_streams (row strides not V, a column slice of draft tokens),
    non-default streams, through the split path."""
    p, drafts, q, nd, seeds, pos = _inputs(4, 4, 90, seed=5, kinds=(0, 3, 2), spread=0.4)
    args = _strided(p, drafts, q, float("nan")) + (nd, seeds, pos)
    ref = verify_probabilistic(*args, "block", accept_stream=6, recover_stream=7)
    ours = verify_block_triton(*args, accept_stream=6, recover_stream=7, block_v=32, splits=2)
    assert sum(_assert_same_block((p, drafts, q, nd, seeds, pos), ours, ref, 6, 7)) <= 1
    default = verify_probabilistic(p, drafts, q, nd, seeds, pos, "block")
    assert not torch.equal(default[0], ref[0])  # the streams matter


def test_block_same_tokens_on_every_layout_and_batch() -> None:
    """The residual masses are summed in the same order (tile sums of block_v tokens, in tile order)
    whatever the split count and rows per program: the tokens are bit-identical across layouts with one
    block_v, and a request verified alone gets the tokens it gets in a batch."""
    B, N, V = 4, 4, 200
    inputs = _inputs(B, N, V, seed=21, kinds=(0, 1, 3), spread=0.4)
    base = verify_block_triton(*inputs, block_v=64)  # 4 tiles
    for kw in (dict(splits=2), dict(splits=4), dict(block_b=1, splits=2), dict(block_b=2, splits=3)):
        got = verify_block_triton(*inputs, block_v=64, **kw)
        assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), kw
    rows = [1, 3]
    alone = verify_block_triton(*(t[rows] for t in inputs), block_v=64, splits=3)
    assert torch.equal(alone[0], base[0][rows]) and torch.equal(alone[1], base[1][rows])


@pytest.mark.parametrize("method", ["standard", "block"])
def test_out_of_range_drafts_are_rejected(method: str) -> None:
    """A draft id outside [0, V) in a real slot (which the reference cannot gather) is read as
    p(x) = q(x) = 0 (r = 0): exactly the reference on a vocabulary with one more token, of
    probability 0 under p and q, standing for it."""
    B, N, V = 6, 4, 60
    p, drafts, q, nd, seeds, pos = _inputs(B, N, V, seed=9, kinds=(0, 3), spread=0.3)
    nd = torch.full((B,), N)
    bad = drafts.clone()
    bad[:, 2] = torch.where(torch.arange(B) % 2 == 0, V, -1)  # slot 3: one past the end, or -1
    bad[1, 0] = V + 5  # and the first slot of row 1
    wider = drafts.clone()
    wider[bad >= V] = V
    wider[bad < 0] = V
    q = torch.nan_to_num(q)  # no padding here
    ref = verify_probabilistic(torch.cat([p, torch.zeros(B, N + 1, 1)], -1), wider,
                               torch.cat([q, torch.zeros(B, N, 1)], -1), nd, seeds, pos, method)
    verify = verify_standard_triton if method == "standard" else verify_block_triton
    tokens, emitted = verify(p, bad, q, nd, seeds, pos, block_v=16, splits=2)
    assert bool((emitted <= 3).all()) and int(emitted[1]) == 1  # never past the bad draft
    assert bool((ref[0] != V).all())  # the stand-in token is never emitted (p = 0 there)
    assert torch.equal(tokens, ref[0]) and torch.equal(emitted, ref[1])


def _block_exact(p: torch.Tensor, q: torch.Tensor, scale_one: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 law of one block verification step with N_b = 2 context-free drafts X_i ~ q_i,
    by enumeration of (X_1, X_2): the joint [V, V] of the first two tokens (the second completed from
    p_2 where the step emitted one) and the law [3] of τ. ``scale_one``: the residual after τ = 1
    wrongly built from p_2 instead of P_1·p_2 (what the chi-square below must detect)."""
    p, q = p.double(), q.double()
    V = p.shape[1]

    def residual(scale: float, pk: torch.Tensor, qk: torch.Tensor) -> torch.Tensor:
        r = (scale * pk - qk).clamp(min=0.0)
        return r / r.sum() if float(r.sum()) > 0 else pk

    joint = torch.zeros(V, V, dtype=torch.float64)
    tau = torch.zeros(3, dtype=torch.float64)
    for x1 in range(V):
        for x2 in range(V):
            w = float(q[0, x1] * q[1, x2])
            if w == 0:
                continue
            p1 = min(float(p[0, x1] / q[0, x1]), 1.0)
            p2 = min(p1 * float(p[1, x2] / q[1, x2]), 1.0)
            mass = float((p1 * p[1] - q[1]).clamp(min=0.0).sum())  # R_1
            h1 = mass / (mass + 1.0 - p1) if mass + 1.0 - p1 > 0 else 1.0
            law = (w * (1 - h1) * (1 - p2), w * h1 * (1 - p2), w * p2)  # τ = 0, 1, 2
            tau += torch.tensor(law, dtype=torch.float64)
            joint += law[0] * torch.outer(residual(1.0, p[0], q[0]), p[1])
            joint[x1] += law[1] * residual(1.0 if scale_one else p1, p[1], q[1])
            joint[x1, x2] += law[2]
    return joint, tau


# Pearson chi-square upper 0.1% points for the block test's degrees of freedom (as CHI2_999).
CHI2_999_BLOCK = {2: 13.816, 5: 20.515, 23: 49.728}


def test_block_lossless_chi_square() -> None:
    """20,000 requests (one batch, one seed each), N_b = 2, the same p_1..p_3, q_1, q_2 over V = 6
    (q_2 drafts tokens outside p_2's support): the first two tokens (the second completed from p_2
    where the step emitted one, as the next step would) ~ p_1 ⊗ p_2, the bonus ~ p_3, and τ follows
    its exact law. The enumeration first checks that block verification is lossless here, and that a
    residual without the P_τ factor would fail the joint test by far (the test has power)."""
    T, V = 20_000, 6
    p = torch.stack([_dist([9, 5, 7, 3, 4, 7]), _dist([9, 0, 6, 0, 4, 5]), _dist([4, 8, 6, 2, 5, 6])])
    q = torch.stack([_dist([2, 2, 7, 4, 2, 2]), _dist([3, 1, 2, 4, 5, 0])])
    target = torch.outer(p[0].double(), p[1].double())
    joint, tau_law = _block_exact(p, q)
    assert torch.allclose(joint, target, rtol=0, atol=1e-7)  # p, q normalised in float32
    wrong, _ = _block_exact(p, q, scale_one=True)
    support = target > 0
    assert float(T * ((wrong - target)[support] ** 2 / target[support]).sum()) > 8 * CHI2_999_BLOCK[23]

    g = torch.Generator().manual_seed(12)
    drafts = torch.stack([torch.multinomial(q[i], T, replacement=True, generator=g) for i in range(2)], dim=1)
    seeds = torch.arange(T, dtype=torch.int64) * 1_000_033 + 5
    positions = (torch.arange(T, dtype=torch.int64) * 7907) % 1_000_000
    inputs = (p.expand(T, 3, V), drafts, q.expand(T, 2, V), torch.full((T,), 2, dtype=torch.int64), seeds, positions)
    tokens, emitted = verify_block_triton(*inputs, block_b=1024)  # 20 programs, run one by one
    assert sum(_assert_same_block(inputs, (tokens, emitted), verify_probabilistic(*inputs, "block"))) <= 2

    tau = emitted - 1
    second = torch.where(tau >= 1, tokens[:, 1], torch.multinomial(p[1], T, replacement=True, generator=g))
    stat, df = _chi2(torch.bincount(tokens[:, 0] * V + second, minlength=V * V), target.flatten())
    assert df == 23 and stat < CHI2_999_BLOCK[df], f"tokens 1, 2: chi2 {stat:.1f}"
    stat, df = _chi2(torch.bincount(tau, minlength=3), tau_law)
    assert df == 2 and stat < CHI2_999_BLOCK[df], f"τ: chi2 {stat:.1f}"
    stat, df = _chi2(torch.bincount(tokens[tau == 2, 2], minlength=V), p[2])
    assert df == 5 and stat < CHI2_999_BLOCK[df], f"bonus token: chi2 {stat:.1f}"


# ------------------------------------------------------------------------------------ compiled variants
@pytest.mark.parametrize("method", ["standard", "block"])
def test_max_drafts_pads_without_changing_tokens(method: str) -> None:
    """Padding the draft dimension to the caller's block size (max_drafts: one compiled kernel for every N up
    to it) gives the same tokens, bit for bit, on one launch and on a vocabulary split."""
    fn = verify_standard_triton if method == "standard" else verify_block_triton
    for N in (1, 2, 5):
        inputs = _inputs(4, N, 67, seed=40 + N)
        for kw in ({}, dict(block_b=1, block_v=16, splits=3)):
            base = fn(*inputs, **kw)
            for max_drafts in (N, 7, 16):
                got = fn(*inputs, **kw, max_drafts=max_drafts)
                assert torch.equal(got[0], base[0]) and torch.equal(got[1], base[1]), (N, kw, max_drafts)


def test_one_launch_shape_for_every_draft_count_and_batch() -> None:
    """With max_drafts, the constexprs of a GPU launch do not depend on how many drafts or sampled requests a
    step verifies (confidence scheduling changes both every step): only HAS_MASS (N >= 2) and FINAL (one
    split) are left, four kernels, which ``precompile`` builds. Without it each draft count had its own."""
    from dspark.kernels.rejection import _launch

    def shapes(max_drafts):
        out = set()
        for n in range(1, 8):
            for batch in [*range(1, 200), *range(200, 1000, 7)]:
                L = _launch(batch, n, 49152, True, 132, None, None, None, max_drafts, programs_per_sm=6)
                out.add((L["n_pad"], L["out_pad"], L["s_pad"], L["block_v"], L["block_b"], L["has_mass"], L["final"]))
        return out

    padded = shapes(7)
    assert {s[:5] for s in padded} == {(8, 8, 64, 1024, 1)}
    assert {s[5:] for s in padded} == {(False, False), (True, False), (False, True), (True, True)}
    assert len({s[:2] for s in shapes(None)}) == 4  # N_PAD / OUT_PAD: (4, 2), (4, 4), (4, 8), (8, 8)


@pytest.mark.parametrize("method", ["standard", "block"])
def test_precompile_runs_every_variant(method: str) -> None:
    """precompile runs N = 1 and N = max_drafts, each split and in one split, from probabilities and from logits
    (target_stats), on dummy inputs, and returns the count."""
    from dspark.kernels.rejection import precompile

    assert precompile(method, 50, 5, "cpu") == 4
    assert precompile(method, 50, 1, "cpu") == 2
    assert precompile(method, 50, 5, "cpu", from_logits=True) == 4
    assert precompile(method, 50, 5, "cpu", draft_rows=True) == 4


def test_block_verification_split_default() -> None:
    """Block verification's CUDA split (BLOCK_PROGRAMS_PER_SM = 6, session 53's sweep on the H100): 24 splits of
    two tiles at batch 32, one tile per program (48 splits) at batch 16 and below; standard keeps ~2 per SM."""
    from dspark.kernels.rejection import BLOCK_PROGRAMS_PER_SM, _launch

    assert BLOCK_PROGRAMS_PER_SM == 6
    got = {b: _launch(b, 3, 49152, True, 132, None, None, None, 7, programs_per_sm=6)["n_split"]
           for b in (1, 8, 16, 32)}
    assert got == {1: 48, 8: 48, 16: 48, 32: 24}, got
    assert _launch(32, 3, 49152, True, 132, None, None, None, 7)["n_split"] == 8  # standard's default: 2 per SM


# ------------------------------------------------------------------------------------------ from logits
def _logits_inputs(B: int, N: int, V: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Target logits [B * (N+1), V] with per-row temperatures (0 among them), and drafts drawn from a q near
    the target's distribution at those temperatures (or one-hot: greedy drafts), ragged with -1 / NaN padding."""
    from dspark.kernels.softmax import temperature_softmax_argmax

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B * (N + 1), V, generator=g) * 3.0
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.5, 2.0])[torch.arange(B) % 6]
    t = temps.repeat_interleave(N + 1)
    probs, _ = temperature_softmax_argmax(logits, t)
    p = probs.view(B, N + 1, V)
    q = torch.softmax(p[:, :N].clamp(min=1e-30).log() + 0.6 * torch.randn(B, N, V, generator=g), dim=-1)
    q[1::3] = torch.nn.functional.one_hot(q[1::3].argmax(-1), V).float()
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, N)
    nd = torch.randint(0, N + 1, (B,), generator=g)
    nd[0] = N
    pad = torch.arange(N).unsqueeze(0) >= nd.unsqueeze(1)
    drafts = torch.where(pad, -1, drafts)
    q = torch.where(pad.unsqueeze(-1), float("nan"), q)
    seeds = torch.randint(-(2**62), 2**62, (B,), generator=g)
    positions = torch.randint(0, 2**33, (B,), generator=g)
    return logits, t, drafts, q, nd, seeds, positions


# (layout, B, N, V) of the from-logits and draft-rows tests. In Triton's interpreter a split layout's time goes by
# its vocabulary tiles (16-32 columns), so the split layouts take V = 97, still several tiles to a split, a ragged
# last tile and empty splits (block_split: 64 splits of 2 columns), B = 3 over their request blocks (block_b 2:
# a ragged last block); the one launch takes the larger vocabularies. N = 0, 1 and >= 2 on every layout.
_SPLIT_SHAPES = [(3, 3, 97), (4, 1, 97), (3, 5, 97), (2, 0, 50)]
LAYOUT_SHAPES = [*[("one_launch", *s) for s in [(6, 3, 300), (4, 1, 97), (3, 5, 256), (2, 0, 50)]],
                 *[(layout, *s) for layout in ("per_row_split", "block_split") for s in _SPLIT_SHAPES]]


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("layout,B,N,V", LAYOUT_SHAPES)
def test_from_logits_same_tokens_as_from_probs(method: str, layout: str, B: int, N: int, V: int) -> None:
    """target_stats (softmax.temperature_softmax_stats) with the logits gives the tokens and counts of
    temperature_softmax_argmax's probabilities, exactly: each p is made with the ops that would have written it."""
    from dspark.kernels.softmax import temperature_softmax_argmax, temperature_softmax_stats

    fn = {"standard": verify_standard_triton, "block": verify_block_triton}[method]
    total = torch.zeros(2, dtype=torch.int64)
    for seed in range(3):
        logits, t, drafts, q, nd, seeds, positions = _logits_inputs(B, N, V, 100 * seed + 7 * B + N)
        probs, am = temperature_softmax_argmax(logits, t)
        stats, am2 = temperature_softmax_stats(logits, t)
        assert torch.equal(am, am2)
        want = fn(probs.view(B, N + 1, V), drafts, q, nd, seeds, positions, **LAYOUTS[layout])
        got = fn(logits.view(B, N + 1, V), drafts, q, nd, seeds, positions, **LAYOUTS[layout],
                 target_stats=stats.view(B, N + 1, 3))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)
        total += torch.stack([(want[1] - 1).sum(), nd.sum()])
    if N:
        assert 0 < total[0] < total[1]  # some drafts accepted, some rejected: the acceptance really compared


def test_from_logits_rejects_bad_stats() -> None:
    logits, t, drafts, q, nd, seeds, positions = _logits_inputs(2, 2, 50, 1)
    x = logits.view(2, 3, 50)
    with pytest.raises(ValueError, match="target_stats must be float32"):
        verify_block_triton(x, drafts, q, nd, seeds, positions, target_stats=torch.ones(2, 3, 2))
    with pytest.raises(ValueError, match="target_stats must be float32"):
        verify_standard_triton(x, drafts, q, nd, seeds, positions, target_stats=torch.ones(2, 3, 3).double())


# ------------------------------------------------------------------------------------------ draft rows
@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("layout,B,N,V,from_logits",
                         [(*c, False) for c in LAYOUT_SHAPES if c[2] != 5]  # N = 5: the from-logits test's
                         + [(*c, True) for c in LAYOUT_SHAPES if c[1:] in [(6, 3, 300), _SPLIT_SHAPES[0]]])
def test_draft_rows_read_each_request_q_at_its_row(method: str, layout: str, B: int, N: int, V: int,
                                                   from_logits: bool) -> None:
    """draft_rows (the verification graphs: each request's q where the drafter graph wrote it) gives the tokens
    and counts of passing draft_probs.index_select(0, draft_rows): rows out of order, repeated, past B, and
    other rows holding other (NaN) values that must not be read. With the target's logits (FROM_LOGITS, what the
    graphs of 128 rows and more pass) on one shape per layout: the two constexprs touch separate loads
    (_q_base, _tp_load), and test_from_logits_same_tokens_as_from_probs covers the logits on every shape."""
    from dspark.kernels.softmax import temperature_softmax_argmax, temperature_softmax_stats

    fn = {"standard": verify_standard_triton, "block": verify_block_triton}[method]
    for seed in range(2):
        logits, t, drafts, q, nd, seeds, positions = _logits_inputs(B, N, V, 31 * seed + 5 * B + N)
        probs, _ = temperature_softmax_argmax(logits, t)
        g = torch.Generator().manual_seed(seed)
        rows = torch.randperm(2 * B + 3, generator=g)[:B]  # distinct rows of a larger buffer, in any order
        rows[-1] = rows[0] if B > 2 and seed else rows[-1]  # and, once, one row read by two requests
        buf = torch.full((2 * B + 3, N, V), float("nan"))
        buf[rows] = q if not (B > 2 and seed) else torch.cat([q[:-1], q[:1]])
        q_eff = buf.index_select(0, rows)
        kw = dict(LAYOUTS[layout])
        if from_logits:
            stats, _ = temperature_softmax_stats(logits, t)
            tp, kw["target_stats"] = logits.view(B, N + 1, V), stats.view(B, N + 1, 3)
        else:
            tp = probs.view(B, N + 1, V)
        want = fn(tp, drafts, q_eff, nd, seeds, positions, **kw)
        got = fn(tp, drafts, buf, nd, seeds, positions, draft_rows=rows, **kw)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (got, want)


def test_draft_rows_rejects_bad_rows() -> None:
    logits, t, drafts, q, nd, seeds, positions = _logits_inputs(2, 2, 50, 1)
    from dspark.kernels.softmax import temperature_softmax_argmax

    p = temperature_softmax_argmax(logits, t)[0].view(2, 3, 50)
    with pytest.raises(ValueError, match="draft_rows must be int64"):
        verify_block_triton(p, drafts, q, nd, seeds, positions, draft_rows=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="draft_rows must be int64"):
        verify_standard_triton(p, drafts, q[:, :1], nd, seeds, positions, draft_rows=torch.zeros(2, dtype=torch.int64))
