"""Fused elementwise/normalisation kernels of a decoder layer, in Triton, each with its PyTorch reference.

Kernels (each wrapper takes CUDA tensors, or CPU tensors under Triton's interpreter, and never reads a
tensor value on the host, so all of them can be captured in a CUDA graph):

- ``add_rms_norm`` / ``rms_norm``: ``s = x + residual`` (rounded to the activations' dtype, as the
  eager ``h = h + attn(..)`` is) and ``out = weight * rmsnorm(s)``, in one pass over the row; the
  residual add of one sub-layer and the norm of the next are one kernel instead of four. RMSNorm
  semantics are dspark.layers.basic.RMSNorm's (HF's): normalise in fp32, cast to the activations'
  dtype, then multiply by the weight in the weight's dtype.
- ``rope_qk_cache``: optional per-head q/k RMSNorm (Qwen3), rotate-half ("NeoX") RoPE on q and k
  from RotaryEmbedding's tables (``cos``, ``sin_signed`` with its first half negated, indexed by
  absolute position and cast to the activations' dtype, as ``cos_sin`` does), and the paged-cache
  write of the rotated k and of v at ``slot_mapping`` (layout ``[num_blocks, block_size, Hkv, D]``,
  see dspark/layers/attention.py). One program per token (rows_per_program: several under the interpreter)
  handles all its heads; q/k/v may be strided views of the fused qkv projection. Rows with a negative slot are
  not written (padding).
- ``silu_and_mul``: SwiGLU, ``silu(gate) * up`` on the fused ``[.., 2I]`` gate|up projection.
- ``store_context_kv``: the DSpark drafter's context K/V store (DSparkProposer.write_context /
  DrafterLayer.context_kv): optional k_norm and RoPE on K, then K and V of *committed* rows only
  into the drafter's paged cache. Rows whose ``valid`` flag is False or whose slot is negative
  (padding, rejected drafts) are skipped in the kernel, so the caller passes the whole verify batch
  with a mask instead of a boolean-indexed copy (which needs a host sync to size).

Exactness: every intermediate rounding the eager code does in a low-precision dtype (the RoPE
products and sum, silu before the multiply, the residual add, the fp32->dtype cast before the norm
weight) is reproduced with explicit casts, and floating-point contraction is turned off on the GPU
(``enable_fp_fusion=False``) where it could merge a rounding away. What remains is the summation
order of the RMSNorm mean and the last bit of ``rsqrt``/``exp``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import triton
import triton.language as tl
from triton.language.extra import libdevice

from dspark.kernels import check_device, next_pow2, pdl_opts, pdl_wait
from dspark.layers.basic import apply_rope, silu_and_mul as _silu_and_mul_ref


def _launch_opts(t: Tensor) -> dict:
    """Launch keywords of the kernels with the exact roundings (no fp contraction on the GPU) and a PDL
    parameter (dspark.kernels.pdl_opts)."""
    return {"enable_fp_fusion": False, **pdl_opts(t)} if t.device.type == "cuda" else pdl_opts(t)


# ------------------------------------------------------------------------------- rounding
@triton.jit
def _round_bf16(x):
    """fp32 -> fp32 holding x rounded to bfloat16 (to nearest, ties to even; NaN not preserved)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def cast_rtne(x, dtype: tl.constexpr):
    """fp32 x to ``dtype`` rounding to nearest even. Same as ``x.to(dtype)`` on a GPU; Triton's
    interpreter truncates when casting to bfloat16, so the rounding is done here in integer ops."""
    if dtype == tl.bfloat16:
        return _round_bf16(x).to(dtype)
    else:
        return x.to(dtype)


