"""LlamaForCausalLM's fused forward (``fused = True``: the Triton kernels of dspark/kernels/fused_ops.py,
K/V written by the RoPE kernel, TritonAttentionBackend.attend) against its unfused forward through the
same backend: one ragged step (prefill, decode and verification rows, a chunk after context,
padding) on tiny random Llama and Qwen3 (q/k norm) models with tapped layers; then whole engines,
whose Triton backend runs the fused forward, against the PyTorch backend. Off the GPU the kernels
run in Triton's interpreter, so models and token counts are tiny."""

from __future__ import annotations

import os

import pytest
import torch

# Interpreter mode must be on before triton is first imported (see tests/kernels/conftest.py).
os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from dspark import LLM, SamplingParams  # noqa: E402
from dspark.kernels.paged_attention import paged_attention_ref  # noqa: E402
from dspark.layers.attention import TorchAttentionBackend  # noqa: E402
from dspark.layers.triton_attention import TritonAttentionBackend  # noqa: E402
from dspark.models.llama import LlamaForCausalLM  # noqa: E402
from dspark.models.loader import load_model  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.layers.test_triton_attention import ragged_layout  # noqa: E402
from tests.spec.drafters import random_drafter  # noqa: E402

ARCHS = {  # arch -> (checkpoint overrides, tap layers (unordered, the last included), drafter's target layers)
    "llama": (dict(num_hidden_layers=3), (2, 0), [0, 1]),
    "qwen3": (dict(num_hidden_layers=2), (0, 1), [0]),  # q/k norm, head_dim 32
}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    overrides, taps, _ = ARCHS[request.param]
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("fused") / request.param, request.param, seed=11, **overrides)
    return request.param, path, taps


