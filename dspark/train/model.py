"""The training forward of a DSpark drafter (docs: ../shared/docs/dspark.md §1, §5), plain PyTorch.

For a batch of sequences x_0 .. x_{S-1} (prompt + regenerated response, right-padded):

  1. the frozen target runs densely (causal SDPA, no KV cache) and returns the taps of
     ``target_layer_ids`` at every position and its final hidden states (→ p_t through lm_head);
  2. up to K anchors p per sequence, where p and p+1 are response tokens;
  3. anchor p makes the block [x_p, mask × (γ−1)] at positions p .. p+γ−1; slot k (1-based) predicts
     x_{p+k}; its label counts while p+k is inside the sequence and the loss mask (a contiguous prefix);
  4. the drafter runs all K blocks of a sequence in one pass: ctx = hidden_norm(fc(taps)) gives the
     context K/V of every position, and a block query sees context j < p and all γ rows of its own
     block (``block_attention_mask``) — exactly what the engine does at a step whose anchor sits at p
     (spec/proposer.py; tests/train checks the two agree);
  5. Markov head teacher-forced: slot k's bias uses the true x_{p+k-1} (the anchor for k = 1);
  6. losses on the rows with a label (``draft_losses``); lm_head matmuls and softmaxes in fp32, as
     the engine computes logits.

The target, the embedding and the lm_head are frozen; the drafter uses the target's embedding and
lm_head by reference (they are not drafter parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dspark.models.dspark_drafter import DSparkDrafter
from dspark.models.llama import LlamaForCausalLM

LOSS_WEIGHTS = {"ce": 0.1, "tv": 0.9, "conf": 1.0}
POSITION_DECAY = 4.0  # w_k = exp(-(k-1)/4) (DeepSpec's code)


# ------------------------------------------------------------------------------------ target
@dataclass(frozen=True)
class DenseShape:
    batch: int
    seq: int


class DenseCausalAttention:
    """The ``forward`` of an attention backend (layers/attention.py) for a dense [B, S] batch:
    causal SDPA over the batch's own K/V, no cache. Right padding never reaches a real row."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: None, v_cache: None,
                meta: DenseShape, scale: float) -> torch.Tensor:
        B, S = meta.batch, meta.seq
        T, Hq, D = q.shape
        Hkv = k.shape[1]
        o = F.scaled_dot_product_attention(
            q.view(B, S, Hq, D).transpose(1, 2), k.view(B, S, Hkv, D).transpose(1, 2),
            v.view(B, S, Hkv, D).transpose(1, 2), is_causal=True, scale=scale, enable_gqa=Hq != Hkv,
        )  # [B, Hq, S, D]
        return o.transpose(1, 2).reshape(T, Hq, D)


