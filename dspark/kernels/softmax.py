"""Temperature softmax and arg-max of independent rows in two launches, with its PyTorch reference.

What a sampled batch's verification needs from the target's logits (engine/cuda_graphs.py ``_verify_step``,
ModelRunner._verify): for R rows of V logits at temperature t (no top-k / top-p / min-p, no penalties)

    probs[r]  = softmax(logits[r] / t_r)      (t_r = 0 divides by 1, as sampler.apply_temperature)
    argmax[r] = argmax(logits[r])             (first index on ties, as torch.argmax)

i.e. ``sampler.compute_probs`` of an ``all_random`` batch without filters, and the raw argmax every greedy
row is verified by. Torch runs that as three passes over [R, V] fp32 (the division writing a scaled copy,
softmax, argmax: 56 µs at 128 x 49,152 on the H100, session 52's profile); the fused sampler
(markov_sampler.processed_probs) does it in two launches but pays for its generality (per-row filter settings,
a scratch copy of the scaled logits, atomics): 68 µs there, no gain (session 53).

Here, two launches over a grid of (row, vocabulary tile), no scratch copy, no atomics:
- **A** reads its tile once: tile maximum and first arg-max of the raw logits, and of z = x / t the tile
  maximum and Σ exp(z - max) (partials [R, NT]).
- **B** reduces the row's NT partials (a few dozen values, redundantly in every program of the row),
  reads its tile again (from L2 at these sizes) and writes exp(z - M) / Z; the row's first program writes
  the arg-max.
So [R, V] is read twice and written once. The division is ``div_rn`` (Triton's ``/`` is approximate on
NVIDIA GPUs), so z is bit-equal to torch's; the sums differ from torch's softmax only in their order.
``ONE_HOT_GREEDY``: rows at temperature 0 get the one-hot of their arg-max instead (compute_probs of a
batch that is not ``all_random``).

``temperature_sample`` is the plain decode step's draw from the same rows (``Sampler.__call__`` of a batch at
temperatures only): argmax(x / t + gumbel(seed, position, stream)) for t > 0, argmax(x) for t = 0, the noise
made in the tile by markov_sampler's Philox (the words of rng.gumbel, bit for bit on the GPU, where both use
libdevice's log / log1p). Launch A writes each tile's (max, first arg-max) of its score, launch B (one program
per row) reduces them. Torch's version is about twelve passes over [B, V] (the Philox words, the Gumbel transform
in four element-wise ops, the division, the addition, two arg-max reductions, a select): 75-90 µs at 32 x 49,152
on the H100 (session 53's profile, session 54's rows benchmark), 6-7 % of the plain batch-32 step's GPU time.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from dspark.kernels import check_device, next_pow2, pdl_opts, pdl_wait
from dspark.kernels.markov_sampler import _NEG_INF, _first_argmax, _gumbel_from_words, _random_words

# (BLOCK_V, num_warps) on a GPU; the interpreter takes small tiles (the tests' vocabularies). H100, CUDA-graph µs
# for probabilities + argmax of V = 49,152 at 32 / 128 / 256 rows (session 53, kernel_ops_bench.py --only rows
# --rows-tiles): 512 x 4 11.9 / 37.9 / 73.1, 1024 x 4 9.0 / 28.9 / 60.4, 2048 x 4 8.3 / 27.1 / 57.9, 2048 x 8
# 8.0 / 27.5 / 59.0, 4096 x 8 8.3 / 27.7 / 59.4; torch (division, softmax, argmax) 35.1 / 66.4 / 134.6.
TILE_CUDA = (2048, 4)
TILE_CPU = (128, 4)
# temperature_sample's tile on a GPU. H100, CUDA-graph µs at V = 49,152, 32 / 128 / 256 rows (session 54,
# kernel_ops_bench.py --only rows --rows-tiles): the draw 1024 x 4 10.2 / 28.8 / 53.9, 2048 x 4 9.8 / 27.8 / 51.4,
# 2048 x 8 10.0 / 29.4 / 54.8 against torch's 87.9 / 287.6 / 596.3; the arg-max alone 4.3 / 7.7 / 19.9 at 2048 x 4
# against torch's 12.2 / 12.5 / 23.7.
SAMPLE_TILE_CUDA = (2048, 4)


@triton.jit
def _partials_kernel(x_ptr, stride_x, t_ptr, amax_ptr, aidx_ptr, zmax_ptr, zsum_ptr, V, NT_PAD: tl.constexpr,
                     BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cm = cols < V
    x = tl.load(x_ptr + b * stride_x + cols, mask=cm, other=_NEG_INF)
    temp = tl.load(t_ptr + b)
    temp = tl.where(temp == 0.0, 1.0, temp)
    z = tl.math.div_rn(x, tl.zeros_like(x) + temp)
    zm = tl.max(z, 0)
    tl.store(amax_ptr + b * NT_PAD + t, tl.max(x, 0))
    tl.store(aidx_ptr + b * NT_PAD + t, t * BLOCK_V + tl.argmax(x, 0))
    tl.store(zmax_ptr + b * NT_PAD + t, zm)
    tl.store(zsum_ptr + b * NT_PAD + t, tl.sum(tl.where(cm, tl.exp(z - zm), 0.0), 0))


@triton.jit
def _row_max_sum(zmax_ptr, zsum_ptr, b, NT, NT_PAD: tl.constexpr):
    """Row b's M = max(z) and Z = Σ exp(z - M) from launch A's tile partials. One helper for _probs_kernel and
    _stats_kernel, so that both reduce with the same code (the same bits: "From logits" in kernels/rejection.py)."""
    tt = tl.arange(0, NT_PAD)
    tm = tt < NT
    mz = tl.load(zmax_ptr + b * NT_PAD + tt, mask=tm, other=_NEG_INF)
    se = tl.load(zsum_ptr + b * NT_PAD + tt, mask=tm, other=0.0)
    M = tl.max(mz, 0)
    return M, tl.sum(tl.where(tm, se * tl.exp(mz - M), 0.0), 0)


@triton.jit
def _probs_kernel(x_ptr, stride_x, t_ptr, amax_ptr, aidx_ptr, zmax_ptr, zsum_ptr, q_ptr, stride_q, am_ptr, V, NT,
                  NT_PAD: tl.constexpr, BLOCK_V: tl.constexpr, ONE_HOT_GREEDY: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    M, Z = _row_max_sum(zmax_ptr, zsum_ptr, b, NT, NT_PAD)
    arg = _first_argmax(amax_ptr + b * NT_PAD, aidx_ptr + b * NT_PAD, NT, NT_PAD)  # the row's first arg-max
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cm = cols < V
    x = tl.load(x_ptr + b * stride_x + cols, mask=cm, other=_NEG_INF)
    temp = tl.load(t_ptr + b)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    z = tl.math.div_rn(x, tl.zeros_like(x) + temp)
    q = tl.exp(z - M) / Z
    if ONE_HOT_GREEDY:
        q = tl.where(greedy, (cols == arg).to(tl.float32), q)
    tl.store(q_ptr + b * stride_q + cols, q, mask=cm)
    if t == 0:
        tl.store(am_ptr + b, arg.to(tl.int64))


@triton.jit
def _stats_kernel(t_ptr, amax_ptr, aidx_ptr, zmax_ptr, zsum_ptr, st_ptr, am_ptr, NT, NT_PAD: tl.constexpr,
                  PDL: tl.constexpr):
    """Row b's (t, M, Z) and arg-max from launch A's partials: the values _probs_kernel reduces in each of
    its programs (_row_max_sum on the same partials, hence the same bits), so exp(x / t - M) / Z made
    elsewhere from them is _probs_kernel's probability to the bit."""
    pdl_wait(PDL)
    b = tl.program_id(0)
    M, Z = _row_max_sum(zmax_ptr, zsum_ptr, b, NT, NT_PAD)
    temp = tl.load(t_ptr + b)
    tl.store(st_ptr + 3 * b, tl.where(temp == 0.0, 1.0, temp))
    tl.store(st_ptr + 3 * b + 1, M)
    tl.store(st_ptr + 3 * b + 2, Z)
    tl.store(am_ptr + b, _first_argmax(amax_ptr + b * NT_PAD, aidx_ptr + b * NT_PAD, NT, NT_PAD).to(tl.int64))


