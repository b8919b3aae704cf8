"""Sampling from the top-k candidates only (``sample_from_candidates``) draws the same token as the
full-vocabulary path: same filters, same counter-based noise at the same columns."""

from __future__ import annotations

import itertools

import pytest
import torch

from dspark.sample import sampler as sampler_mod
from dspark.sample.rng import gumbel, gumbel_at
from dspark.sample.sampler import Sampler, SamplingBatch, sample_from_candidates
from dspark.sampling_params import SamplingParams

V = 1000


def _batch(params: list[SamplingParams], positions: list[int]) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(params, seeds=[11 * i + 3 for i in range(n)], positions=positions,
                               prompt_ids=[[1, 2, 3]] * n, output_ids=[[4, 5, 4]] * n, vocab_size=V, device="cpu")


def test_gumbel_at_is_gumbel_gathered():
    seeds, pos = torch.tensor([0, 2**62 + 7, -5]), torch.tensor([0, 9, 2**33 + 1])
    cols = torch.randint(0, 777, (3, 40), generator=torch.Generator().manual_seed(0))
    assert torch.equal(gumbel_at(seeds, pos, 6, cols), gumbel(seeds, pos, 6, 777).gather(1, cols))


@pytest.mark.parametrize("top_k,top_p,min_p,temperature", list(itertools.product(
    (1, 7, 20, 64), (1.0, 0.8, 0.3), (0.0, 0.05), (0.7, 1.3))))
def test_candidates_equal_full_vocabulary(top_k, top_p, min_p, temperature, monkeypatch):
    g = torch.Generator().manual_seed(top_k * 1000 + int(top_p * 100) + int(min_p * 1000))
    logits = torch.randn(24, V, generator=g) * 3
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                             repetition_penalty=1.2 if i % 5 == 0 else 1.0)
              for i in range(24)]
    params[3] = SamplingParams(temperature=0)  # a greedy row in the batch
    params[4] = SamplingParams(temperature=temperature, top_k=3)  # a smaller k than the batch's largest
    batch = _batch(params, positions=list(range(100, 124)))
    fast = Sampler()(logits, batch)
    served = sample_from_candidates(logits, batch, 0)[1]
    assert served.sum() == 23 and not served[3]  # every random row took the fast path
    monkeypatch.setattr(sampler_mod, "CANDIDATE_LIMIT", 0)  # force the full-vocabulary path
    full = Sampler()(logits, batch)
    assert torch.equal(fast, full)


def test_rows_without_top_k_use_the_full_path_and_others_do_not_care(monkeypatch):
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1)) * 3
    mixed = _batch([SamplingParams(temperature=1.0, top_k=20, seed=5), SamplingParams(temperature=1.0)], [5, 6])
    assert sample_from_candidates(logits, mixed, 0)[1].tolist() == [True, False]
    alone = _batch([SamplingParams(temperature=1.0, top_k=20, seed=5)], [5])
    assert Sampler()(logits, mixed)[0] == Sampler()(logits[:1], alone)[0]  # the row decides, not the batch
    fast = Sampler()(logits, mixed)
    monkeypatch.setattr(sampler_mod, "CANDIDATE_LIMIT", 0)  # now neither row is served by candidates
    assert sample_from_candidates(logits, mixed, 0) is None
    assert torch.equal(Sampler()(logits, mixed), fast)


def test_a_tie_past_the_candidates_falls_back_and_keeps_every_tied_token():
    # top_k=2 with the 2nd..6th largest logits tied: all five stay in the full path's top-k set
    logits = torch.full((1, V), -10.0)
    logits[0, 10] = 5.0
    logits[0, [20, 30, 40, 50, 60]] = 4.0
    batch = _batch([SamplingParams(temperature=1.0, top_k=2)], [0])
    assert sample_from_candidates(logits, batch, 0)[1].tolist() == [False]
    seen = set()
    for pos in range(400):
        b = _batch([SamplingParams(temperature=1.0, top_k=2)], [pos])
        seen.add(int(Sampler()(logits, b)))
    assert seen == {10, 20, 30, 40, 50, 60}
