"""Adaptive verification's policy (spec/adaptive.py): acceptance estimates and the Θ-maximising length,
against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from dspark.spec.adaptive import GREEDY, SAMPLED, AcceptanceEstimate, SampledBatchRule, VerifyLengthPolicy
from dspark.spec.config import SpeculativeConfig, SpeculativeConfigError


def test_estimate_counts_reached_and_accepted_positions():
    e = AcceptanceEstimate(4, decay=0.5, min_reached=1, prior_weight=0.0)
    e.observe(False, 4, 2)  # slots 1, 2 accepted, 3 rejected, 4 not reached
    e.observe(False, 4, 4)
    e.observe(True, 2, 0)
    e.end_step()
    np.testing.assert_array_equal(e.reached[GREEDY], [2, 2, 2, 1])
    np.testing.assert_array_equal(e.accepted[GREEDY], [2, 2, 1, 1])
    np.testing.assert_array_equal(e.reached[SAMPLED], [1, 0, 0, 0])
    e.observe(False, 2, 0)  # next step: only slot 1 reached; slots 2-4 keep their counts (not decayed)
    e.end_step()
    np.testing.assert_array_equal(e.reached[GREEDY], [2 * 0.5 + 1, 2, 2, 1])
    np.testing.assert_array_equal(e.accepted[GREEDY], [2 * 0.5, 2, 1, 1])
    # a_j = product of conditional acceptances: 1/2, 1, 1/2, 1
    np.testing.assert_allclose(e.survival(GREEDY), [0.5, 0.5, 0.25, 0.25])


def test_estimate_shrinks_rare_positions_to_the_pooled_rate_and_waits_for_data():
    e = AcceptanceEstimate(3, decay=1.0, min_reached=10, prior_weight=2.0)
    for _ in range(9):
        e.observe(False, 3, 0)  # slot 1 reached 9 times, never accepted
    e.end_step()
    assert e.survival(GREEDY) is None  # 9 observations < min_reached
    e.observe(False, 3, 1)
    e.end_step()
    # reached [10, 1, 0], accepted [1, 0, 0]; pooled 1/11; (a + 2 * 1/11) / (r + 2)
    p = 1 / 11
    cond = np.array([(1 + 2 * p) / 12, (0 + 2 * p) / 3, p])
    np.testing.assert_allclose(e.survival(GREEDY), np.cumprod(cond))
    assert e.survival(SAMPLED) is None


def _policy(cond_greedy, cond_sampled, step_time, **kw):
    n = len(cond_greedy)
    e = AcceptanceEstimate(n, decay=1.0, min_reached=1, prior_weight=0.0)
    e.reached[:] = 1000.0
    e.accepted[GREEDY] = 1000.0 * np.array(cond_greedy)
    e.accepted[SAMPLED] = 1000.0 * np.array(cond_sampled)
    return VerifyLengthPolicy((1, 3, n), step_time, e, **{"margin": 0.0, "min_steps": 0, "explore": None, **kw})


def test_policy_maximises_tokens_per_second():
    # step time grows with the rows: 1 ms + 0.1 ms per row at batch 32 (q = 1 + n rows per request)
    def t(n, b, sampled):
        return 1e-3 + 1e-4 * b * (1 + n)

    pol = _policy([0.9] * 7, [0.5] * 7, t)
    # greedy, a_j = 0.9^j: Θ(1) = 32 * 1.9 / 7.4 ms = 8.22, Θ(3) = 32 * 3.439 / 13.8 ms = 7.97,
    # Θ(7) = 32 * 5.783 / 26.6 ms = 6.96 tokens/ms
    assert pol.throughput(1, 32, 0) == pytest.approx(32 * 1.9 / 7.4e-3)
    assert pol.throughput(3, 32, 0) == pytest.approx(32 * (1 + 0.9 + 0.81 + 0.729) / 13.8e-3)
    assert pol.choose(7, 32, 0) == 1
    # at batch 1 the step is latency-bound: Θ(7) = 5.783 / 1.8 ms is the best
    assert pol.choose(1, 1, 0) == 7
    # sampled requests count with their own (lower) acceptance: 16 + 16 at batch 32
    a_g, a_s = np.cumprod([0.9] * 7), np.cumprod([0.5] * 7)
    want = {n: (32 + 16 * a_g[:n].sum() + 16 * a_s[:n].sum()) / t(n, 32, True) for n in (1, 3, 7)}
    assert pol.throughput(3, 16, 16) == pytest.approx(want[3])
    assert pol.choose(7, 16, 16) == max(want, key=want.get)


def test_policy_hysteresis_and_unknown_estimates():
    flat = lambda n, b, s: 1e-3 * (1 + 0.01 * n)  # noqa: E731  (nearly flat: long blocks win a little)
    pol = _policy([0.5] * 7, [0.5] * 7, flat, margin=0.05, min_steps=2)
    # Θ(7) / Θ(3) = (1.9921875 / 1.07) / (1.875 / 1.03) = 1.023: less than the margin, stay at 3
    assert pol.choose(3, 8, 0) == 3
    pol.margin = 0.0
    assert pol.choose(3, 8, 0) == 7
    pol.changed()
    assert pol.choose(3, 8, 0) == 3  # too soon after a change
    pol.tick(), pol.tick()
    assert pol.choose(3, 8, 0) == 7
    empty = VerifyLengthPolicy((1, 7), flat, AcceptanceEstimate(7), min_steps=0)
    assert empty.choose(7, 8, 0) == 7  # no observations yet: keep the current length


def test_config_verify_lengths_errors():
    assert SpeculativeConfig(num_speculative_tokens=7, verify_lengths=[7, 3, 3, 1]).verify_lengths == (1, 3, 7)
    for bad in ([], [0, 2], "3", [2.5], [True]):
        with pytest.raises(SpeculativeConfigError, match="verify_lengths must be a non-empty list"):
            SpeculativeConfig(verify_lengths=bad)
    with pytest.raises(SpeculativeConfigError, match="go past num_speculative_tokens 5"):
        SpeculativeConfig(num_speculative_tokens=5, verify_lengths=[3, 7])


def test_policy_learns_whether_the_host_or_the_gpu_bounds_a_step():
    """The two cases measured on the H200 (session 26), as the policy sees them. The graphs' profiled
    times alone make 3 drafts look faster in both; what the read-backs show decides.
    - T = 1, batch 32 (sampled, conditional acceptance ~0.5): graphs 1.45 ms at 3 drafts, 1.82 at 7, but
      read-backs 2.9 ms apart with no wait for the GPU: host-bound, a shorter GPU step gains nothing, stay.
    - batch 128 (greedy, ~0.6): graphs 1.84 / 2.87 ms, read-backs 3.2 ms apart of which 2.0 waiting for
      the GPU: GPU-bound (host 1.2 ms, 0.33 ms neither), 3 drafts are 1.31x faster."""
    prof = {(1, True): 1.3e-3, (3, True): 1.45e-3, (7, True): 1.82e-3,
            (1, False): 1.6e-3, (3, False): 1.84e-3, (7, False): 2.87e-3}
    pol = _policy([0.6] * 7, [0.5] * 7, lambda n, b, s: prof[(n, s)], margin=0.1)
    assert pol.choose(7, 0, 32) == 3  # graphs only: (1.875 / 1.45) / (1.9922 / 1.82) = 1.18x
    for _ in range(300):
        pol.observe_step(7, 32, True, 2.9e-3, 0.0)
    assert pol.host[32] == pytest.approx((2.9e-3, 0.0))
    assert pol.real_step_time(3, 32, True) == pytest.approx(2.9e-3)  # max(1.45, 2.9)
    assert pol.choose(7, 0, 32) == 7
    for _ in range(300):
        pol.observe_step(7, 128, False, 3.2e-3, 2.0e-3)
    assert pol.host[128] == pytest.approx((1.2e-3, 0.33e-3))
    assert pol.throughput(3, 128, 0) / pol.throughput(7, 128, 0) == pytest.approx(
        (2.176 / 2.17e-3) / (2.458 / 3.2e-3), rel=1e-3)
    assert pol.choose(7, 128, 0) == 3
    pol.observe_step(7, 100, False, 0.1, 0.0)  # a 100 ms pause of the process: left out
    assert pol.host[128] == pytest.approx((1.2e-3, 0.33e-3))
    assert 64 not in pol.host  # learnt per batch-size bucket


def test_runner_step_time_takes_the_smallest_profiled_batch_that_holds_the_batch():
    """ModelRunner.step_time over a profile table (StepGraphs.profile's shape; on a GPU only otherwise)."""
    from types import SimpleNamespace

    from dspark.engine.runner import ModelRunner

    table = {(b, s): b * (2.0 if s else 1.0) for b in (1, 8, 32) for s in (False, True)}
    runner = SimpleNamespace(step_times={3: table})
    assert [ModelRunner.step_time(runner, 3, b, False) for b in (1, 2, 8, 9, 32, 40)] == [1, 8, 8, 32, 32, 32]
    assert ModelRunner.step_time(runner, 3, 5, True) == 16.0


def test_policy_tries_what_the_model_suggests_then_judges_on_measured_intervals():
    """H200 session 31, T = 1, batch 128: profiled graphs 1.64 ms at 3 drafts and 2.29 at 7, read-backs at
    7 drafts 4.0 ms apart of which 3.6 waiting for the GPU (GPU-bound; the drafter and real-context
    attention are outside the profile, so 1.71 ms is "rest"). The model then puts 3 drafts 12 % ahead:
    the policy moves there, and from then on each length's measured interval decides — staying when 3
    drafts measure 2.9 ms, going back when they measure slower than the model said."""
    prof = {3: 1.64e-3, 7: 2.29e-3}
    e = _policy([0.5] * 7, [0.5] * 7, None).estimate
    pol = VerifyLengthPolicy((3, 7), lambda n, b, s: prof[n], e, min_steps=0, min_timed=8,
                             explore=None)  # default margin 5 %
    for _ in range(50):
        pol.observe_step(7, 128, True, 4.0e-3, 3.6e-3)
    assert pol.measured[(128, 7)] == (pytest.approx(4.0e-3), 50)
    assert pol.real_step_time(7, 128, True) == pytest.approx(4.0e-3)  # measured
    assert pol.real_step_time(3, 128, True) == pytest.approx(1.64e-3 + 1.71e-3)  # the model: never run at 3
    assert pol.throughput(3, 0, 128) / pol.throughput(7, 0, 128) == pytest.approx(
        (1.875 / 3.35e-3) / (1.9921875 / 4.0e-3), rel=1e-3)  # 1.124
    assert pol.choose(7, 0, 128) == 3
    pol.changed()
    for _ in range(7):
        pol.observe_step(3, 128, True, 2.9e-3, 2.5e-3)
        pol.tick()
    assert pol.real_step_time(3, 128, True) == pytest.approx(1.64e-3 + pol.host[128][1])  # 7 steps: the model yet
    for _ in range(30):
        pol.observe_step(3, 128, True, 2.9e-3, 2.5e-3)
        pol.tick()
    assert pol.real_step_time(3, 128, True) == pytest.approx(2.9e-3)
    assert pol.choose(3, 0, 128) == 3
    # the same move measured badly (a host-bound surprise): back to 7 once 3 drafts time at 4.2 ms
    for _ in range(200):
        pol.observe_step(3, 128, True, 4.2e-3, 0.0)
    assert pol.real_step_time(3, 128, True) == pytest.approx(4.2e-3, rel=1e-3)
    assert pol.choose(3, 0, 128) == 7
    assert (64, 3) not in pol.measured  # timed per batch-size bucket


def test_policy_times_a_length_the_model_puts_close():
    """T = 1, batch 32 (session 31): profiled 1.28 / 1.48 ms at 3 / 7 drafts, read-backs at 7 drafts 2.2 ms
    apart (1.7 waiting). The model puts 3 drafts 2 % ahead — under the 5 % margin — but within the 10 %
    exploration band, so once 7 is timed the policy tries 3; measured at 1.8 ms it keeps 3. A length the
    model puts far behind (1 draft here) is never tried; with explore=None nothing is."""
    prof = {1: 1.2e-3, 3: 1.28e-3, 7: 1.48e-3}
    e = _policy([0.5] * 7, [0.55] * 7, None).estimate
    mk = lambda **kw: VerifyLengthPolicy((1, 3, 7), lambda n, b, s: prof[n], e, min_steps=0, **kw)  # noqa: E731
    pol, off = mk(), mk(explore=None)
    for p in (pol, off):
        for _ in range(20):
            p.observe_step(7, 32, True, 2.2e-3, 1.7e-3)
    th = {n: pol.throughput(n, 0, 32) for n in (1, 3, 7)}
    assert 1.0 < th[3] / th[7] < 1.05 and th[1] / th[7] < 0.9
    assert off.choose(7, 0, 32) == 7
    assert pol.choose(7, 0, 32) == 3
    pol.changed()
    for _ in range(20):
        pol.observe_step(3, 32, True, 1.8e-3, 1.3e-3)
        pol.tick()
    assert pol.real_step_time(3, 32, True) == pytest.approx(1.8e-3)
    assert pol.choose(3, 0, 32) == 3  # measured: 3 drafts ahead; 1 draft still far behind, not tried


def test_sampled_batch_rule_chooses_by_the_batch_and_waits_after_a_change():
    rule = SampledBatchRule(3, 7, min_batch=8, min_steps=2, interval=1)
    assert rule.lengths == (3, 7)
    assert rule.choose(7, 0, 8) == 3  # all sampled, 8 of them: the short block
    assert rule.choose(7, 0, 7) == 7  # too few
    assert rule.choose(7, 1, 31) == 7  # one greedy request keeps the long block
    assert rule.choose(3, 0, 0) == 3  # nothing speculating: no change
    rule.changed()
    assert not rule.due() and rule.choose(3, 1, 8) == 3  # too soon after a change
    rule.tick(), rule.tick()
    assert rule.due() and rule.choose(3, 1, 8) == 7
    every4 = SampledBatchRule(2, 5, min_batch=1, min_steps=0, interval=4)
    due = []
    for _ in range(8):
        due.append(every4.due())
        every4.tick()
    assert due == [True, False, False, False, True, False, False, False]
    fresh = rule.fresh()
    assert (fresh.short, fresh.long, fresh.min_batch, fresh.min_steps, fresh.changes) == (3, 7, 8, 2, 0)
    assert fresh.greedy_batches is None
    with pytest.raises(ValueError, match="sampled verify length 7 must be in"):
        SampledBatchRule(7, 7, min_batch=8)


def test_sampled_batch_rule_greedy_window():
    """greedy_verify_batches: a batch with greedy requests (greedy or mixed) takes the short length where its
    size is within [lo, hi], the long one outside; all-sampled batches follow min_batch as before."""
    rule = SampledBatchRule(3, 7, min_batch=16, min_steps=0, interval=1, greedy_batches=(16, 32))
    got = {(g, s): rule.choose(7, g, s) for g, s in ((8, 0), (15, 0), (16, 0), (32, 0), (33, 0), (64, 0),
                                                     (1, 15), (10, 22), (1, 32), (1, 40), (0, 16), (0, 128), (0, 8))}
    assert got == {(8, 0): 7, (15, 0): 7, (16, 0): 3, (32, 0): 3, (33, 0): 7, (64, 0): 7,
                   (1, 15): 3, (10, 22): 3, (1, 32): 7, (1, 40): 7, (0, 16): 3, (0, 128): 3, (0, 8): 7}
    assert rule.fresh().greedy_batches == (16, 32)


def test_config_sampled_verify_length_errors():
    cfg = SpeculativeConfig(num_speculative_tokens=7, sampled_verify_length=3)
    assert (cfg.sampled_verify_length, cfg.sampled_verify_min_batch) == (3, 8)
    for key, bad in (("sampled_verify_length", 0), ("sampled_verify_length", 2.5),
                     ("sampled_verify_min_batch", 0), ("sampled_verify_min_batch", True)):
        with pytest.raises(SpeculativeConfigError, match=f"{key} must be an integer >= 1"):
            SpeculativeConfig(**{key: bad})
    with pytest.raises(SpeculativeConfigError, match="sampled_verify_min_batch must be an integer >= 1, got None"):
        SpeculativeConfig(sampled_verify_min_batch=None)
    with pytest.raises(SpeculativeConfigError, match="sampled_verify_length 6 goes past num_speculative_tokens 5"):
        SpeculativeConfig(num_speculative_tokens=5, sampled_verify_length=6)
    with pytest.raises(SpeculativeConfigError, match="give one of them"):
        SpeculativeConfig(verify_lengths=[3, 5], sampled_verify_length=3)
    assert SpeculativeConfig.parse('{"sampled_verify_length": 3, "sampled_verify_min_batch": 16}').sampled_verify_min_batch == 16
    assert SpeculativeConfig.parse(
        '{"sampled_verify_length": 3, "greedy_verify_batches": [16, 32]}').greedy_verify_batches == (16, 32)
    assert SpeculativeConfig(sampled_verify_length=3).greedy_verify_batches is None
    for bad in ([16], [32, 16], [0, 8], [1.5, 8], 16, [True, 8], "16,32"):
        with pytest.raises(SpeculativeConfigError, match="greedy_verify_batches must be \\[lo, hi\\]"):
            SpeculativeConfig(sampled_verify_length=3, greedy_verify_batches=bad)


# ------------------------------------------------------------------ confidence-scheduled verification
def _sched(row_ms, draft_ms=0.0, **kw):
    from dspark.spec.adaptive import ConfidenceScheduler

    s = ConfidenceScheduler(lambda r: row_ms(r) / 1e3, **kw)
    if draft_ms:
        s.draft_time = lambda batch: draft_ms / 1e3
    return s


def test_confidence_scheduler_admits_drafts_by_survival_while_theta_rises():
    s = _sched(lambda r: 10 + 2 * r)
    # rows 2 (anchors): Θ 2/14; admit 0.9 -> 2.9/16, 0.8 -> 3.7/18, 0.5 -> 4.2/20; 0.2 -> 4.4/22 = 0.2 < 0.21: stop
    assert s.schedule([[0.9, 0.8, 0.1], [0.5, 0.2]], [False, False]) == [2, 1]
    assert s.stats["drafts_made"] == 5 and s.stats["drafts_kept"] == 3
    # rows nearly free: everything with a > 0 is worth its row
    assert _sched(lambda r: 10 + 1e-6 * r).schedule([[0.9, 0.8, 0.1], [0.5, 0.2]], [False, False]) == [3, 2]
    # the drafter's time counts in every Θ: a dearer drafter makes rows relatively cheaper
    assert _sched(lambda r: 10 + 2 * r, draft_ms=100).schedule([[0.9, 0.8, 0.1], [0.5, 0.2]], [False, False]) == [3, 2]


def test_confidence_scheduler_stops_at_the_first_admission_that_does_not_pay():
    """A concave cost (the second row dear, the rest cheap): verifying all four drafts would beat none, but
    the first admission alone lowers Θ, so none is verified. Deciding on (r, j) from the entries ranked
    after it (which read draft j through a_{r,j+1}) would bias sampled requests (ConfidenceScheduler)."""
    s = _sched(lambda r: 10 if r <= 1 else 20 + 0.1 * (r - 2))
    assert s.schedule([[0.3, 0.3, 0.3, 0.3]], [False]) == [0]
    assert (1 + 1.2) / 20.2e-3 > 1 / 10e-3  # (the whole block would have paid)
    # ties: a request's earlier draft first, so lengths stay prefixes
    assert _sched(lambda r: 10 + r).schedule([[1.0, 1.0, 1.0]], [False]) == [3]


def test_confidence_scheduler_keeps_seeded_requests_whole_and_pauses_when_plain_is_faster():
    s = _sched(lambda r: 10 * r, draft_ms=100)
    # a fixed (seeded sampled) request verifies all its drafts; the other one is scheduled
    assert s.schedule([[0.1, 0.05], [0.9, 0.8]], [True, False]) == [2, 2]
    assert s.paused_left == 0  # the drafter runs for the seeded request anyway: no pause
    # plain decoding: 1 token per 10 ms; speculating: 1.5 tokens per 120 ms -> pause 4, then 8, 16, ... 64 steps
    for want in (4, 8, 16, 32, 64, 64):
        assert s.schedule([[0.5]], [False]) == [1]  # (the drafts made are still verified)
        assert [s.pause_step() for _ in range(want + 1)] == [True] * want + [False]
    assert s.stats["paused_steps"] == 4 + 8 + 16 + 32 + 64 + 64 and s.stats["pauses"] == 6
    s.draft_time = lambda batch: 0.0  # a free drafter: as fast as plain decoding (no draft is worth a row here), no pause,
    assert s.schedule([[0.99, 0.98]], [False]) == [0] and s.paused_left == 0  # and the next pause starts short
    s.draft_time = lambda batch: 0.1
    s.schedule([[0.5]], [False])
    assert s.paused_left == 4


def test_row_time_table_profiles_powers_of_two_lazily_and_interpolates():
    from dspark.spec.adaptive import RowTimeTable

    calls = []

    def profile(r):
        calls.append(r)
        return 1.0 + (r if r <= 8 else 8 + 0.5 * (r - 8))

    t = RowTimeTable(profile, cap=16)
    assert t(1) == 2.0 and calls == [1]
    assert t(3) == pytest.approx(3 + 1 * (3 - 2) / 2 * 2)  # between t(2) = 3 and t(4) = 5
    assert calls == [1, 2, 4]
    assert t(12) == pytest.approx(11)  # halfway between t(8) = 9 and t(16) = 13
    assert t(40) == pytest.approx(13 + (13 - 9) * (40 - 16) / 8)  # past the cap: the last segment's slope
    assert sorted(calls) == [1, 2, 4, 8, 16]


def test_config_confidence_scheduling_errors():
    assert SpeculativeConfig.parse({"confidence_scheduling": False}).confidence_scheduling is False
    with pytest.raises(SpeculativeConfigError, match="confidence_scheduling must be true, false or null"):
        SpeculativeConfig.parse({"confidence_scheduling": "yes"})


def _admitted_up_to(sched, survival, r, j):
    """How many of request r's first j drafts the scheduler verifies."""
    return min(sched.schedule([list(a) for a in survival], [False] * len(survival))[r], j)


def test_confidence_scheduler_decides_each_draft_without_reading_it():
    """The losslessness condition of ConfidenceScheduler, checked on random batches: whether draft j of a
    request is verified must not depend on that draft's own value. Draft j enters the scheduler only
    through a_{r,j+1}, a_{r,j+2}, ... (the confidence head reads the previous draft), so changing those
    (keeping a non-increasing) must leave min(ℓ_r, j) as it was. A rule that admitted by the best Θ over the
    whole sorted list (looking ahead) fails this check (below)."""
    rng = np.random.default_rng(0)
    # linear, the CPU's (a dear second row), steps (a tile of 4 rows at a time, as on a GPU), convex
    costs = [lambda r: 10 + 2 * r, lambda r: 10 if r <= 1 else 20 + 0.1 * (r - 2), lambda r: 10 * -(-r // 4) + 0.1 * r,
             lambda r: 5 + r ** 1.2]

    def batch():
        return [np.cumprod(rng.uniform(0.3, 1.0, rng.integers(1, 6))) for _ in range(rng.integers(1, 4))]

    def perturbed(survival, r, j):
        s = [a.copy() for a in survival]
        a = s[r]
        a[j:] = a[j - 1] * np.cumprod(rng.uniform(0.0, 1.0, len(a) - j))
        return s

    def violations(make):
        bad = 0
        for _ in range(300):
            cost, td = costs[rng.integers(len(costs))], float(rng.uniform(0, 5))
            survival = batch()
            r = int(rng.integers(len(survival)))
            j = int(rng.integers(1, len(survival[r]) + 1))
            base = _admitted_up_to(make(cost, td), survival, r, j)
            bad += any(_admitted_up_to(make(cost, td), perturbed(survival, r, j), r, j) != base for _ in range(4))
        return bad

    assert violations(lambda cost, td: _sched(cost, draft_ms=td)) == 0

    class LookAhead:  # the best Θ over every prefix of the sorted list: reads entries ranked after (r, j)
        def __init__(self, cost, td):
            self.cost = lambda r: cost(r) + td

        def schedule(self, survival, fixed):
            cand = sorted((-x, j, i) for i, a in enumerate(survival) for j, x in enumerate(a))
            rows, tokens = len(survival), float(len(survival))
            best, best_k = tokens / self.cost(rows), 0
            for k, (neg, _, _) in enumerate(cand, 1):
                tokens, rows = tokens - neg, rows + 1
                if tokens / self.cost(rows) > best:
                    best, best_k = tokens / self.cost(rows), k
            lengths = [0] * len(survival)
            for _, _, i in cand[:best_k]:
                lengths[i] += 1
            return lengths

    assert violations(LookAhead) > 0  # (the check can fail)


def test_row_time_table_warms_the_rows_of_one_block_up_front():
    from dspark.spec.adaptive import RowTimeTable

    calls = []
    t = RowTimeTable(lambda r: calls.append(r) or float(r), cap=16)
    assert t.warm(8) == {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0} and calls == [1, 2, 4, 8] * 3  # three interleaved rounds
    assert t.warm(6) and calls == [1, 2, 4, 8] * 3  # (8 covers 6; nothing profiled again)
    assert list(RowTimeTable(float, cap=4).warm(100)) == [1, 2, 4]


def test_row_time_table_keeps_each_row_counts_fastest_round():
    """A slow stretch during one row count's measurement (here: the first measurement of 4 rows, 3x slow) does not
    stay in the table: each row count keeps its fastest of the interleaved rounds. With one pass it did, t(3) looked
    dearer than t(2), and the scheduler then verified one draft per step for the whole process."""
    from dspark.spec.adaptive import ConfidenceScheduler, RowTimeTable

    seen = set()

    def profile(r):  # a launch-bound step: the same time at 2-8 rows; 4 rows' first run hit a slow stretch
        slow = r == 4 and r not in seen
        seen.add(r)
        return (10.0 if r == 1 else 12.0) * (3 if slow else 1)

    table = RowTimeTable(profile, cap=16)
    assert table.warm(8) == {1: 10.0, 2: 12.0, 4: 12.0, 8: 12.0}
    s = ConfidenceScheduler(table)
    s.draft_time = lambda batch: 2.0
    assert s.schedule([[0.8, 0.6, 0.4, 0.3]], [False]) == [4]  # flat rows: every draft with a > 0 pays
    one_pass = RowTimeTable(lambda r: {1: 10.0, 2: 12.0, 4: 36.0, 8: 12.0}[r], cap=16, rounds=1)
    one_pass.warm(8)
    s1 = ConfidenceScheduler(one_pass)
    s1.draft_time = lambda batch: 2.0
    assert s1.schedule([[0.8, 0.6, 0.4, 0.3]], [False]) == [1]  # (the control: the symptom it prevents)


def test_confidence_scheduler_draft_time_is_a_median_per_batch_bucket():
    """One slow drafting (a compile, the collector) does not make plain decoding look faster for long: with a
    running mean, a first drafting of 1 s kept this batch paused for over a thousand steps (paused steps
    measure nothing, so the mean never came down); the median of the bucket's last draftings drops it."""
    from dspark.spec.adaptive import ConfidenceScheduler

    s = ConfidenceScheduler(lambda r: 0.010 + 0.0005 * r)
    assert s.draft_time(4) == 0.0  # nothing measured yet
    a = [0.7 ** j for j in range(1, 6)]
    key = frozenset(range(4))
    drafted = 0
    for step in range(200):
        if s.pause_step(key):
            continue
        s.schedule([a] * 4, [False] * 4, key=key)
        s.observe_draft(4, 1.0 if drafted == 0 else 0.004)
        drafted += 1
        if s.paused_left == 0 and drafted > 1:
            break
    assert step < 30 and s.stats["paused_steps"] < 20, (step, s.stats)
    assert s.draft_time(4) == pytest.approx(0.004) and s.draft_time(3) == pytest.approx(0.004)  # 3 and 4: one bucket
    assert s.draft_time(8) == 0.0  # another bucket: its own measurements


def test_confidence_scheduler_counts_requests_that_do_not_speculate_and_ends_pauses_on_a_new_batch():
    # one speculating request among 31 that decode plainly (penalties); rows free up to 8, then 2 ms each
    cost = lambda r: 10 if r <= 8 else 10 + 2 * (r - 8)  # noqa: E731  (ms)
    s = _sched(cost, draft_ms=3)
    a = [[0.9, 0.8, 0.7, 0.6, 0.5]]
    assert s.schedule(a, [False], others=31, key="a") == [0]  # every draft costs 2 ms for < 1 token
    assert s.paused_left == 4 and s.paused_key == "a"  # 32 / t(32) beats 32 / (t(32) + 3 ms)
    assert _sched(cost, draft_ms=3).schedule(a, [False]) == [5]  # alone, its rows are free
    # the pause belongs to the batch that armed it
    assert s.pause_step("a") and s.paused_left == 3
    assert not s.pause_step("b") and s.paused_left == 0 and s.next_pause == 4
