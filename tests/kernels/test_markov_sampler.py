"""The fused Markov sampler vs the proposer's PyTorch loop: Philox words, Gumbel noise, drafted tokens
(token for token) and draft distributions q, greedy and sampled, with and without top-k/top-p/min-p
and penalties, on both of the kernel's threshold paths (sorted candidates and bisection).

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py): small vocabularies (~1000).
Markov weights are multiples of 1/16 so the rank-r bias is exact in any summation order; base logits
are continuous, so exact ties (where the kernel and torch.sort may legitimately differ) do not occur.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

from dataclasses import replace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels import interpreter_ready  # noqa: E402
from dspark.kernels.markov_sampler import (  # noqa: E402
    gumbel_triton,
    markov_sample,
    markov_sample_reference,
    philox4x32_triton,
)
from dspark.sample.rng import STREAM_ACCEPT, STREAM_SAMPLE, draft_stream, gumbel, philox4x32  # noqa: E402
from dspark.sample.sampler import SamplingBatch  # noqa: E402
from dspark.sampling_params import SamplingParams as P  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ready(), reason="Triton interpreter not active in this process")


# ------------------------------------------------------------------------------ Philox / Gumbel
def test_philox_words_match_rng() -> None:
    g = torch.Generator().manual_seed(1)
    counters = torch.randint(0, 2**32, (3000, 4), generator=g, dtype=torch.int64)
    keys = torch.randint(0, 2**32, (3000, 2), generator=g, dtype=torch.int64)
    edge = torch.tensor([[0, 0, 0, 0], [2**32 - 1] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]])
    edge_keys = torch.tensor([[0, 0], [2**32 - 1] * 2, [0xA4093822, 0x299F31D0]])
    counters = torch.cat([counters, edge])
    keys = torch.cat([keys, edge_keys])
    out = philox4x32_triton(counters, keys)
    assert torch.equal(out, philox4x32(counters, keys))
    assert out[-3:, 0].tolist() == [0x6627E8D5, 0x408F276D, 0xD16CFE09]  # Random123 known answers


@pytest.mark.parametrize("stream", [STREAM_SAMPLE, STREAM_ACCEPT, draft_stream(0), draft_stream(6)])
def test_gumbel_matches_rng(stream: int) -> None:
    seeds = torch.tensor([0, -1, 2**62 + 5, -(2**63), 12345, 7], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**33 + 3, 99, 2**32 - 1, 123456789], dtype=torch.int64)
    n = 1003  # not a multiple of 4 (Philox blocks) nor of the kernel's tile
    ours = gumbel_triton(seeds, positions, stream, n)
    ref = gumbel(seeds, positions, stream, n)
    # Same uniforms; the two logs may differ in the last bit (numpy vs torch's vectorised log on CPU;
    # both are libdevice's on a GPU).
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    assert (ours == ref).float().mean() > 0.8


# ------------------------------------------------------------------------------------ sampler
def _inputs(B: int, N: int, V: int, r: int, seed: int, scale: float = 3.0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(B, N, V, generator=g) * scale
    w1 = (torch.randint(-8, 8, (V, r), generator=g).float() / 16).to(dtype)
    w2_t = (torch.randint(-8, 8, (r, V), generator=g).float() / 16).to(dtype)
    anchors = torch.randint(0, V, (B,), generator=g)
    anchor_pos = torch.randint(0, 5000, (B,), generator=g)
    return base, anchors, anchor_pos, w1, w2_t


def _batch(params: list[P], anchor_pos: torch.Tensor, V: int, seed: int = 0) -> SamplingBatch:
    B = len(params)
    g = torch.Generator().manual_seed(seed + 99)
    outputs = [torch.randint(0, V, (6,), generator=g).tolist() for _ in range(B)]
    prompts = [torch.randint(0, V, (9,), generator=g).tolist() for _ in range(B)]
    seeds = [int(s) for s in torch.randint(-(2**62), 2**62, (B,), generator=g)]
    return SamplingBatch.build(params, seeds, (anchor_pos + 1).tolist(), prompts, outputs, V, "cpu")


def _check(params: list[P], prob: list[bool], N: int, V: int, seed: int, scale: float = 3.0,
           block_v: int = 256, cap: int = 64, r: int = 16, dtype=torch.float32, no_markov: bool = False,
           temp_only: bool = False, bias_gemm: bool | None = None) -> torch.Tensor:
    """Kernel vs reference on random inputs; returns how each sampled row's threshold was found
    ([B, N]: 0 no filter, 1 sorted candidates, 2 bisection, -1 not sampled)."""
    B = len(params)
    base, anchors, anchor_pos, w1, w2_t = _inputs(B, N, V, r, seed, scale, dtype)
    if no_markov:
        w1 = w2_t = None
    batch = _batch(params, anchor_pos, V, seed)
    paths = torch.empty(B, N, dtype=torch.int32)
    # the Markov bias inside the kernel below 4 rows, by one GEMM from 4 on: the GPU's default (on a CPU
    # the default is always the GEMM)
    bias_gemm = B >= 4 if bias_gemm is None else bias_gemm
    if temp_only:  # the one-launch slots, and the general launches give the same tokens and q
        tokens, q = markov_sample(base, anchors, w1, w2_t, batch, anchor_pos + 1, prob, block_v=block_v,
                                  temp_only=True, bias_gemm=bias_gemm)
        gen_tokens, gen_q = markov_sample(base, anchors, w1, w2_t, batch, anchor_pos + 1, prob, block_v=block_v,
                                          temp_only=False, bias_gemm=bias_gemm)
        assert torch.equal(tokens, gen_tokens)
        assert (q is None) == (gen_q is None) and (q is None or torch.equal(q, gen_q))
    else:
        tokens, q = markov_sample(base, anchors, w1, w2_t, batch, anchor_pos + 1, prob, block_v=block_v, cap=cap,
                                  _paths=paths, bias_gemm=bias_gemm)
    ref_tokens, ref_q = markov_sample_reference(base, anchors, w1, w2_t, batch, anchor_pos + 1, prob)
    assert torch.equal(tokens, ref_tokens), f"\n{tokens}\n{ref_tokens}"
    if ref_q is None:
        assert q is None
    else:
        torch.testing.assert_close(q, ref_q, rtol=0, atol=1e-6)
    return paths


@pytest.mark.parametrize(("B", "N", "V"), [(1, 5, 1000), (4, 7, 997), (3, 5, 1000)])
def test_greedy_matches_reference(B: int, N: int, V: int) -> None:
    _check([P(temperature=0.0)] * B, [False] * B, N, V, seed=B * 10 + N)


def test_the_gpu_tile_matches_reference() -> None:
    """MARKOV_TILE_CUDA's vocabulary tile (markov_sample's default on a GPU) over a vocabulary of two
    whole tiles and a partial one: greedy, T = 1, top-p, top-k + top-p rows in one batch."""
    from dspark.kernels.markov_sampler import MARKOV_TILE_CUDA

    v = MARKOV_TILE_CUDA[0]
    params = [P(temperature=0.0), P(temperature=1.0), P(temperature=0.7, top_p=0.95),
              P(temperature=0.7, top_k=20, top_p=0.8)]
    _check(params, [False, True, True, True], 5, 2 * v + 904, seed=11, block_v=v, cap=256)


def test_greedy_drafting_of_random_rows_is_argmax() -> None:
    # draft_sample_method "greedy": rows with temperature > 0 still draft by argmax, q is None.
    _check([P(temperature=0.8, top_k=5), P(temperature=1.0)], [False, False], 5, 1000, seed=3)


def test_sampled_plain_temperature() -> None:
    _check([P(temperature=1.0), P(temperature=0.6), P(temperature=1.7)], [True] * 3, 7, 1000, seed=5)


@pytest.mark.parametrize("bias_gemm", [False, True])
def test_temperature_only_slots(bias_gemm: bool) -> None:
    """markov_sample(temp_only=True), the drafts' path (no filter, no penalty): one launch per slot and q
    normalised after the loop — sampled rows, a probabilistic row at temperature 0 (one-hot q), greedy drafting of
    a random row (q zeros), the Markov bias in the kernel or from one GEMM; greedy-only batches (no q)."""
    params = [P(temperature=1.0), P(temperature=0.0), P(temperature=0.6), P(temperature=1.7), P(temperature=0.9)]
    _check(params, [True, True, False, True, True], 6, 1003, seed=31, block_v=128, temp_only=True,
           bias_gemm=bias_gemm)
    _check(params[:3], [False] * 3, 4, 1000, seed=37, temp_only=True, bias_gemm=bias_gemm)


def test_temperature_only_slots_bf16_no_markov_gpu_tile_and_errors() -> None:
    from dspark.kernels.markov_sampler import MARKOV_TILE_CUDA

    params = [P(temperature=0.0), P(temperature=0.8), P(temperature=1.0)]
    _check(params, [False, True, True], 5, 1000, seed=41, dtype=torch.bfloat16, temp_only=True)
    _check(params, [True, True, True], 5, 1000, seed=43, no_markov=True, temp_only=True)
    _check(params, [False, True, True], 3, 2 * MARKOV_TILE_CUDA[0] + 904, seed=47, block_v=MARKOV_TILE_CUDA[0],
           temp_only=True)
    base, anchors, anchor_pos, w1, w2_t = _inputs(2, 3, 500, 8, 1)
    filtered = _batch([P(temperature=1.0, top_p=0.9)] * 2, anchor_pos, 500)
    with pytest.raises(ValueError, match="temp_only"):
        markov_sample(base, anchors, w1, w2_t, filtered, anchor_pos + 1, [True, True], temp_only=True)


def test_sampled_top_k_top_p_min_p() -> None:
    params = [
        P(temperature=0.7, top_k=5),  # k <= number of tiles: candidates bounded by the tile maxima
        P(temperature=0.6, top_p=0.9),  # the tile maxima carry too little mass: L raised by bisection
        P(temperature=0.8, top_k=6, top_p=0.8),
        P(temperature=1.2, min_p=0.05),
        P(temperature=0.9, top_k=7, top_p=0.95, min_p=0.02),
    ]
    paths = _check(params, [True] * len(params), 5, 1003, seed=7, block_v=128)
    assert paths[[0, 1, 2, 4]].eq(1).all() and paths[3].eq(0).all()


def test_sampled_flat_distributions_use_bisection() -> None:
    # top_k larger than the candidate buffer, and flat distributions (top-p keeps hundreds of tokens):
    # the exact bisection over the row decides.
    params = [P(temperature=0.7, top_k=300), P(temperature=3.0, top_p=0.95),
              P(temperature=0.8, top_k=400, top_p=0.9, min_p=0.01)]
    paths = _check(params, [True] * 3, 5, 997, seed=11, scale=1.0)
    assert paths[:2].eq(2).all()


def test_forced_bisection_matches() -> None:
    params = [P(temperature=0.7, top_k=5), P(temperature=1.0, top_p=0.8), P(temperature=0.9, top_k=4, top_p=0.7)]
    paths = _check(params, [True] * 3, 5, 1000, seed=13, cap=2)  # top_k > cap: no candidate buffer
    assert paths[[0, 2]].eq(2).all()


def test_mixed_rows_and_temperature_zero_probabilistic() -> None:
    params = [P(temperature=0.0), P(temperature=1.0, top_p=0.9), P(temperature=0.5), P(temperature=0.9, top_k=8)]
    # row 0: probabilistic at temperature 0 (one-hot q); row 2: greedy drafting of a random row
    _check(params, [True, True, False, True], 7, 1000, seed=17)


def test_penalties() -> None:
    params = [
        P(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2, top_p=0.9),
        P(temperature=0.0, repetition_penalty=2.0),  # probabilistic at T=0: argmax of the penalised logits
        P(temperature=1.0, frequency_penalty=1.0),
        P(temperature=0.0, repetition_penalty=1.5),  # greedy drafting: raw argmax, no penalty
    ]
    _check(params, [True, True, True, False], 5, 1000, seed=19)


def test_bf16_weights_and_no_markov_head() -> None:
    params = [P(temperature=0.0), P(temperature=0.8, top_k=6)]
    _check(params, [False, True], 5, 1000, seed=23, dtype=torch.bfloat16)
    _check(params, [False, True], 5, 1000, seed=29, no_markov=True)


# ----------------------------------------------------------------------- the proposer itself
class _FakeDrafter:
    """Just enough of a DSparkDrafter for DSparkProposer.propose: no layers, given base logits,
    the real Markov bias of a markov head with weights w1 / w2_t."""

    def __init__(self, U: torch.Tensor, w1: torch.Tensor, w2_t: torch.Tensor, block_size: int) -> None:
        from types import SimpleNamespace

        self.U, self.w1, self.w2_t = U, w1, w2_t
        self.layers = []
        self.confidence = None
        self.config = SimpleNamespace(block_size=block_size, target_layer_ids=(1,))

    def block_hidden(self, anchors, anchor_pos, ctx_kv, valid, num_slots):
        return torch.zeros(anchors.shape[0], num_slots, 1)

    def base_logits(self, h):
        return self.U[:, : h.shape[1]]

    def markov_bias(self, prev):
        return torch.nn.functional.embedding(prev, self.w1) @ self.w2_t


def test_matches_dspark_proposer() -> None:
    from dspark.spec.proposer import DSparkProposer

    V, N = 1000, 5
    params = [P(temperature=0.0), P(temperature=0.8, top_p=0.9), P(temperature=1.1, top_k=6), P(temperature=0.7)]
    prob = [False, True, True, False]
    base, anchors, anchor_pos, w1, w2_t = _inputs(len(params), N, V, 16, seed=31)
    batch = _batch(params, anchor_pos, V, seed=31)
    proposer = DSparkProposer(_FakeDrafter(base, w1, w2_t, N))
    proposer.block_size = 16
    block_tables = torch.zeros(len(params), 400, dtype=torch.int64)
    proposal = proposer.propose([None] * len(params), anchors, anchor_pos, block_tables, N, batch, prob)
    tokens, q = markov_sample(base, anchors, w1, w2_t, batch, anchor_pos + 1, prob, cap=64)
    assert torch.equal(tokens, proposal.tokens)
    torch.testing.assert_close(q, proposal.probs, rtol=0, atol=1e-6)
    # and the reference is that loop
    ref_tokens, ref_q = markov_sample_reference(base, anchors, w1, w2_t, replace(batch), anchor_pos + 1, prob)
    assert torch.equal(ref_tokens, proposal.tokens) and torch.equal(ref_q, proposal.probs)


@pytest.mark.parametrize("stream", [STREAM_SAMPLE, draft_stream(3)])
def test_philox_words_kernel_matches_rng(stream: int) -> None:
    """The one-launch Philox that rng.py uses on CUDA: the same words as the torch path, full rows and
    chosen columns (integer arithmetic: bit for bit)."""
    from dspark.kernels.markov_sampler import philox_words_triton
    from dspark.sample.rng import _random_words, _random_words_at

    seeds = torch.tensor([0, -1, 2**62 + 5, -(2**63), 12345], dtype=torch.int64)
    positions = torch.tensor([0, 7, 2**33 + 3, 99, 2**32 - 1], dtype=torch.int64)
    assert torch.equal(philox_words_triton(seeds, positions, stream, 517), _random_words(seeds, positions, stream, 517))
    cols = torch.randint(0, 49152, (5, 21), generator=torch.Generator().manual_seed(0))
    assert torch.equal(philox_words_triton(seeds, positions, stream, cols=cols),
                       _random_words_at(seeds, positions, stream, cols))


# ------------------------------------------------------- the same kernels on independent rows
# Sampler(fused=True) on a GPU: the target's verification rows (processed_probs, in place of a vocabulary
# sort per row) and plain top-p sampling (sample_rows).
_ROW_PARAMS = [
    P(temperature=0.0),  # greedy: one-hot of the argmax / the argmax
    P(temperature=1.0, top_p=0.9),
    P(temperature=0.7, top_k=5),
    P(temperature=0.6, top_p=0.8, top_k=12),
    P(temperature=1.3, min_p=0.05, top_p=0.95),
    P(temperature=0.9),  # no filter in a filtered batch
    P(temperature=3.0, top_p=0.97),  # flat: the cut found by bisection
    P(temperature=0.8, top_p=0.9, repetition_penalty=1.4, frequency_penalty=0.3),
    P(temperature=0.0, repetition_penalty=2.0),  # greedy rows take the penalised argmax
    P(temperature=2.0, top_k=300, top_p=0.9, min_p=0.001),  # flat, top-k > cap: bisection, then radix
]


def _rows(seed: int, V: int = 1003, scale: float = 3.0):
    g = torch.Generator().manual_seed(seed)
    R = len(_ROW_PARAMS)
    logits = torch.randn(R, V, generator=g) * scale
    logits[[6, 9]] /= scale  # the flat rows
    positions = torch.randint(0, 10**6, (R,), generator=g)
    return logits, _batch(_ROW_PARAMS, positions - 1, V, seed)


@pytest.mark.parametrize(("seed", "radix"), [(0, 1), (1, 2)])
def test_processed_probs_matches_compute_probs(seed: int, radix: int, monkeypatch) -> None:
    """radix 1 (the default): rows whose top-p candidates overflow the buffer take the radix select;
    radix 2: every top-p row without top-k does."""
    from dspark.kernels import markov_sampler
    from dspark.kernels.markov_sampler import processed_probs
    from dspark.sample.sampler import compute_probs

    monkeypatch.setattr(markov_sampler, "TOPP_RADIX", radix)
    logits, batch = _rows(seed)
    paths = torch.empty(len(_ROW_PARAMS), dtype=torch.int32)
    out = torch.full_like(logits, float("nan"))
    q = processed_probs(logits, batch, probs_out=out, block_v=128, cap=64, _paths=paths)
    assert q is out
    ref = compute_probs(logits, batch)
    torch.testing.assert_close(q, ref, rtol=0, atol=1e-6)
    assert torch.equal(q > 0, ref > 0)  # the same kept sets
    # every way to the cut ran: none (greedy), no filter, sorted candidates, the radix select (flat row)
    assert paths[0] == -1 and paths[5] == 0 and paths[2] == 1 and paths[6] == 4 and paths[9] == 4, paths
    assert (paths[4] == 4) == (radix == 2)  # a peaked top-p row: sorted candidates unless radix 2


def test_sample_rows_matches_sampler() -> None:
    from dspark.kernels.markov_sampler import sample_rows
    from dspark.sample.sampler import Sampler

    logits, batch = _rows(2)
    for stream in (STREAM_SAMPLE, STREAM_ACCEPT):
        assert torch.equal(sample_rows(logits, batch, stream, block_v=128, cap=64), Sampler()(logits, batch, stream))



def test_processed_probs_top_k_only_batch() -> None:
    """A batch without top-p skips the radix launches; the rows' top-k / min-p cuts as the reference's."""
    from dspark.kernels.markov_sampler import processed_probs
    from dspark.sample.sampler import compute_probs

    params = [P(temperature=0.7, top_k=5), P(temperature=0.0), P(temperature=1.1, top_k=40, min_p=0.02)]
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 1003, generator=g) * 3.0
    batch = _batch(params, torch.zeros(3, dtype=torch.int64), 1003)
    assert batch.no_top_p
    torch.testing.assert_close(processed_probs(logits, batch, block_v=128, cap=64), compute_probs(logits, batch),
                               rtol=0, atol=1e-6)
