"""Reference PyTorch layers shared by targets and drafters: RMSNorm, rotary embedding, SwiGLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, as HF Llama/Qwen do (keeps bf16 parity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by absolute position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        # sin with the first half negated: rotate_half(x) * sin == roll(x, D/2) * sin_signed (exactly)
        sin = emb.sin()
        self.register_buffer("sin_signed", torch.cat([-sin[:, : head_dim // 2], sin[:, head_dim // 2:]], -1),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's [T, 1, D] cos and sin, gathered once and shared by every layer."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin_signed[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, x: [T, H, D]; cos/sin_signed: [T, 1, D] from RotaryEmbedding.cos_sin.
    x * cos + rotate_half(x) * sin, written with one roll instead of slice/negate/cat."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused [.., 2I] gate|up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return nn.functional.silu(gate) * up
