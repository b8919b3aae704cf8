"""Shared fixtures: tiny random HF checkpoints (written with save_pretrained) and the real SmolLM2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dspark.engine.request import Request
from dspark.layers.attention import BatchLayout
from dspark.sampling_params import SamplingParams

# DSPARK_RECORD_LAUNCHES=PATH: count each distinct Triton launch of the tests run (in the interpreter) and write them
# to PATH, for ``python benchmarks/offline_compile.py --launches PATH`` to compile each for sm_90 (one process:
# -p no:xdist).
_LAUNCHES: dict | None = None


def pytest_sessionstart(session):
    global _LAUNCHES
    if os.environ.get("DSPARK_RECORD_LAUNCHES"):
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
        from offline_compile import record_launches

        _LAUNCHES = record_launches()


def pytest_sessionfinish(session):
    if _LAUNCHES is not None:
        from offline_compile import write_launches

        write_launches(_LAUNCHES, os.environ["DSPARK_RECORD_LAUNCHES"])


TINY_ARCHS = ("llama", "qwen2", "qwen3")

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs pytest-xdist workers: the cores are shared out among them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))


def _single_thread():
    """torch on one intra-op thread, restored afterwards. Tiny tensors gain nothing from threads, and
    on a shared 2-core machine threads contending with other jobs stalled steps ~70x (OpenMP barriers)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


one_thread = pytest.fixture(_single_thread, name="one_thread")  # one test
one_thread_module = pytest.fixture(_single_thread, scope="module", name="one_thread_module")  # a whole module


def write_tiny_checkpoint(path: Path, arch: str, seed: int = 0, **overrides) -> Path:
    import transformers

    common = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, initializer_range=0.2,
        tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
    )
    common.update(overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=32, **common)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    if arch == "qwen2":  # biases init to zero: make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    p.bias.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {a: write_tiny_checkpoint(root / a, a) for a in TINY_ARCHS}


@pytest.fixture(scope="session")
def smollm_llm():
    """The embedded default model on the CPU in fp32, shared by the tests that only read from it."""
    from dspark import LLM

    return LLM(device="cpu", dtype="float32", max_model_len=2048, kv_cache_memory_gb=0.5)


@pytest.fixture(scope="session")
def hf_smollm():
    """HF transformers' own Llama loaded from the same GGUF: the reference implementation."""
    import transformers

    from dspark.models.gguf_loader import default_gguf_path

    p = default_gguf_path()
    m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return m.eval()


@torch.inference_mode()
def forward_logits(engine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] of one prefill pass of ``ids`` through the engine's model and paged KV cache."""
    runner, kv = engine.runner, engine.kv
    r = Request("__logits__", ids, SamplingParams(), 0, ())
    assert kv.allocate_slots(r, len(ids))
    try:
        bs = kv.block_size
        bt = torch.tensor([kv.block_ids(r.request_id)])
        pos = torch.arange(len(ids))
        layout = BatchLayout(pos, bt[0, pos // bs] * bs + pos % bs, [0, len(ids)], [len(ids)], bt, bs)
        meta = runner.backend.prepare(layout)
        h, _ = runner.model(torch.tensor(ids), pos, runner.backend, meta, runner.kv_caches)
        return runner.model.compute_logits(h)
    finally:
        kv.free(r)