@triton.jit
def _sample_partials_kernel(x_ptr, stride_x, t_ptr, seeds_ptr, pos_ptr, stream, smax_ptr, sidx_ptr, V,
                            NT_PAD: tl.constexpr, BLOCK_V: tl.constexpr, GREEDY_ONLY: tl.constexpr,
                            PRECISE: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    t = tl.program_id(1)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    x = tl.load(x_ptr + b * stride_x + cols, mask=cols < V, other=_NEG_INF)
    if GREEDY_ONLY:
        score = x
    else:
        temp = tl.load(t_ptr + b)
        if temp == 0.0:  # a greedy row: the raw arg-max
            score = x
        else:
            words = _random_words(tl.load(seeds_ptr + b), tl.load(pos_ptr + b), stream, t * BLOCK_V, BLOCK_V)
            # padding columns stay -inf (-inf / t + noise)
            score = tl.math.div_rn(x, tl.zeros_like(x) + temp) + _gumbel_from_words(words, PRECISE)
    tl.store(smax_ptr + b * NT_PAD + t, tl.max(score, 0))
    tl.store(sidx_ptr + b * NT_PAD + t, t * BLOCK_V + tl.argmax(score, 0))


@triton.jit
def _pick_kernel(smax_ptr, sidx_ptr, out_ptr, NT, NT_PAD: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0)
    tok = _first_argmax(smax_ptr + b * NT_PAD, sidx_ptr + b * NT_PAD, NT, NT_PAD)
    tl.store(out_ptr + b, tok.to(tl.int64))


def _rows_2d(logits: Tensor) -> Tensor:
    check_device(logits)
    if logits.dim() != 2:
        raise ValueError(f"logits must be [R, V], got shape {tuple(logits.shape)}")
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        logits = logits.float().contiguous()
    return logits


def temperature_sample(logits: Tensor, temperature: Tensor | None, seeds: Tensor | None = None,
                       positions: Tensor | None = None, stream: int = 0, *, out: Tensor | None = None,
                       block_v: int | None = None, num_warps: int | None = None) -> Tensor:
    """[R] int64 tokens drawn from ``logits`` [R, V] as ``Sampler.__call__`` draws a batch at temperatures only
    (no filter, no penalty): argmax(logits / t + rng.gumbel(seeds, positions, stream)) for rows with t > 0, the
    first argmax of the logits for t = 0. ``temperature`` None: every row greedy (the argmax alone, no noise).
    ``out``: an int64 [R] tensor to write into (a CUDA graph's buffer). Never reads a device value on the host:
    capturable."""
    logits = _rows_2d(logits)
    R, V = logits.shape
    dev = logits.device
    greedy_only = temperature is None
    if not greedy_only:
        if temperature.shape != (R,):
            raise ValueError(f"temperature must be [{R}], got shape {tuple(temperature.shape)}")
        if seeds is None or positions is None or seeds.shape != (R,) or positions.shape != (R,):
            raise ValueError(f"sampled rows need seeds and positions of shape ({R},)")
        temperature = temperature.to(device=dev, dtype=torch.float32)
        seeds = seeds.to(device=dev, dtype=torch.int64)
        positions = positions.to(device=dev, dtype=torch.int64)
    else:
        temperature = seeds = positions = logits  # never read
    if out is None:
        out = torch.empty(R, dtype=torch.int64, device=dev)
    elif out.shape != (R,) or out.dtype != torch.int64:
        raise ValueError(f"out must be an int64 ({R},) tensor")
    if R == 0:
        return out
    tile_v, warps = SAMPLE_TILE_CUDA if logits.is_cuda else TILE_CPU
    block_v = block_v or tile_v
    nt = triton.cdiv(V, block_v)
    nt_pad = next_pow2(nt)
    smax = torch.empty(R, nt_pad, dtype=torch.float32, device=dev)
    sidx = torch.empty(R, nt_pad, dtype=torch.int32, device=dev)
    _sample_partials_kernel[(R, nt)](logits, logits.stride(0), temperature, seeds, positions, stream, smax, sidx, V,
                                     NT_PAD=nt_pad, BLOCK_V=block_v, GREEDY_ONLY=greedy_only,
                                     PRECISE=logits.is_cuda, num_warps=num_warps or warps,
                                     **pdl_opts(logits))
    _pick_kernel[(R,)](smax, sidx, out, nt, NT_PAD=nt_pad, num_warps=1, **pdl_opts(logits))
    return out


def temperature_sample_reference(logits: Tensor, temperature: Tensor | None, seeds: Tensor | None = None,
                                 positions: Tensor | None = None, stream: int = 0) -> Tensor:
    """The same with torch (rng.gumbel's noise)."""
    x = logits.float()
    if temperature is None:
        return x.argmax(dim=-1)
    from dspark.sample.rng import gumbel

    t = temperature.to(device=x.device, dtype=torch.float32)
    z = x / torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1)
    sampled = (z + gumbel(seeds, positions, stream, x.shape[-1])).argmax(dim=-1)
    return torch.where(t == 0, x.argmax(dim=-1), sampled)


