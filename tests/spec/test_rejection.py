"""Speculative verification (dspark.spec.rejection): greedy prefix matching on hand-made cases, exact
edge cases, and chi-square tests that standard and block verification are lossless, including a test
that the chi-square can fail (draft noise sharing the acceptance stream, the bug vLLM shipped).

Statistical setup: the target distributions p_1..p_{N+1} and draft distributions q_1..q_N over a
small vocabulary do not depend on earlier tokens, so sampling from the target token by token gives
independent tokens with joint p_1 ⊗ p_2 ⊗ p_3. Each trial is one verify step with its own seed and
position; tokens the step did not emit are completed from p_k with an independent stream (what the
engine's next step would do), so the first three tokens always exist and their joint distribution
must be exactly p_1 ⊗ p_2 ⊗ p_3.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

import dspark.spec.rejection as rejection
from dspark.sample.rng import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RECOVER, STREAM_SAMPLE, gumbel, uniform
from dspark.spec.rejection import verify_greedy, verify_probabilistic



pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny tensors: threads only add overhead


ALPHA = 1e-3  # fixed significance of every chi-square test below
# scipy.stats.chi2.ppf(0.999, df) for a few df: checks the bisection that gives any df's critical value.
CHI2_CRITICAL_999 = {1: 10.828, 5: 20.515, 10: 29.588, 35: 66.619, 100: 149.449}
TRIALS = 40_000
V = 6
N = 3
K = 3  # tokens whose joint distribution is checked
METHODS = ("standard", "block")


# ------------------------------------------------------------------------------------------ chi-square


def chi2_critical(df: int, alpha: float = ALPHA) -> float:
    """Upper-alpha point of chi-square(df): solves Q(df/2, x/2) = alpha by bisection (no scipy)."""
    lo, hi = 0.0, 10.0 * df + 100.0
    half_df = torch.tensor(df / 2.0, dtype=torch.float64)
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if float(torch.special.gammaincc(half_df, torch.tensor(mid / 2.0, dtype=torch.float64))) > alpha:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of `counts` against `probs` (same shape, any rank).

    Cells with probability 0 must be empty (asserted). Cells with expected count < 5 are pooled into
    one cell so the chi-square approximation holds.
    """
    counts = counts.flatten().double()
    probs = probs.flatten().double()
    total = counts.sum()
    impossible = probs <= 0
    assert float(counts[impossible].sum()) == 0, "a token with target probability 0 was emitted"
    expected = probs[~impossible] * total
    observed = counts[~impossible]
    small = expected < 5
    if bool(small.any()):
        expected = torch.cat([expected[~small], expected[small].sum().view(1)])
        observed = torch.cat([observed[~small], observed[small].sum().view(1)])
    stat = float(((observed - expected) ** 2 / expected).sum())
    return stat, expected.numel() - 1


