"""Triton attention backend: the engine's paged attention as two Triton launches per layer.

Same interface and semantics as ``TorchAttentionBackend`` (dspark/layers/attention.py): ``prepare``
once per step, ``forward`` per layer writes the new K/V at ``slot_mapping`` and attends causally over
each request's blocks. ``forward`` is ``write_kv`` (one launch, K and V together) followed by
``paged_attention`` (one launch, plus a small merge launch when the key range is split), both from
dspark/kernels/paged_attention.py; no context is gathered into dense copies and no mask is built.

- ``prepare`` makes the step's device metadata once, shared by all layers: seq_lens and
  query_start_loc as one int32 host->device copy, and the kernel's tuning hints ``max_query_len`` /
  ``max_seq_len`` as host ints from the layout's Python lists. Nothing reads device values back, so
  no step waits on the GPU here.
- **Every row goes through the kernel: decode (1 row), verification (1 + N), prefill chunks (up to
  ``max_num_batched_tokens`` rows) and mixed batches, in one launch per layer.** Given
  ``max_query_len``, the kernel spreads a long request's query rows over several programs of
  ``BLOCK_Q`` tokens × the G query heads of one KV head (at most 64 rows), each looping only over
  the keys its chunk can see (causal bound) in 128-key tiles read straight from the paged cache: a
  FlashAttention-style prefill, not a serial loop over rows. So there is no prefill route to the
  PyTorch backend: that would cost a second attention call per layer, host-side regrouping and, in
  the PyTorch path, a dense gather of the whole context plus an explicit mask (which rules out
  SDPA's flash kernel on CUDA anyway). Known costs, to be measured on the GPU before any change:
  (1) query tiles of at most 64 rows reuse each K/V tile half as often as FlashAttention-2's 128;
  (2) the grid is sized by the *longest* request, so in a mixed batch the other requests' extra
  programs start and exit at once (B × Hkv × ceil(max_query_len / BLOCK_Q) programs in all). If
  either shows, the fix is a chunk work list (one program per real (request, query chunk)), not a
  second backend.
- Off the GPU the kernels run in Triton's interpreter (numpy, very slow): for tests only.

With this backend the runner also sets ``LlamaForCausalLM.fused``: the decoder layer then writes K/V in
its fused RoPE kernel and calls ``attend`` (attention only) instead of ``forward``.

The DSpark drafter does not use this backend: its block pass attends over its own context cache
(dspark/spec/proposer.py, dspark/models/dspark_drafter.py).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass

import torch

from dspark.engine.cuda_graphs import SMALLEST_BUCKET
from dspark.layers.attention import BatchLayout

logger = logging.getLogger(__name__)


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each new K/V row
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with the dummy block 0
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    max_query_len: int  # host ints: kernel tile sizes and program counts, never read from the device
    max_seq_len: int


# The invariant attention's key slice (TritonAttentionBackend). Until session 46 batch-invariant mode did not split
# the key range at all, so a batch-1 decode step ran 3 programs (SmolLM2's KV heads) over the whole context; session
# 46 took 128-key slices. Session 47 (H100, benchmarks/invariance_check.py --sweep, 1k context) measured 64: a slice
# is one key tile, and batch-1 decode / verification attention took 4.6-4.7 / 5.3 µs per layer against the tuned
# default's 4.9 / 6.3 (128-key slices: 5.7-5.9 / 6.5), batch 32 10.9 / 16.8 against 10.0 / 15.4 (128: 9.3 / 15.1).
INVARIANT_SPLIT_KEYS = 64
# Past 64 x 64 = 4,096 keys of max_model_len the slices grow (powers of two) so that a step has at most this many:
# each slice of each query row takes a [head_dim] fp32 partial until the merge. A 2,048-row prefill chunk of
# SmolLM2 at 8k context holds 0.3 GB of them in 64 slices (1.2 GB in 256). SmolLM2's default max_model_len, 8,192,
# gets 128-key slices: 0.8-1 µs per layer slower than the tuned default at batch-1 decode (the sweep above).
INVARIANT_MAX_SPLITS = 64


def invariant_split_keys(max_model_len: int | None) -> int:
    """The key slice of batch-invariant attention for an engine of ``max_model_len`` tokens: fixed per engine, so a
    row's slices are the same in every step (and in two engines of the same max_model_len, as plain and DSpark)."""
    keys = INVARIANT_SPLIT_KEYS
    while max_model_len is not None and keys * INVARIANT_MAX_SPLITS < max_model_len:
        keys *= 2
    return keys