def _row_partials(logits: Tensor, temperature: Tensor, argmax_out: Tensor | None, block_v: int | None,
                  num_warps: int | None) -> tuple:
    """The checks and launch A shared by temperature_softmax_argmax / _stats: (logits as [R, V] fp32, temperature
    [R] fp32, argmax_out, the partials (amax, aidx, zmax, zsum), NT, NT_PAD, BLOCK_V, warps); launch A is skipped
    for R = 0."""
    logits = _rows_2d(logits)
    R, V = logits.shape
    dev = logits.device
    if temperature.shape != (R,):
        raise ValueError(f"temperature must be [{R}], got shape {tuple(temperature.shape)}")
    temperature = temperature.to(device=dev, dtype=torch.float32)
    if argmax_out is None:
        argmax_out = torch.empty(R, dtype=torch.int64, device=dev)
    elif argmax_out.shape != (R,) or argmax_out.dtype != torch.int64:
        raise ValueError(f"argmax_out must be an int64 ({R},) tensor")
    tile_v, warps = TILE_CUDA if logits.is_cuda else TILE_CPU
    block_v, warps = block_v or tile_v, num_warps or warps
    nt = triton.cdiv(V, block_v)
    nt_pad = next_pow2(nt)
    f32 = dict(dtype=torch.float32, device=dev)
    amax, zmax, zsum = (torch.empty(R, nt_pad, **f32) for _ in range(3))
    aidx = torch.empty(R, nt_pad, dtype=torch.int32, device=dev)
    if R:
        _partials_kernel[(R, nt)](logits, logits.stride(0), temperature, amax, aidx, zmax, zsum, V, NT_PAD=nt_pad,
                                  BLOCK_V=block_v, num_warps=warps, **pdl_opts(logits))
    return logits, temperature, argmax_out, (amax, aidx, zmax, zsum), nt, nt_pad, block_v, warps


