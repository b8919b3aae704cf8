"""Confidence-scheduled verification in the engine (spec/adaptive.py ConfidenceScheduler, eager steps):
greedy output unchanged with ragged verify lengths and paused drafting, sampled output still exact samples
of the target (a chi-square test that can fail), seeded requests verifying whole blocks, and where it is off.

The scheduler's inputs that are measured (t(R) per target step, the drafter's time) are replaced by fixed
numbers here, so that each test knows which regime it is in; the admission itself runs as served."""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")  # (one test builds the graph path, with the triton backend)

from dspark import LLM, SamplingParams  # noqa: E402
from tests.spec.test_spec_engine import (GREEDY, SAMPLING_PROMPT, assert_second_token_follows_target,  # noqa: E402,F401
                                         drafter, prompts, reference, sampling_llm, target)


def fix_costs(llm: LLM, row_time, draft_time: float) -> None:
    """Give the engine's scheduler fixed costs: t(R) = row_time(R) and a drafter time of draft_time."""
    cs = llm.engine.runner.conf_sched
    assert cs is not None
    cs.row_time = row_time
    cs.draft_time = lambda batch: draft_time
    cs.observe_draft = lambda batch, seconds: None


def spec_llm(target, drafter, **kw) -> LLM:
    return LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512, speculative_config={"model": str(drafter)},
               **kw)


@pytest.mark.parametrize("regime", ["ragged", "paused"])
def test_greedy_output_is_unchanged_by_scheduled_lengths_and_pauses(regime, target, drafter, prompts, reference):
    llm = spec_llm(target, drafter)
    if regime == "ragged":  # rows cheap enough for the likelier drafts only; no pause (the drafter is free)
        fix_costs(llm, lambda r: 1.0 + 0.02 * r, 0.0)
    else:  # a dear drafter: plain decoding is faster, so drafting pauses between looks
        fix_costs(llm, lambda r: 1.0 + 0.02 * r, 2.0)
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == reference
    cs = llm.engine.runner.conf_sched.stats
    st = llm.engine.spec_stats
    if regime == "ragged":
        assert 0 < cs["drafts_kept"] < cs["drafts_made"] and cs["paused_steps"] == 0
        lengths = {n for n, _ in st.by_outcome}
        assert len(lengths) > 1, st.by_outcome  # requests verified different numbers of drafts
    else:
        assert cs["pauses"] > 0 and cs["paused_steps"] > cs["scheduled_steps"]


def test_seeded_sampled_requests_verify_whole_blocks(target, drafter, prompts):
    llm = spec_llm(target, drafter)
    fix_costs(llm, lambda r: 1.0 + 0.5 * r, 5.0)  # rows and drafting so dear that nothing else would be verified
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(4)]
    a = [o.token_ids for o in llm.generate(prompts[:4], params)]
    st = llm.engine.spec_stats
    assert st.num_steps > 0 and {n for n, _ in st.by_outcome} == {5}  # the drafter's block, every time
    cs = llm.engine.runner.conf_sched.stats
    assert cs["drafts_kept"] == cs["drafts_made"] and cs["paused_steps"] == 0
    # and their text does not depend on the costs (a second engine, other costs: the same tokens)
    other = spec_llm(target, drafter)
    fix_costs(other, lambda r: 1.0 + 1e-6 * r, 0.0)
    assert [o.token_ids for o in other.generate(prompts[:4], params)] == a


@pytest.mark.parametrize("method", ["standard", "block"])
def test_scheduled_sampling_matches_target_distribution(method, tmp_path):
    """As test_spec_engine's chi-square test, with unseeded requests (scheduled) and costs that make the
    verify lengths ragged: the second emitted token (the first one through verification, or decoded plainly
    where no draft was kept) still follows the target's p(· | prompt, first token). (With a random drafter
    verification seldom accepts, so this checks the plumbing more than it could see a subtle selection
    bias; the rule that keeps the selection unbiased is checked exactly in test_adaptive.py.)"""
    llm = sampling_llm(tmp_path, method)
    fix_costs(llm, lambda r: 1.0 + 0.0005 * r, 0.0)  # most requests verify drafts, some fewer than they could
    n = 6000
    # (max_tokens 4: after the first token each request may verify up to 2 drafts, the ones it can emit)
    outs = llm.generate([SAMPLING_PROMPT] * n, SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    st, cs = llm.engine.spec_stats, llm.engine.runner.conf_sched.stats
    assert st.num_drafts > st.num_accepted > 0 and 0 < cs["drafts_kept"] < cs["drafts_made"]
    assert len({n for n, _ in st.by_outcome}) > 1, st.by_outcome  # ragged lengths
    assert_second_token_follows_target(llm, outs, {})


def test_scheduled_requests_verify_no_draft_past_max_tokens(target, drafter, prompts, reference):
    """Rows free, so every draft a scheduled request is given is verified: near max_tokens it is given only
    the drafts it can still emit (a draft past the end would cost a row and count in Θ for nothing)."""
    llm = spec_llm(target, drafter)
    fix_costs(llm, lambda r: 1.0 + 1e-6 * r, 0.0)
    got = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))]
    assert got == [r[:4] for r in reference]
    st = llm.engine.spec_stats
    assert st.num_steps > 0 and max(n for n, _ in st.by_outcome) <= 2, st.by_outcome  # 4 - the first token - 1
    assert set(st.length_steps) <= {1, 2}  # (eager steps are counted by their longest verification)


def test_where_confidence_scheduling_is_off(target, drafter, tmp_path, caplog):
    assert spec_llm(target, drafter).engine.runner.conf_sched is not None  # the default on eager steps
    off = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512,
              speculative_config={"model": str(drafter), "confidence_scheduling": False})
    assert off.engine.runner.conf_sched is None
    off.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    st = off.engine.spec_stats
    assert st.num_steps > 0 and {n for n, _ in st.by_outcome} == {5}
    # Triton's kernels in the CPU interpreter: off unless asked for (a step's time there is numpy's), and the
    # CPU products keep their default instead of a timed choice
    interp = spec_llm(target, drafter, attention_backend="triton").engine.runner
    assert interp.conf_sched is None and interp.cpu_split_k_rows == 1
    graphs = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512, attention_backend="triton",
                 speculative_config={"model": str(drafter), "confidence_scheduling": True})
    assert graphs.engine.runner.conf_sched is not None
    graphs.engine.runner.enable_graphs(capture=False)  # graph steps verify q rows per request: off
    assert graphs.engine.runner.conf_sched is None
    # eager GPU steps (launch-bound; sessions 43-44): off unless asked for. The device is only relabelled here
    # (no GPU in CI): the rule reads the runner's device before anything runs on it.
    runner = spec_llm(target, drafter).engine.runner
    runner.conf_sched, runner.device = None, torch.device("cuda")
    runner._enable_confidence_scheduling()
    assert runner.conf_sched is None
    # a drafter without a confidence head: off, and said so when asked for
    cfg = json.loads((drafter / "config.json").read_text())
    nohead = tmp_path / "nohead"
    nohead.mkdir()
    (nohead / "config.json").write_text(json.dumps({**cfg, "enable_confidence_head": False}))
    for f in drafter.iterdir():
        if f.name != "config.json":
            (nohead / f.name).symlink_to(f)
    with caplog.at_level("WARNING"):
        llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512,
                  speculative_config={"model": str(nohead), "confidence_scheduling": True})
    assert llm.engine.runner.conf_sched is None and "no confidence head" in caplog.text
