"""DSpark in the engine: greedy losslessness (random and oracle drafters), drafter context under
prefix hits / chunked prefill / preemption, sampling losslessness end to end, the Markov head."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from dspark import LLM, LLMEngine, SamplingParams
from tests.conftest import forward_logits, write_tiny_checkpoint
from tests.spec.drafters import OracleProposer, random_drafter

GREEDY = SamplingParams(temperature=0, max_tokens=25, ignore_eos=True)
LENS = [5, 17, 33, 9, 1, 40, 12, 26]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "t", "llama", num_hidden_layers=4, seed=3)


@pytest.fixture(scope="module")
def drafter(target, tmp_path_factory):
    return random_drafter(tmp_path_factory.mktemp("spec") / "d", target, target_layer_ids=[0, 2], block_size=5)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(4, 512, (20,), generator=g).tolist()
    return [(shared if i % 2 else []) + torch.randint(4, 512, (n,), generator=g).tolist() for i, n in enumerate(LENS)]


@pytest.fixture(scope="module")
def reference(target, prompts):
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512, enable_prefix_caching=False)
    return [o.token_ids for o in llm.generate(prompts, GREEDY)]


def spec_llm(target, drafter, **kw) -> LLM:
    spec = {"model": str(drafter), **kw.pop("spec", {})}
    kw.setdefault("num_kv_blocks", 512)
    return LLM(str(target), device="cpu", block_size=4, speculative_config=spec, **kw)


EVERY_STEP = {"confidence_scheduling": False}  # every step drafts and verifies its whole block

CONFIGS = {
    "batched": {},
    "block-verification": dict(spec={"rejection_sample_method": "block"}),
    "3-drafts": dict(spec={"num_speculative_tokens": 3}),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(num_kv_blocks=40),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_speculation_is_lossless_with_random_drafter(name, target, drafter, prompts, reference):
    kw = dict(CONFIGS[name])
    kw["spec"] = {**EVERY_STEP, **kw.get("spec", {})}  # (confidence scheduling: tests/spec/test_confidence_scheduling.py)
    llm = spec_llm(target, drafter, **kw)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    st = llm.engine.spec_stats
    assert st.num_steps > 0 and st.num_drafts > st.num_accepted  # drafts were verified and many rejected
    if name == "preemption":
        assert sum(o.stats["num_preemptions"] for o in outs) > 0
    if name == "batched":  # a second round is served from the prefix cache
        again = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == reference
        assert all(o.stats["num_cached_tokens"] > 0 for o, p in zip(again, prompts) if len(p) > 4)
    assert llm.engine.kv.check_integrity()["in_use"] == 0


@pytest.mark.parametrize("n", [1, 3, 5])
def test_oracle_drafter_accepts_everything(n, target, prompts, reference):
    conts = {tuple(p): r for p, r in zip(prompts, reference)}
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512,
              speculative_config={"num_speculative_tokens": n}, proposer_factory=OracleProposer(conts, 5))
    max_tokens = 1 + 4 * (n + 1)  # the first token, then 4 verification steps of n + 1 tokens
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r[:max_tokens] for r in reference]
    for o in outs:
        assert o.stats["spec_tau"] == n + 1 and o.stats["spec_num_steps"] == 4
        assert o.stats["spec_conditional_acceptance"] == [1.0] * n


def drafts_seen(engine: LLMEngine, prompt: list[int]) -> list[list[int]]:
    """Run one request alone; return the drafts it carried after each step."""
    rid = engine.add_request(prompt, GREEDY)
    seen = []
    while engine.has_unfinished():
        engine.step()
        req = engine.requests.get(rid)
        if req is not None and req.spec_token_ids:
            seen.append(list(req.spec_token_ids))
    engine.step()
    return seen


def test_drafter_context_survives_prefix_hits_chunking_and_preemption(target, drafter, prompts):
    """The drafts (not only the output) must not depend on how the context got into the cache. (Every step
    drafts: confidence scheduling off, whose pauses follow measured step times.)"""
    p = prompts[1]
    want = drafts_seen(spec_llm(target, drafter, spec=EVERY_STEP, enable_prefix_caching=False).engine, p)
    assert len(want) >= 10
    hit = spec_llm(target, drafter, spec=EVERY_STEP).engine
    drafts_seen(hit, p[:-3] + [7, 7, 7])  # shares all but the last block: its blocks are cached
    assert drafts_seen(hit, p) == want
    assert drafts_seen(spec_llm(target, drafter, spec=EVERY_STEP, max_num_batched_tokens=5).engine, p) == want


def test_sampling_speculation_runs_and_is_seed_reproducible(target, drafter, prompts):
    params = [SamplingParams(temperature=0.8, top_k=50, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(len(prompts))]
    for method in ("standard", "block"):
        for draft in ("greedy", "probabilistic"):
            llm = spec_llm(target, drafter, spec={"rejection_sample_method": method, "draft_sample_method": draft})
            a = [o.token_ids for o in llm.generate(prompts, params)]
            b = [llm.generate([p], sp)[0].token_ids for p, sp in zip(prompts[:3], params[:3])]
            assert a[:3] == b  # independent of batch composition
            assert llm.engine.spec_stats.num_steps > 0


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Wilson–Hilferty approximation of the chi-square quantile (z = 3.09: alpha = 1e-3)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def pooled_chi2(pairs: list[tuple[int, int]], expected: dict[int, torch.Tensor]) -> tuple[float, int]:
    """Σ over first tokens t1 of the chi-square of the second token against p(· | prompt, t1);
    cells with expected count < 5 are merged."""
    stat, df = 0.0, 0
    by_first = Counter(t1 for t1, _ in pairs)
    second = Counter(pairs)
    for t1, n in by_first.items():
        e = expected[t1] * n
        big = (e >= 5).nonzero().flatten().tolist()
        obs = [second[(t1, v)] for v in big]
        exp = [float(e[v]) for v in big]
        rest_o = n - sum(obs)
        rest_e = n - sum(exp)
        if rest_e >= 1e-9:
            obs.append(rest_o)
            exp.append(rest_e)
        if len(obs) < 2:
            continue
        stat += sum((o - x) ** 2 / x for o, x in zip(obs, exp))
        df += len(obs) - 1
    return stat, df


SAMPLING_PROMPT = [5, 9, 2, 11]


def sampling_llm(tmp_path, method: str) -> LLM:
    """A 16-token-vocabulary target whose next-token distributions are far from flat, a random drafter
    (block 3) drafting probabilistically, verification by ``method``: for the chi-square tests."""
    t = write_tiny_checkpoint(tmp_path / "t", "llama", num_hidden_layers=4, vocab_size=16, seed=5,
                              initializer_range=0.5)
    d = random_drafter(tmp_path / "d", t, target_layer_ids=[1, 2], block_size=3, seed=6)
    return LLM(str(t), device="cpu", block_size=4, num_kv_blocks=2048, max_num_seqs=256,
               speculative_config={"model": str(d), "draft_sample_method": "probabilistic",
                                   "rejection_sample_method": method})


def assert_second_token_follows_target(llm: LLM, outs, filters: dict) -> None:
    """Outputs of SAMPLING_PROMPT at temperature 1 (with ``filters``): the second emitted token follows the
    target's p(· | prompt, first token) by a pooled chi-square test; and the same samples against a slightly
    wrong target (temperature 1.3; with filters: without them) are rejected, so the test can fail."""
    from dspark.sample.sampler import SamplingBatch, compute_probs

    prompt = SAMPLING_PROMPT
    pairs = [(o.token_ids[0], o.token_ids[1]) for o in outs]
    sp = SamplingParams(temperature=1.0, **filters)
    batch = SamplingBatch.build([sp], [0], [0], [prompt], [[]], 16, "cpu")
    expected = {t1: compute_probs(forward_logits(llm.engine, prompt + [t1])[-1:], batch)[0]
                for t1 in {a for a, _ in pairs}}
    stat, df = pooled_chi2(pairs, expected)
    assert stat < chi2_critical(df), (stat, df)
    scale = 1.0 if filters else 1.3
    wrong = {t1: torch.softmax(forward_logits(llm.engine, prompt + [t1])[-1] / scale, -1) for t1 in expected}
    bad, bad_df = pooled_chi2(pairs, wrong)
    assert bad > chi2_critical(bad_df), (bad, bad_df)


@pytest.mark.parametrize("method,filters", [("standard", {}), ("block", {}), ("block", {"top_k": 5, "top_p": 0.95})])
def test_speculative_sampling_matches_target_distribution(method, filters, tmp_path):
    """Temperature-1 sampling with probabilistic drafts: the second emitted token (the first one that
    goes through verification) follows the target's p(· | prompt, first token). With top-k / top-p the
    drafter draws from its unfiltered distribution (sampler.draft_params) and the output still follows
    the target's filtered one. (Seeded requests: every one verifies whole blocks.)"""
    llm = sampling_llm(tmp_path, method)
    n = 6000
    outs = llm.generate([SAMPLING_PROMPT] * n, [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True,
                                                               **filters) for s in range(n)])
    assert llm.engine.spec_stats.num_drafts > llm.engine.spec_stats.num_accepted > 0
    assert_second_token_follows_target(llm, outs, filters)