@torch.no_grad()
def target_forward(target: LlamaForCausalLM, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [B, S] -> (final-normed hidden [B, S, H], taps [B, S, m·H]) of the frozen target."""
    B, S = tokens.shape
    pos = torch.arange(S, device=tokens.device).repeat(B)
    no_cache = [(None, None)] * len(target.layers)
    h, taps = target(tokens.reshape(-1), pos, DenseCausalAttention(), DenseShape(B, S), no_cache)
    return h.view(B, S, -1), taps.view(B, S, -1)


# ------------------------------------------------------------------------------------ blocks
@dataclass
class Blocks:
    """K blocks per sequence; slot k (1-based) of the block at anchor p sits at position p+k-1."""

    anchors: torch.Tensor  # [B, K] anchor positions p, ascending; 0 for padding anchors
    valid: torch.Tensor  # [B, K] bool, a real anchor
    tokens: torch.Tensor  # [B, K, γ] [x_p, mask, ..., mask]
    positions: torch.Tensor  # [B, K, γ] p .. p+γ-1
    labels: torch.Tensor  # [B, K, γ] x_{p+k} (0 where out of range)
    label_mask: torch.Tensor  # [B, K, γ] bool, a contiguous prefix of each block
    prev: torch.Tensor  # [B, K, γ] x_{p+k-1}: the Markov head's teacher-forced previous token


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """loss_mask [B, S] -> (anchors [B, K], valid [B, K]): up to K positions p with p and p+1 both
    response tokens, uniformly without replacement, ascending; K = min(max_anchors, S-1), S counted to
    the last response token: padding columns past it (make_batch rounds S up) draw nothing, so a padded
    batch gets the anchors of the unpadded one."""
    cols = loss_mask.any(0).nonzero()
    S = int(cols.max()) + 1 if cols.numel() else loss_mask.shape[1]
    ok = (loss_mask[:, :S - 1] & loss_mask[:, 1:S]).cpu()  # [B, S-1]
    score = torch.where(ok, torch.rand(ok.shape, generator=generator), -1.0)
    K = min(max_anchors, S - 1)
    top, idx = score.topk(K, dim=1)
    valid = top >= 0
    idx, order = torch.where(valid, idx, S).sort(dim=1)
    valid = valid.gather(1, order)
    return torch.where(valid, idx, 0).to(loss_mask.device), valid.to(loss_mask.device)


def make_blocks(tokens: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor,
                block_size: int, mask_token_id: int) -> Blocks:
    """tokens/loss_mask [B, S], anchors/valid [B, K] -> the blocks and their labels."""
    B, S = tokens.shape
    k = torch.arange(block_size, device=tokens.device)  # slot k+1 (0-based k)
    pos = anchors[:, :, None] + k  # [B, K, γ]  p + k
    label_pos = pos + 1  # p + k + 1
    inside = label_pos < S
    lp = label_pos.clamp(max=S - 1).flatten(1)
    label_mask = inside & loss_mask.gather(1, lp).view_as(pos) & valid[:, :, None]
    label_mask = label_mask.long().cumprod(-1).bool()  # contiguous prefix
    labels = torch.where(label_mask, tokens.gather(1, lp).view_as(pos), 0)
    prev = torch.where(label_mask, tokens.gather(1, pos.clamp(max=S - 1).flatten(1)).view_as(pos), 0)
    blk = torch.full_like(pos, mask_token_id)
    blk[:, :, 0] = tokens.gather(1, anchors)
    return Blocks(anchors, valid, blk, pos, labels, label_mask, prev)


def block_attention_mask(anchors: torch.Tensor, valid: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """[B, K·γ, S + K·γ] bool, True = may attend. Keys are [context 0..S-1 ‖ block rows]; a query of the
    block at anchor p sees context j < p and the γ rows of its own block (a padding anchor only its
    own block, so its softmax stays finite)."""
    B, K = anchors.shape
    dev = anchors.device
    q_block = torch.arange(K * block_size, device=dev) // block_size  # [Q]
    p = torch.where(valid, anchors, 0)[:, q_block]  # [B, Q] anchor of each query
    ctx = torch.arange(seq_len, device=dev)[None, None, :] < p[:, :, None]  # [B, Q, S]
    own = (q_block[:, None] == q_block[None, :]).expand(B, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx, own], dim=-1)


# ------------------------------------------------------------------------------------ drafter
def drafter_block_hidden(drafter: DSparkDrafter, taps: torch.Tensor, blocks: Blocks) -> torch.Tensor:
    """taps [B, S, m·H] -> final-normed hidden of every block slot [B, K·γ, H] (block-major)."""
    B, S, _ = taps.shape
    K, G = blocks.tokens.shape[1:]
    ctx = drafter.hidden_norm(drafter.fc(taps.reshape(B * S, -1)))  # [B·S, H]
    ctx_cs = drafter.rope.cos_sin(torch.arange(S, device=taps.device).repeat(B), ctx.dtype)
    h = drafter.embed_tokens(blocks.tokens.view(B, K * G)).float()  # [B, Q, H]
    blk_cs = drafter.rope.cos_sin(blocks.positions.reshape(-1), h.dtype)
    mask = block_attention_mask(blocks.anchors, blocks.valid, S, G)
    for layer in drafter.layers:
        k, v = layer.context_kv(ctx, ctx_cs)  # [B·S, Hkv, D]
        h = layer(h, blk_cs, k.view(B, S, *k.shape[1:]), v.view(B, S, *v.shape[1:]), mask)
    return drafter.norm(h)


# ------------------------------------------------------------------------------------ losses
def position_weights(block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[γ] w_k = exp(-(k-1)/4), k = 1..γ."""
    return torch.exp(-torch.arange(block_size, device=device, dtype=torch.float32) / POSITION_DECAY)


def expected_acceptance_length(accept: torch.Tensor) -> torch.Tensor:
    """accept [N, γ] (1 − TV_k, 0 past a block's labels) -> [N] τ_prob = 1 + Σ_k ∏_{i≤k} accept_i."""
    return 1.0 + accept.cumprod(-1).sum(-1)


@dataclass
class LossOutput:
    total: torch.Tensor  # scalar, 0.1·ce + 0.9·tv + 1.0·conf
    ce: torch.Tensor  # scalar, weighted CE of the Markov-corrected draft distribution
    tv: torch.Tensor  # scalar, weighted Σ_v |p_d − p_t|
    conf: torch.Tensor  # scalar, weighted BCE-with-logits vs clamp(1 − ½‖p_d − p_t‖₁, 0, 1)
    tau_prob: torch.Tensor  # scalar (detached), mean over blocks of 1 + Σ_k ∏_{i≤k} (1 − TV_i)
    accept: torch.Tensor  # [γ] (detached), mean 1 − TV_k over rows of slot k
    num_rows: int  # labelled slots

    def metrics(self) -> dict[str, float | list[float]]:
        return {"loss": self.total.item(), "ce": self.ce.item(), "tv": self.tv.item(), "conf": self.conf.item(),
                "tau_prob": self.tau_prob.item(), "accept": [round(a, 4) for a in self.accept.tolist()]}


def draft_losses(draft_logits: torch.Tensor, target_logits: torch.Tensor, conf_logits: torch.Tensor,
                 labels: torch.Tensor, slot: torch.Tensor, block: torch.Tensor, num_blocks: int,
                 block_size: int) -> LossOutput:
    """Rows are labelled slots. draft_logits [M, V] (base + Markov bias), target_logits [M, V] (the
    target's logits for the same position), conf_logits [M], labels [M], slot [M] (0-based k-1),
    block [M] (block index in [0, num_blocks)). Each loss is the w_k-weighted mean over rows."""
    w = position_weights(block_size, draft_logits.device)[slot]  # [M]
    wsum = w.sum()
    logp_d = torch.log_softmax(draft_logits.float(), dim=-1)
    p_d = logp_d.exp()
    p_t = torch.softmax(target_logits.float(), dim=-1)
    ce = (w * F.nll_loss(logp_d, labels, reduction="none")).sum() / wsum
    l1 = (p_d - p_t).abs().sum(-1)  # [M] = 2·TV
    tv = (w * l1).sum() / wsum
    soft = (1.0 - 0.5 * l1).clamp(0.0, 1.0).detach()  # [M] 1 − TV: P(accept | reached)
    bce = F.binary_cross_entropy_with_logits(conf_logits.float(), soft, reduction="none")
    conf = (w * bce).sum() / wsum
    total = LOSS_WEIGHTS["ce"] * ce + LOSS_WEIGHTS["tv"] * tv + LOSS_WEIGHTS["conf"] * conf
    with torch.no_grad():
        grid = torch.zeros(num_blocks, block_size, device=soft.device)
        grid[block, slot] = soft
        has = torch.zeros(num_blocks, dtype=torch.bool, device=soft.device)
        has[block] = True
        tau = expected_acceptance_length(grid)[has].mean()
        n = torch.zeros(block_size, device=soft.device).index_add_(0, slot, torch.ones_like(soft))
        accept = torch.zeros(block_size, device=soft.device).index_add_(0, slot, soft) / n.clamp(min=1)
    return LossOutput(total, ce, tv, conf, tau, accept, int(labels.numel()))


def training_forward(target: LlamaForCausalLM, drafter: DSparkDrafter, tokens: torch.Tensor,
                     loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator,
                     losses_fn=draft_losses) -> LossOutput:
    """One batch: tokens [B, S] (right-padded), loss_mask [B, S] bool -> losses and metrics.
    ``losses_fn``: draft_losses, or a compiled draft_losses (TrainConfig.compile_loss)."""
    c = drafter.config
    B, S = tokens.shape
    hidden, taps = target_forward(target, tokens)
    anchors, valid = sample_anchors(loss_mask, max_anchors, generator)
    blocks = make_blocks(tokens, loss_mask, anchors, valid, c.block_size, c.mask_token_id)
    h = drafter_block_hidden(drafter, taps, blocks)  # [B, K·γ, H]
    rows = blocks.label_mask.flatten().nonzero().squeeze(1)  # [M] flat (b, i, k) of labelled slots
    G = c.block_size
    slot = rows % G
    block = rows // G  # b·K + i
    h_rows = h.reshape(-1, h.shape[-1])[rows]
    prev = blocks.prev.flatten()[rows]
    b = block // anchors.shape[1]
    t_rows = b * S + blocks.positions.flatten()[rows]  # the target row predicting x_{p+k}
    with torch.autocast(h.device.type, enabled=False):  # fp32 lm_head matmuls, as the engine serves
        base = drafter.base_logits(h_rows)  # [M, V]
        with torch.no_grad():
            target_logits = target.compute_logits(hidden.view(B * S, -1)[t_rows])  # [M, V]
    draft_logits = base + drafter.markov_bias(prev)  # [M, V] fp32
    conf_logits = drafter.confidence_logit(h_rows, prev)  # [M]
    return losses_fn(draft_logits, target_logits, conf_logits, blocks.labels.flatten()[rows], slot, block,
                     anchors.numel(), G)
