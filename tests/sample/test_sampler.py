"""Sampler tests: exact filter masks and penalties on hand-made logits, greedy/seeded behaviour, and
chi-square goodness-of-fit of the sampled distributions (with a check that the test can fail)."""

from __future__ import annotations

import math
from typing import NoReturn

import pytest
import torch

import dspark.sample.sampler as sampler_module
from dspark.sample.rng import STREAM_DRAFT, STREAM_SAMPLE
from dspark.sample.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p_min_p,
    compute_probs,
)
from dspark.sampling_params import SamplingParams

# Upper 0.1% points of the chi-square distribution (scipy.stats.chi2.ppf(0.999, df)), by degrees of freedom.
CHI2_CRITICAL_999 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124, 9: 27.877}

# Hand-made distribution over 5 tokens, deliberately not in sorted order: probabilities by token id.
HAND_PROBS = [0.1, 0.4, 0.05, 0.3, 0.15]  # ranks: 1 (0.4) > 3 (0.3) > 4 (0.15) > 0 (0.1) > 2 (0.05)


def make_batch(
    params: list[SamplingParams],
    vocab_size: int,
    *,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        seeds if seeds is not None else [0] * n,
        positions if positions is not None else [0] * n,
        prompts if prompts is not None else [[] for _ in range(n)],
        outputs if outputs is not None else [[] for _ in range(n)],
        vocab_size,
        "cpu",
    )


def kept_sets(logits: torch.Tensor, filtered: torch.Tensor) -> list[set[int]]:
    """Token ids left unmasked per row; also checks that kept logits are unchanged and masked ones are -inf."""
    kept = torch.isfinite(filtered)
    assert torch.equal(filtered[kept], logits[kept])
    assert bool((filtered[~kept] == -math.inf).all())
    return [set(torch.nonzero(row).flatten().tolist()) for row in kept]


# ---------------------------------------------------------------------------------------------- build


class Untouchable(list[list[int]]):
    """A token-list list that fails on any read: proves build() ignores token lists without penalties."""

    def _boom(self, *args: object) -> NoReturn:
        raise AssertionError("token lists were read although no penalty is active")

    __getitem__ = __iter__ = __len__ = _boom  # type: ignore[assignment]


def test_build_without_penalties_does_not_read_token_lists() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)]
    batch = SamplingBatch.build(params, [1, 2], [3, 4], Untouchable(), Untouchable(), 100, "cpu")
    assert batch.no_penalties and batch.prompt_counts is None and batch.output_counts is None
    assert not batch.all_greedy and not batch.all_random
    assert not batch.no_top_k and not batch.no_top_p and batch.no_min_p and batch.max_top_k == 5
    assert batch.top_k.tolist() == [100, 5]  # greedy row neutralised
    assert batch.top_p.tolist() == pytest.approx([1.0, 0.9])
    assert batch.temperature.tolist() == pytest.approx([0.0, 0.7])
    assert batch.positions.tolist() == [3, 4]


def test_build_flags_and_seed_wrapping() -> None:
    params = [SamplingParams(top_k=-1), SamplingParams(top_k=0), SamplingParams(top_k=1000)]
    batch = make_batch(params, 50, seeds=[2**64 - 1, 2**63, -5])
    assert batch.all_random and not batch.all_greedy
    assert batch.no_top_k and batch.no_top_p and batch.no_min_p and batch.no_penalties
    assert batch.top_k.tolist() == [50, 50, 50]  # top_k >= vocab is disabled too
    assert batch.seeds.tolist() == [-1, -(2**63), -5]  # same low 64 bits


def test_build_counts_only_for_penalised_rows() -> None:
    params = [SamplingParams(), SamplingParams(repetition_penalty=1.5), SamplingParams(frequency_penalty=0.5)]
    batch = make_batch(params, 6, prompts=[[0, 1], [2, 2, 5], [3]], outputs=[[4], [1, 1, 1], [0, 5]])
    assert batch.prompt_counts is not None and batch.output_counts is not None
    assert batch.prompt_counts.tolist() == [[0] * 6, [0, 0, 2, 0, 0, 1], [0, 0, 0, 1, 0, 0]]
    assert batch.output_counts.tolist() == [[0] * 6, [0, 3, 0, 0, 0, 0], [1, 0, 0, 0, 0, 1]]
    only_presence = make_batch([SamplingParams(presence_penalty=1.0)], 6, outputs=[[2]])
    assert only_presence.prompt_counts is None  # no repetition penalty: the prompt is not needed


# -------------------------------------------------------------------------------------------- penalties


