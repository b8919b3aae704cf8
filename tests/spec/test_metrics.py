"""SpecStats: the per-position counts read off its (drafts, accepted) histogram equal the counts kept
position by position, for steps of varying lengths (adaptive verification) and outcomes."""

from __future__ import annotations

import random

from dspark.spec.metrics import SpecStats


def _by_position(steps: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    """Per-position counts updated at every step (what SpecStats.record did before the histogram)."""
    reached, accepted_at = [], []
    for n, a in steps:
        need = max(n, len(reached))
        reached += [0] * (need - len(reached))
        accepted_at += [0] * (need - len(accepted_at))
        for k in range(min(a + 1, n)):
            reached[k] += 1
        for k in range(a):
            accepted_at[k] += 1
    return reached, accepted_at


def test_positions_from_the_histogram():
    rng = random.Random(0)
    for _ in range(50):
        steps = []
        for _ in range(rng.randint(0, 40)):
            n = rng.choice((2, 3, 5, 7))
            steps.append((n, rng.randint(0, n)))
        s = SpecStats()
        for n, a in steps:
            s.record(n, a)
        reached, accepted_at = _by_position(steps)
        assert s.reached == reached and s.accepted_at == accepted_at
        assert s.num_steps == len(steps) and s.num_accepted == sum(a for _, a in steps)
        d = s.as_dict()
        assert d["spec_accepted_per_position"] == accepted_at
        if steps:
            assert s.tau == (len(steps) + sum(a for _, a in steps)) / len(steps)
            assert s.conditional_acceptance == [x / r if r else None for x, r in zip(accepted_at, reached)]


def test_hand_counted():
    s = SpecStats()
    for n, a in ((3, 0), (3, 3), (5, 2)):
        s.record(n, a)
    # position 0 reached by all three, 1 by (3,3) and (5,2), 2 by both again, 3 and 4 by none
    assert s.reached == [3, 2, 2, 0, 0]
    assert s.accepted_at == [2, 2, 1, 0, 0]
    assert s.tau == (3 + 5) / 3