def test_markov_head_conditions_on_previous_draft_and_returns_corrected_probs(target, drafter):
    from dataclasses import replace

    from dspark.sample.sampler import SamplingBatch

    llm = spec_llm(target, drafter)
    prop = llm.engine.runner.proposer
    d = prop.drafter
    V = d.config.vocab_size
    anchors = torch.tensor([17, 250])
    anchor_pos = torch.tensor([0, 0])  # no context: the block alone
    tables = torch.zeros(2, 1, dtype=torch.long)
    params = [SamplingParams(temperature=0.7, top_k=20, seed=1), SamplingParams(temperature=0)]
    batch = SamplingBatch.build(params, [1, 2], [1, 1], [[1], [1]], [[], []], V, "cpu")
    out = prop.propose([None, None], anchors, anchor_pos, tables, 4, batch, [True, False])
    with torch.inference_mode():
        empty = [(torch.zeros(2, 0, *prop.kv.shape[-2:]),) * 2 for _ in d.layers]
        h = d.block_hidden(anchors, anchor_pos, empty, torch.zeros(2, 0, dtype=torch.bool), 5)
        U = d.base_logits(h)
        W1, W2 = d.markov_w1.weight, d.markov_w2.weight_t  # [V, r], [r, V]
        prev = anchors
        for k in range(4):
            logits = U[:, k] + (W1[prev] @ W2).float()
            # Greedy row: the draft is the argmax of the corrected logits given the previous draft.
            assert out.tokens[1, k] == logits[1].argmax()
            # Sampled row: q = softmax of the corrected logits / T restricted to the top-20.
            z = logits[0] / 0.7
            keep = z >= z.topk(20).values[-1]
            q = torch.softmax(torch.where(keep, z, -torch.inf), -1)
            torch.testing.assert_close(out.probs[0, k], q, rtol=1e-5, atol=1e-6)
            assert keep[out.tokens[0, k]]
            prev = out.tokens[:, k]
    assert out.confidence.shape == (2, 4) and ((out.confidence > 0) & (out.confidence < 1)).all()
    del replace


def test_stops_inside_an_accepted_run_truncate_it(target, prompts, reference):
    conts = {tuple(p): r for p, r in zip(prompts, reference)}
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=512,
              speculative_config={"num_speculative_tokens": 5}, proposer_factory=OracleProposer(conts, 5))
    ref = reference[0]
    stop_tok = ref[4]  # inside the first accepted run (tokens 1..6)
    cut = ref.index(stop_tok) + 1
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=25, stop_token_ids=[stop_tok]))[0]
    assert out.token_ids == ref[:cut] and out.finish_reason == "stop"
    out = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    assert out.token_ids == ref[:4] and out.finish_reason == "length"
    assert llm.engine.kv.check_integrity()["in_use"] == 0