# ----------------------------------------------------------------------------------- RMSNorm
# T, the step's row count, is not specialised on (== 1, divisible by 16): one compiled kernel for every T, so that a new
# row count never compiles while serving (rejection.py, "Compiled variants"); the same for the two kernels below.
@triton.jit(do_not_specialize=["T"])
def _rms_norm_kernel(
    x_ptr, stride_x, r_ptr, stride_r, w_ptr, out_ptr, stride_o, res_ptr, stride_res,
    T, H, eps, n_keep, group,
    HAS_RES: tl.constexpr, BLOCK_H: tl.constexpr, SELECT: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_wait(PDL)
    row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64))[:, None]  # [ROWS, 1] of T
    src = row
    if SELECT:  # output row r is input row r // n_keep * group + r % n_keep (rms_norm_rows; no sum written)
        src = row // n_keep * group + row % n_keep
    h = tl.arange(0, BLOCK_H)
    hm = h < H
    m = (row < T) & hm[None, :]
    x = tl.load(x_ptr + src * stride_x + h[None, :], mask=m, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + src * stride_r + h[None, :], mask=m, other=0.0)
        x = cast_rtne(x.to(tl.float32) + r.to(tl.float32), x_ptr.dtype.element_ty)  # eager: one add in the dtype
        if not SELECT:
            tl.store(res_ptr + row * stride_res + h[None, :], x, mask=m)
    out = _normed_row(x, w_ptr, h, hm, H, eps)
    tl.store(out_ptr + row * stride_o + h[None, :], cast_rtne(out, out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _normed_row(x, w_ptr, h, hm, H, eps):
    """weight * rmsnorm(x) of rows x [.., BLOCK_H] (values in the activations' dtype; columns h [BLOCK_H],
    masked by hm) in fp32, for the caller to round to the result dtype: RMSNorm.forward's roundings."""
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, -1, keep_dims=True) / H + eps)
    y = cast_rtne(xf * inv, x.dtype)  # F.rms_norm(x.float()).to(x.dtype)
    w = tl.load(w_ptr + h, mask=hm, other=0.0)
    return y.to(tl.float32) * w.to(tl.float32)  # weight * y, rounded to the result dtype by the caller


# Rows (tokens) one program of the row-wise kernels here (RMSNorm, RoPE + cache write, SwiGLU) takes at most under
# Triton's CPU interpreter, which runs every program as Python and numpy calls: its time goes by the number of
# programs, not their width (session 64: these kernels were half of an engine test's time at one row per program).
# benchmarks/offline_compile.py compiles the launches it records with ROWS = GPU_ROWS: the GPU's.
INTERPRETER_ROWS = 64
GPU_ROWS = 1


def rows_per_program(t: Tensor, T: int) -> int:
    """GPU_ROWS on the GPU (the launches measured there: one program per row), else up to INTERPRETER_ROWS."""
    return GPU_ROWS if t.device.type == "cuda" else min(next_pow2(T), INTERPRETER_ROWS)


def _rows(x: Tensor) -> Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(weight * rmsnorm(x + residual), x + residual) over the last dimension; with residual None,
    (weight * rmsnorm(x), x). The sum is in x's dtype, the output in promote(weight, x) dtypes."""
    check_device(x)
    H = x.shape[-1]
    x2 = _rows(x)
    T = x2.shape[0]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, H)
    if residual is None:
        res2 = x2
        new_res = x
    else:
        res2 = _rows(residual.to(x.dtype))
        new_res = torch.empty_like(x, memory_format=torch.contiguous_format)
    nr2 = new_res.reshape(-1, H) if residual is not None else x2
    if T:
        rows = rows_per_program(x, T)
        _rms_norm_kernel[(triton.cdiv(T, rows),)](
            x2, x2.stride(0), res2, res2.stride(0), weight, out2, out2.stride(0), nr2, nr2.stride(0),
            T, H, eps, 1, 1, HAS_RES=residual is not None, BLOCK_H=next_pow2(H), SELECT=False, ROWS=rows,
            num_warps=4 if H <= 4096 else 8, **_launch_opts(x),
        )
    return out, new_res


