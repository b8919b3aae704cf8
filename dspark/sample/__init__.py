"""Token sampling: counter-based RNG (rng) and the batched sampler (sampler)."""

from dspark.sample.rng import STREAM_ACCEPT, STREAM_DRAFT, STREAM_RECOVER, STREAM_SAMPLE, gumbel, philox4x32, uniform
from dspark.sample.sampler import (
    Sampler,
    SamplingBatch,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p_min_p,
    compute_probs,
)

__all__ = [
    "STREAM_ACCEPT",
    "STREAM_DRAFT",
    "STREAM_RECOVER",
    "STREAM_SAMPLE",
    "Sampler",
    "SamplingBatch",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p_min_p",
    "compute_probs",
    "gumbel",
    "philox4x32",
    "uniform",
]
