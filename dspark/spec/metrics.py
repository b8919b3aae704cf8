"""Acceptance metrics. Vocabulary: a verification step checks N drafts; a = drafts accepted
(0..N); the step emits a + 1 tokens (accepted drafts + one recovered or bonus token).

    τ (acceptance length)        = emitted tokens / verification steps   (bonus included)
    conditional acceptance at k  = P(draft k accepted | drafts 1..k-1 accepted)
                                 = accepted_at[k] / reached[k], where a step "reaches" k when it
                                   verified at least k drafts and accepted the first k-1.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_steps: int = 0
    num_drafts: int = 0
    num_accepted: int = 0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # engine steps whose times draft_time_s / verify_time_s sum (the engine's aggregate only): with confidence
    # scheduling many steps verify nothing, so those times per verification step would mislead
    engine_steps: int = 0
    # engine steps that verified drafts, by the number of drafts the step's graphs verify per request
    # (adaptive verification changes it: spec/adaptive.py); the engine's aggregate only
    length_steps: dict[int, int] = field(default_factory=dict)
    # verification steps by (drafts verified, drafts accepted): ``record`` runs for every request at every
    # step (twice: the engine's aggregate and the request's own), so it only counts; the per-position
    # figures are derived from this when read
    by_outcome: dict[tuple[int, int], int] = field(default_factory=dict)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        key = (num_drafts, num_accepted)
        h = self.by_outcome
        h[key] = h.get(key, 0) + 1

    @property
    def reached(self) -> list[int]:
        """Steps that reached position k (verified at least k + 1 drafts and accepted the first k)."""
        out = [0] * max((n for n, _ in self.by_outcome), default=0)
        for (n, a), c in self.by_outcome.items():
            for k in range(min(a + 1, n)):
                out[k] += c
        return out

    @property
    def accepted_at(self) -> list[int]:
        """Steps whose draft at position k was accepted."""
        out = [0] * max((n for n, _ in self.by_outcome), default=0)
        for (n, a), c in self.by_outcome.items():
            for k in range(a):
                out[k] += c
        return out

    @property
    def tau(self) -> float | None:
        return (self.num_accepted + self.num_steps) / self.num_steps if self.num_steps else None

    @property
    def conditional_acceptance(self) -> list[float | None]:
        return [a / r if r else None for a, r in zip(self.accepted_at, self.reached)]

    def as_dict(self) -> dict:
        return {
            "spec_tau": self.tau,
            "spec_num_steps": self.num_steps,
            "spec_num_drafts": self.num_drafts,
            "spec_num_accepted": self.num_accepted,
            "spec_acceptance_rate": self.num_accepted / self.num_drafts if self.num_drafts else None,
            "spec_accepted_per_position": self.accepted_at,
            "spec_conditional_acceptance": self.conditional_acceptance,
            "spec_draft_time_s": self.draft_time_s,
            "spec_verify_time_s": self.verify_time_s,
        } | ({"spec_verify_length_steps": dict(sorted(self.length_steps.items()))} if self.length_steps else {})
