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
    reached: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # engine steps that verified drafts, by the number of drafts the step's graphs verify per request
    # (adaptive verification changes it: spec/adaptive.py); the engine's aggregate only
    length_steps: dict[int, int] = field(default_factory=dict)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_steps += 1
        self.num_drafts += num_drafts
        self.num_accepted += num_accepted
        need = max(num_drafts, len(self.reached))
        self.reached += [0] * (need - len(self.reached))
        self.accepted_at += [0] * (need - len(self.accepted_at))
        for k in range(min(num_accepted + 1, num_drafts)):
            self.reached[k] += 1
        for k in range(num_accepted):
            self.accepted_at[k] += 1

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
            "spec_accepted_per_position": list(self.accepted_at),
            "spec_conditional_acceptance": self.conditional_acceptance,
            "spec_draft_time_s": self.draft_time_s,
            "spec_verify_time_s": self.verify_time_s,
        } | ({"spec_verify_length_steps": dict(sorted(self.length_steps.items()))} if self.length_steps else {})
