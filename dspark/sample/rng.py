"""Counter-based random numbers (Philox4x32-10) built from plain torch int64 tensor ops.

Why counter-based: every random number is a pure function of (seed, token position, stream, column),
so a seeded request draws the same numbers whatever else shares its batch, on whatever row it sits,
after preemption and recomputation, and with no torch.Generator state to save, restore or keep per
request. The same code runs on CPU and CUDA and gives bit-identical integers on both.

All 32-bit words are held in int64 tensors with values in [0, 2^32). Products of two such words are
formed from 16-bit halves so that no intermediate value leaves the int64 range, and every
sum/shift result is masked back to 32 bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Streams separate independent uses of the same (seed, position): plain sampling, speculative draft
# noise, acceptance uniforms and recovery/bonus noise must never reuse each other's numbers.
STREAM_SAMPLE = 0
STREAM_DRAFT = 1
STREAM_ACCEPT = 2
STREAM_RECOVER = 3


def draft_stream(k: int) -> int:
    """Stream of the draft noise of slot k (0-based) of one proposal. Draft noise is keyed per step
    (by the position of the step's first draft) with the slot in the stream: block verification looks
    at every draft of a step, so noise keyed by draft position would be reused, already observed, by
    the next step (measured bias: 53x the chi-square threshold). Draft streams are 1 mod 4, never equal
    to the sample (0), accept (2) or recover (3) streams."""
    return STREAM_DRAFT + 4 * k

_MASK32 = 0xFFFFFFFF
_PHILOX_M0 = 0xD2511F53  # multiplier of words 0 (Random123's PHILOX_M4x32_0)
_PHILOX_M1 = 0xCD9E8D57  # multiplier of words 2 (PHILOX_M4x32_1)
_PHILOX_W0 = 0x9E3779B9  # key schedule increments (golden ratio, sqrt(3) - 1)
_PHILOX_W1 = 0xBB67AE85
_PHILOX_ROUNDS = 10

_TWO_POW_M32 = 2.0**-32
_BELOW_ONE_F32 = 1.0 - 2.0**-24  # largest float32 below 1


def _mulhilo_split(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """Exact 64-bit product of 32-bit words `a` (int64 tensor) and constant `m`: (high word, low word).

    a * m can reach 2^64, past int64, so m is split into 16-bit halves: both partial products stay
    below 2^48 and the carry is propagated by hand.
    """
    p_lo = a * (m & 0xFFFF)  # < 2^48
    p_hi = a * (m >> 16)  # < 2^48; a * m == p_hi * 2^16 + p_lo
    t = p_lo + ((p_hi & 0xFFFF) << 16)  # < 2^49: the part of the product below bit 48 of p_hi << 16
    return (p_hi >> 16) + (t >> 32), t & _MASK32


def _mulhilo_wrap(a: Tensor, m: int) -> tuple[Tensor, Tensor]:
    """The same words from one int64 product: a * m < 2^64, so its low 64 bits — what an int64 product
    that wraps keeps — are the whole product; the arithmetic shift's sign bits are masked off. 4 tensor
    ops instead of 9: the CPU's Philox (the sampler's Gumbel noise on a CPU) ~2x faster."""
    p = a * m
    return (p >> 32) & _MASK32, p & _MASK32


def _int64_products_wrap() -> bool:
    """Whether this torch's int64 products wrap modulo 2^64 (C++ leaves signed overflow undefined; every
    build seen wraps, on the vectorised and the scalar loops alike): checked once, on the edge words, in
    both loops (a tensor of 1 and of 1,000 elements, and a broadcast one), against the split product."""
    edge = torch.tensor([0, 1, 2, _MASK32, _MASK32 - 1, 1 << 31, (1 << 31) - 1, 0x12345678, 0xDEADBEEF],
                        dtype=torch.int64)
    cases = [edge[i:i + 1] for i in range(len(edge))]
    cases += [edge.repeat(120), edge.view(-1, 1).expand(-1, 7), (edge.view(-1, 1) ^ edge.view(1, -1))]
    return all(torch.equal(x, y) for a in cases for m in (_PHILOX_M0, _PHILOX_M1)
               for x, y in zip(_mulhilo_wrap(a, m), _mulhilo_split(a, m)))


_mulhilo = _mulhilo_wrap if _int64_products_wrap() else _mulhilo_split


def _philox_words(
    c0: Tensor, c1: Tensor, c2: Tensor, c3: Tensor, k0: Tensor, k1: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10 on counter words c0..c3 and key words k0, k1 (mutually broadcastable int64 tensors).

    Taking the words separately lets callers pass small broadcastable pieces (e.g. a [1, n] column
    counter and a [B, 1] position) instead of materialising a [B, n, 4] counter tensor.
    """
    for r in range(_PHILOX_ROUNDS):
        if r:
            k0 = (k0 + _PHILOX_W0) & _MASK32
            k1 = (k1 + _PHILOX_W1) & _MASK32
        hi0, lo0 = _mulhilo(c0, _PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, _PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def philox4x32(counter: Tensor, key: Tensor) -> Tensor:
    """Philox4x32-10 block function (Salmon et al. 2011, as in Random123's philox4x32_10).

    counter: [..., 4] int64 words in [0, 2^32); key: [..., 2] int64 words in [0, 2^32); leading
    dimensions broadcast. Returns [..., 4] int64 words in [0, 2^32).
    """
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    return torch.stack(_philox_words(c0, c1, c2, c3, k0, k1), dim=-1)


_PHILOX_KERNEL: list = []


def _philox_kernel():
    """dspark.kernels.markov_sampler.philox_words_triton, or None without triton. On a GPU the torch
    Philox below is ~200 tiny kernels per draw (several ms per sampling step); the Triton kernel gives
    the same words in one launch."""
    if not _PHILOX_KERNEL:
        try:
            from dspark.kernels.markov_sampler import philox_words_triton
        except ImportError:
            philox_words_triton = None
        _PHILOX_KERNEL.append(philox_words_triton)
    return _PHILOX_KERNEL[0]


def _random_words(seeds: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """[B, n] int64 words in [0, 2^32): word j of row b depends only on (seeds[b], positions[b], stream, j).

    Key = (seed low 32 bits, seed high 32 bits); counter = (j // 4, position low 32 bits, stream,
    position high 32 bits); word j is output word j % 4 of that Philox block.
    """
    if seeds.is_cuda and _philox_kernel() is not None:  # one launch instead of ~200 small ones
        return _philox_kernel()(seeds, positions, stream, n)
    seeds = seeds.to(torch.int64).unsqueeze(1)  # [B, 1]
    positions = positions.to(device=seeds.device, dtype=torch.int64).unsqueeze(1)  # [B, 1]
    n_blocks = (n + 3) // 4
    c0 = torch.arange(n_blocks, device=seeds.device, dtype=torch.int64).unsqueeze(0)  # [1, n_blocks]
    c1 = positions & _MASK32  # [B, 1]
    c2 = torch.full_like(c1, stream & _MASK32)  # [B, 1]
    c3 = (positions >> 32) & _MASK32  # [B, 1]; 0 for any position below 2^32
    k0 = seeds & _MASK32  # [B, 1]
    k1 = (seeds >> 32) & _MASK32  # [B, 1]; the arithmetic shift is fine, the mask keeps the bits
    words = torch.stack(_philox_words(c0, c1, c2, c3, k0, k1), dim=-1)  # [B, n_blocks, 4]
    return words.reshape(seeds.shape[0], 4 * n_blocks)[:, :n]


def _random_words_at(seeds: Tensor, positions: Tensor, stream: int, cols: Tensor) -> Tensor:
    """[B, K] int64 words: entry [b, i] equals ``_random_words(seeds, positions, stream, n)[b, cols[b, i]]``
    for any n > cols[b, i], computing only the K Philox blocks asked for (the whole point of a
    counter-based generator: a sampler that only needs the top-k candidates draws only those)."""
    if seeds.is_cuda and _philox_kernel() is not None:
        return _philox_kernel()(seeds, positions, stream, cols=cols)
    seeds = seeds.to(torch.int64).unsqueeze(1)  # [B, 1]
    positions = positions.to(device=seeds.device, dtype=torch.int64).unsqueeze(1)  # [B, 1]
    cols = cols.to(device=seeds.device, dtype=torch.int64)  # [B, K]
    c1 = positions & _MASK32
    c2 = torch.full_like(c1, stream & _MASK32)
    c3 = (positions >> 32) & _MASK32
    k0 = seeds & _MASK32
    k1 = (seeds >> 32) & _MASK32
    words = torch.stack(_philox_words(cols >> 2, c1, c2, c3, k0, k1), dim=-1)  # [B, K, 4]
    return words.gather(-1, (cols & 3).unsqueeze(-1)).squeeze(-1)


def _open_unit(words: Tensor) -> Tensor:
    """Map 32-bit words to float32 in the open interval (0, 1): (w + 0.5) / 2^32, rounded to float32.

    Near 0 this keeps float32's full relative precision (far finer than a fixed 24-bit grid; the
    smallest value is 2^-33). Near 1 the float32 grid step is 2^-24, and the few top words that
    would round to exactly 1.0 are clamped to the largest float32 below 1, so 0 and 1 never occur.
    """
    return ((words.to(torch.float32) + 0.5) * _TWO_POW_M32).clamp_(max=_BELOW_ONE_F32)


def uniform(seeds: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """[B, n] float32 uniforms in (0, 1); entry [b, j] is a pure function of (seeds[b], positions[b], stream, j).

    seeds: [B] int64 (any 64-bit pattern); positions: [B] int64 (>= 0). Results do not depend on B,
    on row order, or on n (a longer draw extends a shorter one).
    """
    return _open_unit(_random_words(seeds, positions, stream, n))


def gumbel(seeds: Tensor, positions: Tensor, stream: int, n: int) -> Tensor:
    """[B, n] float32 standard Gumbel noise, -log(-log(u)) for the same u that `uniform` draws.

    Computed as -log(-log1p(-v)) with v = 1 - u taken straight from the complemented word, so the
    upper tail (u near 1, where float32 u has only 24 bits, and the draws that decide Gumbel-max
    sampling come from) keeps full precision: the largest value is about 22.9 rather than about 16.6.
    """
    v = _open_unit(_MASK32 - _random_words(seeds, positions, stream, n))  # 1 - u, fine near 0
    return -torch.log(-torch.log1p(-v))


def gumbel_at(seeds: Tensor, positions: Tensor, stream: int, cols: Tensor) -> Tensor:
    """[B, K] float32: ``gumbel(seeds, positions, stream, n)[b, cols[b, i]]``, bit for bit, for columns
    cols [B, K] only."""
    v = _open_unit(_MASK32 - _random_words_at(seeds, positions, stream, cols))
    return -torch.log(-torch.log1p(-v))
