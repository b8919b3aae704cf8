"""Proposers: what drafts the next block. The engine's verification does not care who drafted.

A proposer keeps whatever context it needs from committed target rows (``write_context``), and
``propose`` returns per request up to N draft tokens, the distribution each was sampled from
(for probabilistic verification) and the confidence head's output.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, replace
from typing import Protocol

import torch

from dspark.engine.request import Request
from dspark.layers.attention import context_slots, gather_rows
from dspark.layers.basic import apply_rope, silu_and_mul
from dspark.models.dspark_drafter import DSparkDrafter
from dspark.sample.rng import draft_stream
from dspark.sample.sampler import Sampler, SamplingBatch, compute_probs


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, N] int64 drafts (row b valid up to num_drafts[b])
    probs: torch.Tensor | None  # [B, N, V] f32 draft distributions q (None if every row is greedy)
    confidence: torch.Tensor | None  # [B, N] f32 c_k (conditional acceptance estimates)


class Proposer(Protocol):
    num_slots: int  # the most drafts one proposal can hold (the drafter's block size)
    tap_layers: tuple[int, ...]  # target layers whose raw outputs write_context needs

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...

    def allocate_cache(self, num_blocks: int, block_size: int) -> None: ...

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None: ...

    def propose(self, reqs: list[Request], anchors: torch.Tensor, anchor_pos: torch.Tensor,
                block_tables: torch.Tensor, num_drafts: int, batch: SamplingBatch,
                probabilistic: list[bool]) -> Proposal: ...


class DSparkProposer:
    """Drafts with a DSpark drafter; its context K/V lives in the engine's paged cache under the
    same block ids as the target's, so prefix-cache hits carry the drafter's context too."""

    def __init__(self, drafter: DSparkDrafter, use_triton: bool = False) -> None:
        self.drafter = drafter
        # True (the engine's attention backend is "triton"): draft with the Triton kernels (context
        # K/V store, shared-tile block attention, fused Markov sampler); False: the PyTorch path below.
        self.use_triton = use_triton
        # With use_triton: block passes of up to fewrow.ENGINE_MAX_ROWS rows (128: batch 1-16 x block 8) on
        # kernels/fewrow.py, as the target's verification (DecoderLayer.forward_fewrow): 3 launches fewer per
        # drafter layer (batch 8, 64 rows, H100 session 51: 0.2429 -> 0.2416 ms, about even; batch 16, 128 rows,
        # session 53: 0.315 -> 0.320 ms greedy, 0.292 -> 0.295 at T = 1 in `dspark bench`, noise-sized). H200,
        # session 36 (benchmarks/gpu_graphs_check.py steps): the batch-1 drafter graph 0.2005 -> 0.1934 ms
        # (sampled drafts 0.2119 -> 0.2044). DSPARK_FEWROW_DRAFTER=1 on everywhere, =0 off; unset (None), on
        # for CUDA tensors only, as the target's (models/llama.py FEWROW; CPU tests turn it on explicitly).
        self.fewrow: bool | None = {"1": True, "0": False}.get(os.environ.get("DSPARK_FEWROW_DRAFTER", ""))
        c = drafter.config
        self.num_slots = c.block_size
        self.tap_layers = c.target_layer_ids
        self.sampler = Sampler()
        self.kv: torch.Tensor | None = None  # [L_d, 2, num_blocks, block_size, Hkv, D]
        self._ctx_kv: tuple[torch.Tensor, torch.Tensor | None] | None = None  # _context_kv_weight
        # [N, H] hidden -> [N, V] fp32 logits: the target's compute_logits when the factory builds the
        # proposer (on CUDA from its half-precision lm_head copy, fp32 accumulation), else base_logits
        self.logits = drafter.base_logits

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        c = self.drafter.config
        n = c.num_hidden_layers * 2 * block_size * c.num_key_value_heads * c.head_dim
        return n * torch.empty((), dtype=dtype).element_size()

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        c = self.drafter.config
        w = self.drafter.fc.weight_t
        self.block_size = block_size
        self.kv = torch.zeros(c.num_hidden_layers, 2, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                              dtype=w.dtype, device=w.device)
        self._ctx_kv = None
        self._context_kv_weight()  # now, not inside a CUDA graph capture

    @torch.inference_mode()
    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      valid: torch.Tensor | None = None) -> None:
        """Context K/V for committed rows only (taps [R, m·H] at positions [R] -> cache slots [R]);
        with ``valid`` [R] bool, only the rows it marks (a CUDA graph passes every row and a mask)."""
        if taps.shape[0] == 0:
            return
        if self.use_triton:
            return self._write_context_triton(taps, positions, slots, valid)
        if valid is not None:
            keep = valid.nonzero().squeeze(1)
            taps, positions, slots = taps[keep], positions[keep], slots[keep]
        for l, (k, v) in enumerate(self.drafter.context_entries(taps, positions)):
            self.kv[l, 0].view(-1, *k.shape[1:]).index_copy_(0, slots, k)
            self.kv[l, 1].view(-1, *v.shape[1:]).index_copy_(0, slots, v)

    @torch.inference_mode()
    def propose(self, reqs, anchors, anchor_pos, block_tables, num_drafts, batch, probabilistic) -> Proposal:
        """anchors/anchor_pos [B]: the last emitted token and its position a; the context is every
        position < a. Draft k (1-based) takes position a + k and is sampled, left to right, from
        softmax(U_k + W1[x_{k-1}]·W2ᵀ) at the request's temperature/top-k/top-p (argmax for greedy),
        with Gumbel noise gumbel(seed, a + 1, draft_stream(k-1)): keyed per step, see draft_stream."""
        if self.use_triton:
            return self._propose_triton(anchors, anchor_pos, block_tables, num_drafts, batch, probabilistic)
        d = self.drafter
        slots, valid = context_slots(block_tables, anchor_pos, self.block_size)
        ctx_kv = []
        for l in range(len(d.layers)):
            kc, vc = (c.view(-1, *c.shape[2:]) for c in (self.kv[l, 0], self.kv[l, 1]))  # [slots, Hkv, D]
            ctx_kv.append((gather_rows(kc, slots), gather_rows(vc, slots)))
        h = d.block_hidden(anchors, anchor_pos, ctx_kv, valid, self.num_slots)  # [B, γ, H]
        U = d.base_logits(h[:, :num_drafts])  # [B, N, V]
        B = anchors.shape[0]
        prob_rows = torch.tensor(probabilistic, device=anchors.device)
        any_prob = bool(prob_rows.any())
        tokens = torch.empty(B, num_drafts, dtype=torch.long, device=anchors.device)
        probs = torch.zeros(B, num_drafts, U.shape[-1], device=anchors.device) if any_prob else None
        conf = torch.empty(B, num_drafts, device=anchors.device) if d.confidence is not None else None
        prev = anchors
        step_batch = replace(batch, positions=anchor_pos + 1)  # noise keyed per step (see draft_stream)
        for k in range(num_drafts):
            logits = U[:, k] + d.markov_bias(prev)  # [B, V]
            if conf is not None:
                conf[:, k] = torch.sigmoid(d.confidence_logit(h[:, k], prev))
            tok = logits.argmax(dim=-1)
            if any_prob:
                q = compute_probs(logits, step_batch)
                sampled = self.sampler(logits, step_batch, stream=draft_stream(k))
                tok = torch.where(prob_rows, sampled, tok)
                probs[:, k] = torch.where(prob_rows[:, None], q, 0.0)
            tokens[:, k] = tok
            prev = tok
        return Proposal(tokens, probs, conf)

    # ------------------------------------------------------------------ Triton path
    def _write_context_triton(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                              valid: torch.Tensor | None = None) -> None:
        """write_context through fused_ops: DrafterLayer.context_kv's projections (fc, then every drafter
        layer's K|V in one GEMM), the hidden norm as one kernel, then k_norm + RoPE + the paged store in
        one kernel per drafter layer."""
        from dspark.kernels.fused_ops import rms_norm, store_context_kv

        d = self.drafter
        ctx = rms_norm(d.fc(taps), d.hidden_norm.weight, d.hidden_norm.eps)
        w, bias = self._context_kv_weight()
        kv_all = ctx @ w
        if bias is not None:
            kv_all = kv_all + bias
        for l, layer in enumerate(d.layers):
            width = 2 * layer.kv_size
            kv = kv_all[:, l * width:(l + 1) * width]
            k, v = kv.view(-1, 2 * layer.num_kv_heads, layer.head_dim).split(layer.num_kv_heads, dim=1)
            kn = layer.k_norm
            store_context_kv(k, v, self.kv[l, 0], self.kv[l, 1], slots, valid, positions, d.rope.cos,
                             d.rope.sin_signed, kn.weight if kn is not None else None,
                             kn.eps if kn is not None else 1e-6)

    def _context_kv_weight(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every drafter layer's K|V projection side by side, [H, L·2·kv] (and its bias): the context
        store's projections as one GEMM. Built by allocate_cache (the weights are loaded by then)."""
        if self._ctx_kv is None:
            layers = self.drafter.layers
            w = torch.cat([layer.qkv_proj.weight_t[:, layer.q_size:] for layer in layers], dim=1)
            bias = None
            if layers[0].qkv_proj.bias is not None:
                bias = torch.cat([layer.qkv_proj.bias[layer.q_size:] for layer in layers])
            self._ctx_kv = (w, bias)
        return self._ctx_kv

    def _block_hidden_triton(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, block_tables: torch.Tensor,
                             num_slots: int, max_ctx_len: int | None = None,
                             num_out: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """DSparkDrafter.block_hidden on the fused kernels, [B * num_slots, H] (final-normed; with ``num_out``
        only the first num_out slots of each request, [B * num_out, H]: the final norm writes just the rows that
        draft), and the draft noise's key positions anchor_pos + 1 [B] (made by the same launch as the block's
        first rows): each
        layer's attention is drafter_attention straight over the paged context cache (no gather, no
        mask), the residual adds are fused into the next RMSNorm (add_rms_norm, as the target's
        forward_fused), q/k norm + RoPE is one kernel (rope_qk), SwiGLU one (silu_and_mul). Per layer:
        4 GEMMs + 5 kernels; the same roundings as the PyTorch path (the kernels' tests check them).
        With ``fewrow`` and at most fewrow.ENGINE_MAX_ROWS rows: kernels/fewrow.py's products (norms after the
        product, SwiGLU and the residual adds in their epilogues), 4 products + 2 kernels per layer; the norms
        round differently (see kernels/fewrow.py), so drafts match the other path up to near-ties."""
        from dspark.kernels import fewrow
        from dspark.kernels.drafter_attention import drafter_attention
        from dspark.kernels.fused_ops import add_rms_norm, drafter_block_inputs, rms_norm_rows, rope_qk, silu_and_mul

        d = self.drafter
        B, G = anchors.shape[0], num_slots
        norm = d.layers[0].input_layernorm if len(d.layers) else d.norm
        # h [B·G, H]: the residual stream (the anchor's embedding, then the mask token's), x its first norm, pos the
        # rows' positions; key_pos (anchor_pos + 1, the draft noise's positions) is for the caller: one launch
        x, h, pos, key_pos = drafter_block_inputs(anchors, anchor_pos, d.embed_tokens.weight, d.config.mask_token_id,
                                                  G, norm.weight, norm.eps)
        n = G if num_out is None else num_out
        if not len(d.layers):
            return x.view(B, G, -1)[:, :n].reshape(B * n, -1), key_pos
        few = (self.fewrow if self.fewrow is not None else anchors.is_cuda) and B * G <= fewrow.ENGINE_MAX_ROWS and all(
            lin.bias is None and not lin.batch_invariant for layer in d.layers
            for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
        sumsq = None  # few: the sums of squares behind x (None: x is normed already)
        for l, layer in enumerate(d.layers):  # DrafterLayer.forward, attention swapped
            qs, ks = layer.q_size, layer.kv_size
            if few:
                qkv = fewrow.linear(x, layer.qkv_proj.weight_t, sumsq, layer.input_layernorm.eps)
            else:
                qkv = layer.qkv_proj(x)
            qn, kn = layer.q_norm, layer.k_norm
            q, k = rope_qk(qkv[:, :qs].view(B * G, layer.num_heads, layer.head_dim),
                           qkv[:, qs:qs + ks].view(B * G, layer.num_kv_heads, layer.head_dim), pos,
                           d.rope.cos, d.rope.sin_signed, qn.weight if qn is not None else None,
                           kn.weight if kn is not None else None, kn.eps if kn is not None else 1e-6)
            v = qkv[:, qs + ks:].view(B, G, layer.num_kv_heads, layer.head_dim)
            o = drafter_attention(q.view(B, G, layer.num_heads, layer.head_dim),
                                  k.view(B, G, layer.num_kv_heads, layer.head_dim), v, self.kv[l, 0], self.kv[l, 1],
                                  block_tables, anchor_pos, layer.head_dim**-0.5, max_ctx_len=max_ctx_len)
            post = layer.post_attention_layernorm
            norm = d.layers[l + 1].input_layernorm if l + 1 < len(d.layers) else d.norm
            if few:  # the norms after the products, SwiGLU in gate|up's epilogue (kernels/fewrow.py)
                last = l + 1 == len(d.layers)
                h, x, sumsq = fewrow.o_proj_and_mlp(o.view(B * G, qs), layer.o_proj.weight_t, h, post.weight, post.eps,
                                                    layer.gate_up_proj.weight_t, layer.down_proj.weight_t,
                                                    None if last else norm.weight)
                if last:
                    x = rms_norm_rows(h, None, d.norm.weight, d.norm.eps, n, G)
                continue
            x, h = add_rms_norm(layer.o_proj(o.view(B * G, qs)), h, post.weight, post.eps)
            mlp = layer.down_proj(silu_and_mul(layer.gate_up_proj(x)))
            if l + 1 == len(d.layers):
                x = rms_norm_rows(mlp, h, d.norm.weight, d.norm.eps, n, G)
            else:
                x, h = add_rms_norm(mlp, h, norm.weight, norm.eps)
        return x, key_pos

    def propose_fixed(self, anchors, anchor_pos, block_tables, num_drafts, batch, prob_mask: torch.Tensor,
                      any_prob: bool, max_ctx_len: int | None = None, probs_out: torch.Tensor | None = None) -> Proposal:
        """propose for a fixed-shape step (a CUDA graph, dspark/engine/cuda_graphs.py): the Triton path,
        the rows' probabilistic flags as a device mask and only whether any row samples on the host;
        ``max_ctx_len`` is the graph's context bucket. Reads no tensor value on the host."""
        B = anchors.shape[0]
        # No confidence head here: nothing in the engine consumes c_k yet, and its per-slot ops are
        # ~35 of the drafter graph's kernels.
        return self._propose_triton(anchors, anchor_pos, block_tables, num_drafts, batch, [any_prob] * B,
                                    prob_mask=prob_mask, max_ctx_len=max_ctx_len, with_confidence=False,
                                    probs_out=probs_out)

    def _propose_triton(self, anchors, anchor_pos, block_tables, num_drafts, batch, probabilistic,
                        prob_mask: torch.Tensor | None = None, max_ctx_len: int | None = None,
                        with_confidence: bool = True, probs_out: torch.Tensor | None = None) -> Proposal:
        """propose with the Triton kernels: block attention over the paged cache, then the fused
        Markov sampler (markov_sample, which picks the tokens the PyTorch loop picks); the confidence
        head, which needs only the drafted tokens, runs after it."""
        from dspark.kernels.markov_sampler import markov_sample

        d = self.drafter
        B, G = anchors.shape[0], self.num_slots
        h, key_pos = self._block_hidden_triton(anchors, anchor_pos, block_tables, G, max_ctx_len, num_out=num_drafts)
        U = self.logits(h).view(B, num_drafts, -1)  # [B, N, V] fp32
        h = h.view(B, num_drafts, -1)
        w1 = d.markov_w1.weight if d.markov_w1 is not None else None
        w2_t = d.markov_w2.weight_t if d.markov_w2 is not None else None
        tokens, probs = markov_sample(U, anchors, w1, w2_t, batch, key_pos, list(probabilistic),
                                      prob_mask=prob_mask, probs_out=probs_out)
        conf = None
        if d.confidence is not None and with_confidence:
            conf = torch.empty(anchors.shape[0], num_drafts, device=anchors.device)
            for k in range(num_drafts):
                prev = anchors if k == 0 else tokens[:, k - 1]
                conf[:, k] = torch.sigmoid(d.confidence_logit(h[:, k], prev))
        return Proposal(tokens, probs, conf)


class DSparkProposerFactory:
    """Validates a drafter checkpoint against the target before any model is built, then builds the
    proposer once the target exists (the drafter shares its embedding and lm_head)."""

    def __init__(self, spec, target_config, max_positions: int, dtype: torch.dtype, device: str) -> None:
        import json
        from pathlib import Path

        from dspark.models.dspark_drafter import DrafterConfig
        from dspark.spec.config import SpeculativeConfigError

        if spec.model is None:
            raise SpeculativeConfigError(
                "speculative config has no 'model' and dspark ships no drafter for this target (a drafter "
                "stored inside the target checkpoint is only supported for DeepSeek-V4, not yet); give the "
                "drafter directory"
            )
        p = Path(spec.model)
        if not (p / "config.json").is_file():
            raise SpeculativeConfigError(f"drafter {spec.model!r}: no config.json there")
        try:
            cfg = DrafterConfig.from_dict(json.loads((p / "config.json").read_text()))
        except json.JSONDecodeError as e:
            raise SpeculativeConfigError(f"drafter {spec.model!r}: config.json is not valid JSON: {e}") from None
        cfg.check_target(target_config)
        n = spec.num_speculative_tokens
        if n is not None and n > cfg.block_size:
            raise SpeculativeConfigError(
                f"num_speculative_tokens {n} is larger than the drafter's block size {cfg.block_size}: "
                "slots past the block predict nothing"
            )
        v = spec.verify_lengths
        if v is not None and max(v) > (n or cfg.block_size):
            raise SpeculativeConfigError(
                f"verify_lengths {list(v)} go past the {n or cfg.block_size} drafts a step makes "
                f"(num_speculative_tokens, default the drafter's block size {cfg.block_size})"
            )
        s = spec.sampled_verify_length
        if s is not None and s > (n or cfg.block_size):
            raise SpeculativeConfigError(
                f"sampled_verify_length {s} goes past the {n or cfg.block_size} drafts a step makes "
                f"(num_speculative_tokens, default the drafter's block size {cfg.block_size})"
            )
        self.spec, self.cfg, self.target_config = spec, cfg, target_config
        self.max_positions, self.dtype, self.device = max_positions, dtype, device
        self.tap_layers = cfg.target_layer_ids
        self.notes: list[str] = []

    def build(self, model) -> DSparkProposer:
        from dspark.models.dspark_drafter import load_drafter

        drafter, self.notes = load_drafter(self.spec.model, self.target_config, model.embed_tokens, model.lm_head,
                                           self.max_positions, self.dtype, torch.device(self.device))
        proposer = DSparkProposer(drafter)
        proposer.logits = model.compute_logits
        return proposer
