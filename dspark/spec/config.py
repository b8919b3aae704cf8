"""SpeculativeConfig: vLLM's keys, validated before any work."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from typing import Any


class SpeculativeConfigError(ValueError):
    """The speculative configuration or the drafter checkpoint is unusable; the message says why."""


DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")
REJECTION_SAMPLE_METHODS = ("standard", "block")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "dspark"
    model: str | None = None  # drafter checkpoint dir; None = stored inside the target checkpoint
    num_speculative_tokens: int | None = None  # None: the drafter's block size
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    # Adaptive verification (dspark's key, not vLLM's; spec/adaptive.py): the numbers of drafts a step may
    # verify, one of them per step for the whole batch, chosen to maximise expected tokens per second from
    # the measured acceptance and the profiled step times. num_speculative_tokens is always one of them.
    # None: every step verifies num_speculative_tokens drafts. Needs CUDA graphs (one set per length).
    verify_lengths: tuple[int, ...] | None = None
    # The sampled-batch rule (dspark's keys; spec/adaptive.py SampledBatchRule): a step whose speculating
    # requests are all sampled (temperature > 0), at least sampled_verify_min_batch of them, verifies
    # sampled_verify_length drafts; every other step num_speculative_tokens. One more graph set, no
    # profiling. Why: at temperature 1 the late drafts are seldom accepted, and on the H200 3 drafts beat 7
    # at every batch from 8 to 128 while greedy batches gain from 7 (docs/benchmarks.md, session 32).
    # None: off. Needs CUDA graphs, as verify_lengths; the two are exclusive.
    sampled_verify_length: int | None = None
    sampled_verify_min_batch: int = 8
    # The same rule for batches with greedy requests (greedy or mixed; dspark's key): [lo, hi], a batch of lo to hi
    # speculating requests, any of them greedy, verifies sampled_verify_length drafts too. Why a window: with
    # programmatic dependent launch (session 60) steps of up to 128 rows on the few-row kernels got 12-16 % faster,
    # steps of more rows (cuBLAS) ~2 %: on an H100 greedy batch 16 and 32 ran 14 % and 8-9 % faster verifying 3 drafts
    # (64 and 128 rows) than 7 (128 and 256), batch 8 3 % slower (docs/benchmarks.md, session 61); batches of 64
    # and more are not measured since (on the H200 before it, 7 was ahead at 64, 3 at 128: session 32). The shipped
    # drafter's [12, 32]: 12 by the row count (SampledBatchRule), not measured. None: off.
    # Needs sampled_verify_length (the shipped drafter's settings bring one; checked once they are filled in:
    # LLMEngine).
    greedy_verify_batches: tuple[int, int] | None = None
    # Confidence-scheduled verification (dspark's key; spec/adaptive.py ConfidenceScheduler, dspark.md §4):
    # on eagerly run steps (the CPU, --enforce-eager), each request verifies the drafts whose confidence-head
    # survival is worth their target rows at the measured cost per row, and drafting pauses for a few steps
    # when plain decoding is faster. None (default): on where it applies and was measured to pay (eager steps
    # on the CPU, a drafter with a confidence head; off on eager GPU steps, which are launch-bound: docs/
    # benchmarks.md, sessions 43-44); False: off; True: on (GPU eager steps too), with a warning where it cannot
    # apply.
    confidence_scheduling: bool | None = None

    def __post_init__(self) -> None:
        if self.method != "dspark":
            raise SpeculativeConfigError(f"unknown speculative method {self.method!r}: dspark supports 'dspark'")
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise SpeculativeConfigError(
                f"draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, got {self.draft_sample_method!r}"
            )
        if self.rejection_sample_method not in REJECTION_SAMPLE_METHODS:
            raise SpeculativeConfigError(
                f"rejection_sample_method must be one of {REJECTION_SAMPLE_METHODS}, got {self.rejection_sample_method!r}"
            )
        n = self.num_speculative_tokens
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise SpeculativeConfigError(f"num_speculative_tokens must be an integer >= 1, got {n!r}")
        v = self.verify_lengths
        if v is not None:
            if (not isinstance(v, (list, tuple)) or not v
                    or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in v)):
                raise SpeculativeConfigError(f"verify_lengths must be a non-empty list of integers >= 1, got {v!r}")
            if n is not None and max(v) > n:
                raise SpeculativeConfigError(
                    f"verify_lengths {list(v)} go past num_speculative_tokens {n}: a step cannot verify more drafts "
                    "than the drafter makes")
            object.__setattr__(self, "verify_lengths", tuple(sorted(set(v))))
        for key in ("sampled_verify_length", "sampled_verify_min_batch"):
            x = getattr(self, key)
            if x is not None and (not isinstance(x, int) or isinstance(x, bool) or x < 1):
                raise SpeculativeConfigError(f"{key} must be an integer >= 1, got {x!r}")
        g = self.greedy_verify_batches
        if g is not None:
            if (not isinstance(g, (list, tuple)) or len(g) != 2
                    or any(not isinstance(x, int) or isinstance(x, bool) or x < 1 for x in g) or g[0] > g[1]):
                raise SpeculativeConfigError(
                    f"greedy_verify_batches must be [lo, hi], two integers with 1 <= lo <= hi, got {g!r}")
            object.__setattr__(self, "greedy_verify_batches", tuple(g))
        c = self.confidence_scheduling
        if c is not None and not isinstance(c, bool):
            raise SpeculativeConfigError(f"confidence_scheduling must be true, false or null, got {c!r}")
        if self.sampled_verify_min_batch is None:
            raise SpeculativeConfigError("sampled_verify_min_batch must be an integer >= 1, got None")
        s = self.sampled_verify_length
        if s is not None:
            if v is not None:
                raise SpeculativeConfigError(
                    "verify_lengths (adaptive verification) and sampled_verify_length (the sampled-batch rule) "
                    "both choose the drafts a step verifies: give one of them")
            if n is not None and s > n:
                raise SpeculativeConfigError(
                    f"sampled_verify_length {s} goes past num_speculative_tokens {n}: a step cannot verify more "
                    "drafts than the drafter makes")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """Accept a SpeculativeConfig, a dict, or a JSON string (as on the command line)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise SpeculativeConfigError(f"speculative config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise SpeculativeConfigError(f"speculative config must be a JSON object, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(
                f"unknown speculative config key(s): {', '.join(unknown)} (known: {', '.join(sorted(known))})"
            )
        cfg = cls(**value)
        # the keys it named, kept beside the fields (not one: asdict / replace leave it out): when the
        # engine fills in the drafter dspark ships for the target (no "model"), it also fills in that
        # drafter's recommended settings for the keys not named (default_speculative_config). A config
        # built in code has none: every field counts as chosen.
        object.__setattr__(cfg, "given", frozenset(value))
        return cfg


def resolve_for_target(spec: SpeculativeConfig | None, target: str | None) -> SpeculativeConfig | None:
    """The config the engine runs for the target named ``target`` (the loader's name; None: fill nothing).

    No drafter named (``"model"`` absent): the one dspark ships for this target, if any (dspark/drafters), with
    its recommended settings (probabilistic drafts, block verification, the sampled-batch rule and its greedy
    window) for the keys the config did not name, as `dspark generate` / `bench` use it; vLLM's defaults stay
    for named drafters. A recommended sampled-batch rule gives way to what the config chose: adaptive
    verification (the two exclude each other), or a num_speculative_tokens at or under the rule's length; where
    the rule is off its greedy window goes too. Then the one check that needs the filled config."""
    if spec is not None and spec.model is None and target is not None:
        from dspark.drafters import default_speculative_config

        shipped = default_speculative_config(target)
        if shipped is not None:
            named = getattr(spec, "given", None)  # the keys SpeculativeConfig.parse saw named
            if named is None:  # built in code: every field counts as chosen
                named = {f.name for f in fields(spec)}
            fill = {k: v for k, v in shipped.items() if k == "model" or k not in named}
            n = spec.num_speculative_tokens
            if spec.verify_lengths is not None or (n is not None and fill.get("sampled_verify_length", 0) >= n):
                fill.pop("sampled_verify_length", None)
            if "sampled_verify_length" not in fill and spec.sampled_verify_length is None:  # the rule is off
                fill.pop("greedy_verify_batches", None)
            spec = replace(spec, **fill)
    if spec is not None and spec.greedy_verify_batches is not None and spec.sampled_verify_length is None:
        raise SpeculativeConfigError("greedy_verify_batches needs sampled_verify_length: the number of drafts "
                                     "those batches verify")
    return spec
