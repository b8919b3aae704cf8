"""DSpark drafters shipped inside the package (DeepSpec format, one directory per target).

No DSpark drafter for SmolLM2-135M-Instruct exists anywhere, so dspark trains one
(``benchmarks/train_gpu_split.sh``, docs/training.md) and ships it here; its model card is the
``README.md`` next to the weights. ``dspark generate`` / ``dspark serve`` / ``make run`` speculate with
it by default when the target is the embedded default model (``--no-spec`` turns that off).
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
# target name (as the loader resolves it) -> directory under dspark/drafters
SHIPPED = {"smollm2-135m-instruct": "smollm2-135m-instruct"}


def shipped_drafter(model: str | None) -> Path | None:
    """The shipped drafter directory for ``model`` (None = the default model), or None if dspark ships
    none for it (or its weights are missing from this installation)."""
    from dspark.models.loader import DEFAULT_MODEL

    name = (model or DEFAULT_MODEL).lower()
    sub = SHIPPED.get(name)
    if sub is None:
        return None
    d = _HERE / sub
    return d if (d / "config.json").is_file() and any(d.glob("*.safetensors")) else None


def default_speculative_config(model: str | None) -> dict | None:
    """The speculative config the CLI uses when none is given: the shipped drafter, probabilistic
    drafting (greedy requests still draft the argmax; sampled ones draft from the Markov-corrected q)
    and block verification (Sun et al. 2024) for sampled requests. Both verification methods are
    lossless; block accepts at least as many drafts in expectation. Measured with the shipped drafter
    on the H200 at temperature 1 (docs/benchmarks.md, session 19): τ 1.96 → 2.12 at batch 1, 2.02 →
    2.12 at batch 32 (CPU: +4–9 % for the block-5 weights, +0.5 % for these on 24 prompts), for a fused
    kernel costing 7–52 µs more per step than standard's (1–3 % of a verification step). Greedy
    requests verify by argmax either way.

    And the sampled-batch rule (spec/adaptive.py SampledBatchRule; CUDA graphs only): a batch of 16 or more
    requests, all sampled, verifies 3 of the 7 drafts. Measured on the H200 at temperature 1 against
    fixed 7 (docs/benchmarks.md, session 34, three processes, DSpark / plain): batch 128 +6 to +22 %,
    64 0 to +14 %, 32 +3 to +14 %, 16 −4 to +3 %; at batch 8 the same rule was −6 to +6 %, i.e. noise,
    hence 16. Batches with greedy requests (greedy or mixed) of 12 to 32 requests verify 3 too
    (``greedy_verify_batches``; H100, session 61, with programmatic dependent launch: greedy batch 16 1.62x plain
    against 1.42x with 7 drafts, batch 32 1.38-1.41x against 1.28-1.29x; batches under 12 or over 32 keep all 7;
    12-15 not measured)."""
    d = shipped_drafter(model)
    if d is None:
        return None
    return {"method": "dspark", "model": str(d), "draft_sample_method": "probabilistic",
            "rejection_sample_method": "block", "sampled_verify_length": 3, "sampled_verify_min_batch": 16,
            "greedy_verify_batches": [12, 32]}
