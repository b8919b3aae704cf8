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
from dspark.layers.linear import Linear, use_cpu_split_k  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.spec.drafters import random_drafter  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bi")
    target = write_tiny_checkpoint(root / "t", "llama", seed=3)
    return target, random_drafter(root / "d", target, target_layer_ids=[0], block_size=4)


def _run(target, drafter, invariant: bool, threads_at_start: int | None = None):
    """Greedy plain and DSpark runs of two prompts with log-probs. ``threads_at_start``: torch's thread
    count while the engines are built, which is when the CPU runner picks its one-row products (split-K
    over that many slices, up to 8; layers/linear.py); the runs themselves stay on the worker's threads."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (4, 11)]
    # the first request ends early, so the second decodes alone for a while: one-row steps, which CPU
    # matmuls sum differently from several rows at any thread count
    p = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (5, 12)]
    out = {}
    for name, kw in (("plain", {}), ("dspark", {"speculative_config": {"model": str(drafter)}})):
        threads = torch.get_num_threads()
        torch.set_num_threads(threads_at_start or threads)
        try:
            llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton",
                      batch_invariant=invariant, **kw)
        finally:
            torch.set_num_threads(threads)
        if threads_at_start:
            splits = {m.split_k for m in llm.engine.runner.model.modules() if isinstance(m, Linear)}
            assert splits == {min(threads_at_start, 8)}, splits
        res = llm.generate(prompts, p)
        out[name] = ([o.token_ids for o in res], [[lp["logprob"] for lp in o.logprobs] for o in res])
    return out


def test_logprobs_equal_bit_for_bit_with_and_without_speculation(models):
    out = _run(*models, invariant=True)
    assert out["dspark"][0] == out["plain"][0]
    assert out["dspark"][1] == out["plain"][1]  # exact float equality, every emitted token


def _split_k_differs_from_onednn(chunks: int) -> bool:
    """Whether the engine's CPU Linear at ``chunks`` split-K slices (one-row products: a decode step of
    one request) gives a row other bits than oneDNN's inner product over the same row among 5 (its
    verification block), for the tiny model's shapes (in 64 / out 64, 128, 512; in 128 / out 64)."""
    g = torch.Generator().manual_seed(0)
    for k, n in ((64, 128), (64, 64), (64, 512), (128, 64)):
        lin = Linear(k, n)
        lin.load(torch.randn(n, k, generator=g))
        use_cpu_split_k(lin, chunks=chunks, max_rows=1)
        x = torch.randn(5, k, generator=g)
        if not torch.equal(lin(x[:1]), lin(x)[:1]):
            return True
    return False


def test_without_it_rows_differ_in_the_last_bits(models):
    """The control: without batch-invariant mode the CPU engine sums a decode row and a verification row
    differently, so the same test sees different log-probs. The engines are built at 2 threads, as `make
    run` on a 2-core machine is: one-row products split-K over 2 slices, 5-row verification blocks through
    oneDNN (layers/linear.py). (At one thread every product is one MKL GEMM, which on some CPUs gives a row
    the same bits at 1 and at 5 rows: CI failed on such a machine, 2026-12-05, with the probe below then
    looking at MKL.) A CPU where the two kernels agree bit for bit would have nothing to show."""
    if not _split_k_differs_from_onednn(chunks=2):
        pytest.skip("this CPU's split-K and oneDNN products give the same bits")
    out = _run(*models, invariant=False, threads_at_start=2)
    assert out["dspark"][0] == out["plain"][0]  # fp32: the tokens still agree
    assert out["dspark"][1] != out["plain"][1]


def test_needs_the_triton_backend():
    with pytest.raises(ValueError, match="batch_invariant needs the triton attention backend"):
        EngineConfig(batch_invariant=True)  # auto = torch on a CPU
    assert EngineConfig(batch_invariant=True, attention_backend="triton").batch_invariant
    with pytest.raises(ValueError, match="invariant_attention needs the triton attention backend"):
        EngineConfig(invariant_attention=True)
    assert EngineConfig(invariant_attention=True, attention_backend="triton").invariant_attention


def test_invariant_attention_environment_switch(monkeypatch):
    """DSPARK_INVARIANT_ATTENTION=1 (the benchmark commands' switch) turns invariant_attention on for CUDA engines
    on the triton backend, and nowhere else (a CPU engine keeps the plain launch)."""
    monkeypatch.setenv("DSPARK_INVARIANT_ATTENTION", "1")
    assert EngineConfig(device="cuda", attention_backend="triton").invariant_attention
    assert not EngineConfig(device="cuda", attention_backend="torch").invariant_attention
    assert not EngineConfig(device="cpu", attention_backend="triton").invariant_attention
    monkeypatch.setenv("DSPARK_INVARIANT_ATTENTION", "0")
    assert not EngineConfig(device="cuda", attention_backend="triton").invariant_attention


def test_invariant_attention_alone(models):
    """EngineConfig.invariant_attention: the attention's fixed key slices and tensor-core row sums
    (TritonAttentionBackend._fixed), the products left as by default; greedy DSpark still gives plain's tokens."""
    target, drafter = models
    llm = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton",
              invariant_attention=True, speculative_config={"model": str(drafter)})
    runner = llm.engine.runner
    assert runner.backend._fixed == {"split_keys": 64, "block_n": 64, "rowsum_mma": True, "block_m": 64}
    assert not any(m.batch_invariant for m in runner.model.modules() if isinstance(m, Linear))
    assert runner.model.fewrow_max_rows == 16  # steps of 17-64 rows multiply on cuBLAS, as their verification does
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate([[5, 9, 200, 31]], p)[0].token_ids
    plain = LLM(str(target), device="cpu", block_size=4, num_kv_blocks=64, attention_backend="triton")
    assert plain.engine.runner.backend._fixed == {} and plain.engine.runner.model.fewrow_max_rows is None
    assert got == plain.generate([[5, 9, 200, 31]], p)[0].token_ids