def test_penalties_hand_computed() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    params = [
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(),
    ]
    batch = make_batch(params, 5, prompts=[[0, 1], [0, 1]], outputs=[[3, 3, 1], [3, 3, 1]])
    out = apply_penalties(logits, batch)
    # Row 0: seen = {0, 1, 3}. Token 0: 2/2 = 1. Token 1: -1*2 - 0.5*1 - 0.25 = -2.75.
    # Token 3: 3/2 - 0.5*2 - 0.25 = 0.25. Unseen tokens 2, 4 unchanged. Row 1 has no penalties.
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]]))
    assert torch.equal(logits[0], torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0]))  # input not modified


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # prompt [0], output [1, 1, 2]: seen = {0, 1, 2}
        (SamplingParams(repetition_penalty=0.5), [3.0, -0.5, -0.5, 1.0]),
        (SamplingParams(frequency_penalty=1.5), [1.5, -4.0, -2.5, 1.0]),
        (SamplingParams(presence_penalty=-1.0), [1.5, 0.0, 0.0, 1.0]),
    ],
)
def test_each_penalty_alone(params: SamplingParams, expected: list[float]) -> None:
    logits = torch.tensor([[1.5, -1.0, -1.0, 1.0]])
    batch = make_batch([params], 4, prompts=[[0]], outputs=[[1, 1, 2]])
    torch.testing.assert_close(apply_penalties(logits, batch), torch.tensor([expected]))


def test_no_penalties_is_identity() -> None:
    logits = torch.randn(3, 7)
    assert apply_penalties(logits, make_batch([SamplingParams()] * 3, 7)) is logits


# ------------------------------------------------------------------------------------ filtering masks


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_k=4), {1, 3, 4, 0}),
        (SamplingParams(top_p=0.6), {1, 3}),  # mass before token 4 is 0.7 >= 0.6
        (SamplingParams(top_p=0.75), {1, 3, 4}),  # mass before token 0 is 0.85 >= 0.75
        (SamplingParams(top_p=0.5), {1, 3}),
        (SamplingParams(top_p=0.01), {1}),  # the top token is always kept
        (SamplingParams(top_k=2, top_p=0.5), {1}),  # top-p on the renormalised top-2: 0.4/0.7 >= 0.5
        (SamplingParams(min_p=0.3), {1, 3, 4}),  # prob < 0.3 * 0.4 = 0.12 dropped
        (SamplingParams(min_p=0.2, top_k=3), {1, 3, 4}),
        (SamplingParams(min_p=0.3, top_p=0.9), {1, 3, 4}),  # without min-p, top-p 0.9 keeps 4 tokens
        (SamplingParams(), {0, 1, 2, 3, 4}),
        (SamplingParams(temperature=0.0, top_k=1, top_p=0.1, min_p=0.9), {0, 1, 2, 3, 4}),  # greedy: neutral
    ],
)
def test_filter_masks_single_row(params: SamplingParams, expected: set[int]) -> None:
    logits = torch.tensor([HAND_PROBS]).log()
    assert kept_sets(logits, apply_top_k_top_p_min_p(logits, make_batch([params], 5))) == [expected]


def test_filter_masks_mixed_batch() -> None:
    # Rows with different settings share one call; top-p rows force the sorting path for top-k rows too.
    params = [
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.75),
        SamplingParams(),
        SamplingParams(min_p=0.3),
        SamplingParams(top_k=2, top_p=0.5),
        SamplingParams(top_p=1.0, top_k=4),
    ]
    logits = torch.tensor([HAND_PROBS] * len(params)).log()
    got = kept_sets(logits, apply_top_k_top_p_min_p(logits, make_batch(params, 5)))
    assert got == [{1, 3}, {1, 3, 4}, {0, 1, 2, 3, 4}, {1, 3, 4}, {1}, {0, 1, 3, 4}]


@pytest.mark.parametrize("with_top_p_row", [False, True])
def test_top_k_keeps_ties_and_disabled_rows(with_top_p_row: bool) -> None:
    # Both the top-k-only path (topk) and the sorting path (any top-p row) keep ties at the k-th value.
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0], [1.0, 2.0, 2.0, 0.0]])
    params = [SamplingParams(top_k=1), SamplingParams(top_k=3), SamplingParams(top_p=0.9 if with_top_p_row else 1.0)]
    got = kept_sets(logits, apply_top_k_top_p_min_p(logits, make_batch(params, 4)))
    assert got[:2] == [{1, 2}, {0, 1, 2}]
    assert got[2] == ({0, 1, 2} if with_top_p_row else {0, 1, 2, 3})