def seq_len_hint(n: int) -> int:
    """The longest context of a step, rounded up as the CUDA graphs' context buckets are (powers of two
    from cuda_graphs.SMALLEST_BUCKET): the kernel's launch (split count, tiles) follows this hint and
    each launch setting is a separate Triton compile, so an eager step (a prefill, a mixed step) takes
    the setting of its bucket, which the graphs' capture and the warm-up compiled, instead of one per
    context length that would compile inside a live step."""
    b = SMALLEST_BUCKET
    while b < n:
        b *= 2
    return b


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonAttentionBackend:
    """Paged attention in Triton (see the module docstring). ``device`` is the engine's device: CUDA,
    or a CPU where Triton runs in its interpreter (tests)."""

    def __init__(self, device: str | torch.device, batch_invariant: bool = False,
                 max_model_len: int | None = None) -> None:
        device = torch.device(device)
        # Batch-invariant attention (EngineConfig.batch_invariant): fixed key slices (invariant_split_keys, merged in
        # order), one key tile (64 keys) and the softmax row sums on the tensor cores (paged_attention(rowsum_mma=)),
        # so that a row sums the same tiles in the same slices in the same order however many rows its request or
        # the batch has. On the GPU the query tile, the warps and the stages then do not change a row's bits
        # (H100, docs/benchmarks.md session 47: 32 warp/stage pairs, decode vs verification rows) and follow the
        # step (invariant_attention_launch); off CUDA (Triton's interpreter, tests) the query tile is pinned at 64
        # rows, since the interpreter's numpy products may round a row by its tile's shape.
        # EngineConfig.invariant_attention (--invariant-attention; DSPARK_INVARIANT_ATTENTION=1 on CUDA) asks for
        # this attention without the rest of batch-invariant mode. Not the default: session 50 measured its cost in
        # the engine (config.py).
        keys = invariant_split_keys(max_model_len)
        if batch_invariant:
            self._fixed = {"split_keys": keys, "block_n": 64, "rowsum_mma": True}
            if device.type != "cuda":
                self._fixed["block_m"] = 64
            # DSPARK_INVARIANT_LAUNCH (benchmarks only): a JSON dict of paged_attention keywords over these, to time
            # other launches of the invariant attention in the engine (warps, stages, slices per program, slice size)
            self._fixed.update(json.loads(os.environ.get("DSPARK_INVARIANT_LAUNCH") or "{}"))
        else:
            self._fixed = {}
        try:
            from dspark.kernels import interpreter_ready
            from dspark.kernels import paged_attention as pa
        except ImportError as e:
            raise ValueError(f"attention_backend 'triton' needs the triton package, which failed to import: {e}; "
                             "install triton or use attention_backend 'torch'") from None
        if device.type != "cuda":
            if not interpreter_ready():
                raise ValueError(
                    f"attention_backend 'triton' on {device.type}: Triton kernels run only on CUDA, or on a CPU "
                    "in Triton's interpreter, which must be chosen (TRITON_INTERPRET=1) before triton is first "
                    "imported; use attention_backend 'torch' here"
                )
            logger.warning("attention_backend 'triton' on %s runs the kernels in Triton's interpreter: very slow, "
                           "meant for tests", device.type)
        self._paged_attention = pa.paged_attention
        self._write_kv = pa.write_kv

    def prepare(self, layout: BatchLayout) -> TritonAttentionMetadata:
        qsl = layout.query_start_loc
        B = len(layout.seq_lens)
        # One host->device copy for both small int arrays: [seq_lens (B) | query_start_loc (B + 1)].
        small = torch.tensor(list(layout.seq_lens) + list(qsl), dtype=torch.int32).to(layout.positions.device)
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            block_tables=layout.block_tables,
            seq_lens=small[:B],
            query_start_loc=small[B:],
            max_query_len=max((qsl[b + 1] - qsl[b] for b in range(B)), default=0),
            max_seq_len=seq_len_hint(max(layout.seq_lens, default=0)),
        )

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        self._write_kv(_last_dim_contiguous(k), _last_dim_contiguous(v), k_cache, v_cache, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, meta, scale)

    def attend_rope(self, q, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float, rope: dict) -> torch.Tensor:
        """``attend`` with fused_ops.rope_qk_cache folded into the launch: ``q`` raw (pre-RoPE), ``rope``
        the new K/V and tables (kernels/paged_attention.py, ``paged_attention(rope=)``)."""
        return self._paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
            max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, rope=rope, **self._fixed,
        )

    def attend(self, q, k_cache, v_cache, meta: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        """Attention only, over K/V the caller already wrote at ``meta.slot_mapping`` (the fused decoder
        layer writes them in its RoPE kernel, fused_ops.rope_qk_cache): ``forward`` without write_kv."""
        return self._paged_attention(
            _last_dim_contiguous(q), k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, **self._fixed,
        )
