"""The small device-side steps around a one-sync DSpark step's CUDA graphs (engine/cuda_graphs.py,
ModelRunner.launch_one_sync), one launch each instead of 10-15 tiny torch ops.

Why: at batch 1 a DSpark step is bound by the host, not the GPU. Measured on the H200 (session 20,
benchmarks/gpu_continuous_profile.py host timers, 16 held-out prompts at concurrency 1): the host spent
1.06 ms launching each step (rows_from_previous_step 0.19 ms, drafter_inputs_on_device 0.11, greedy
verification and the rest of launch_one_sync ~0.5) against ~1.2 ms of GPU work (target 1.0, drafter
0.2); each torch op costs the host ~10-15 µs to issue there, whatever its size.

- ``verify_greedy_rows``: spec/rejection.verify_greedy (the longest prefix of drafts equal to the target
  argmax, then the argmax after it), one program per request.
- ``shift_rows``: StepGraphs.rows_from_previous_step, i.e. ``shift_rows_reference``: a block launched on
  top of the step in flight moves its rows back from the host's worst case by q - n_out, recomputes
  their cache slots and takes its input ids (anchor, drafts) from that step's row for the request.
- ``drafter_inputs``: StepGraphs.drafter_inputs_on_device, i.e. ``drafter_inputs_reference``: the
  drafter's committed-row mask, anchors and anchor positions from the step's outcome.

Each is checked against its reference on the CPU in Triton's interpreter (tests/kernels/test_spec_step.py)
and inside every graph-step engine test.
"""

from __future__ import annotations

import torch
from torch import Tensor

import triton
import triton.language as tl

from dspark.kernels import check_device, next_pow2, pdl_opts, pdl_wait
from dspark.spec.rejection import verify_greedy


