"""A random-weight checkpoint of SmolLM2-135M's shapes, for the GPU scripts that time the engine without
the GGUF (so they run in the device calls that bring its pieces)."""

from __future__ import annotations

import tempfile
from pathlib import Path

SMOL = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.02)


def smol_checkpoint(seed: int = 1) -> Path:
    from tests.conftest import write_tiny_checkpoint

    return write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "smol", "llama", seed=seed, **SMOL)
