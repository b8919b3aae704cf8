"""EngineConfig.batch_invariant: the target's per-row results do not depend on the step's shape, so a
token's log-probability is the same bit for bit whether it was decided by a decode row (plain
decoding) or by a verification row (DSpark). Tiny random Llama, Triton backend in the interpreter."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.config import EngineConfig  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.spec.drafters import random_drafter  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    target = write_tiny_checkpoint(root / "t", "llama", seed=3)
    return target, random_drafter(root / "d", target, target_layer_ids=[0], block_size=4)


def _run(target, drafter, invariant: bool):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (4, 11)]
    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    out = {}
    for name, kw in (("plain", {}), ("dspark", {"speculative_config": {"model": str(drafter)}})):
        llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton",
                  batch_invariant=invariant, **kw)
        res = llm.generate(prompts, p)
        out[name] = ([o.token_ids for o in res], [[lp["logprob"] for lp in o.logprobs] for o in res])
    return out


def test_logprobs_equal_bit_for_bit_with_and_without_speculation(models):
    out = _run(*models, invariant=True)
    assert out["dspark"][0] == out["plain"][0]
    assert out["dspark"][1] == out["plain"][1]  # exact float equality, every emitted token


def test_without_it_rows_differ_in_the_last_bits(models):
    """The control: the default kernels (split-K for one row, oneDNN for several on the CPU) sum a
    verification row differently from a decode row, so the same test sees different log-probs."""
    out = _run(*models, invariant=False)
    assert out["dspark"][0] == out["plain"][0]  # fp32: the tokens still agree
    assert out["dspark"][1] != out["plain"][1]


def test_needs_the_triton_backend():
    with pytest.raises(ValueError, match="batch_invariant needs the triton attention backend"):
        EngineConfig(batch_invariant=True)  # auto = torch on a CPU
    assert EngineConfig(batch_invariant=True, attention_backend="triton").batch_invariant