def test_top_p_one_never_drops_tiny_tail() -> None:
    # A long tail of tiny probabilities must survive top_p = 1 even when another row forces the top-p path.
    logits = torch.cat([torch.tensor([[20.0]]), torch.zeros(1, 4095)], dim=1).repeat(2, 1)
    batch = make_batch([SamplingParams(top_p=0.5), SamplingParams()], 4096)
    out = apply_top_k_top_p_min_p(logits, batch)
    assert int(torch.isfinite(out[0]).sum()) == 1 and bool(torch.isfinite(out[1]).all())


def test_filters_act_on_temperature_scaled_logits() -> None:
    logits = torch.tensor([HAND_PROBS, HAND_PROBS]).log()
    batch = make_batch([SamplingParams(temperature=1.0, top_p=0.8), SamplingParams(temperature=0.5, top_p=0.8)], 5)
    probs = compute_probs(logits, batch)
    # T=1: mass before token 0 is 0.85 >= 0.8 -> {1, 3, 4}. T=0.5 squares the probabilities:
    # 0.16, 0.09, 0.0225, ... / 0.285 -> mass before token 4 is 0.877 >= 0.8 -> {1, 3}.
    assert [set(torch.nonzero(r).flatten().tolist()) for r in probs] == [{1, 3, 4}, {1, 3}]
    torch.testing.assert_close(probs[1, [1, 3]], torch.tensor([0.16, 0.09]) / 0.25)


def test_apply_temperature_leaves_greedy_rows() -> None:
    logits = torch.tensor([[1.0, -2.0], [1.0, -2.0]])
    batch = make_batch([SamplingParams(temperature=0.0), SamplingParams(temperature=0.5)], 2)
    torch.testing.assert_close(apply_temperature(logits, batch), torch.tensor([[1.0, -2.0], [2.0, -4.0]]))


# ------------------------------------------------------------------------------------- compute_probs


def test_compute_probs_rows() -> None:
    logits = torch.tensor([[0.5, 2.0, 1.0, -1.0]] * 3)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=2.0),
        SamplingParams(temperature=0.0, presence_penalty=2.0),
    ]
    probs = compute_probs(logits, make_batch(params, 4, outputs=[[1], [], [1]]))
    torch.testing.assert_close(probs[0], torch.tensor([0.0, 1.0, 0.0, 0.0]))
    torch.testing.assert_close(probs[1], (logits[1] / 2.0).softmax(-1))
    torch.testing.assert_close(probs[2], torch.tensor([0.0, 0.0, 1.0, 0.0]))  # 2.0 - 2.0 < 1.0


def test_compute_probs_all_greedy_and_all_random() -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    greedy = compute_probs(logits, make_batch([SamplingParams(temperature=0.0)] * 4, 9))
    assert torch.equal(greedy.argmax(-1), logits.argmax(-1)) and torch.equal(greedy.sum(-1), torch.ones(4))
    random = compute_probs(logits, make_batch([SamplingParams(temperature=0.8)] * 4, 9))
    torch.testing.assert_close(random, (logits / 0.8).softmax(-1))


# ------------------------------------------------------------------------------------------- sampling


def test_all_greedy_is_argmax_without_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_rng(*args: object) -> NoReturn:
        raise AssertionError("greedy sampling drew random numbers")

    monkeypatch.setattr(sampler_module, "gumbel", no_rng)
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
    batch = make_batch([SamplingParams(temperature=0.0, top_k=3)] * 8, 300)
    assert torch.equal(Sampler()(logits, batch), logits.argmax(-1))
    # bf16 logits (what a model may return) work too.
    assert torch.equal(Sampler()(logits.bfloat16(), batch), logits.bfloat16().float().argmax(-1))


def test_greedy_uses_penalised_logits() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]] * 2)
    params = [SamplingParams(temperature=0.0, presence_penalty=0.5), SamplingParams(temperature=1.0, top_k=1)]
    tokens = Sampler()(logits, make_batch(params, 3, outputs=[[0], [2]]))
    assert tokens.tolist() == [1, 0]  # mixed batch: row 0 greedy after penalty, row 1 top-1 sampling


