"""Drafters built for tests: random-weight DSpark checkpoints and an oracle proposer."""

from __future__ import annotations

from pathlib import Path

import torch

from dspark.config import ModelConfig
from dspark.models.dspark_drafter import (DrafterConfig, drafter_config_dict, random_drafter_state_dict,
                                          write_drafter)
from dspark.spec.proposer import Proposal


def random_drafter(path: Path, target_dir: Path, seed: int = 0, **kw) -> Path:
    import json

    target = ModelConfig.from_hf(json.loads((target_dir / "config.json").read_text()))
    kw.setdefault("mask_token_id", 3)
    cfg = drafter_config_dict(target, **kw)
    return write_drafter(path, cfg, random_drafter_state_dict(DrafterConfig.from_dict(cfg), seed, std=0.2))


class OracleProposer:
    """Proposes the target's own greedy continuation (looked up from a reference run): every draft
    is accepted, so τ = N + 1 exactly."""

    tap_layers: tuple[int, ...] = ()

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], num_slots: int) -> None:
        self.continuations = continuations  # prompt token ids -> greedy output token ids
        self.num_slots = num_slots

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return 0

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        pass

    def write_context(self, taps, positions, slots) -> None:
        pass

    def propose(self, reqs, anchors, anchor_pos, block_tables, num_drafts, batch, probabilistic) -> Proposal:
        rows = []
        for r, a in zip(reqs, anchor_pos.tolist()):
            cont = self.continuations[tuple(r.prompt_token_ids)]
            k = a + 1 - r.num_prompt_tokens  # output index of the token at position a + 1
            nxt = cont[k:k + num_drafts]
            rows.append(nxt + [0] * (num_drafts - len(nxt)))
        return Proposal(torch.tensor(rows, device=anchors.device), None, None)

    def build(self, model) -> "OracleProposer":
        return self