def temperature_softmax_argmax(logits: Tensor, temperature: Tensor, *, probs_out: Tensor | None = None,
                               argmax_out: Tensor | None = None, one_hot_greedy: bool = False,
                               block_v: int | None = None, num_warps: int | None = None) -> tuple[Tensor, Tensor]:
    """(probs [R, V] fp32, argmax [R] int64) of ``logits`` [R, V] (fp32, unit column stride; other dtypes are
    converted) at ``temperature`` [R] (module docstring). ``probs_out`` / ``argmax_out``: tensors to write into
    (a CUDA graph's buffers). Never reads a device value on the host: capturable."""
    logits = _rows_2d(logits)  # (once: _row_partials' own call is then a no-op)
    R, V = logits.shape
    if probs_out is not None and (probs_out.shape != (R, V) or probs_out.dtype != torch.float32
                                  or probs_out.stride(-1) != 1):
        raise ValueError(f"probs_out must be a float32 {(R, V)} tensor with unit column stride")
    logits, temperature, argmax_out, parts, nt, nt_pad, block_v, warps = _row_partials(
        logits, temperature, argmax_out, block_v, num_warps)
    if probs_out is None:
        probs_out = torch.empty(R, V, dtype=torch.float32, device=logits.device)
    if R == 0:
        return probs_out, argmax_out
    _probs_kernel[(R, nt)](logits, logits.stride(0), temperature, *parts, probs_out, probs_out.stride(0), argmax_out,
                           V, nt, NT_PAD=nt_pad, BLOCK_V=block_v, ONE_HOT_GREEDY=one_hot_greedy, num_warps=warps,
                           **pdl_opts(logits))
    return probs_out, argmax_out


