"""The DSpark drafter (docs: ../shared/docs/dspark.md §1): a parallel block backbone fed by the
target's hidden states, a sequential low-rank Markov head, and a confidence head.

Checkpoint format: DeepSpec's (``Qwen3DSparkModel``: config.json with the target's fields plus
``block_size, mask_token_id, target_layer_ids, num_target_layers, markov_rank, ...``; tensors without a
``model.`` prefix). ``LlamaDSparkModel`` and ``Qwen2DSparkModel`` are the same structure for those
target families (no q/k norm; q/k/v biases for Qwen2), so a drafter for SmolLM2 is just a config.

Data flow for one request whose anchor token sits at position a:

    context entries   ctx_j = hidden_norm(fc(concat(target taps at j)))  for every committed j < a
                      -> per layer K/V (k_norm, RoPE at j) kept in the engine's paged cache
    block             [anchor, mask x (γ-1)] at positions a .. a+γ-1; queries from block rows only,
                      keys/values = [context K/V (j < a) ‖ block K/V], bidirectional in the block
    base logits       U_k = lm_head(norm(h_k))                (target's lm_head, shared)
    Markov head       p_k(v) ∝ exp(U_k(v) + W1[x_{k-1}] · W2[v])   x_0 = anchor, x_k = draft k
    confidence        c_k = σ(w · [h_k ; W1[x_{k-1}]] + b)    P(draft k accepted | drafts < k accepted)

Slot k (1-based) predicts the token at position a + k.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dspark.config import ModelConfig
from dspark.layers.basic import RMSNorm, RotaryEmbedding, apply_rope, silu_and_mul
from dspark.layers.linear import Linear
from dspark.spec.config import SpeculativeConfigError

ARCHITECTURES = {  # architecture -> (q/k norm, q/k/v bias)
    "Qwen3DSparkModel": (True, False),
    "LlamaDSparkModel": (False, False),
    "Qwen2DSparkModel": (False, True),
}


@dataclass(frozen=True)
class DrafterConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    markov_rank: int
    markov_head_type: str
    enable_confidence_head: bool
    confidence_head_with_markov: bool
    qk_norm: bool
    attention_bias: bool

    @classmethod
    def from_dict(cls, c: dict[str, Any]) -> "DrafterConfig":
        archs = c.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise SpeculativeConfigError(
                f"drafter architectures {archs} not supported: expected one of {', '.join(ARCHITECTURES)}"
            )
        qk_norm, bias = ARCHITECTURES[arch]
        try:
            heads = int(c["num_attention_heads"])
            hidden = int(c["hidden_size"])
            rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
            cfg = cls(
                architecture=arch,
                hidden_size=hidden,
                intermediate_size=int(c["intermediate_size"]),
                num_hidden_layers=int(c["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(c.get("num_key_value_heads") or heads),
                head_dim=int(c.get("head_dim") or hidden // heads),
                rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                vocab_size=int(c["vocab_size"]),
                block_size=int(c["block_size"]),
                mask_token_id=int(c["mask_token_id"]),
                target_layer_ids=tuple(int(i) for i in c["target_layer_ids"]),
                num_target_layers=int(c["num_target_layers"]),
                markov_rank=int(c.get("markov_rank", 256)),
                markov_head_type=str(c.get("markov_head_type", "vanilla")),
                enable_confidence_head=bool(c.get("enable_confidence_head", True)),
                confidence_head_with_markov=bool(c.get("confidence_head_with_markov", True)),
                qk_norm=qk_norm,
                attention_bias=bool(c.get("attention_bias", bias)),
            )
        except KeyError as e:
            raise SpeculativeConfigError(f"drafter config is missing the field {e.args[0]!r}") from None
        if cfg.markov_head_type != "vanilla":
            raise SpeculativeConfigError(f"markov_head_type {cfg.markov_head_type!r} not supported (only 'vanilla')")
        if cfg.block_size < 1 or not cfg.target_layer_ids:
            raise SpeculativeConfigError("drafter needs block_size >= 1 and at least one target layer id")
        if not 0 <= cfg.mask_token_id < cfg.vocab_size:
            raise SpeculativeConfigError(f"mask_token_id {cfg.mask_token_id} is outside the vocabulary")
        return cfg

    def check_target(self, t: ModelConfig) -> None:
        """Raise naming the first incompatibility with the target."""
        if self.hidden_size != t.hidden_size:
            raise SpeculativeConfigError(f"drafter hidden_size {self.hidden_size} != target hidden_size {t.hidden_size}")
        if self.vocab_size != t.vocab_size:
            raise SpeculativeConfigError(f"drafter vocab_size {self.vocab_size} != target vocab_size {t.vocab_size}")
        if self.rope_theta != t.rope_theta:
            raise SpeculativeConfigError(f"drafter rope_theta {self.rope_theta} != target rope_theta {t.rope_theta}")
        if self.num_target_layers != t.num_hidden_layers:
            raise SpeculativeConfigError(
                f"drafter was built for {self.num_target_layers} target layers, the target has {t.num_hidden_layers}"
            )
        last = t.num_hidden_layers - 1
        for i in self.target_layer_ids:
            if not 0 <= i < t.num_hidden_layers:
                raise SpeculativeConfigError(f"target_layer_ids: {i} is out of range for {t.num_hidden_layers} layers")
            if i == last:
                raise SpeculativeConfigError(
                    f"target_layer_ids: {i} is the target's last layer, whose output HF returns normalised; "
                    "use an earlier layer"
                )


class DrafterLayer(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_size = c.num_attention_heads * c.head_dim
        self.kv_size = c.num_key_value_heads * c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = Linear(self.q_size, c.hidden_size)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = Linear(c.hidden_size, 2 * c.intermediate_size)
        self.down_proj = Linear(c.intermediate_size, c.hidden_size)

    def context_kv(self, ctx: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of context entries: [R, H] -> ([R, Hkv, D], [R, Hkv, D]). No input norm (KV injection)."""
        w = self.qkv_proj.weight_t[:, self.q_size:]
        kv = ctx @ w
        if self.qkv_proj.bias is not None:
            kv = kv + self.qkv_proj.bias[self.q_size:]
        k, v = kv.view(-1, 2 * self.num_kv_heads, self.head_dim).split(self.num_kv_heads, dim=1)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, *cos_sin), v

    def forward(self, h, cos_sin, ctx_k, ctx_v, mask) -> torch.Tensor:
        """h: [B, G, H] block rows; ctx_k/ctx_v: [B, C, Hkv, D] context entries; mask: [B, G or 1, C + G]
        bool over [context ‖ block rows] (serving: one block, every row sees the same keys; training:
        several blocks per sequence, each with its own context prefix and block)."""
        B, G, H = h.shape
        x = self.input_layernorm(h).view(B * G, H)
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(B * G, self.num_heads, self.head_dim)
        k = k.view(B * G, self.num_kv_heads, self.head_dim)
        v = v.view(B, G, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, *cos_sin).view(B, G, self.num_heads, self.head_dim)
        k = apply_rope(k, *cos_sin).view(B, G, self.num_kv_heads, self.head_dim)
        keys = torch.cat([ctx_k, k], dim=1).transpose(1, 2)  # [B, Hkv, C+γ, D]
        values = torch.cat([ctx_v, v], dim=1).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=self.head_dim**-0.5,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Hq, γ, D]
        h = h + self.o_proj(o.transpose(1, 2).reshape(B * G, self.q_size)).view(B, G, H)
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(silu_and_mul(self.gate_up_proj(x.view(B * G, H)))).view(B, G, H)