def rms_norm_rows(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, n_keep: int, group: int) -> Tensor:
    """add_rms_norm's normed output of only the first ``n_keep`` rows of every ``group`` rows of x [R, H]
    (R a multiple of group), [R / group * n_keep, H] contiguous: the drafter's final norm of the slots that
    draft (their rows straight into the lm_head's input, no copy of a strided selection after the norm)."""
    check_device(x)
    H = x.shape[-1]
    x2 = _rows(x)
    R = x2.shape[0]
    if not 0 <= n_keep <= group or group < 1 or R % group:
        raise ValueError(f"n_keep {n_keep} of every {group} rows: need 0 <= n_keep <= group, group dividing {R} rows")
    res2 = _rows(residual.to(x.dtype)) if residual is not None else x2
    T = R // group * n_keep
    out = torch.empty(T, H, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if T:
        rows = rows_per_program(x, T)
        _rms_norm_kernel[(triton.cdiv(T, rows),)](
            x2, x2.stride(0), res2, res2.stride(0), weight, out, out.stride(0), out, 0,
            T, H, eps, n_keep, group, HAS_RES=residual is not None, BLOCK_H=next_pow2(H), SELECT=True, ROWS=rows,
            num_warps=4 if H <= 4096 else 8, **_launch_opts(x),
        )
    return out


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """weight * rmsnorm(x): dspark.layers.basic.RMSNorm.forward."""
    return add_rms_norm(x, None, weight, eps)[0]


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm.forward of dspark.layers.basic."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm_reference(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The eager pattern of DecoderLayer: ``h = residual + x`` then the next RMSNorm of h."""
    s = x if residual is None else residual + x
    return rms_norm_reference(s, weight, eps), s


# --------------------------------------------------------------------------- RoPE + KV cache
@triton.jit
def _head_norm(x, xr, w_ptr, d, dr, eps, D: tl.constexpr):
    """Per-head RMSNorm (RMSNorm over head_dim) of x [.., H, D] and of its half-rolled copy xr (d, dr: [D])."""
    xf = x.to(tl.float32)
    inv = tl.math.rsqrt(tl.sum(xf * xf, -1, keep_dims=True) / D + eps)
    w = tl.load(w_ptr + d).to(tl.float32)
    wr = tl.load(w_ptr + dr).to(tl.float32)
    dt = x.dtype
    xn = cast_rtne(cast_rtne(xf * inv, dt).to(tl.float32) * w, dt)
    xrn = cast_rtne(cast_rtne(xr.to(tl.float32) * inv, dt).to(tl.float32) * wr, dt)
    return xn, xrn


@triton.jit
def _rope(x, xr, c, s):
    """x * cos + rotate_half(x) * sin with every product and the sum rounded to x's dtype, as the
    eager apply_rope does (xr = x rolled by D/2; s = sin with its first half negated)."""
    dt = x.dtype
    a = cast_rtne(x.to(tl.float32) * c, dt)
    b = cast_rtne(xr.to(tl.float32) * s, dt)
    return cast_rtne(a.to(tl.float32) + b.to(tl.float32), dt)


@triton.jit(do_not_specialize=["T"])
def _rope_cache_kernel(
    q_ptr, sq_t, sq_h, k_ptr, sk_t, sk_h, v_ptr, sv_t, sv_h,
    qo_ptr, ko_ptr,  # contiguous [T, Hq, D] / [T, Hkv, D] outputs
    pos_ptr, cos_ptr, sin_ptr, stride_cs,  # [T] positions; [P, D] fp32 tables
    qn_ptr, kn_ptr, eps,  # per-head norm weights [D]
    kc_ptr, vc_ptr, sc_slot, sc_head,  # caches: slot stride and head stride (unit stride along D)
    slot_ptr, valid_ptr,
    Hq, Hkv, T,
    D: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr,
    HAS_Q: tl.constexpr, ROPE: tl.constexpr, HAS_QNORM: tl.constexpr, HAS_KNORM: tl.constexpr,
    HAS_VALID: tl.constexpr, WRITE_KOUT: tl.constexpr, WRITE_CACHE: tl.constexpr, ROWS: tl.constexpr,
    PDL: tl.constexpr,
):
    # tiles [ROWS tokens, heads, D]: ROWS = rows_per_program (1 on the GPU)
    pdl_wait(PDL)
    t1 = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    tm1 = t1 < T
    t = t1[:, None, None]
    tm = tm1[:, None, None]
    d = tl.arange(0, D)
    dr = (d + D // 2) % D
    d3 = d[None, None, :]
    dr3 = dr[None, None, :]
    dt = k_ptr.dtype.element_ty
    if ROPE:
        pos = tl.load(pos_ptr + t1, mask=tm1, other=0).to(tl.int64)[:, None, None]
        c = cast_rtne(tl.load(cos_ptr + pos * stride_cs + d3).to(tl.float32), dt).to(tl.float32)
        s = cast_rtne(tl.load(sin_ptr + pos * stride_cs + d3).to(tl.float32), dt).to(tl.float32)

    if HAS_Q:
        h = tl.arange(0, HQ_PAD)[None, :, None]
        hm = (h < Hq) & tm
        off = q_ptr + t * sq_t + h * sq_h
        x = tl.load(off + d3, mask=hm, other=0.0)
        xr = tl.load(off + dr3, mask=hm, other=0.0)
        if HAS_QNORM:
            x, xr = _head_norm(x, xr, qn_ptr, d, dr, eps, D)
        if ROPE:
            x = _rope(x, xr, c, s)
        tl.store(qo_ptr + (t * Hq + h) * D + d3, x, mask=hm)

    h = tl.arange(0, HKV_PAD)[None, :, None]
    hm = (h < Hkv) & tm
    off = k_ptr + t * sk_t + h * sk_h
    x = tl.load(off + d3, mask=hm, other=0.0)
    xr = tl.load(off + dr3, mask=hm, other=0.0)
    if HAS_KNORM:
        x, xr = _head_norm(x, xr, kn_ptr, d, dr, eps, D)
    if ROPE:
        x = _rope(x, xr, c, s)
    if WRITE_KOUT:
        tl.store(ko_ptr + (t * Hkv + h) * D + d3, x, mask=hm)
    if WRITE_CACHE:
        slot = tl.load(slot_ptr + t1, mask=tm1, other=-1).to(tl.int64)
        ok = slot >= 0
        if HAS_VALID:
            ok = ok & (tl.load(valid_ptr + t1, mask=tm1, other=0) != 0)
        wm = hm & ok[:, None, None]
        cache_off = slot[:, None, None] * sc_slot + h * sc_head + d3
        tl.store(kc_ptr + cache_off, cast_rtne(x.to(tl.float32), kc_ptr.dtype.element_ty), mask=wm)
        v = tl.load(v_ptr + t * sv_t + h * sv_h + d3, mask=wm, other=0.0)
        tl.store(vc_ptr + cache_off, cast_rtne(v.to(tl.float32), vc_ptr.dtype.element_ty), mask=wm)


def _cache_strides(cache: Tensor) -> tuple[int, int]:
    """(slot stride, head stride) of a [num_blocks, block_size, Hkv, D] cache viewed as [slots, Hkv, D]."""
    if cache.stride(-1) != 1 or cache.stride(0) != cache.shape[1] * cache.stride(1):
        raise ValueError("KV cache must be [num_blocks, block_size, Hkv, D] with block rows laid out back to back")
    return cache.stride(1), cache.stride(2)


def _heads(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch_rope(q, k, v, positions, cos, sin_signed, k_cache, v_cache, slots, valid, q_norm, k_norm, eps,
                 write_kout):
    T, Hkv, D = k.shape
    if D % 2 or D & (D - 1):
        raise ValueError(f"head_dim {D} must be an even power of two")
    dev = k.device
    k = _heads(k)
    cache = k_cache is not None  # None: rotate only (rope_qk), v unused
    v = _heads(v) if cache else k
    Hq = q.shape[1] if q is not None else 1
    if q is not None:
        q = _heads(q)
    q_out = torch.empty(T, Hq, D, dtype=k.dtype, device=dev) if q is not None else None
    k_out = torch.empty(T, Hkv, D, dtype=k.dtype, device=dev) if write_kout else None
    rope = positions is not None
    if rope:
        cos = cos if cos.stride(-1) == 1 else cos.contiguous()
        sin_signed = sin_signed.to(cos.dtype)
        if sin_signed.stride() != cos.stride():
            sin_signed = sin_signed.contiguous()
            cos = cos.contiguous()
    dummy = k
    sc_slot = sc_head = 0
    if cache:
        sc_slot, sc_head = _cache_strides(k_cache)
        if _cache_strides(v_cache) != (sc_slot, sc_head):
            raise ValueError("K and V caches must have the same layout")
    else:
        k_cache = v_cache = slots = dummy
    if T:
        rows = rows_per_program(k, T)
        _rope_cache_kernel[(triton.cdiv(T, rows),)](
            q if q is not None else dummy, q.stride(0) if q is not None else 0, q.stride(1) if q is not None else 0,
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
            q_out if q_out is not None else dummy, k_out if k_out is not None else dummy,
            positions if rope else slots, cos if rope else dummy, sin_signed if rope else dummy,
            cos.stride(0) if rope else 0,
            q_norm if q_norm is not None else dummy, k_norm if k_norm is not None else dummy, eps,
            k_cache, v_cache, sc_slot, sc_head, slots, valid if valid is not None else slots,
            Hq, Hkv, T,
            D=D, HQ_PAD=next_pow2(Hq), HKV_PAD=next_pow2(Hkv),
            HAS_Q=q is not None, ROPE=rope, HAS_QNORM=q_norm is not None, HAS_KNORM=k_norm is not None,
            HAS_VALID=valid is not None, WRITE_KOUT=write_kout, WRITE_CACHE=cache, ROWS=rows,
            num_warps=4 if D * next_pow2(max(Hq, Hkv)) <= 4096 else 8, **_launch_opts(k),
        )
    return q_out, k_out


def rope_qk_cache(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos: Tensor, sin_signed: Tensor,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    q_norm: Tensor | None = None, k_norm: Tensor | None = None, eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """RoPE (after optional per-head q/k RMSNorm) on q [T, Hq, D] and k [T, Hkv, D] at positions [T],
    with RotaryEmbedding's ``cos`` / ``sin_signed`` tables [P, D]; writes the rotated k and v [T, Hkv, D]
    into the caches at slot_mapping [T] (negative slots skipped). Returns (q, k) rotated, contiguous."""
    check_device(k)
    return _launch_rope(q, k, v, positions, cos, sin_signed, k_cache, v_cache, slot_mapping, None,
                        q_norm, k_norm, eps, write_kout=True)


def rope_qk(q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin_signed: Tensor,
            q_norm: Tensor | None = None, k_norm: Tensor | None = None, eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """rope_qk_cache without a cache: (q, k) after the optional per-head norms and RoPE, contiguous
    [T, H, D], in one launch (the DSpark drafter's block rows, whose K/V are not cached)."""
    check_device(k)
    return _launch_rope(q, k, None, positions, cos, sin_signed, None, None, None, None, q_norm, k_norm, eps,
                        write_kout=True)


def rope_qk_reference(q: Tensor, k: Tensor, positions: Tensor, cos: Tensor, sin_signed: Tensor,
                      q_norm: Tensor | None = None, k_norm: Tensor | None = None,
                      eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """The eager path of rope_qk: q/k norm, then apply_rope with RotaryEmbedding.cos_sin's tables."""
    dt = k.dtype
    cs = (cos[positions].to(dt)[:, None, :], sin_signed[positions].to(dt)[:, None, :])
    if q_norm is not None:
        q = rms_norm_reference(q, q_norm, eps)
    if k_norm is not None:
        k = rms_norm_reference(k, k_norm, eps)
    return apply_rope(q, *cs).contiguous(), apply_rope(k, *cs).contiguous()


def rope_qk_cache_reference(
    q: Tensor, k: Tensor, v: Tensor, positions: Tensor, cos: Tensor, sin_signed: Tensor,
    k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    q_norm: Tensor | None = None, k_norm: Tensor | None = None, eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """The eager path: Attention.forward's q/k norm + apply_rope, then the backend's index_copy_."""
    q, k = rope_qk_reference(q, k, positions, cos, sin_signed, q_norm, k_norm, eps)
    keep = slot_mapping >= 0
    Hkv, D = k.shape[1], k.shape[2]
    k_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping[keep], k[keep].to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slot_mapping[keep], v[keep].to(v_cache.dtype))
    return q, k


def store_context_kv(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, valid: Tensor | None = None,
    positions: Tensor | None = None, cos: Tensor | None = None, sin_signed: Tensor | None = None,
    k_norm: Tensor | None = None, eps: float = 1e-6,
) -> None:
    """The drafter's context K/V store for one drafter layer: K [R, Hkv, D] (pre-RoPE; RoPE applied
    here at positions [R] when given, after k_norm when given) and V into the caches at slots [R],
    only for rows with valid[R] True (if given) and slot >= 0."""
    check_device(k)
    if positions is not None and (cos is None or sin_signed is None):
        raise ValueError("RoPE needs the cos and sin_signed tables")
    _launch_rope(None, k, v, positions, cos, sin_signed, k_cache, v_cache, slots, valid, None, k_norm, eps,
                 write_kout=False)


def store_context_kv_reference(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, valid: Tensor | None = None,
    positions: Tensor | None = None, cos: Tensor | None = None, sin_signed: Tensor | None = None,
    k_norm: Tensor | None = None, eps: float = 1e-6,
) -> None:
    """DrafterLayer.context_kv's tail (k_norm, apply_rope) + DSparkProposer.write_context's index_copy_
    of the committed rows."""
    dt = k.dtype
    if k_norm is not None:
        k = rms_norm_reference(k, k_norm, eps)
    if positions is not None:
        k = apply_rope(k, cos[positions].to(dt)[:, None, :], sin_signed[positions].to(dt)[:, None, :])
    keep = slots >= 0
    if valid is not None:
        keep = keep & valid.bool()
    Hkv, D = k.shape[1], k.shape[2]
    k_cache.view(-1, Hkv, D).index_copy_(0, slots[keep], k[keep].to(k_cache.dtype))
    v_cache.view(-1, Hkv, D).index_copy_(0, slots[keep], v[keep].to(v_cache.dtype))


# ---------------------------------------------------------------- the DSpark drafter's block rows
@triton.jit
def _block_inputs_kernel(anc_ptr, apos_ptr, emb_ptr, stride_emb, w_ptr, x_ptr, h_ptr, pos_ptr, key_ptr, G, H,
                         eps, mask_id, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)  # row = b * G + g
    b = row // G
    g = row - b * G
    ap = tl.load(apos_ptr + b)
    tok = tl.where(g == 0, tl.load(anc_ptr + b), mask_id).to(tl.int64)
    tl.store(pos_ptr + row, ap + g)
    if g == 0:
        tl.store(key_ptr + b, ap + 1)
    c = tl.arange(0, BLOCK_H)
    m = c < H
    e = tl.load(emb_ptr + tok * stride_emb + c, mask=m, other=0.0)
    tl.store(h_ptr + row * H + c, e, mask=m)
    tl.store(x_ptr + row * H + c, cast_rtne(_normed_row(e, w_ptr, c, m, H, eps), x_ptr.dtype.element_ty), mask=m)


def drafter_block_inputs(anchors: Tensor, anchor_pos: Tensor, embed: Tensor, mask_id: int, G: int,
                         weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """drafter_block_inputs_reference in one launch (it was seven in the drafter graph: a fill, a copy, the
    embedding, an arange and an add for the positions, the norm, the noise positions' add)."""
    check_device(anchors)
    B, H = anchors.shape[0], embed.shape[1]
    dev = anchors.device
    h = torch.empty(B * G, H, dtype=embed.dtype, device=dev)
    x = torch.empty(B * G, H, dtype=torch.promote_types(weight.dtype, embed.dtype), device=dev)
    pos = torch.empty(B * G + B, dtype=torch.int64, device=dev)  # the rows' positions, then the B noise positions
    if embed.stride(1) != 1:
        raise ValueError("the embedding's rows must be contiguous")
    if B * G:
        _block_inputs_kernel[(B * G,)](anchors, anchor_pos, embed, embed.stride(0), weight, x, h, pos, pos[B * G:], G,
                                       H, eps, mask_id, BLOCK_H=next_pow2(H), num_warps=4 if H <= 4096 else 8,
                                       **_launch_opts(anchors))
    return x, h, pos[:B * G], pos[B * G:]


def drafter_block_inputs_reference(anchors: Tensor, anchor_pos: Tensor, embed: Tensor, mask_id: int, G: int,
                                   weight: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows a DSpark drafter block pass starts from, for B anchors (the last emitted token of each request)
    at positions anchor_pos, G slots each (row b * G + g): (x = weight * rmsnorm(h) [B·G, H], the embeddings h
    of the anchor then G - 1 mask tokens, their positions anchor_pos + g [B·G], the draft noise's key
    positions anchor_pos + 1 [B]) — DSparkDrafter.block_hidden's inputs and its first layer's input norm."""
    B = anchors.shape[0]
    tokens = torch.full((B, G), mask_id, dtype=torch.long, device=anchors.device)
    tokens[:, 0] = anchors
    h = F.embedding(tokens, embed).view(B * G, embed.shape[1])
    pos = (anchor_pos[:, None] + torch.arange(G, device=anchors.device)[None, :]).reshape(-1)
    x = add_rms_norm_reference(h, None, weight, eps)[0]
    return x, h, pos, anchor_pos + 1


# ------------------------------------------------------------------------------------ SwiGLU
@triton.jit(do_not_specialize=["T"])
def _silu_mul_kernel(x_ptr, stride_x, out_ptr, stride_o, T, I, PRECISE: tl.constexpr, BLOCK: tl.constexpr,
                     ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    row = (tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64))[:, None]  # [ROWS, 1] of T
    i = (tl.program_id(1) * BLOCK + tl.arange(0, BLOCK))[None, :]
    m = (row < T) & (i < I)
    g = tl.load(x_ptr + row * stride_x + i, mask=m, other=0.0)
    u = tl.load(x_ptr + row * stride_x + I + i, mask=m, other=0.0)
    out = silu_mul_rounded(g, u, g.dtype, PRECISE)
    tl.store(out_ptr + row * stride_o + i, cast_rtne(out.to(tl.float32), out_ptr.dtype.element_ty), mask=m)


@triton.jit
def silu_mul_rounded(g, u, dt: tl.constexpr, PRECISE: tl.constexpr):
    """silu(g) * u for g and u holding values of the dtype ``dt``, with the eager roundings: F.silu in fp32
    (torch's CUDA kernel: expf and an IEEE division; PRECISE on the GPU), rounded to dt, times u, rounded
    to dt. Shared by silu_and_mul and the SwiGLU epilogues of kernels/gemv.py and kernels/fewrow.py."""
    gf = g.to(tl.float32)
    if PRECISE:
        s = tl.math.div_rn(gf, 1.0 + libdevice.exp(-gf))
    else:
        s = gf / (1.0 + tl.exp(-gf))
    return cast_rtne(cast_rtne(s, dt).to(tl.float32) * u.to(tl.float32), dt)


def silu_and_mul(gate_up: Tensor) -> Tensor:
    """SwiGLU on a fused [.., 2I] gate|up projection -> [.., I] (dspark.layers.basic.silu_and_mul)."""
    check_device(gate_up)
    I2 = gate_up.shape[-1]
    if I2 % 2:
        raise ValueError("gate_up's last dimension must be even")
    I = I2 // 2
    x2 = _rows(gate_up)
    T = x2.shape[0]
    out = torch.empty(*gate_up.shape[:-1], I, dtype=gate_up.dtype, device=gate_up.device)
    o2 = out.view(-1, I)
    BLOCK = min(next_pow2(I), 1024)
    if T:
        rows = rows_per_program(gate_up, T)
        _silu_mul_kernel[(triton.cdiv(T, rows), triton.cdiv(I, BLOCK))](
            x2, x2.stride(0), o2, o2.stride(0), T, I, PRECISE=gate_up.device.type == "cuda", BLOCK=BLOCK, ROWS=rows,
            num_warps=4, **pdl_opts(gate_up))
    return out


def silu_and_mul_reference(gate_up: Tensor) -> Tensor:
    return _silu_and_mul_ref(gate_up)


__all__ = [
    "add_rms_norm", "add_rms_norm_reference", "drafter_block_inputs", "drafter_block_inputs_reference",
    "rms_norm", "rms_norm_reference", "rms_norm_rows",
    "rope_qk", "rope_qk_reference", "rope_qk_cache", "rope_qk_cache_reference", "silu_and_mul", "silu_and_mul_reference",
    "store_context_kv", "store_context_kv_reference",
]
