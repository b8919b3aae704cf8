"""Llama-family decoder (Llama, Qwen2, Qwen3) over a flattened batch and the paged KV cache.

Inputs are flattened across requests: ``input_ids [T]`` and ``positions [T]``; attention finds each
request's rows and cache slots through the backend metadata. q/k/v and gate/up are fused into one
matmul each (fewer kernels per step). The model can also return the raw outputs (the residual stream
before the final norm) of chosen decoder layers — the taps a DSpark drafter is fed with; with no taps
requested nothing extra is computed or stored.

Two forwards, chosen by ``LlamaForCausalLM.fused``:

- unfused (default; the CPU path and the PyTorch attention backend's): PyTorch ops, the attention
  backend's ``forward`` writing K/V and attending.
- fused (set by the runner with the Triton attention backend): the same math on the fused Triton
  kernels of dspark/kernels/fused_ops.py, see ``DecoderLayer.forward_fused``. On a GPU a small model
  is launch-bound at decode (every launch costs several µs, ~30 layers), so the point is fewer
  launches per layer: 9 (10 when paged attention splits the key range) instead of 26 for Llama in
  bf16 (22 in fp32, 8 more with Qwen3's q/k norm), counting each F.rms_norm as one kernel. With
  ``small_m_gemv`` (SMALL_M_GEMV, on for CUDA by default), steps of at most GEMV_MAX_ROWS (1) rows take 6 (the
  GEMV kernels of dspark/kernels/gemv.py, see ``DecoderLayer.forward_gemv``).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from dspark.config import ModelConfig
from dspark.layers.attention import AttentionBackend
from dspark.layers.basic import RMSNorm, RotaryEmbedding, apply_rope, silu_and_mul
from dspark.layers.linear import Linear
from dspark.layers.triton_attention import TritonAttentionBackend, TritonAttentionMetadata
from dspark.models.errors import ModelLoadError


# RoPE (+ q/k norm) and the K/V cache write inside the attention launch (kernels/paged_attention.py,
# ``rope=``): one launch fewer per layer, bit-identical in Triton's interpreter. Off until measured on
# the GPU (benchmarks/gpu_fastpath_check.py); DSPARK_ROPE_IN_ATTENTION=1 turns it on.
ROPE_IN_ATTENTION = os.environ.get("DSPARK_ROPE_IN_ATTENTION") == "1"

# Few-row steps (T <= GEMV_MAX_ROWS) of the fused forward on the GEMV kernels of dspark/kernels/gemv.py,
# which fold each residual add + RMSNorm into the projection after it and SwiGLU into the gate|up
# projection: 3 launches fewer per layer (see DecoderLayer.forward_gemv). Same roundings as the GEMM
# path, only the fp32 summation order of the products differs (not bit-identical to cuBLAS).
# Measured on the H200 (session 13, benchmarks/gpu_fastpath_check.py parts gemv / gemv_engine, random
# SmolLM2-shaped weights, bf16): at ONE row the four products of a layer with their neighbours take
# 13.8 µs instead of 18.5 (graphs of 30 launches) and batch-1 greedy decode runs at 1,152 tok/s instead
# of 974 (0.839 vs 0.997 ms per graph step); at 6 and 8 rows the kernels' row loop makes them 2-2.7x
# slower than cuBLAS + the unfused kernels (40-51 vs 19 µs per layer), so GEMV_MAX_ROWS is 1: batch-1
# decode steps only (not verification blocks). DSPARK_SMALL_M_GEMV=1 turns the path on everywhere,
# =0 off; unset, it is on for CUDA tensors only (in Triton's CPU interpreter its ~100 programs per
# launch cost more than they save, and CPU tests turn it on explicitly).
SMALL_M_GEMV = {"1": True, "0": False}.get(os.environ.get("DSPARK_SMALL_M_GEMV", ""))  # None: CUDA only
# DSPARK_GEMV_MAX_ROWS (at most 16) raises it: more rows then take the kernels' row loop, which lost to
# cuBLAS on the H200 (40.3 vs 19.1 µs per layer at 6 rows, session 15; the 3-D tile and tl.dot paths that
# also lost were deleted; sessions 21, 32 and 33 measured four more few-row designs, none faster in the
# engine: kernels/gemv.py's docstring)
GEMV_MAX_ROWS = int(os.environ.get("DSPARK_GEMV_MAX_ROWS", "1"))
# Steps of 2-128 rows (verification at batch 1-16, decode at batch 2-128; fewrow.ENGINE_MAX_ROWS) on kernels/fewrow.py:
# tensor-core products with the residual adds, RMSNorms and SwiGLU in their epilogues (6 launches per
# layer instead of 9, with RoPE + the K/V write in the qkv epilogue 5; DecoderLayer.forward_fewrow).
# DSPARK_FEWROW=1 on everywhere, =0 off; unset, on for CUDA tensors only (CPU tests turn it on explicitly).
# Measured on the H200 (session 35, docs/benchmarks.md): a layer's products with their norms and SwiGLU
# 17.7 µs against 22.7 on cuBLAS + the fused_ops kernels (benchmarks/fewrow_chain_bench.py, 30 layers of
# random SmolLM2-shaped weights from HBM, 8 rows); the batch-1 verification graph 0.85 ms against 0.99.
FEWROW = {"1": True, "0": False}.get(os.environ.get("DSPARK_FEWROW", ""))  # None: CUDA only
# With SMALL_M_GEMV, o_proj and down_proj on gemv.linear_small_m too (no launch saved there, only a
# different kernel than cuBLAS's); DSPARK_SMALL_M_GEMV_PLAIN=0 keeps cuBLAS for those two.
SMALL_M_GEMV_PLAIN = os.environ.get("DSPARK_SMALL_M_GEMV_PLAIN", "1") == "1"


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x, cos_sin, backend: AttentionBackend, meta, kv: torch.Tensor):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        o = backend.forward(q, k, v, kv[0], kv[1], meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, cos_sin, backend, meta, kv):
        h = h + self.self_attn(self.input_layernorm(h), cos_sin, backend, meta, kv)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, x: torch.Tensor, residual: torch.Tensor, positions: torch.Tensor,
                      rope: RotaryEmbedding, backend: TritonAttentionBackend, meta: TritonAttentionMetadata,
                      kv: torch.Tensor, rope_in_attention: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` on the fused Triton kernels, in vLLM's residual chain: the residual adds are
        fused into the following RMSNorm (fused_ops.add_rms_norm), so a layer takes its input already
        normed (``x = input_layernorm(residual)``, done by the caller together with the previous
        layer's last add) and returns ``(mlp_out, residual)`` unsummed; the caller's next add_rms_norm
        forms this layer's output ``residual + mlp_out``. Launches (GEMMs unchanged):

        qkv GEMM -> rope_qk_cache (q/k norm, RoPE, K/V cache write) -> paged attention (+ the split
        merge) -> o_proj GEMM -> add_rms_norm (residual add + post-attention norm) -> gate_up GEMM ->
        silu_and_mul -> down GEMM; plus the caller's add_rms_norm: 9 launches (10 with a key split).

        ``rope_in_attention``: the rope_qk_cache launch is folded into the attention launch (8 launches).

        Few rows with ``LlamaForCausalLM.small_m_gemv``: ``forward_gemv`` instead, 6 launches (7 with a
        key split, 5 with rope_in_attention): the add + norms move into GEMV prologues.

        Reads no tensor value on the host, so it can be captured in a CUDA graph."""
        from dspark.kernels.fused_ops import add_rms_norm, silu_and_mul as silu_and_mul_kernel

        a = self.self_attn
        T = x.shape[0]
        o = self._attend_fused(a.qkv_proj(x), positions, rope, backend, meta, kv, rope_in_attention)
        norm = self.post_attention_layernorm
        x, residual = add_rms_norm(a.o_proj(o.reshape(T, a.q_size)), residual, norm.weight, norm.eps)
        return self.mlp.down_proj(silu_and_mul_kernel(self.mlp.gate_up_proj(x))), residual

    def forward_gemv(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                     rope: RotaryEmbedding, backend: TritonAttentionBackend, meta: TritonAttentionMetadata,
                     kv: torch.Tensor, rope_in_attention: bool = False, plain: bool = True,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """forward_fused for few rows on the GEMV kernels of dspark/kernels/gemv.py. The layer takes the
        previous layer's ``(mlp_out, residual)`` unsummed and un-normed (the embeddings and None for
        layer 0) and does the add + input_layernorm inside its qkv product; returns ``(mlp_out,
        residual, h)`` with ``h = x + residual`` this layer's input, i.e. the previous layer's output
        (its tap). Launches:

        add_rms_norm_linear (residual add + input norm + qkv) -> rope_qk_cache -> paged attention (+ the
        split merge) -> linear_small_m (o_proj) -> add_rms_norm_gate_up_silu (residual add +
        post-attention norm + gate_up + SwiGLU) -> linear_small_m (down): 6 launches (7 with a key
        split, 5 with rope_in_attention), against forward_fused's 9; the caller's final add_rms_norm
        once per step. ``plain`` False: o_proj and down_proj stay the Linears (cuBLAS), same count."""
        from dspark.kernels.gemv import add_rms_norm_gate_up_silu, add_rms_norm_linear, linear_small_m

        a = self.self_attn
        T = x.shape[0]
        ln = self.input_layernorm
        qkv, h = add_rms_norm_linear(x, residual, ln.weight, ln.eps, _gemv_w(a.qkv_proj), a.qkv_proj.bias)
        o = self._attend_fused(qkv, positions, rope, backend, meta, kv, rope_in_attention)
        o = o.reshape(T, a.q_size)
        o = linear_small_m(o, _gemv_w(a.o_proj), a.o_proj.bias) if plain else a.o_proj(o)
        norm = self.post_attention_layernorm
        act, residual = add_rms_norm_gate_up_silu(o, h, norm.weight, norm.eps, _gemv_w(self.mlp.gate_up_proj))
        down = self.mlp.down_proj
        return (linear_small_m(act, _gemv_w(down), down.bias) if plain else down(act)), residual, h

    def forward_fewrow(self, x: torch.Tensor, h: torch.Tensor, sumsq, next_norm: torch.Tensor | None,
                       positions: torch.Tensor, rope: RotaryEmbedding, backend: TritonAttentionBackend,
                       meta: TritonAttentionMetadata, kv: torch.Tensor, rope_in_attention: bool = False):
        """forward_fused for 2-128 rows (fewrow_max_rows) on kernels/fewrow.py. Takes ``x``, this layer's normed
        input in the form the previous layer left it (``z = g * h`` with its sums of squares ``sumsq``; for layer 0 the
        normed embeddings and None), and ``h``, the layer's input (the residual stream). Returns ``(z, h',
        sumsq')``: h' this layer's output (its tap) and z = next_norm * h' for the next layer (None
        without ``next_norm``, the last layer, whose output the caller norms). Launches:

        qkv_rope_cache (qkv, times 1 / rms; q/k norm, RoPE and the K/V cache write in its epilogue) ->
        paged attention (+ the split merge) -> linear_residual (o_proj + residual add; z and sums of
        squares for the post-attention norm) -> gate_up_silu (times 1 / rms, SwiGLU) -> linear_residual
        (down_proj + residual add; z and sums for the next layer's input norm): 5 launches (6 with a key
        split). A head_dim under 32 (half a head must fill an MMA tile) or rope_in_attention: linear for
        qkv and the separate RoPE launch (or RoPE inside attention), 6 (7) launches."""
        from dspark.kernels import fewrow

        a, mlp = self.self_attn, self.mlp
        T = x.shape[0]
        eps = self.input_layernorm.eps
        if rope_in_attention or a.head_dim < 32 or a.head_dim & (a.head_dim - 1):
            qkv = fewrow.linear(x, _gemv_w(a.qkv_proj), sumsq, eps)
            o = self._attend_fused(qkv, positions, rope, backend, meta, kv, rope_in_attention)
        else:  # q/k norm, RoPE and the K/V cache write in the qkv product's epilogue: one launch fewer
            qn, kn, qk_eps = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if a.q_norm is not None else (None, None, 0.0)
            q = fewrow.qkv_rope_cache(x, _gemv_w(a.qkv_proj), sumsq, eps, positions, rope.cos, rope.sin_signed,
                                      kv[0], kv[1], meta.slot_mapping, a.num_heads, a.num_kv_heads, qn, kn, qk_eps)
            o = backend.attend(q, kv[0], kv[1], meta, a.scale)
        o = o.reshape(T, a.q_size)
        post = self.post_attention_layernorm
        h, z, sumsq = fewrow.o_proj_and_mlp(o, _gemv_w(a.o_proj), h, post.weight, post.eps,
                                            _gemv_w(mlp.gate_up_proj), _gemv_w(mlp.down_proj), next_norm)
        return z, h, sumsq

    def fewrow_ready(self) -> bool:
        """Whether forward_fewrow may run: gemv_ready and no bias on any of the four products."""
        a, mlp = self.self_attn, self.mlp
        return self.gemv_ready() and all(lin.bias is None for lin in (a.qkv_proj, a.o_proj, mlp.down_proj))

    def _attend_fused(self, qkv: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                      backend: TritonAttentionBackend, meta: TritonAttentionMetadata, kv: torch.Tensor,
                      rope_in_attention: bool) -> torch.Tensor:
        """q/k norm, RoPE, the K/V cache write and paged attention on the fused qkv projection -> [T, Hq, D]."""
        from dspark.kernels.fused_ops import rope_qk_cache

        a = self.self_attn
        T = qkv.shape[0]
        q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
        q, k, v = (q.view(T, a.num_heads, a.head_dim), k.view(T, a.num_kv_heads, a.head_dim),
                   v.view(T, a.num_kv_heads, a.head_dim))
        qk_norm = (a.q_norm.weight, a.k_norm.weight, a.q_norm.eps) if a.q_norm is not None else (None, None, 0.0)
        if rope_in_attention:
            return backend.attend_rope(q, kv[0], kv[1], meta, a.scale, dict(
                k=k, v=v, positions=positions, cos=rope.cos, sin_signed=rope.sin_signed,
                slot_mapping=meta.slot_mapping, q_norm=qk_norm[0], k_norm=qk_norm[1], eps=qk_norm[2]))
        q, _ = rope_qk_cache(  # K/V land in the cache here (slot < 0: padding, skipped)
            q, k, v, positions, rope.cos, rope.sin_signed, kv[0], kv[1], meta.slot_mapping, *qk_norm,
        )
        return backend.attend(q, kv[0], kv[1], meta, a.scale)  # K/V already in the cache: attention only

    def gemv_ready(self) -> bool:
        """Whether forward_gemv may run: none of the layer's Linears is batch-invariant (that mode keeps
        kernels/matmul.py for every product) and gate_up has no bias (the SwiGLU GEMV takes none)."""
        a, mlp = self.self_attn, self.mlp
        linears = (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)
        return mlp.gate_up_proj.bias is None and not any(lin.batch_invariant for lin in linears)


def _gemv_w(lin) -> torch.Tensor:
    """The weight the GEMV kernels read: the output-major copy if LlamaForCausalLM.use_gemv_output_major
    made one, else the Linear's own input-major weight."""
    w = getattr(lin, "gemv_weight_t", None)
    return lin.weight_t if w is None else w


# Output-major copies for the GEMV path only up to this many bytes of decoder weights (a second copy of
# them): a small model's batch-1 decode is launch- and latency-bound, a large one's is not.
GEMV_OUTPUT_MAJOR_MAX_BYTES = 1 << 30


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, tap_layers: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.config = cfg
        for i in tap_layers:
            if not 0 <= i < cfg.num_hidden_layers:
                raise ValueError(f"tap layer {i} is out of range for {cfg.num_hidden_layers} layers")
        self.tap_layers = tuple(tap_layers)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, max_positions)
        # Its own input-major copy even when tied to the embedding (see layers/linear.py for why), and
        # always fp32: bf16 logits are spaced 0.125 apart near 20, so greedy argmax would meet exact
        # ties that any kernel difference flips (verify vs decode, dspark vs HF).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        # True: the decoder layers use the fused Triton kernels (set by the runner with the triton
        # attention backend, the only backend it works with); False: the PyTorch ops.
        self.fused = False
        self._lm_head_half: torch.Tensor | None = None  # see use_half_lm_head
        # RoPE and the K/V write inside the attention launch (fused forward only; see ROPE_IN_ATTENTION)
        self.rope_in_attention = ROPE_IN_ATTENTION and cfg.head_dim & (cfg.head_dim - 1) == 0
        # steps of at most gemv_max_rows rows on the GEMV kernels (fused forward only; see SMALL_M_GEMV);
        # None: on CUDA only
        self.small_m_gemv: bool | None = SMALL_M_GEMV
        self.gemv_max_rows = GEMV_MAX_ROWS
        self.small_m_gemv_plain = SMALL_M_GEMV_PLAIN  # o_proj / down_proj on the GEMV too
        # steps of up to fewrow_max_rows rows not taken by the GEMVs on kernels/fewrow.py (fused forward
        # only; see FEWROW); None: on CUDA only
        self.fewrow: bool | None = FEWROW
        self.fewrow_max_rows: int | None = None  # None: fewrow.ENGINE_MAX_ROWS (128; DSPARK_FEWROW_MAX_ROWS)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        backend: AttentionBackend,
        meta: object,
        kv_caches: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        taps_out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final-normed hidden states [T, H], taps [T, len(tap_layers) * H] or None); ``taps_out``: write
        the taps there (a CUDA graph's buffer: no copy after the concatenation)."""
        if self.fused:
            return self._forward_fused(input_ids, positions, backend, meta, kv_caches, taps_out)
        h = self.embed_tokens(input_ids)
        cos_sin = self.rope.cos_sin(positions, h.dtype)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos_sin, backend, meta, kv_caches[i])
            if i in self.tap_layers:
                taps[i] = h
        return self.norm(h), self._taps(taps, taps_out)

    def _taps(self, taps: dict[int, torch.Tensor], out: torch.Tensor | None) -> torch.Tensor | None:
        if not taps:
            return None
        parts = [taps[i] for i in self.tap_layers]
        return torch.cat(parts, dim=-1) if out is None else torch.cat(parts, dim=-1, out=out)

    def _forward_fused(self, input_ids, positions, backend, meta, kv_caches, taps_out=None):
        """``forward`` on the fused kernels (DecoderLayer.forward_fused). Each add_rms_norm adds a
        layer's MLP output to the residual stream and norms the sum for the next layer (or the final
        norm); the sum it returns is that layer's raw output, the tap, rounded to the activations'
        dtype as the unfused ``h + mlp(..)`` is. With ``small_m_gemv`` and at most GEMV_MAX_ROWS rows,
        DecoderLayer.forward_gemv: the add + norm happens inside the next layer's qkv product, which
        returns the sum (the tap) too; the last layer's output still goes through add_rms_norm (the
        final norm, feeding the lm_head)."""
        if not isinstance(backend, TritonAttentionBackend):
            raise TypeError(f"LlamaForCausalLM.fused needs the Triton attention backend (it writes K/V in its own "
                            f"RoPE kernel and calls TritonAttentionBackend.attend), got {type(backend).__name__}; "
                            "set fused = False for other backends")
        from dspark.kernels import fewrow
        from dspark.kernels.fused_ops import add_rms_norm

        taps: dict[int, torch.Tensor] = {}
        T = input_ids.shape[0]
        on = input_ids.is_cuda if self.small_m_gemv is None else self.small_m_gemv
        gemv = on and T <= self.gemv_max_rows
        few = (input_ids.is_cuda if self.fewrow is None else self.fewrow) and T <= (
            self.fewrow_max_rows or fewrow.ENGINE_MAX_ROWS)
        if gemv and all(layer.gemv_ready() for layer in self.layers):
            x, residual = self.embed_tokens(input_ids), None  # layer 0 norms the embeddings in its qkv GEMV
            for i, layer in enumerate(self.layers):
                x, residual, h = layer.forward_gemv(x, residual, positions, self.rope, backend, meta, kv_caches[i],
                                                    self.rope_in_attention, self.small_m_gemv_plain)
                if i - 1 in self.tap_layers:
                    taps[i - 1] = h  # layer i's input: layer i - 1's output
            x, residual = add_rms_norm(x, residual, self.norm.weight, self.norm.eps)
            if len(self.layers) - 1 in self.tap_layers:
                taps[len(self.layers) - 1] = residual
        elif few and T and all(layer.fewrow_ready() for layer in self.layers):
            norm = self.layers[0].input_layernorm
            x, h = add_rms_norm(self.embed_tokens(input_ids), None, norm.weight, norm.eps)
            sumsq = None  # layer 0 takes the normed embeddings
            for i, layer in enumerate(self.layers):
                nxt = self.layers[i + 1].input_layernorm.weight if i + 1 < len(self.layers) else None
                x, h, sumsq = layer.forward_fewrow(x, h, sumsq, nxt, positions, self.rope, backend, meta,
                                                   kv_caches[i], self.rope_in_attention)
                if i in self.tap_layers:
                    taps[i] = h
            x = add_rms_norm(h, None, self.norm.weight, self.norm.eps)[0]
        else:
            norm = self.layers[0].input_layernorm
            x, residual = add_rms_norm(self.embed_tokens(input_ids), None, norm.weight, norm.eps)
            for i, layer in enumerate(self.layers):
                mlp_out, residual = layer.forward_fused(x, residual, positions, self.rope, backend, meta,
                                                        kv_caches[i], self.rope_in_attention)
                norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
                x, residual = add_rms_norm(mlp_out, residual, norm.weight, norm.eps)  # residual: layer i's output
                if i in self.tap_layers:
                    taps[i] = residual
        return x, self._taps(taps, taps_out)

    def use_gemv_output_major(self, any_device: bool = False) -> bool:
        """Give the GEMV path (forward_gemv) output-major copies ``[N, K]`` (seen ``[K, N]``) of the
        decoder's weights, on CUDA, when the GEMV path may run and the copies take at most
        GEMV_OUTPUT_MAJOR_MAX_BYTES; the Linears keep their input-major weights for cuBLAS (which is
        slower on output-major weights at few rows: docs/benchmarks.md, session 11). Measured on the
        H200 (session 13, one row, graphs of 30): qkv 2.40 vs 2.88 µs, gate_up 4.11 vs 5.50, o 1.83 vs
        2.10, down 2.61 vs 3.35: each program then reads whole rows of K contiguous elements instead of
        8-16-element runs. Same values, other memory layout. Returns whether the copies were made.
        ``any_device``: on a CPU too (tests, in Triton's interpreter)."""
        if self.small_m_gemv is False or (self.embed_tokens.weight.device.type != "cuda" and not any_device):
            return False
        lins = [lin for layer in self.layers if layer.gemv_ready()
                for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                            layer.mlp.down_proj)]
        if not lins or sum(lin.weight_t.numel() * lin.weight_t.element_size() for lin in lins) > GEMV_OUTPUT_MAJOR_MAX_BYTES:
            return False
        for lin in lins:
            lin.gemv_weight_t = lin.weight_t.detach().t().contiguous().t()
        return True

    def use_half_lm_head(self, output_major: bool = False) -> bool:
        """On CUDA with bf16/fp16 activations: compute the fp32 logits from a half-precision copy of the
        lm_head with fp32 accumulation and fp32 output (``torch.mm(out_dtype=float32)``). Same values as
        the fp32 matmul up to summation order: the fp32 weights are exact upcasts of half weights
        (checked here) and a product of two bf16/fp16 numbers is exact in fp32. Reads half the bytes:
        measured on an H200 at SmolLM2's [576, 49152], 15.9 vs 32.3 µs at batch 1, 18.6 vs 59.0 µs at 32
        (docs/benchmarks.md). Returns whether it is in use (not on a CPU, a torch without out_dtype, or
        weights that are not exact upcasts). ``output_major``: keep the copy ``[V, H]`` contiguous (see
        layers/linear.py, CUDA_OUTPUT_MAJOR). In batch-invariant mode the copy goes through
        kernels/matmul.py (fp32 output) instead of torch.mm: fp32 products there took 96 µs at one row on an
        H100 against 24 µs on the tensor cores, 693 against 109 µs at 512 rows (session 46)."""
        w = self.lm_head.weight_t
        dtype = self.embed_tokens.weight.dtype
        if w.device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
            return False
        half = w.detach().to(dtype)
        if output_major:
            half = half.t().contiguous().t()
        if not torch.equal(half.float(), w):
            return False
        try:
            probe = torch.zeros(2, w.shape[0], dtype=dtype, device=w.device)
            buf = torch.empty(2, w.shape[1], dtype=torch.float32, device=w.device)
            torch.mm(probe, half, out_dtype=torch.float32, out=buf)
        except (TypeError, RuntimeError, NotImplementedError):
            return False
        self._lm_head_half = half
        return True

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> [N, V] float32 logits (fp32 products and sums whatever the model dtype); ``out``:
        write them there (a CUDA graph's shared logits buffer) instead of a new tensor."""
        if self._lm_head_half is not None:
            h = hidden.to(self._lm_head_half.dtype)
            if self.lm_head.batch_invariant:  # tensor cores, fp32 sums (kernels/matmul.py), not fp32 products
                from dspark.kernels.matmul import matmul_invariant

                return matmul_invariant(h, self._lm_head_half, out=out, out_dtype=torch.float32)
            if out is None:
                return torch.mm(h, self._lm_head_half, out_dtype=torch.float32)
            return torch.mm(h, self._lm_head_half, out_dtype=torch.float32, out=out)
        if out is None:
            return self.lm_head(hidden.float())
        if self.lm_head.batch_invariant:
            from dspark.kernels.matmul import matmul_invariant

            return matmul_invariant(hidden.float(), self.lm_head.weight_t, out=out)
        return torch.matmul(hidden.float(), self.lm_head.weight_t, out=out)  # the lm_head has no bias

    # ---------------------------------------------------------------- weights
    @torch.no_grad()
    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights (``model.layers.{i}.self_attn.q_proj.weight``, ...), fusing q/k/v and
        gate/up. Raises ModelLoadError naming any missing tensor or shape mismatch."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
            return sd[name]

        def put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if tuple(param.shape) != tuple(value.shape):
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.copy_(value)

        def put_linear(lin: Linear, names: list[str], bias: bool = False) -> None:
            w = torch.cat([take(n + ".weight") for n in names], 0)
            b = torch.cat([take(n + ".bias") for n in names], 0) if bias else None
            try:
                lin.load(w, b)
            except ModelLoadError as e:
                raise ModelLoadError(f"tensor(s) {', '.join(names)}: {e}") from None

        put(self.embed_tokens.weight, take("model.embed_tokens.weight"), "model.embed_tokens.weight")
        put(self.norm.weight, take("model.norm.weight"), "model.norm.weight")
        if cfg.tie_word_embeddings:
            self.lm_head.load(self.embed_tokens.weight)
        else:
            put_linear(self.lm_head, ["lm_head"])
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            a = layer.self_attn
            put_linear(a.qkv_proj, [p + f"self_attn.{x}_proj" for x in "qkv"], cfg.attention_bias)
            put_linear(a.o_proj, [p + "self_attn.o_proj"])
            if cfg.qk_norm:
                put(a.q_norm.weight, take(p + "self_attn.q_norm.weight"), p + "self_attn.q_norm.weight")
                put(a.k_norm.weight, take(p + "self_attn.k_norm.weight"), p + "self_attn.k_norm.weight")
            put_linear(layer.mlp.gate_up_proj, [p + "mlp.gate_proj", p + "mlp.up_proj"])
            put_linear(layer.mlp.down_proj, [p + "mlp.down_proj"])
            for n in ("input_layernorm", "post_attention_layernorm"):
                put(getattr(layer, n).weight, take(p + n + ".weight"), p + n + ".weight")