def test_seeded_sampling_independent_of_batch_composition() -> None:
    vocab = 64
    gen = torch.Generator().manual_seed(3)
    row_logits = torch.randn(6, vocab, generator=gen) * 2
    params = [
        SamplingParams(temperature=1.0, seed=11),
        SamplingParams(temperature=0.7, top_k=10, seed=12),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02, seed=14),
        SamplingParams(temperature=0.9, frequency_penalty=0.4, repetition_penalty=1.2, seed=15),
        SamplingParams(temperature=1.0, seed=11),  # same seed as row 0, later position
    ]
    seeds = [11, 12, 0, 14, 15, 11]
    positions = [5, 9, 2, 40, 17, 6]
    prompts = [[1, 2], [3], [4, 4], [5], [6, 7, 8], [1, 2]]
    outputs = [[9], [], [10], [11, 12], [6, 6, 13], [9, 20]]
    sampler = Sampler()

    def sample(order: list[int], stream: int = STREAM_SAMPLE) -> list[int]:
        batch = make_batch(
            [params[i] for i in order],
            vocab,
            seeds=[seeds[i] for i in order],
            positions=[positions[i] for i in order],
            prompts=[prompts[i] for i in order],
            outputs=[outputs[i] for i in order],
        )
        tokens = sampler(row_logits[order], batch, stream).tolist()
        return [tokens[order.index(i)] for i in sorted(order)]

    full = sample(list(range(6)))
    assert sample(list(range(6))) == full  # reproducible
    assert sample([5, 3, 1, 4, 0, 2]) == full  # reordered
    assert [sample([i])[0] for i in range(6)] == full  # each row alone
    assert sample([3, 0]) == [full[0], full[3]]
    assert full[2] == int(row_logits[2].argmax())


def test_no_sync_draws_the_same_tokens() -> None:
    """``no_sync`` (async scheduling) skips the host check of whether every row was served by its top-k
    candidates and always makes the whole-vocabulary draw too: the tokens are the same, with and
    without candidate rows, greedy rows and rows the candidates cannot serve (no top-k)."""
    vocab = 300
    gen = torch.Generator().manual_seed(5)
    sampler = Sampler()
    for trial in range(20):
        logits = torch.randn(5, vocab, generator=gen) * 3
        params = [SamplingParams(temperature=0.8, top_k=7, seed=trial),
                  SamplingParams(temperature=1.0, top_k=3, top_p=0.8, seed=trial + 1),
                  SamplingParams(temperature=0.0),
                  SamplingParams(temperature=1.0, seed=trial + 2),
                  SamplingParams(temperature=0.5, top_p=0.9, seed=trial + 3)]
        for rows in ([0, 1], [0, 1, 2], [0, 1, 2, 3, 4], [3, 4]):
            batch = make_batch([params[i] for i in rows], vocab, seeds=[trial * 7 + i for i in rows],
                               positions=[trial + i for i in rows])
            assert sampler(logits[rows], batch, no_sync=True).tolist() == sampler(logits[rows], batch).tolist()


def test_seed_position_and_stream_change_draws() -> None:
    vocab = 1000
    logits = torch.zeros(200, vocab)  # uniform distribution: draws are pure noise
    params = [SamplingParams(temperature=1.0)] * 200
    sampler = Sampler()
    base = sampler(logits, make_batch(params, vocab, seeds=[7] * 200, positions=list(range(200))))
    other_seed = sampler(logits, make_batch(params, vocab, seeds=[8] * 200, positions=list(range(200))))
    shifted = sampler(logits, make_batch(params, vocab, seeds=[7] * 200, positions=list(range(1, 201))))
    other_stream = sampler(
        logits, make_batch(params, vocab, seeds=[7] * 200, positions=list(range(200))), STREAM_DRAFT
    )
    assert torch.equal(shifted[:-1], base[1:])  # a draw belongs to (seed, position), not to the row
    for other in (other_seed, other_stream):
        assert int((other == base).sum()) < 10  # ~0.2 expected matches by chance


# ----------------------------------------------------------------------------- distribution (chi-square)