def temperature_softmax_argmax_reference(logits: Tensor, temperature: Tensor,
                                         one_hot_greedy: bool = False) -> tuple[Tensor, Tensor]:
    """The same with torch: softmax(logits / where(t == 0, 1, t)) (one-hot of the argmax for t == 0 rows
    with ``one_hot_greedy``) and logits.argmax(-1)."""
    x = logits.float()
    t = temperature.to(device=x.device, dtype=torch.float32)
    probs = (x / torch.where(t == 0, torch.ones_like(t), t).unsqueeze(1)).softmax(dim=-1)
    am = x.argmax(dim=-1)
    if one_hot_greedy:
        one_hot = torch.nn.functional.one_hot(am, x.shape[-1]).to(torch.float32)
        probs = torch.where((t == 0).unsqueeze(1), one_hot, probs)
    return probs, am


def temperature_softmax_stats(logits: Tensor, temperature: Tensor, *, stats_out: Tensor | None = None,
                              argmax_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(stats [R, 3] fp32, argmax [R] int64): for each row the temperature it is divided by (1 for t = 0),
    M = max(x / t) and Z = Σ exp(x / t - M) (x / t rounded as ``div_rn``), so that a consumer reading the
    logits can make ``temperature_softmax_argmax``'s probabilities itself, to the bit:
    p = exp(div_rn(x, t) - M) / Z. What block / standard verification reads instead of a written [R, V]
    (kernels/rejection.py ``target_stats``): launch A, then one small program per row in place of launch B's
    write of every probability. Capturable, as ``temperature_softmax_argmax``."""
    logits = _rows_2d(logits)
    R = logits.shape[0]
    if stats_out is not None and (stats_out.shape != (R, 3) or stats_out.dtype != torch.float32
                                  or not stats_out.is_contiguous()):
        raise ValueError(f"stats_out must be a contiguous float32 {(R, 3)} tensor")
    # launch A as temperature_softmax_argmax's (the same tile), so the same partials
    logits, temperature, argmax_out, parts, nt, nt_pad, _, warps = _row_partials(logits, temperature, argmax_out,
                                                                                  None, None)
    if stats_out is None:
        stats_out = torch.empty(R, 3, dtype=torch.float32, device=logits.device)
    if R:  # with _probs_kernel's warps: its reductions of the partials, laid out alike
        amax, aidx, zmax, zsum = parts
        _stats_kernel[(R,)](temperature, amax, aidx, zmax, zsum, stats_out, argmax_out, nt, NT_PAD=nt_pad,
                            num_warps=warps, **pdl_opts(amax))
    return stats_out, argmax_out


def probs_from_stats(logits: Tensor, stats: Tensor) -> Tensor:
    """[R, V] fp32 probabilities from the logits and ``temperature_softmax_stats``'s stats with torch's ops,
    exp(x / t - M) / Z: equal to the kernels' up to rounding, not to the bit (a fallback's)."""
    x = logits.float()
    return torch.exp(x / stats[:, :1] - stats[:, 1:2]) / stats[:, 2:3]
