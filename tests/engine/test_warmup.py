"""LLMEngine.warm_up: throwaway requests at start-up (on by default on CUDA only; forced here on the CPU).
What must hold: it runs (prefills, a prefill joining decode steps, greedy and sampled requests, with and
without DSpark) and leaves no trace: no request, KV pool whole and free, prefix cache and its statistics
empty, statistics zero, and the next requests get the ids and seeds (hence the tokens) an engine without
the warm-up gives them."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from tests.conftest import write_tiny_checkpoint
from tests.spec.drafters import random_drafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("warm") / "t", "llama", seed=5)


@pytest.mark.parametrize("spec", [False, True])
def test_warm_up_leaves_no_trace(target, tmp_path, spec):
    kw = dict(device="cpu", block_size=4, num_kv_blocks=96, max_num_seqs=4, max_model_len=128)
    if spec:
        kw["speculative_config"] = {"model": str(random_drafter(tmp_path / "d", target, target_layer_ids=[0], block_size=3)),
                                     "confidence_scheduling": False}
    warm = LLM(str(target), warmup=True, **kw)
    cold = LLM(str(target), warmup=False, **kw)
    eng = warm.engine
    assert eng.warmup_s is not None and eng.warmup_s > 0 and cold.engine.warmup_s is None
    assert not eng.requests and eng._inflight is None and not eng.scheduler.running and not eng.scheduler.waiting
    counts = eng.kv.check_integrity()
    assert eng.kv.num_free_blocks == eng.kv.num_usable_blocks, counts
    assert not eng.kv.cached and eng.kv.prefix_queries == eng.kv.prefix_hits == 0
    assert eng.spec_stats.num_steps == 0 and not eng._req_spec
    if spec:
        assert not eng.runner.draft_probs

    prompts = [[5, 9, 33, 7, 21, 2, 8], [40, 41, 42] * 6]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)]  # seed drawn from the engine's stream
    got, want = warm.generate(prompts, params), cold.generate(prompts, params)
    assert [o.request_id for o in got] == [o.request_id for o in want] == ["req-0", "req-1"]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_warm_up_is_off_by_default_on_a_cpu(target):
    assert LLM(str(target), device="cpu", num_kv_blocks=32, block_size=4).engine.warmup_s is None


def test_warm_up_reaches_every_context_bucket(target):
    """A prompt just past each context bucket's lower edge (512, 1024, ... below max_model_len), so the
    eager launches of each bucket (layers/triton_attention.seq_len_hint) compile at start-up; none that
    the KV pool could not hold twice, and still no trace."""
    def prompt_lengths(num_kv_blocks):
        eng = LLM(str(target), device="cpu", block_size=16, num_kv_blocks=num_kv_blocks, max_num_seqs=4,
                  max_model_len=1024, warmup=False).engine
        seen, add = [], eng.add_request
        eng.add_request = lambda p, *a, **k: seen.append(len(p)) or add(p, *a, **k)
        eng.warm_up()
        assert not eng.requests and eng.kv.num_free_blocks == eng.kv.num_usable_blocks and not eng.kv.cached
        return seen

    assert prompt_lengths(160) == [5, 16, 513, 37]  # buckets [512, 1024]
    assert prompt_lengths(60) == [5, 16, 37]  # 513 + 8 tokens: more than half of a 960-slot pool