class DSparkDrafter(nn.Module):
    def __init__(self, c: DrafterConfig, target_embed: nn.Embedding, target_lm_head: nn.Module,
                 max_positions: int) -> None:
        super().__init__()
        self.config = c
        m = len(c.target_layer_ids)
        self.fc = Linear(m * c.hidden_size, c.hidden_size)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, max_positions)
        r = c.markov_rank
        self.markov_w1 = nn.Embedding(c.vocab_size, r) if r > 0 else None  # [V, r]
        self.markov_w2 = Linear(r, c.vocab_size) if r > 0 else None  # stored [r, V]
        conf_in = c.hidden_size + (r if c.confidence_head_with_markov and r > 0 else 0)
        self.confidence = Linear(conf_in, 1, bias=True) if c.enable_confidence_head else None
        # Shared with the target by reference (a plain attribute, not a submodule: no second copy).
        self._target = (target_embed, target_lm_head)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target[0]

    def base_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[.., H] normed hidden -> [.., V] fp32 logits through the target's lm_head."""
        return self._target[1](h.reshape(-1, h.shape[-1]).float()).view(*h.shape[:-1], -1)

    # ------------------------------------------------------------------ context
    def context_entries(self, taps: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """taps [R, m·H] (raw target layer outputs) at positions [R] -> per drafter layer (K, V) [R, Hkv, D]."""
        ctx = self.hidden_norm(self.fc(taps))
        cos_sin = self.rope.cos_sin(positions, ctx.dtype)
        return [layer.context_kv(ctx, cos_sin) for layer in self.layers]

    # ------------------------------------------------------------------ block
    def block_hidden(self, anchors: torch.Tensor, anchor_pos: torch.Tensor, ctx_kv, ctx_valid: torch.Tensor,
                     num_slots: int) -> torch.Tensor:
        """anchors [B], anchor_pos [B]; ctx_kv: per layer (K, V) [B, C, Hkv, D] of positions < anchor_pos;
        returns final-normed hidden states of the block slots [B, num_slots, H]."""
        B, G = anchors.shape[0], num_slots
        tokens = torch.full((B, G), self.config.mask_token_id, dtype=torch.long, device=anchors.device)
        tokens[:, 0] = anchors
        h = self.embed_tokens(tokens)  # [B, G, H]
        pos = (anchor_pos[:, None] + torch.arange(G, device=anchors.device)[None, :]).reshape(-1)
        cos_sin = self.rope.cos_sin(pos, h.dtype)
        mask = torch.cat([ctx_valid, ctx_valid.new_ones(B, G)], dim=1)[:, None, :]  # [B, 1, C + G]
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, cos_sin, k, v, mask)
        return self.norm(h)

    def markov_bias(self, prev: torch.Tensor) -> torch.Tensor:
        """B(x, ·) = W1[x] · W2ᵀ for previous tokens [B] -> [B, V] fp32 (zeros without a Markov head)."""
        if self.markov_w1 is None:
            return torch.zeros((), device=prev.device)
        return self.markov_w2(self.markov_w1(prev)).float()

    def confidence_logit(self, h_k: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """c_k's logit from the slot's hidden [B, H] and the previous token [B] -> [B] fp32."""
        x = h_k
        if self.config.confidence_head_with_markov and self.markov_w1 is not None:
            x = torch.cat([h_k, self.markov_w1(prev)], dim=-1)
        return self.confidence(x)[:, 0].float()

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_state_dict_deepspec(self, sd: dict[str, torch.Tensor], target_embed_w: torch.Tensor,
                                 target_lm_head_w_t: torch.Tensor) -> list[str]:
        """Load DeepSpec tensor names. Returns notes (e.g. embedding copies checked and dropped).
        Raises SpeculativeConfigError naming a missing tensor or a shape mismatch."""
        c = self.config
        notes: list[str] = []

        def take(name: str) -> torch.Tensor:
            if name not in sd:
                raise SpeculativeConfigError(f"drafter checkpoint is missing tensor {name!r}")
            return sd[name]

        def put(param: torch.Tensor, name: str) -> None:
            v = take(name)
            if tuple(v.shape) != tuple(param.shape):
                raise SpeculativeConfigError(f"drafter tensor {name!r} has shape {tuple(v.shape)}, expected {tuple(param.shape)}")
            param.copy_(v)

        def put_lin(lin: Linear, names: list[str], bias: bool = False) -> None:
            for n in names:
                take(n + ".weight")
            w = torch.cat([sd[n + ".weight"] for n in names], 0)
            b = torch.cat([take(n + ".bias") for n in names], 0) if bias else None
            if tuple(w.shape) != tuple(lin.weight_t.shape[::-1]):
                raise SpeculativeConfigError(
                    f"drafter tensor(s) {', '.join(names)} have shape {tuple(w.shape)}, expected {tuple(lin.weight_t.shape[::-1])}"
                )
            lin.load(w, b)

        put_lin(self.fc, ["fc"])
        put(self.hidden_norm.weight, "hidden_norm.weight")
        put(self.norm.weight, "norm.weight")
        for i, layer in enumerate(self.layers):
            p = f"layers.{i}."
            put_lin(layer.qkv_proj, [p + f"self_attn.{x}_proj" for x in "qkv"], c.attention_bias)
            put_lin(layer.o_proj, [p + "self_attn.o_proj"])
            if c.qk_norm:
                put(layer.q_norm.weight, p + "self_attn.q_norm.weight")
                put(layer.k_norm.weight, p + "self_attn.k_norm.weight")
            put_lin(layer.gate_up_proj, [p + "mlp.gate_proj", p + "mlp.up_proj"])
            put_lin(layer.down_proj, [p + "mlp.down_proj"])
            put(layer.input_layernorm.weight, p + "input_layernorm.weight")
            put(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        if self.markov_w1 is not None:
            put(self.markov_w1.weight, "markov_head.markov_w1.weight")
            w2 = take("markov_head.markov_w2.weight")  # stored [V, r]
            if tuple(w2.shape) != (c.vocab_size, c.markov_rank):
                raise SpeculativeConfigError(f"drafter tensor 'markov_head.markov_w2.weight' has shape {tuple(w2.shape)}")
            self.markov_w2.load(w2)
        if self.confidence is not None:
            put_lin(self.confidence, ["confidence_head.proj"], bias=True)
        # The drafter uses the target's embedding and lm_head; copies in the checkpoint must match.
        for name, ref in (("embed_tokens.weight", target_embed_w), ("lm_head.weight", target_lm_head_w_t.t())):
            if name in sd:
                same = sd[name].shape == ref.shape and torch.allclose(sd[name].to(ref), ref, atol=1e-3, rtol=1e-3)
                if not same:
                    raise SpeculativeConfigError(
                        f"drafter checkpoint's {name} differs from the target's: this drafter was trained for "
                        "another target (dspark shares the target's embedding and lm_head)"
                    )
                notes.append(f"drafter's copy of {name} equals the target's: dropped, the target's is shared")
        return notes


def load_drafter(path: str | Path, target_config: ModelConfig, target_embed: nn.Embedding, target_lm_head: Linear,
                 max_positions: int, dtype: torch.dtype, device: torch.device) -> tuple[DSparkDrafter, list[str]]:
    """Read a DeepSpec-format drafter directory (config.json + *.safetensors) for this target."""
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").is_file():
        raise SpeculativeConfigError(f"drafter {path!r}: no config.json there")
    cfg = DrafterConfig.from_dict(json.loads((p / "config.json").read_text()))
    cfg.check_target(target_config)
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise SpeculativeConfigError(f"drafter {path!r}: no *.safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(load_file(str(f)))
    with torch.device(device):
        drafter = DSparkDrafter(cfg, target_embed, target_lm_head, max_positions).to(dtype)
    notes = drafter.load_state_dict_deepspec(sd, target_embed.weight, target_lm_head.weight_t)
    return drafter.eval(), notes


def default_target_layer_ids(num_target_layers: int, m: int) -> list[int]:
    """m layers spread from layer 1 to the second-to-last (DeepSpec uses [1, 9, 17, 25, 33] of 36)."""
    last = num_target_layers - 2
    if m == 1:
        return [last // 2]
    return sorted({round(1 + i * (last - 1) / (m - 1)) for i in range(m)})


def drafter_config_dict(target: ModelConfig, *, num_hidden_layers: int = 2, block_size: int = 5,
                        mask_token_id: int, target_layer_ids: list[int] | None = None,
                        markov_rank: int = 64, architecture: str | None = None) -> dict[str, Any]:
    """A DeepSpec-format config.json for a drafter of ``target``: the target's shapes plus DSpark keys."""
    arch = architecture or {"qwen3": "Qwen3DSparkModel", "qwen2": "Qwen2DSparkModel"}.get(
        target.model_type, "LlamaDSparkModel")
    return {
        "architectures": [arch],
        "model_type": target.model_type,
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "vocab_size": target.vocab_size,
        "attention_bias": target.attention_bias,
        "num_hidden_layers": num_hidden_layers,
        "num_target_layers": target.num_hidden_layers,
        "block_size": block_size,
        "layer_types": ["full_attention"] * num_hidden_layers,
        "mask_token_id": mask_token_id,
        "target_layer_ids": target_layer_ids or default_target_layer_ids(target.num_hidden_layers, 3),
        "markov_rank": markov_rank,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "tie_word_embeddings": False,
    }


def random_drafter_state_dict(c: DrafterConfig, seed: int = 0, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random weights in DeepSpec tensor names (no embedding / lm_head: those are the target's)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    H, I, D = c.hidden_size, c.intermediate_size, c.head_dim
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    sd = {"fc.weight": rnd(H, len(c.target_layer_ids) * H), "hidden_norm.weight": torch.ones(H),
          "norm.weight": torch.ones(H)}
    for i in range(c.num_hidden_layers):
        p = f"layers.{i}."
        sd.update({p + "self_attn.q_proj.weight": rnd(q, H), p + "self_attn.k_proj.weight": rnd(kv, H),
                   p + "self_attn.v_proj.weight": rnd(kv, H), p + "self_attn.o_proj.weight": rnd(H, q),
                   p + "mlp.gate_proj.weight": rnd(I, H), p + "mlp.up_proj.weight": rnd(I, H),
                   p + "mlp.down_proj.weight": rnd(H, I), p + "input_layernorm.weight": torch.ones(H),
                   p + "post_attention_layernorm.weight": torch.ones(H)})
        if c.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = torch.ones(D)
            sd[p + "self_attn.k_norm.weight"] = torch.ones(D)
        if c.attention_bias:
            for x, n in (("q", q), ("k", kv), ("v", kv)):
                sd[p + f"self_attn.{x}_proj.bias"] = rnd(n)
    if c.markov_rank > 0:
        sd["markov_head.markov_w1.weight"] = rnd(c.vocab_size, c.markov_rank)
        sd["markov_head.markov_w2.weight"] = rnd(c.vocab_size, c.markov_rank)
    if c.enable_confidence_head:
        n_in = H + (c.markov_rank if c.confidence_head_with_markov and c.markov_rank > 0 else 0)
        sd["confidence_head.proj.weight"] = rnd(1, n_in)
        sd["confidence_head.proj.bias"] = torch.zeros(1)
    return sd


def write_drafter(path: str | Path, config: dict[str, Any], state_dict: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(p / "model.safetensors"))
    return p
