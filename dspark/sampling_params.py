"""Per-request sampling parameters, validated before any work starts."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import Any


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameters) is invalid. The message names the problem."""


@dataclass
class SamplingParams:
    """How to sample one request's output (vLLM-compatible names and defaults).

    temperature == 0 means greedy (argmax). top_k in {-1, 0} disables top-k. Random draws are a pure
    function of (seed, token position, stream), so a seeded request yields the same text whatever else
    shares its batch. A request without a seed gets a random one when it is added.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top log-probabilities to return per token (0 = sampled only)

    # The flags derived from the fields (greedy, penalized, ...) are cached_property: the engine reads them
    # several times per request per step (~0.3 ms of a batch-128 DSpark step's host time as properties).
    # Setting any field drops them, so a changed object never answers from the old values.
    _DERIVED = ("greedy", "penalized", "greedy_plain", "device_verifiable")

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        d = self.__dict__
        for k in SamplingParams._DERIVED:
            d.pop(k, None)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        return cls(**d)

    @cached_property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def penalized(self) -> bool:
        """Repetition, frequency or presence penalty: the distribution depends on the tokens so far."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @cached_property
    def greedy_plain(self) -> bool:
        """Greedy and needing nothing from the logits but their argmax (no penalties, no logprobs): its
        tokens are the target's argmax chain whatever speculation drafts (ModelRunner._num_drafts)."""
        return self.greedy and self.device_verifiable

    @cached_property
    def device_verifiable(self) -> bool:
        """No penalties (they count output tokens the host would have to upload) and no logprobs (read
        from the logits on the host): DSpark can verify its drafts on the device, in one-sync steps
        launched on top of each other, with full blocks to max_tokens (ModelRunner._num_drafts)."""
        return self.logprobs is None and not self.penalized

    def validate(self) -> None:
        def num(name: str, v: Any, kind: type) -> None:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
            if kind is int:
                ok = isinstance(v, int) and not isinstance(v, bool)
            if not ok:
                raise InvalidRequestError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")

        num("max_tokens", self.max_tokens, int)
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}")
        num("temperature", self.temperature, float)
        if not self.temperature >= 0.0:  # also rejects NaN
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}")
        num("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        num("top_k", self.top_k, int)
        if self.top_k < -1:
            raise InvalidRequestError(f"top_k must be -1 (disabled), 0 (disabled) or >= 1, got {self.top_k}")
        num("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        num("repetition_penalty", self.repetition_penalty, float)
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            num(name, v, float)
            if not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v}")
        if self.seed is not None:
            num("seed", self.seed, int)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must be non-negative integers, got {t!r}")
        if self.logprobs is not None:
            num("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= 20:
                raise InvalidRequestError(f"logprobs must be in [0, 20], got {self.logprobs}")