def build_model(path, taps, dtype=torch.float32) -> LlamaForCausalLM:
    loaded = load_model(str(path), dtype, "cpu")
    model = LlamaForCausalLM(loaded.config, 128, taps).to(dtype)
    model.load_hf_state_dict(loaded.state_dict)
    return model.eval()


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    """Elementwise within ``tol`` relative to the tensor's largest magnitude (the taps reach ~30 here:
    fp32 differences are rounding of the RMSNorm sums carried through the GEMMs, a few ulps of that)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=tol * want.float().abs().max().item())


class NoWriteBackend(TritonAttentionBackend):
    """The fused forward must write K/V only in its RoPE kernel: the write-and-attend path is off."""

    def forward(self, *args, **kwargs):
        raise AssertionError("the fused forward called TritonAttentionBackend.forward (a second K/V write)")


@torch.inference_mode()
def run_step(model, backend, fused: bool, dtype=torch.float32):
    """One ragged step: a prefill, two decodes, a verification block (1 + 5 rows), a chunk after
    context, and a padding request; the context rows already hold random K/V."""
    cfg = model.config
    layout, num_blocks = ragged_layout([7, 12, 9, 30, 20], [7, 1, 1, 6, 5], page=4, pad_requests=1, seed=2)
    T = layout.query_start_loc[-1]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    kv = torch.randn(cfg.num_hidden_layers, 2, num_blocks, 4, cfg.num_key_value_heads, cfg.head_dim,
                     generator=g).to(dtype)
    model.fused = fused
    hidden, taps = model(ids, layout.positions, backend, backend.prepare(layout), kv)
    return hidden, taps, kv


def test_fused_forward_matches_unfused(checkpoint):
    arch, path, taps = checkpoint
    model = build_model(path, taps)
    assert (model.config.qk_norm, model.layers[0].self_attn.q_norm is not None) == (arch == "qwen3",) * 2
    want_h, want_taps, want_kv = run_step(model, TritonAttentionBackend("cpu"), fused=False)
    got_h, got_taps, got_kv = run_step(model, NoWriteBackend("cpu"), fused=True)
    H = model.config.hidden_size
    assert got_h.shape == want_h.shape and got_taps.shape == want_taps.shape == (got_h.shape[0], len(taps) * H)
    assert_close(got_h, want_h, 1e-5)
    assert_close(got_taps, want_taps, 1e-5)
    assert_close(got_kv, want_kv, 1e-5)  # the same slots written, nothing else touched


class RefAttentionBackend(TritonAttentionBackend):
    """TritonAttentionBackend with attention by the PyTorch reference (paged_attention_ref, fp32 math):
    Triton's interpreter (3.6) multiplies bfloat16 tiles in tl.dot wrongly, so the bf16 test below
    checks everything but the attention kernel, which both forwards share."""

    def attend(self, q, k_cache, v_cache, meta, scale):
        return paged_attention_ref(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   scale)


def test_fused_forward_bf16_matches_unfused(checkpoint):
    """bf16: the kernels reproduce every eager rounding (residual adds, norm casts, RoPE products,
    silu), so the two forwards agree but for the last bit of an RMSNorm mean or rsqrt, which can flip
    a bf16 rounding now and then."""
    _, path, taps = checkpoint
    model = build_model(path, taps, torch.bfloat16)
    want_h, want_taps, want_kv = run_step(model, RefAttentionBackend("cpu"), False, torch.bfloat16)
    got_h, got_taps, got_kv = run_step(model, RefAttentionBackend("cpu"), True, torch.bfloat16)
    assert got_h.dtype == got_taps.dtype == got_kv.dtype == torch.bfloat16
    for got, want in ((got_h, want_h), (got_taps, want_taps), (got_kv, want_kv)):
        assert_close(got, want, 2**-8)  # bitwise equal in the interpreter today


def test_fused_forward_without_taps_and_needs_triton_backend(checkpoint):
    _, path, _ = checkpoint
    model = build_model(path, ())
    _, taps, _ = run_step(model, TritonAttentionBackend("cpu"), fused=True)
    assert taps is None
    with pytest.raises(TypeError, match="fused needs the Triton attention backend"):
        run_step(model, TorchAttentionBackend(), fused=True)


# ------------------------------------------------------------------------------- whole engine
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine_case(checkpoint, tmp_path_factory, name: str) -> tuple[list[list[int]], dict]:
    """Two prompts and the engine kwargs of the whole-engine tests: a random drafter tapping the
    target (verification rows, rollbacks) and a small token budget (chunked prefill)."""
    arch, path, _ = checkpoint
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (9, 3)]
    d = random_drafter(tmp_path_factory.mktemp("fused") / f"{name}-{arch}", path, target_layer_ids=ARCHS[arch][2],
                       block_size=4)
    return prompts, dict(device="cpu", block_size=4, num_kv_blocks=48, max_num_batched_tokens=8,
                         speculative_config={"model": str(d), "confidence_scheduling": False})


def test_engine_fused_matches_torch_backend(checkpoint, tmp_path_factory):
    """Greedy tokens of the fused Triton engine equal the PyTorch backend's, with chunked prefill and
    DSpark speculation (a random drafter tapping the target: verification rows and rollbacks)."""
    path = checkpoint[1]
    prompts, kw = engine_case(checkpoint, tmp_path_factory, "d")
    ref = LLM(str(path), attention_backend="torch", **kw)
    want = [o.token_ids for o in ref.generate(prompts, GREEDY)]
    llm = LLM(str(path), attention_backend="triton", **kw)
    assert llm.engine.runner.model.fused and not ref.engine.runner.model.fused
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    st, ref_st = llm.engine.spec_stats, ref.engine.spec_stats
    assert st.num_drafts > 0 and (st.num_drafts, st.num_accepted) == (ref_st.num_drafts, ref_st.num_accepted)


def test_rope_in_the_attention_launch_matches(checkpoint):
    """``rope_in_attention`` (RoPE, q/k norm and the K/V write inside the attention launch, one launch
    fewer per layer): the same hidden states, taps and caches as the separate rope_qk_cache launch."""
    _, path, taps = checkpoint
    model = build_model(path, taps)
    model.rope_in_attention = False
    want = run_step(model, NoWriteBackend("cpu"), fused=True)
    calls = []

    class Counting(NoWriteBackend):
        def attend(self, *a, **k):
            raise AssertionError("rope_in_attention must attend through attend_rope")

        def attend_rope(self, *a, **k):
            calls.append(1)
            return super().attend_rope(*a, **k)

    model.rope_in_attention = True
    got = run_step(model, Counting("cpu"), fused=True)
    assert len(calls) == model.config.num_hidden_layers
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_engine_rope_in_attention_matches(checkpoint, tmp_path_factory):
    """Whole engine with DSpark (verification rows, rollbacks, chunked prefill): the same greedy tokens
    and acceptance with RoPE inside the attention launch as without."""
    path = checkpoint[1]
    prompts, kw = engine_case(checkpoint, tmp_path_factory, "dr")
    runs = []
    for on in (False, True):
        llm = LLM(str(path), attention_backend="triton", **kw)
        llm.engine.runner.model.rope_in_attention = on
        runs.append(([o.token_ids for o in llm.generate(prompts, GREEDY)],
                     (llm.engine.spec_stats.num_drafts, llm.engine.spec_stats.num_accepted)))
    assert runs[0] == runs[1] and runs[0][1][0] > 0