N_DRAWS = 20_000
CHI_VOCAB = 10


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of `counts` against `probs` over the support of `probs`."""
    support = probs > 0
    expected = probs[support].double() * counts.sum()
    assert bool((expected >= 5).all()), "too few expected draws per cell for the chi-square approximation"
    observed = counts[support].double()
    return float(((observed - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def draw_counts(logits: torch.Tensor, params: SamplingParams, seed: int = 1234) -> torch.Tensor:
    """Counts per token of N_DRAWS samples of one distribution, one draw per position 0..N_DRAWS-1."""
    batch = make_batch([params] * N_DRAWS, CHI_VOCAB, seeds=[seed] * N_DRAWS, positions=list(range(N_DRAWS)))
    tokens = Sampler()(logits.expand(N_DRAWS, -1), batch)
    return torch.bincount(tokens, minlength=CHI_VOCAB)


@pytest.fixture(scope="module")
def chi_logits() -> torch.Tensor:
    return torch.rand(1, CHI_VOCAB, generator=torch.Generator().manual_seed(0)) * 2.5  # [1, V]


def target_probs(logits: torch.Tensor, temperature: float, keep: list[int] | None = None) -> torch.Tensor:
    """softmax(logits / temperature), restricted to `keep` and renormalised."""
    probs = (logits[0] / temperature).softmax(-1)
    if keep is not None:
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[keep] = True
        probs = torch.where(mask, probs, 0.0)
    return probs / probs.sum()


def test_chi_square_temperature_one(chi_logits: torch.Tensor) -> None:
    counts = draw_counts(chi_logits, SamplingParams(temperature=1.0))
    stat, df = chi_square(counts, target_probs(chi_logits, 1.0))
    assert stat < CHI2_CRITICAL_999[df], (stat, counts.tolist())
    # The test has power: the same draws are rejected against a mildly wrong distribution.
    for wrong in (target_probs(chi_logits, 1.15), target_probs(chi_logits, 1.0).roll(1)):
        wrong_stat, wrong_df = chi_square(counts, wrong)
        assert wrong_stat > CHI2_CRITICAL_999[wrong_df], wrong_stat


def test_chi_square_other_seed_and_temperature(chi_logits: torch.Tensor) -> None:
    counts = draw_counts(chi_logits, SamplingParams(temperature=0.5), seed=987654321)
    stat, df = chi_square(counts, target_probs(chi_logits, 0.5))
    assert stat < CHI2_CRITICAL_999[df], (stat, counts.tolist())
    wrong_stat, wrong_df = chi_square(counts, target_probs(chi_logits, 1.0))
    assert wrong_stat > CHI2_CRITICAL_999[wrong_df]


def reference_keep(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> list[int]:
    """Token ids kept by top-k then top-p, computed directly from the sorted probabilities."""
    probs = (logits[0] / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()[:top_k]
    total = float(probs[order].sum())
    keep: list[int] = []
    mass = 0.0
    for t in order:
        keep.append(t)
        mass += float(probs[t]) / total
        if mass >= top_p:
            break
    return keep


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 4, 1.0), (1.0, CHI_VOCAB, 0.7), (0.8, 6, 0.85)],
)
def test_chi_square_truncated(chi_logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> None:
    keep = reference_keep(chi_logits, temperature, top_k, top_p)
    assert 2 < len(keep) < CHI_VOCAB  # the truncation is real and leaves something to test
    counts = draw_counts(chi_logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    target = target_probs(chi_logits, temperature, keep)
    assert int(counts[target == 0].sum()) == 0  # no draw outside the kept set
    stat, df = chi_square(counts, target)
    assert stat < CHI2_CRITICAL_999[df], (stat, counts.tolist())


# ------------------------------------------------------------------------------------------- logprobs


def test_logprobs_raw() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(4))
    tokens = torch.tensor([0, 5, 10])
    sampled, ids, values = Sampler().logprobs(logits, tokens, 3)
    reference = logits.log_softmax(-1)
    torch.testing.assert_close(sampled, reference[torch.arange(3), tokens])
    top = reference.topk(3, dim=-1)
    assert torch.equal(ids, top.indices) and ids.dtype == torch.int64
    torch.testing.assert_close(values, top.values)
    sampled0, ids0, values0 = Sampler().logprobs(logits.bfloat16(), tokens, 0)
    assert sampled0.shape == (3,) and sampled0.dtype == torch.float32
    assert ids0.shape == (3, 0) and values0.shape == (3, 0)


def test_draft_params_keep_temperature_seed_and_penalties_without_filters():
    """DSpark drafts at the request's temperature without its top-k / top-p / min-p (sampler.draft_params):
    verification checks the drafts against the filtered target with q = what they were drawn from."""
    from dspark.sample.sampler import draft_params

    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, seed=3, presence_penalty=0.5, max_tokens=9)
    d = draft_params(p)
    assert (d.top_k, d.top_p, d.min_p) == (-1, 1.0, 0.0)
    assert (d.temperature, d.seed, d.presence_penalty, d.max_tokens) == (0.7, 3, 0.5, 9)
    plain = SamplingParams(temperature=1.0)
    assert draft_params(plain) is plain
    from dspark.sample.sampler import unfiltered

    assert unfiltered(plain, 100) and unfiltered(d, 100) and unfiltered(SamplingParams(temperature=1.0, top_k=100), 100)
    assert not any(unfiltered(SamplingParams(temperature=1.0, **kw), 100)
                   for kw in ({"top_k": 99}, {"top_p": 0.99}, {"min_p": 0.01}))
