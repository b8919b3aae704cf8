"""The CPU runner's choice for products of two rows (split-K or oneDNN, layers/linear.py): measured at
start-up by ModelRunner._choose_split_k_rows, or fixed by DSPARK_CPU_SPLIT_K_ROWS."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from dspark.layers.linear import Linear


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