# ------------------------------------------------------------------------------ greedy verification
@triton.jit
def _verify_greedy_kernel(am_ptr, s_am, d_ptr, s_d, nd_ptr, out_ptr, nout_ptr, t_ptr, so_ptr, s_so, sn_ptr, N,
                          SAMPLED: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    nd = tl.load(nd_ptr + b).to(tl.int64)
    am = tl.load(am_ptr + b * s_am + j, mask=j <= N, other=0).to(tl.int64)
    dr = tl.load(d_ptr + b * s_d + j, mask=j < N, other=-1).to(tl.int64)
    miss = (dr != am) | (j >= nd)  # every j >= N is a miss (num_drafts <= N)
    a = tl.min(tl.where(miss, j, BLOCK), axis=0)  # accepted drafts: the first miss
    final = tl.sum(tl.where(j == a, am, 0), axis=0)
    out = tl.where(j < a, dr, tl.where(j == a, final, -1))
    n = (a + 1).to(tl.int64)  # int64 as the sampled branch's (a type both branches of an if must keep on a GPU)
    if SAMPLED:  # a row at temperature > 0 takes the sampled verification's outcome instead
        if tl.load(t_ptr + b) > 0:
            out = tl.load(so_ptr + b * s_so + j, mask=j <= N, other=-1).to(tl.int64)
            n = tl.load(sn_ptr + b).to(tl.int64)
    tl.store(out_ptr + b * (N + 1) + j, out, mask=j <= N)
    tl.store(nout_ptr + b, n)


def verify_greedy_rows(target_argmax: Tensor, draft_tokens: Tensor, num_drafts: Tensor, *,
                       sampled: tuple[Tensor, Tensor, Tensor] | None = None, out: Tensor | None = None,
                       n_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """verify_greedy (spec/rejection.py) in one launch: target_argmax [B, N+1], draft_tokens [B, N]
    (rows may be strided views), num_drafts [B] -> (tokens [B, N+1] int64 padded with -1, num_emitted [B]).
    ``sampled`` (temperature [B], tokens [B, N+1], num_emitted [B]): the rows at temperature > 0 take these
    (their verification by rejection sampling) instead, as ``torch.where`` would pick them. ``out`` / ``n_out``:
    contiguous int64 buffers to write to (a CUDA graph's outputs) instead of new tensors."""
    check_device(target_argmax)
    B, n = draft_tokens.shape
    assert target_argmax.shape == (B, n + 1) and target_argmax.stride(1) == 1 and draft_tokens.stride(1) == 1
    dev = target_argmax.device
    out = torch.empty(B, n + 1, dtype=torch.int64, device=dev) if out is None else out
    n_out = torch.empty(B, dtype=torch.int64, device=dev) if n_out is None else n_out
    if out.shape != (B, n + 1) or n_out.shape != (B,) or not (out.is_contiguous() and n_out.is_contiguous()) or (
            out.dtype != torch.int64 or n_out.dtype != torch.int64):
        raise ValueError(f"out / n_out must be contiguous int64 tensors of shapes {(B, n + 1)} / {(B,)}")
    t, so, sn = sampled if sampled is not None else (num_drafts, out, n_out)
    if sampled is not None and (t.shape != (B,) or so.shape != (B, n + 1) or so.stride(1) != 1 or sn.shape != (B,)):
        raise ValueError(f"sampled must be tensors of shapes {(B,)}, {(B, n + 1)} (rows contiguous), {(B,)}")
    if B:
        _verify_greedy_kernel[(B,)](target_argmax, target_argmax.stride(0), draft_tokens, draft_tokens.stride(0),
                                    num_drafts, out, n_out, t, so, so.stride(0), sn, n,
                                    SAMPLED=sampled is not None, BLOCK=next_pow2(n + 1), num_warps=1,
                                    **pdl_opts(out))
    return out, n_out


def verify_greedy_reference(target_argmax: Tensor, draft_tokens: Tensor, num_drafts: Tensor, *,
                            sampled: tuple[Tensor, Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """verify_greedy's outcome, or with ``sampled`` each row at temperature > 0 that outcome instead."""
    out, n_out = verify_greedy(target_argmax, draft_tokens, num_drafts)
    if sampled is not None:
        t, so, sn = sampled
        out = torch.where((t > 0).unsqueeze(1), so, out)
        n_out = torch.where(t > 0, sn, n_out)
    return out, n_out


# ------------------------------------------------------------------- rows of a block launched on top
@triton.jit
def _shift_rows_kernel(pos_ptr, slot_ptr, ids_ptr, seq_ptr, ntok_ptr, bt_ptr, s_bt, idx_ptr, nout_ptr, out_ptr,
                       s_out, dr_ptr, s_dr, q, bs, HAS_IDX: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    if HAS_IDX:
        p = tl.load(idx_ptr + b).to(tl.int64)
    else:
        p = b
    n = tl.load(nout_ptr + p)
    shift = n - q
    j = tl.arange(0, BLOCK)
    m = j < q
    pos = tl.load(pos_ptr + b * q + j, mask=m, other=0) + shift
    tl.store(pos_ptr + b * q + j, pos, mask=m)
    tl.store(seq_ptr + b, tl.load(seq_ptr + b) + shift.to(tl.int32))
    tl.store(ntok_ptr + b, tl.load(ntok_ptr + b) + shift)
    blk = tl.load(bt_ptr + b * s_bt + pos // bs, mask=m, other=0)
    tl.store(slot_ptr + b * q + j, blk * bs + pos % bs, mask=m)
    anchor = tl.load(out_ptr + p * s_out + tl.maximum(n - 1, 0))  # the last token emitted
    d = tl.load(dr_ptr + p * s_dr + j - 1, mask=m & (j >= 1), other=0)
    tl.store(ids_ptr + b * q + j, tl.where(j == 0, anchor, d), mask=m)


def shift_rows(positions: Tensor, slot_mapping: Tensor, input_ids: Tensor, seq_lens: Tensor, num_tokens: Tensor,
               block_tables: Tensor, q: int, block_size: int, n_out: Tensor, out: Tensor, drafts: Tensor,
               idx: Tensor | None = None) -> None:
    """shift_rows_reference in one launch (in place). ``idx`` [B]: each request's row in the previous
    step's outputs n_out, out, drafts (None: request b is row b)."""
    check_device(positions)
    B = seq_lens.shape[0]
    assert positions.shape == slot_mapping.shape == input_ids.shape == (B * q,) and num_tokens.shape == (B,)
    assert drafts.stride(1) == 1 and out.stride(1) == 1 and block_tables.stride(1) == 1 and seq_lens.dtype == torch.int32
    if B:
        _shift_rows_kernel[(B,)](positions, slot_mapping, input_ids, seq_lens, num_tokens, block_tables,
                                 block_tables.stride(0), idx if idx is not None else n_out, n_out, out, out.stride(0),
                                 drafts, drafts.stride(0), q, block_size, HAS_IDX=idx is not None, BLOCK=next_pow2(q),
                                 num_warps=1, **pdl_opts(out))


def shift_rows_reference(positions: Tensor, slot_mapping: Tensor, input_ids: Tensor, seq_lens: Tensor,
                         num_tokens: Tensor, block_tables: Tensor, q: int, block_size: int, n_out: Tensor,
                         out: Tensor, drafts: Tensor, idx: Tensor | None = None) -> None:
    """The first B requests' q rows each (B = len(seq_lens)), written by the host for the worst case,
    moved by shift = n_out[idx] - q (<= 0) — positions, seq_lens, tokens before the step — their cache
    slots recomputed from the block tables, and their input ids set to the new anchor — the last token
    the previous step emitted, out[idx, n_out[idx] - 1] (the one its drafter drafted from) — then the
    drafts made from it (drafts[idx])."""
    B = seq_lens.shape[0]
    idx = slice(0, B) if idx is None else idx
    n_out, out, drafts = n_out[idx], out[idx], drafts[idx]
    anchors = out.gather(1, (n_out - 1).clamp(min=0)[:, None]).squeeze(1)
    shift = n_out - q
    pos = positions.view(B, q)
    pos += shift[:, None]
    seq_lens += shift.to(seq_lens.dtype)
    num_tokens += shift
    blk = block_tables.gather(1, pos // block_size)
    slot_mapping.view(B, q).copy_(blk * block_size + pos % block_size)
    ids = input_ids.view(B, q)
    ids[:, 0] = anchors
    ids[:, 1:] = drafts


# ------------------------------------------------------------------------------ the drafter's inputs
# B (the step's real rows) is not specialised on: Triton would compile one variant for B == 1, one for B a
# multiple of 16 and one for the rest, and warm-up (a few requests) met only the first and the last, so a batch
# of 32 compiled its own inside a served step (H100, session 44: 121 ms in a timed batch-32 bench cell).
@triton.jit(do_not_specialize=["B"])
def _drafter_inputs_kernel(out_ptr, s_out, nout_ptr, commit_ptr, ntok_ptr, valid_ptr, anc_ptr, apos_ptr, B, q,
                           HAS_COMMIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_wait(PDL)
    b = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    live = b < B
    n = tl.load(nout_ptr + b, mask=live, other=1)
    if HAS_COMMIT:
        c = tl.load(commit_ptr + b, mask=live, other=0)
    else:
        c = n
    tl.store(valid_ptr + b * q + j, (j < c) & live, mask=j < q)
    last = tl.maximum(n - 1, 0)  # rows emitting nothing draft unread
    anchor = tl.load(out_ptr + b * s_out + last, mask=live, other=0)
    apos = tl.load(ntok_ptr + b, mask=live, other=0) + last
    tl.store(anc_ptr + b, tl.where(live, anchor, 0))
    tl.store(apos_ptr + b, tl.where(live, apos, 0))


def drafter_inputs(out: Tensor, n_out: Tensor, commit: Tensor | None, num_tokens: Tensor, valid: Tensor,
                   anchors: Tensor, anchor_pos: Tensor, q: int) -> None:
    """drafter_inputs_reference in one launch (in place)."""
    check_device(out)
    Bg = anchors.shape[0]
    assert out.stride(1) == 1 and valid.shape == (Bg * q,) and anchor_pos.shape == num_tokens.shape == (Bg,)
    _drafter_inputs_kernel[(Bg,)](out, out.stride(0), n_out, commit if commit is not None else n_out, num_tokens,
                                  valid, anchors, anchor_pos, out.shape[0], q, HAS_COMMIT=commit is not None,
                                  BLOCK=next_pow2(q), num_warps=1, **pdl_opts(out))


def drafter_inputs_reference(out: Tensor, n_out: Tensor, commit: Tensor | None, num_tokens: Tensor, valid: Tensor,
                             anchors: Tensor, anchor_pos: Tensor, q: int) -> None:
    """The drafter's step inputs from a step's outcome (B = len(out) requests of Bg = len(anchors) graph
    rows): request b emitted out[b, :n_out[b]], so its first n_out[b] rows are committed (``commit[b]``
    instead where given: a prefill row commits all its real rows and emits one token or none), its
    anchor is its last emitted token, at position num_tokens[b] + n_out[b] - 1; padding rows b >= B
    commit nothing and draft from token 0 at position 0."""
    B, Bg = out.shape[0], anchors.shape[0]
    v = valid.view(Bg, q)
    v.zero_()
    v[:B] = torch.arange(q, device=out.device)[None, :] < (n_out if commit is None else commit)[:, None]
    anchors.zero_()
    anchor_pos.zero_()
    last = (n_out - 1).clamp(min=0)
    anchors[:B] = out.gather(1, last[:, None]).squeeze(1)
    anchor_pos[:B] = num_tokens[:B] + last


__all__ = ["verify_greedy_rows", "verify_greedy_reference", "shift_rows", "shift_rows_reference",
           "drafter_inputs", "drafter_inputs_reference"]
