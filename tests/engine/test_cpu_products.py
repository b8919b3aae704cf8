"""The CPU runner's products (layers/linear.py). fp32: the choice for products of two rows (split-K or oneDNN),
measured at start-up by ModelRunner._choose_split_k_rows, or fixed by DSPARK_CPU_SPLIT_K_ROWS. bf16/fp16: the
weights re-laid output-major, nothing split."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.layers.linear import Linear
from tests.spec.drafters import random_drafter


def _limits(runner) -> set[int]:
    return {m.split_k_max_rows for mod in runner._split_k_modules for m in mod.modules() if isinstance(m, Linear)}


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), device="cpu", block_size=4, num_kv_blocks=64, max_model_len=64)


def test_start_up_sets_one_limit_on_every_layer(llm):
    assert _limits(llm.engine.runner) in ({1}, {2})


def test_the_faster_path_wins_by_its_margin(llm, monkeypatch):
    """Timings by path (read from the layers the profile would run): split-K is kept for two rows only when
    it is more than 5 % faster, so that a tie keeps oneDNN and the choice does not follow noise."""
    runner = llm.engine.runner
    monkeypatch.delenv("DSPARK_CPU_SPLIT_K_ROWS", raising=False)
    seen = []

    def profile(ms):
        def run(rows, warm=None):
            assert rows == 2 and warm  # each path's kernels warmed before its timing
            limit = _limits(runner)
            assert len(limit) == 1  # every layer (target and drafter) switched together
            seen.append(limit.pop())
            return ms[seen[-1]] / 1e3
        return run

    for ms, want in (({1: 60.0, 2: 50.0}, 2), ({1: 50.0, 2: 60.0}, 1), ({1: 50.0, 2: 48.0}, 1)):
        seen.clear()
        monkeypatch.setattr(runner, "_profile_rows", profile(ms))
        runner._choose_split_k_rows()
        assert _limits(runner) == {want} and runner.cpu_split_k_rows == want, ms
        assert sorted(seen) == [1, 1, 1, 2, 2, 2]  # three alternating rounds


def test_environment_fixes_the_limit_and_outputs_do_not_depend_on_it(llm, monkeypatch):
    runner = llm.engine.runner
    prompt = [5, 9, 13, 17, 21]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for limit in ("1", "2", "3"):
        monkeypatch.setenv("DSPARK_CPU_SPLIT_K_ROWS", limit)
        runner._choose_split_k_rows()
        assert _limits(runner) == {int(limit)}
        outs[limit] = [o.token_ids for o in llm.generate([prompt, prompt[::-1]], params)]
    assert outs["1"] == outs["2"] == outs["3"]
    for bad in ("two", "0", "-1"):
        monkeypatch.setenv("DSPARK_CPU_SPLIT_K_ROWS", bad)
        with pytest.raises(ValueError, match="DSPARK_CPU_SPLIT_K_ROWS must be a row count >= 1"):
            runner._choose_split_k_rows()


def test_half_precision_weights_are_read_output_major(tiny_checkpoints, tmp_path):
    """bf16 on the CPU: the runner re-lays the target's and the drafter's bf16 weights ``[out, in]`` (torch's
    CPU product reads them ~10x faster, layers/linear.py) and splits nothing; the fp32 lm_head keeps its
    layout. The same engine with the weights put back input-major gives the same tokens and log-probs up to
    bf16 rounding, speculating with the drafter (so its products are covered too)."""
    target = tiny_checkpoints["llama"]
    drafter = random_drafter(tmp_path / "d", target, target_layer_ids=[0], block_size=4)
    llm = LLM(str(target), device="cpu", dtype="bfloat16", block_size=4, num_kv_blocks=64, max_model_len=64,
              enable_prefix_caching=False, speculative_config={"model": str(drafter)})
    runner = llm.engine.runner
    lins = [m for mod in (runner.model, runner.proposer.drafter) for m in mod.modules() if isinstance(m, Linear)]
    half = [m for m in lins if m.weight_t.dtype == torch.bfloat16]
    assert len(half) >= 10 and any(m in half for m in runner.proposer.drafter.modules())
    assert all(m.weight_t.t().is_contiguous() and m.weight_t.stride(0) == 1 and m.split_k == 1 for m in half)
    head = runner.model.lm_head.weight_t
    assert head.dtype == torch.float32 and head.is_contiguous()
    assert runner._split_k_modules == [] and runner.cpu_split_k_rows is None

    prompts = [[5, 9, 13, 17, 21], [21, 17, 13]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)

    def run():
        res = llm.generate(prompts, params)
        return [o.token_ids for o in res], torch.tensor([[lp["logprob"] for lp in o.logprobs] for o in res])

    got = run()
    for m in half:
        m.weight_t.data = m.weight_t.data.contiguous()
    want = run()
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=0.05, rtol=0)
