"""Philox4x32-10 known answers and the properties the sampler relies on: (0, 1) range, purity in
(seed, position, stream, column), independence from batch composition, distinct streams."""

from __future__ import annotations

import pytest
import torch

from dspark.sample.rng import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RECOVER, STREAM_SAMPLE, gumbel, philox4x32, uniform

# Random123 philox4x32_10 known-answer vectors (kat_vectors): (counter, key, expected output).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize("mulhilo", ["split", "wrap"])
@pytest.mark.parametrize(("counter", "key", "expected"), KNOWN_ANSWERS)
def test_philox_known_answers(counter: tuple[int, ...], key: tuple[int, ...], expected: tuple[int, ...], mulhilo,
                              monkeypatch) -> None:
    """Both 32x32-bit products (the split one; the wrapping int64 one, which rng uses where this torch's int64
    products wrap, as checked at import)."""
    from dspark.sample import rng

    if mulhilo == "wrap" and not rng._int64_products_wrap():
        pytest.skip("this torch's int64 products do not wrap: rng uses the split product")
    monkeypatch.setattr(rng, "_mulhilo", rng._mulhilo_split if mulhilo == "split" else rng._mulhilo_wrap)
    out = philox4x32(torch.tensor(counter, dtype=torch.int64), torch.tensor(key, dtype=torch.int64))
    assert out.tolist() == list(expected)


def test_wrapping_product_equals_the_split_one_on_random_words() -> None:
    from dspark.sample import rng

    if not rng._int64_products_wrap():
        pytest.skip("this torch's int64 products do not wrap: rng uses the split product")
    a = torch.randint(0, 2**32, (100_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    for m in (rng._PHILOX_M0, rng._PHILOX_M1):
        for x, y in zip(rng._mulhilo_wrap(a, m), rng._mulhilo_split(a, m)):
            assert torch.equal(x, y)


def test_philox_batched_matches_single() -> None:
    counters = torch.tensor([c for c, _, _ in KNOWN_ANSWERS], dtype=torch.int64)  # [3, 4]
    keys = torch.tensor([k for _, k, _ in KNOWN_ANSWERS], dtype=torch.int64)  # [3, 2]
    assert philox4x32(counters, keys).tolist() == [list(e) for _, _, e in KNOWN_ANSWERS]


def test_uniform_open_interval_and_moments() -> None:
    seeds = torch.arange(64, dtype=torch.int64) * 7919 - 100  # includes negative seeds
    positions = torch.arange(64, dtype=torch.int64) * 1_000_003
    u = uniform(seeds, positions, STREAM_SAMPLE, 4099)  # [64, 4099]; n not a multiple of 4
    assert u.shape == (64, 4099) and u.dtype == torch.float32
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # Each decile holds about a tenth of the draws (262k draws: sd of a fraction is ~6e-4).
    hist = torch.histc(u, bins=10, min=0.0, max=1.0) / u.numel()
    assert bool(((hist - 0.1).abs() < 0.004).all())


def test_uniform_is_pure_and_prefix_stable() -> None:
    seeds = torch.tensor([3, 3, 4], dtype=torch.int64)
    positions = torch.tensor([10, 11, 10], dtype=torch.int64)
    a = uniform(seeds, positions, STREAM_SAMPLE, 37)
    assert torch.equal(a, uniform(seeds.clone(), positions.clone(), STREAM_SAMPLE, 37))
    assert torch.equal(a[:, :9], uniform(seeds, positions, STREAM_SAMPLE, 9))
    # Neighbouring positions and seeds give unrelated draws.
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])


def test_uniform_independent_of_batch_composition() -> None:
    alone = uniform(torch.tensor([12345]), torch.tensor([77]), STREAM_SAMPLE, 50)  # [1, 50]
    seeds = torch.tensor([1, 2, 12345, 2**62, -9], dtype=torch.int64)
    positions = torch.tensor([0, 77, 77, 5, 2**33], dtype=torch.int64)
    batched = uniform(seeds, positions, STREAM_SAMPLE, 50)
    assert torch.equal(batched[2], alone[0])
    reordered = uniform(seeds.flip(0), positions.flip(0), STREAM_SAMPLE, 50)
    assert torch.equal(reordered.flip(0), batched)


def test_high_position_and_seed_bits_matter() -> None:
    base = uniform(torch.tensor([5]), torch.tensor([7]), STREAM_SAMPLE, 8)
    assert not torch.equal(base, uniform(torch.tensor([5]), torch.tensor([7 + 2**32]), STREAM_SAMPLE, 8))
    assert not torch.equal(base, uniform(torch.tensor([5 + 2**32]), torch.tensor([7]), STREAM_SAMPLE, 8))


def test_streams_differ() -> None:
    seeds = torch.tensor([42, 43], dtype=torch.int64)
    positions = torch.tensor([100, 100], dtype=torch.int64)
    streams = [STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT, STREAM_RECOVER]
    assert len(set(streams)) == 4
    draws = [uniform(seeds, positions, s, 16) for s in streams]
    for i in range(len(draws)):
        for j in range(i + 1, len(draws)):
            assert not bool((draws[i] == draws[j]).any())  # no shared value at all, not merely a differing one


def test_gumbel_matches_uniform_and_distribution() -> None:
    seeds = torch.arange(32, dtype=torch.int64)
    positions = torch.full((32,), 3, dtype=torch.int64)
    u = uniform(seeds, positions, STREAM_DRAFT, 2048).double()
    g = gumbel(seeds, positions, STREAM_DRAFT, 2048)
    assert bool(torch.isfinite(g).all())
    # Same draws: g == -log(-log(u)) up to float32 rounding of u near 1.
    torch.testing.assert_close(g.double(), -torch.log(-torch.log(u)), atol=2e-3, rtol=1e-3)
    # Standard Gumbel: mean = Euler-Mascheroni constant, variance = pi^2 / 6.
    assert abs(g.double().mean().item() - 0.5772156649) < 0.02
    assert abs(g.double().var().item() - 1.6449340668) < 0.05
