"""Engine and model configuration: frozen dataclasses, validated at construction."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of a Llama-family decoder (Llama, Qwen2, Qwen3), read from an HF config dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    SUPPORTED = ("llama", "qwen2", "qwen3")

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        from dspark.models.errors import ModelLoadError

        mt = cfg.get("model_type")
        if mt not in cls.SUPPORTED:
            raise ModelLoadError(
                f"unsupported model_type {mt!r}: dspark supports {', '.join(cls.SUPPORTED)}"
            )
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ("default", None):
                raise ModelLoadError(f"unsupported RoPE scaling {rope_type!r}: only default RoPE is supported")
            theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
            return cls(
                model_type=mt,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", mt == "qwen2")),
                qk_norm=mt == "qwen3",
                eos_token_ids=eos_ids,
                bos_token_id=cfg.get("bos_token_id"),
            )
        except KeyError as e:
            raise ModelLoadError(f"model config is missing the field {e.args[0]!r}") from None


# Attention backends (dspark/layers/attention.py, dspark/layers/triton_attention.py). "auto" picks
# "torch" on every device for now, CUDA included: the Triton kernels are tested against the PyTorch
# backend (in Triton's interpreter) and benchmarked alone on an H200, but the engine with the Triton
# backend has not been measured on a GPU yet, so it is not made the default before it is.
ATTENTION_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine schedules and stores KV. Defaults suit a small model on one device."""

    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # token budget of one step (chunked prefill splits prompts under it)
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = True
    device: str = "cpu"
    dtype: torch.dtype = torch.float32
    seed: int = 0  # seeds the per-request seeds of requests that bring none
    attention_backend: str = "auto"  # one of ATTENTION_BACKENDS; see resolved_attention_backend
    enforce_eager: bool = False  # True: no CUDA graphs (dspark/engine/cuda_graphs.py), every step eager
    # True: the target's row results do not depend on how many rows a step has (batch-invariant matmul,
    # attention over fixed key slices and tiles): greedy speculative output equals plain output in bf16 too.
    batch_invariant: bool = False
    # True: only the attention batch-invariant (batch_invariant's fixed key slices and tensor-core row sums), the
    # products as by default. On a GPU the verification step then rounds a row as the decode step does wherever
    # both steps multiply on cuBLAS (steps of > 16 rows: >= 17 requests decoding), so greedy DSpark output equals
    # plain output on the embedded model's test (64 prompts x 128 tokens at once: 64 of 64 in session 47, 63 of
    # 64 in session 51, against 19 of 64 without; H100). Below that the decode step runs the fused GEMV / few-row
    # kernels, which round apart from the verification step's (bench, batch 1: outputs differ; batch_invariant
    # holds at every batch). Cost (session 50, engine steps at 1k context, max_model_len 2,048):
    # plain decode +0.3-1.0 % at batch 1 and +6-10 % at batch 32, verification -2 % at batch 1 and +6-10 % at
    # batch 8-32; at a max_model_len over 4,096 the key slices grow to 128 keys and batch 1 costs ~5 %.
    invariant_attention: bool = False
    # True: with CUDA graphs (plain decoding; greedy DSpark), the next step is launched before the current
    # one's tokens are read back, so the host's bookkeeping overlaps the GPU (engine/llm_engine.py).
    async_scheduling: bool = True
    # With CUDA graphs: prompt tokens a graph step can carry besides max_num_seqs requests' decode /
    # verification rows (prefill chunks as q-token pseudo-rows, q = 1 without DSpark; cuda_graphs.py
    # "Prefill rows"); 0: every step with a prefill chunk runs its prefill eagerly.
    graph_prefill_tokens: int = 512
    # With CUDA graphs, when no request decodes (a first wave of prompts, an idle server's long prompt):
    # cut the prefill chunks of requests the graphs can take to the graph's rows, so that a prompt longer
    # than them runs as graph steps instead of one eager step (H200: an 846-token prompt's eager prefill
    # took 17 ms plain, 37 ms with DSpark, against ~2 ms per graph step; session 36). Off: measured end to
    # end in session 38, no gain at batch 1 or 32 (docs/benchmarks.md); a long prompt's TTFT not measured.
    graph_prefill_alone: bool = False
    # Throwaway requests at start-up (LLMEngine.warm_up), so the first real ones do not pay for Triton
    # compiles of the eager paths; None: on CUDA only (on a CPU there is nothing to compile).
    warmup: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.graph_prefill_tokens < 0:
            raise ValueError(f"graph_prefill_tokens must be >= 0, got {self.graph_prefill_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}: use one of "
                             f"{', '.join(ATTENTION_BACKENDS)}")
        # DSPARK_INVARIANT_ATTENTION=1 (the switch of the benchmark commands in docs/benchmarks.md): invariant_attention
        # for CUDA engines on the triton backend; read here only
        if (os.environ.get("DSPARK_INVARIANT_ATTENTION") == "1" and str(self.device).startswith("cuda")
                and self.resolved_attention_backend == "triton"):
            object.__setattr__(self, "invariant_attention", True)
        for name in ("batch_invariant", "invariant_attention"):
            if getattr(self, name) and self.resolved_attention_backend != "triton":
                raise ValueError(f"{name} needs the triton attention backend (its kernels are the batch-invariant "
                                 f"ones); attention_backend {self.attention_backend!r} resolves to "
                                 f"{self.resolved_attention_backend!r} on {self.device}")

    @property
    def resolved_attention_backend(self) -> str:
        """The backend to build, "torch" or "triton": "auto" is "triton" on CUDA when triton imports
        (paged Triton kernels, fused decoder ops, CUDA graphs: measured on an H200, docs/benchmarks.md)
        and "torch" elsewhere (on a CPU Triton only runs in its slow interpreter)."""
        if self.attention_backend != "auto":
            return self.attention_backend
        if str(self.device).startswith("cuda"):
            import importlib.util

            if importlib.util.find_spec("triton") is not None:
                return "triton"
        return "torch"