def assert_fits(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    stat, df = chi_square(counts, probs)
    assert stat < chi2_critical(df), f"{what}: chi2 = {stat:.1f} >= {chi2_critical(df):.1f} (df {df})"


def test_chi2_critical_values() -> None:
    for df, value in CHI2_CRITICAL_999.items():
        assert chi2_critical(df) == pytest.approx(value, abs=2e-3)


# ---------------------------------------------------------------------------------------- simulation


def dist(weights: list[float]) -> torch.Tensor:
    t = torch.tensor(weights, dtype=torch.float32)
    return t / t.sum()


def sample_drafts(q: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int) -> torch.Tensor:
    """[T, N] drafts, X_i ~ q_i by Gumbel-max with gumbel(seed, position of draft i, stream, V).

    q: [T, N, V]. Per-position keying, as dspark.spec.proposer does."""
    vocab = q.shape[-1]
    cols = [(q[:, i].log() + gumbel(seeds, positions + i, stream, vocab)).argmax(dim=-1) for i in range(q.shape[1])]
    return torch.stack(cols, dim=1)


def simulate(
    p: torch.Tensor,
    q: torch.Tensor,
    method: str,
    *,
    trials: int = TRIALS,
    seed0: int = 0,
    num_drafts: torch.Tensor | None = None,
    draft_stream: int = STREAM_DRAFT,
    accept_stream: int = STREAM_ACCEPT,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One verify step per trial; returns (first K tokens [T, K] completed from p, num_emitted [T]).

    p: [N+1, V] target distributions p_1..p_{N+1}; q: [N, V] draft distributions q_1..q_N (the same
    for every trial). Trial t has seed seed0 + t (well mixed by Philox) and a scattered position.
    """
    n, vocab = q.shape
    seeds = seed0 * 1_000_003 + torch.arange(trials, dtype=torch.int64)
    positions = (torch.arange(trials, dtype=torch.int64) * 7919 + 13 * seed0) % 1_000_000
    target = p.expand(trials, n + 1, vocab)
    drafts_q = q.expand(trials, n, vocab)
    drafts = sample_drafts(drafts_q, seeds, positions, draft_stream)
    nd = torch.full((trials,), n, dtype=torch.int64) if num_drafts is None else num_drafts
    tokens, emitted = verify_probabilistic(
        target, drafts, drafts_q, nd, seeds, positions, method, accept_stream=accept_stream
    )
    # Complete the first K tokens: token k (0-based) not emitted this step comes from p_{k+1}
    # (context-free target), drawn with an independent stream at its own position.
    out = tokens[:, :K].clone()
    for k in range(K):
        fresh = (p[k].log() + gumbel(seeds, positions + k, STREAM_SAMPLE, vocab)).argmax(dim=-1)
        out[:, k] = torch.where(emitted > k, out[:, k], fresh)
    return out, emitted


def check_lossless(tokens: torch.Tensor, p: torch.Tensor, what: str) -> None:
    """Token 1 ~ p_1, (token 1, token 2) ~ p_1 ⊗ p_2 and (token 1..3) ~ p_1 ⊗ p_2 ⊗ p_3."""
    vocab = p.shape[-1]
    t1 = torch.bincount(tokens[:, 0], minlength=vocab)
    assert_fits(t1, p[0], f"{what}, token 1")
    t12 = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab**2)
    assert_fits(t12, torch.outer(p[0], p[1]), f"{what}, tokens 1-2")
    t123 = torch.bincount((tokens[:, 0] * vocab + tokens[:, 1]) * vocab + tokens[:, 2], minlength=vocab**3)
    joint = torch.einsum("a,b,c->abc", p[0], p[1], p[2])
    assert_fits(t123, joint, f"{what}, tokens 1-3")


P_GENERIC = torch.stack(
    [dist([5, 1, 3, 2, 6, 3]), dist([1, 4, 4, 2, 1, 8]), dist([3, 3, 1, 1, 2, 10]), dist([2, 2, 2, 1, 1, 2])]
)
# Cases: (p rows p_1..p_4, q rows q_1..q_3), all over V = 6 tokens.
CASES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
    "generic": (
        P_GENERIC,
        torch.stack([dist([2, 4, 1, 6, 3, 4]), dist([3, 3, 3, 1, 1, 9]), dist([6, 1, 1, 1, 4, 7])]),
    ),
    "q_zero_where_p_positive": (
        P_GENERIC,
        torch.stack([dist([6, 0, 0, 4, 5, 0]), dist([0, 5, 1, 0, 0, 9]), dist([2, 0, 3, 0, 0, 8])]),
    ),
    "p_zero_where_q_positive": (
        torch.stack(
            [dist([5, 0, 3, 0, 6, 3]), dist([0, 4, 4, 0, 2, 8]), dist([3, 3, 0, 0, 2, 10]), dist([0, 2, 2, 1, 0, 2])]
        ),
        torch.stack([dist([2, 4, 1, 6, 3, 4]), dist([3, 3, 3, 1, 1, 9]), dist([6, 1, 1, 1, 4, 7])]),
    ),
    "p_equals_q": (
        P_GENERIC,
        P_GENERIC[:N],
    ),
    "q_one_hot": (  # greedy drafts against a sampling target
        P_GENERIC,
        F.one_hot(torch.tensor([4, 5, 0]), V).float(),
    ),
}


# -------------------------------------------------------------------------------------------- greedy


def test_greedy_all_accepted_bonus() -> None:
    tokens, emitted = verify_greedy(torch.tensor([[4, 5, 6, 7]]), torch.tensor([[4, 5, 6]]), torch.tensor([3]))
    assert tokens.tolist() == [[4, 5, 6, 7]] and emitted.tolist() == [4]


def test_greedy_first_rejected() -> None:
    tokens, emitted = verify_greedy(torch.tensor([[4, 5, 6, 7]]), torch.tensor([[9, 5, 6]]), torch.tensor([3]))
    assert tokens.tolist() == [[4, -1, -1, -1]] and emitted.tolist() == [1]


def test_greedy_middle_mismatch() -> None:
    # Draft 3 matches its row but draft 2 does not: acceptance stops at the first mismatch.
    tokens, emitted = verify_greedy(torch.tensor([[4, 5, 6, 7]]), torch.tensor([[4, 8, 6]]), torch.tensor([3]))
    assert tokens.tolist() == [[4, 5, -1, -1]] and emitted.tolist() == [2]


def test_greedy_no_drafts() -> None:
    tokens, emitted = verify_greedy(torch.tensor([[4, 5, 6, 7]]), torch.tensor([[4, 5, 6]]), torch.tensor([0]))
    assert tokens.tolist() == [[4, -1, -1, -1]] and emitted.tolist() == [1]
    tokens, emitted = verify_greedy(torch.tensor([[3]]), torch.empty(1, 0, dtype=torch.int64), torch.tensor([0]))
    assert tokens.tolist() == [[3]] and emitted.tolist() == [1]


def test_greedy_mixed_draft_counts() -> None:
    argmax = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7], [1, 2, 3, 4]])
    drafts = torch.tensor([[4, 5, 6], [4, 5, -7], [4, 9, 6], [4, 5, 6], [1, 2, 3]])  # -7: padding garbage
    nd = torch.tensor([3, 2, 3, 1, 0])
    tokens, emitted = verify_greedy(argmax, drafts, nd)
    assert tokens.tolist() == [
        [4, 5, 6, 7],  # all 3 accepted + bonus
        [4, 5, 6, -1],  # N_b = 2: both accepted, bonus from row 2 (padding ignored)
        [4, 5, -1, -1],  # draft 2 rejected: recovered = row 1
        [4, 5, -1, -1],  # N_b = 1: accepted + bonus from row 1 (drafts 2, 3 would match but are padding)
        [1, -1, -1, -1],  # N_b = 0: the target's own token
    ]
    assert emitted.tolist() == [4, 3, 2, 2, 1]


# ----------------------------------------------------------------------------- probabilistic: exact


def random_batch(batch: int, n: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(2 * torch.randn(batch, n + 1, vocab, generator=g), dim=-1)
    draft_p = torch.softmax(2 * torch.randn(batch, n, vocab, generator=g), dim=-1)
    drafts = torch.multinomial(draft_p.view(-1, vocab), 1, generator=g).view(batch, n)
    return target, draft_p, drafts


def test_unknown_method() -> None:
    target, draft_p, drafts = random_batch(1, 2, 5, 0)
    with pytest.raises(ValueError):
        verify_probabilistic(target, drafts, draft_p, torch.tensor([2]), torch.tensor([0]), torch.tensor([0]), "x")


@pytest.mark.parametrize("method", METHODS)
def test_one_hot_target_matches_greedy(method: str) -> None:
    """A greedy target (one-hot p) with greedy drafts (one-hot q) verifies exactly like verify_greedy."""
    g = torch.Generator().manual_seed(1)
    batch, n, vocab = 64, 4, 5
    argmax = torch.randint(0, vocab, (batch, n + 1), generator=g)
    other = torch.randint(0, vocab, (batch, n), generator=g)
    drafts = torch.where(torch.rand(batch, n, generator=g) < 0.7, argmax[:, :n], other)
    nd = torch.randint(0, n + 1, (batch,), generator=g)
    got = verify_probabilistic(
        F.one_hot(argmax, vocab).float(), drafts, F.one_hot(drafts, vocab).float(), nd,
        torch.arange(batch), torch.arange(batch) * 3, method,
    )
    want = verify_greedy(argmax, drafts, nd)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("method", METHODS)
def test_p_equals_q_accepts_everything(method: str) -> None:
    target, draft_p, drafts = random_batch(32, 4, 7, 2)
    target[:, :4] = draft_p
    nd = torch.arange(32) % 5
    seeds, positions = torch.arange(32), torch.zeros(32, dtype=torch.int64)
    tokens, emitted = verify_probabilistic(target, drafts, draft_p, nd, seeds, positions, method)
    assert torch.equal(emitted, nd + 1)
    mask = torch.arange(4).unsqueeze(0) < nd.unsqueeze(1)
    assert torch.equal(tokens[:, :4][mask], drafts[mask])


def test_block_equals_standard_for_one_draft() -> None:
    """With N = 1, h_1 = P_1 = min(1, r_1) and the residual is max(p_1 - q_1, 0): the two coincide."""
    target, draft_p, drafts = random_batch(500, 1, 6, 3)
    args = (target, drafts, draft_p, torch.ones(500, dtype=torch.int64), torch.arange(500) + 77, torch.arange(500))
    std = verify_probabilistic(*args, "standard")
    blk = verify_probabilistic(*args, "block")
    assert torch.equal(std[0], blk[0]) and torch.equal(std[1], blk[1])


@pytest.mark.parametrize("method", METHODS)
def test_output_layout_and_padding_garbage(method: str) -> None:
    """Accepted drafts come first, one target token follows, -1 pads; padded slots (tokens -1 or out
    of the vocabulary, NaN probabilities) change nothing."""
    batch, n, vocab = 200, 4, 6
    target, draft_p, drafts = random_batch(batch, n, vocab, 4)
    nd = torch.arange(batch) % (n + 1)
    seeds, positions = torch.arange(batch) * 11, torch.arange(batch) * 5
    tokens, emitted = verify_probabilistic(target, drafts, draft_p, nd, seeds, positions, method)
    pad = torch.arange(n).unsqueeze(0) >= nd.unsqueeze(1)  # [B, N]
    dirty_drafts = torch.where(pad, torch.where(torch.arange(batch).unsqueeze(1) % 2 == 0, -1, 10**6), drafts)
    dirty_q = draft_p.masked_fill(pad.unsqueeze(2), float("nan"))
    unused_rows = torch.arange(n + 1).unsqueeze(0) > nd.unsqueeze(1)  # [B, N+1]: past the bonus row N_b
    dirty_p = target.masked_fill(unused_rows.unsqueeze(2), float("nan"))
    tokens2, emitted2 = verify_probabilistic(dirty_p, dirty_drafts, dirty_q, nd, seeds, positions, method)
    assert torch.equal(tokens, tokens2) and torch.equal(emitted, emitted2)
    assert bool(((emitted >= 1) & (emitted <= nd + 1)).all())
    col = torch.arange(n + 1).unsqueeze(0)
    assert bool((tokens[col >= emitted.unsqueeze(1)] == -1).all())
    assert bool((tokens[col < emitted.unsqueeze(1)] >= 0).all())
    accepted = col[:, :n] < (emitted - 1).unsqueeze(1)
    assert torch.equal(tokens[:, :n][accepted], drafts[accepted])


@pytest.mark.parametrize("method", METHODS)
def test_no_drafts_samples_target_with_recover_noise(method: str) -> None:
    """N = 0: one token from p_1 by Gumbel-max with gumbel(seed, position, recover stream)."""
    target, _, _ = random_batch(50, 0, 9, 5)
    seeds, positions = torch.arange(50) + 1000, torch.arange(50) * 17
    tokens, emitted = verify_probabilistic(
        target, torch.empty(50, 0, dtype=torch.int64), torch.empty(50, 0, 9), torch.zeros(50, dtype=torch.int64),
        seeds, positions, method,
    )
    want = (target[:, 0].log() + gumbel(seeds, positions, STREAM_RECOVER, 9)).argmax(dim=-1)
    assert torch.equal(tokens[:, 0], want) and emitted.tolist() == [1] * 50


@pytest.mark.parametrize("method", METHODS)
def test_batch_independence(method: str) -> None:
    """A request's result is the same alone (padded only to its own N) and inside a shuffled batch
    padded to a larger N next to requests with other draft counts."""
    batch, n, vocab = 9, 5, 8
    target, draft_p, drafts = random_batch(batch, n, vocab, 6)
    nd = torch.tensor([5, 0, 3, 1, 4, 2, 5, 3, 0])
    seeds = torch.tensor([7, 7, 123, -5, 2**40 + 3, 9, 10, 11, 12])
    positions = torch.tensor([0, 3, 100, 2**33, 55, 8, 8, 1, 0])
    full = verify_probabilistic(target, drafts, draft_p, nd, seeds, positions, method)
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(0))
    shuffled = verify_probabilistic(
        target[perm], drafts[perm], draft_p[perm], nd[perm], seeds[perm], positions[perm], method
    )
    assert torch.equal(shuffled[0], full[0][perm]) and torch.equal(shuffled[1], full[1][perm])
    for b in range(batch):
        k = int(nd[b])
        alone = verify_probabilistic(
            target[b : b + 1, : k + 1], drafts[b : b + 1, :k], draft_p[b : b + 1, :k], nd[b : b + 1],
            seeds[b : b + 1], positions[b : b + 1], method,
        )
        assert int(alone[1]) == int(full[1][b])
        assert alone[0][0].tolist() == full[0][b, : k + 1].tolist()


# ----------------------------------------------------------------------- probabilistic: distribution


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("case", list(CASES))
def test_lossless(case: str, method: str) -> None:
    p, q = CASES[case]
    tokens, emitted = simulate(p, q, method, seed0=1 + list(CASES).index(case))
    check_lossless(tokens, p, f"{case}/{method}")
    if case == "p_equals_q":
        assert bool((emitted == N + 1).all())


@pytest.mark.parametrize("method", METHODS)
def test_lossless_mixed_draft_counts(method: str) -> None:
    """Per-request N_b in {0, 1, 2, 3} within one batch: h at index N_b is P_{N_b}, the bonus row is N_b."""
    p, q = CASES["generic"]
    nd = torch.arange(TRIALS, dtype=torch.int64) % (N + 1)
    tokens, emitted = simulate(p, q, method, seed0=50, num_drafts=nd)
    assert bool((emitted <= nd + 1).all())
    check_lossless(tokens, p, f"mixed/{method}")


@pytest.mark.parametrize("method", METHODS)
def test_shared_draft_and_accept_stream_is_detected(method: str) -> None:
    """Drafts sampled with the acceptance stream at the same positions bias the output (vLLM's bug:
    chi-square 1585 vs 70): the draft chosen is the one whose noise was large, and that same Philox
    word is then the acceptance uniform, so drafts are rejected too often. The chi-square must catch
    it; with separate streams the same setup passes."""
    p, q = CASES["q_zero_where_p_positive"]
    bad, _ = simulate(p, q, method, seed0=77, draft_stream=STREAM_ACCEPT, accept_stream=STREAM_ACCEPT)
    stat, df = chi_square(torch.bincount(bad[:, 0], minlength=V), p[0])
    assert stat > 10 * chi2_critical(df), stat
    good, _ = simulate(p, q, method, seed0=77, draft_stream=STREAM_DRAFT, accept_stream=STREAM_ACCEPT)
    check_lossless(good, p, f"separate streams/{method}")


# ------------------------------------------------------------------------------- block vs token-wise


@pytest.mark.parametrize("case", list(CASES))
def test_block_never_worse_than_standard(case: str) -> None:
    p, q = CASES[case]
    _, std = simulate(p, q, "standard", seed0=200)
    _, blk = simulate(p, q, "block", seed0=200)
    assert blk.double().mean() >= std.double().mean() - 0.02, (blk.double().mean(), std.double().mean())


def test_block_beats_standard() -> None:
    """Sun et al.'s example: p = (1/3, 2/3), q = (2/3, 1/3) at every position. Token-wise accepts each
    draft with probability 2/3 (E[emitted] = 1 + 2/3 + 4/9 + 8/27 ≈ 2.41 for N = 3); block
    verification recovers part of the mass the token-wise rule throws away."""
    p = dist([1, 2]).expand(N + 1, 2)
    q = dist([2, 1]).expand(N, 2)
    _, std = simulate(p, q, "standard", seed0=300)
    _, blk = simulate(p, q, "block", seed0=300)
    assert std.double().mean() == pytest.approx(1 + 2 / 3 + 4 / 9 + 8 / 27, abs=0.03)
    assert blk.double().mean() > std.double().mean() + 0.05, (blk.double().mean(), std.double().mean())


# ------------------------------------------------------------------------------- keying of uniforms


def test_acceptance_uniforms_keyed_by_step_start() -> None:
    """U_i = uniform(seed, position of draft 1, accept stream, N)[i - 1]; independent of padding N."""
    seeds, positions = torch.tensor([3, 4]), torch.tensor([10, 20])
    u = rejection._acceptance_uniforms(seeds, positions, STREAM_ACCEPT, 5)
    assert torch.equal(u, uniform(seeds, positions, STREAM_ACCEPT, 5))
    assert torch.equal(u[:, :2], rejection._acceptance_uniforms(seeds, positions, STREAM_ACCEPT, 2))


# --------------------------------------------------------------------------- consecutive verify steps


def per_draft_position_uniforms(seeds: torch.Tensor, positions: torch.Tensor, stream: int, n: int) -> torch.Tensor:
    """The rejected alternative keying: U_i = uniform(seed, position of draft i, stream, 1)."""
    pos = (positions.unsqueeze(1) + torch.arange(n)).flatten()  # [B*n]
    return uniform(seeds.repeat_interleave(n), pos, stream, 1).view(seeds.shape[0], n)


def generate(
    p: torch.Tensor, q: torch.Tensor, method: str, draft_keying: str, *, length: int = 5, seed0: int = 0
) -> torch.Tensor:
    """Run verify steps until every trial has `length` tokens; returns [TRIALS, length].

    p: [V] target and q: [V] draft distribution at every position (context-free), N = 3 drafts per
    step. The step whose first draft sits at position s draws its draft noise either per draft
    position (gumbel(seed, s + i - 1)) or per step (gumbel(seed, s, n = N·V), column block i - 1).
    """
    vocab = p.numel()
    seeds = seed0 * 1_000_003 + torch.arange(TRIALS, dtype=torch.int64)
    out = torch.full((TRIALS, length), -1, dtype=torch.int64)
    s = torch.zeros(TRIALS, dtype=torch.int64)  # position of draft 1 = tokens generated so far
    while bool((s < length).any()):
        if draft_keying == "position":
            noise = torch.stack([gumbel(seeds, s + i, STREAM_DRAFT, vocab) for i in range(N)], dim=1)
        else:
            noise = gumbel(seeds, s, STREAM_DRAFT, N * vocab).view(TRIALS, N, vocab)
        drafts = (q.log() + noise).argmax(dim=-1)  # [T, N]
        target, draft_p = p.expand(TRIALS, N + 1, vocab), q.expand(TRIALS, N, vocab)
        nd = torch.full((TRIALS,), N, dtype=torch.int64)
        tokens, emitted = verify_probabilistic(target, drafts, draft_p, nd, seeds, s, method)
        for k in range(N + 1):
            keep = (k < emitted) & (s + k < length)
            out[keep, (s + k)[keep]] = tokens[keep, k]
        s = s + emitted
    return out


def worst_ratio(out: torch.Tensor, p: torch.Tensor) -> float:
    """Largest chi-square statistic / critical value over each position's marginal and each adjacent pair."""
    vocab = p.numel()
    ratios = []
    for j in range(out.shape[1]):
        stat, df = chi_square(torch.bincount(out[:, j], minlength=vocab), p)
        ratios.append(stat / chi2_critical(df))
    for j in range(out.shape[1] - 1):
        pairs = torch.bincount(out[:, j] * vocab + out[:, j + 1], minlength=vocab**2)
        stat, df = chi_square(pairs, torch.outer(p, p))
        ratios.append(stat / chi2_critical(df))
    return max(ratios)


@pytest.mark.parametrize(
    "method,draft_keying", [("standard", "position"), ("standard", "step"), ("block", "step")]
)
def test_consecutive_steps_lossless(method: str, draft_keying: str) -> None:
    """Tokens at positions 0..4 produced by several verify steps are i.i.d. p: no randomness consulted
    by one step is reused by the next (token-wise verification only looks at positions <= the
    emitted token, so per-position draft noise is fine there)."""
    p, q = CASES["q_zero_where_p_positive"][0][0], CASES["q_zero_where_p_positive"][1][0]
    assert worst_ratio(generate(p, q, method, draft_keying, seed0=400), p) < 1.0


def test_block_consecutive_steps_need_per_step_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Block verification inspects U_i and X_i for every i <= N, also past τ (finding U_i > h_i), and
    the next step starts at position s + τ + 1. Randomness keyed by the position of each draft is
    therefore reused conditioned, which biases the output: (a) draft noise per draft position, (b)
    acceptance uniforms per draft position. Hence `_acceptance_uniforms` keys by the step's first
    position, and a drafter feeding block verification must key its noise per step too."""
    p, q = CASES["q_zero_where_p_positive"][0][0], CASES["q_zero_where_p_positive"][1][0]
    assert worst_ratio(generate(p, q, "block", "position", seed0=400), p) > 3.0  # (a)
    monkeypatch.setattr(rejection, "_acceptance_uniforms", per_draft_position_uniforms)
    assert worst_ratio(generate(p, q, "block", "step", seed0=400), p) > 3.0  # (b)
