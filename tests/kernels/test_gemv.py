"""Few-row GEMV kernels with fused prologues/epilogues (dspark/kernels/gemv.py) vs their PyTorch
references, and the fused decoder forward on them (``LlamaForCausalLM.small_m_gemv``) vs the GEMM path.

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py). The kernels keep every rounding
of the unfused path but sum the products in another order than the reference's matmul, so fp32 is
compared to ~1e-5 and bf16 to within an ulp on a small fraction of the elements; the residual sum
``s`` is compared exactly. Most cases use BLOCK_N 128 to keep the interpreter's program count small;
the default configuration (BLOCK_N 8) and longer K loops have their own cases.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels import interpreter_ready  # noqa: E402
from dspark.kernels.fused_ops import add_rms_norm, silu_and_mul  # noqa: E402
from dspark.kernels.gemv import (  # noqa: E402
    add_rms_norm_gate_up_silu,
    add_rms_norm_gate_up_silu_reference,
    add_rms_norm_linear,
    add_rms_norm_linear_reference,
    gemv_config,
    linear_small_m,
    linear_small_m_reference,
)

pytestmark = pytest.mark.skipif(not interpreter_ready(), reason="Triton interpreter not active in this process")

DTYPES = [torch.float32, torch.bfloat16]
FAST = dict(block_n=128, block_k=256)  # fewer programs and K steps for the interpreter (K = 576: 3 steps)


def _rows(M: int, K: int, dtype: torch.dtype, g: torch.Generator, strided: bool, scale: float = 1.0) -> torch.Tensor:
    """[M, K] activations; ``strided``: a column slice of a wider buffer (row stride K + 9)."""
    t = (torch.randn(M, K + 9 if strided else K, generator=g) * scale).to(dtype)
    return t[:, 3:K + 3] if strided else t


def _inputs(M: int, K: int, N: int, dtype: torch.dtype, with_res: bool, strided: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = _rows(M, K, dtype, g, strided)
    res = _rows(M, K, dtype, g, strided, 4.0) if with_res else None
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    w = (torch.randn(K, N, generator=g) * K**-0.5).to(dtype)
    bias = (torch.randn(N, generator=g) * 0.1).to(dtype)
    return x, res, nw, w, bias


def _assert_gemv_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor, ulps: int = 1) -> None:
    """fp32: within 1e-5 relative (summation order). bf16: at most ``ulps`` ulp of the reference apart
    (a sum landing on the other side of a rounding boundary), on at most 2 % of the elements, plus
    1e-5 of ``bound`` (= |a| @ |W|, the size of the sum's terms) for cancellation."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w = got.float(), want.float()
    slack = 1e-5 * bound.float()
    if got.dtype == torch.float32:
        assert bool(((g - w).abs() <= 1e-5 * w.abs() + slack + 1e-30).all()), (g - w).abs().max()
        return
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - 7)
    assert bool(((g - w).abs() <= ulps * ulp + slack).all()), (g - w).abs().max()
    assert (got != want).float().mean().item() <= 0.02


def _bound(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return a.float().abs() @ w.float().abs()


# ------------------------------------------------------------------------ K1: add + norm + linear
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_res", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("N", [960, 50])
@pytest.mark.parametrize("K", [576, 100])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_add_rms_norm_linear(M: int, K: int, N: int, with_res: bool, dtype: torch.dtype) -> None:
    strided = M == 3
    x, res, nw, w, bias = _inputs(M, K, N, dtype, with_res, strided, seed=M * 7 + K + N)
    b = bias if N == 50 else None  # Qwen2's qkv bias
    y, s = add_rms_norm_linear(x, res, nw, 1e-5, w, b, **FAST)
    y_ref, s_ref = add_rms_norm_linear_reference(x, res, nw, 1e-5, w, b)
    if res is None:
        assert s is x
    else:
        assert s.is_contiguous() and torch.equal(s, s_ref) and torch.equal(s_ref, res + x)
    h, _ = add_rms_norm(x, res, nw, 1e-5)  # the unfused kernel's normed rows
    _assert_gemv_close(y, y_ref, _bound(h, w))


# ------------------------------------------------------------- K2: add + norm + gate_up + SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_res", [False, True], ids=["nores", "res"])
@pytest.mark.parametrize("N", [960, 50])
@pytest.mark.parametrize("K", [576, 100])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_add_rms_norm_gate_up_silu(M: int, K: int, N: int, with_res: bool, dtype: torch.dtype) -> None:
    """N = 2I columns of the fused gate|up weight."""
    x, res, nw, w, _ = _inputs(M, K, N, dtype, with_res, M == 3, seed=M * 5 + K + N)
    act, s = add_rms_norm_gate_up_silu(x, res, nw, 1e-5, w, **FAST)
    act_ref, s_ref = add_rms_norm_gate_up_silu_reference(x, res, nw, 1e-5, w)
    assert act.shape == (M, N // 2)
    if res is None:
        assert s is x
    else:
        assert torch.equal(s, s_ref)
    h, _ = add_rms_norm(x, res, nw, 1e-5)
    gu = linear_small_m_reference(h, w).float()
    # a gate/up sum rounded the other way moves silu(g) * u by a few ulps (silu's slope)
    bound = (_bound(h, w[:, :N // 2]) * gu[:, N // 2:].abs() + gu[:, :N // 2].abs() * _bound(h, w[:, N // 2:]))
    _assert_gemv_close(act, act_ref, bound, ulps=4)
    # and the unfused kernels themselves
    _assert_gemv_close(act, silu_and_mul(h.float().matmul(w.float()).to(dtype)), bound, ulps=4)


# --------------------------------------------------------------------------- K3: plain few-row linear
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [960, 50])
@pytest.mark.parametrize("K", [576, 100])
@pytest.mark.parametrize("M", [1, 3, 8])
def test_linear_small_m(M: int, K: int, N: int, dtype: torch.dtype) -> None:
    x, _, _, w, bias = _inputs(M, K, N, dtype, False, M == 3, seed=M * 3 + K + N)
    b = bias if M == 3 else None
    y = linear_small_m(x, w, b, **FAST)
    _assert_gemv_close(y, linear_small_m_reference(x, w, b), _bound(x, w))


# ------------------------------------------------------------------------------- configurations
def test_default_config_bf16() -> None:
    """The configuration the model runs with (BLOCK_N 8: 120 programs for SmolLM2's qkv, one K step)."""
    cfg = gemv_config(1, 576, 960)
    assert (cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["NUM_STAGES"]) == (8, 1024, 1)
    assert gemv_config(8, 576, 1536, tiles=2)["BLOCK_N"] == 16
    x, res, nw, w, _ = _inputs(1, 576, 960, torch.bfloat16, True, False, seed=3)
    y, s = add_rms_norm_linear(x, res, nw, 1e-6, w)
    y_ref, s_ref = add_rms_norm_linear_reference(x, res, nw, 1e-6, w)
    assert torch.equal(s, s_ref)
    _assert_gemv_close(y, y_ref, _bound(add_rms_norm(x, res, nw, 1e-6)[0], w))


@pytest.mark.parametrize(("M", "K", "block_k"), [(3, 576, 64), (2, 100, 64), (8, 1100, None)])
def test_k_loop_steps(M: int, K: int, block_k: int | None) -> None:
    """Several (pipelined) K steps, a ragged last one, and (K = 1100 at 8 rows) a two-pass sum of squares."""
    cfg = gemv_config(M, K, 24, block_k=block_k)
    assert cfg["BLOCK_K"] < K and cfg["NUM_STAGES"] == 3
    assert block_k or cfg["NORM_BLOCK"] < K
    x, res, nw, w, _ = _inputs(M, K, 24, torch.float32, True, True, seed=K)
    y, s = add_rms_norm_linear(x, res, nw, 1e-5, w, block_k=block_k)
    y_ref, s_ref = add_rms_norm_linear_reference(x, res, nw, 1e-5, w)
    assert torch.equal(s, s_ref)
    _assert_gemv_close(y, y_ref, _bound(add_rms_norm(x, res, nw, 1e-5)[0], w))
    act, _ = add_rms_norm_gate_up_silu(x, res, nw, 1e-5, w, block_k=block_k)
    _assert_gemv_close(act, add_rms_norm_gate_up_silu_reference(x, res, nw, 1e-5, w)[0], _bound(x, w[:, :12]) * 10)
    _assert_gemv_close(linear_small_m(x, w, block_k=block_k), linear_small_m_reference(x, w), _bound(x, w))


@pytest.mark.parametrize(("M", "K", "block_k"), [(1, 576, None), (3, 576, 64), (2, 100, 64)])
def test_prefetched_first_step(M: int, K: int, block_k: int | None) -> None:
    """PREFETCH (the first K step's weight tiles loaded before pdl_wait, the GPU's default with PDL) gives the same
    bits as loading them in the K loop: the same products in the same order, one K step or several."""
    x, res, nw, w, _ = _inputs(M, K, 24, torch.float32, True, True, seed=K + M)
    for fn, args in ((add_rms_norm_linear, (x, res, nw, 1e-5, w)), (add_rms_norm_gate_up_silu, (x, res, nw, 1e-5, w)),
                     (linear_small_m, (x, w))):
        with_pre, without = (fn(*args, block_k=block_k, prefetch=p) for p in (True, False))
        for a, b in zip(*((t,) if isinstance(t, torch.Tensor) else t for t in (with_pre, without))):
            assert torch.equal(a, b), fn.__name__


def test_output_major_weight_view() -> None:
    """A transposed view of an output-major copy (layers/linear.py CUDA_OUTPUT_MAJOR) reads the same values."""
    x, res, nw, w, _ = _inputs(3, 100, 40, torch.bfloat16, True, False, seed=9)
    w_om = w.t().contiguous().t()
    assert w_om.stride() == (1, 100) and torch.equal(w_om, w)
    assert torch.equal(add_rms_norm_linear(x, res, nw, 1e-5, w_om)[0], add_rms_norm_linear(x, res, nw, 1e-5, w)[0])
    assert torch.equal(linear_small_m(x, w_om), linear_small_m(x, w))


def test_bad_inputs() -> None:
    x, res, nw, w, _ = _inputs(2, 64, 32, torch.float32, True, False, seed=0)
    with pytest.raises(ValueError, match="last dimension"):
        linear_small_m(x[:, :60], w)
    with pytest.raises(ValueError, match="dtype mismatch"):
        linear_small_m(x, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm_linear(x, res[:1], nw, 1e-5, w)
    with pytest.raises(ValueError, match="norm_weight"):
        add_rms_norm_linear(x, res, nw.to(torch.bfloat16), 1e-5, w)
    with pytest.raises(ValueError, match="even"):
        add_rms_norm_gate_up_silu(x, res, nw, 1e-5, w[:, :31])
    with pytest.raises(ValueError, match="bias"):
        linear_small_m(x, w, torch.zeros(31))
    with pytest.raises(ValueError, match="at most 16 rows"):
        linear_small_m(torch.zeros(17, 64), w)
    with pytest.raises(ValueError, match="power of two"):
        linear_small_m(x, w, block_n=12)
    with pytest.raises(ValueError, match="power of two"):
        gemv_config(6, 576, 960, block_k=48)
    empty = linear_small_m(x[:0], w)
    assert empty.shape == (0, 32)


# ----------------------------------------------------------------------- the model's fused forward
ARCHS = {"llama": (dict(num_hidden_layers=3), (2, 0)), "qwen2": ({}, (0, 1)), "qwen3": ({}, (1,))}


@pytest.fixture(scope="module", params=list(ARCHS))
def model_case(request, tmp_path_factory):
    from tests.conftest import write_tiny_checkpoint

    overrides, taps = ARCHS[request.param]
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("gemv") / request.param, request.param, seed=11, **overrides)
    return request.param, path, taps


@pytest.fixture
def wide_tiles(monkeypatch):
    """The model's GEMV launches with BLOCK_N 64 (the interpreter runs programs one after another; the
    default BLOCK_N 8 is covered above)."""
    from dspark.kernels import gemv

    cfg = gemv.gemv_config
    monkeypatch.setattr(gemv, "gemv_config", lambda *a, block_n=None, **k: cfg(*a, block_n=block_n or 64, **k))


@torch.inference_mode()
def _decode_step(model, backend, gemv: bool, dtype):
    """T = 8 rows (GEMV_MAX_ROWS): two decodes, a verification block of 1 + 4 rows, a padding request."""
    from tests.layers.test_triton_attention import ragged_layout

    cfg = model.config
    layout, num_blocks = ragged_layout([12, 9, 30], [1, 1, 5], page=4, pad_requests=1, seed=2)
    T = layout.query_start_loc[-1]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    kv = torch.randn(cfg.num_hidden_layers, 2, num_blocks, 4, cfg.num_key_value_heads, cfg.head_dim,
                     generator=g).to(dtype)
    model.fused, model.small_m_gemv, model.gemv_max_rows = True, gemv, 8
    hidden, taps = model(ids, layout.positions, backend, backend.prepare(layout), kv)
    return hidden, taps, kv


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_forward_gemv_matches_gemm_path(model_case, dtype, monkeypatch, wide_tiles) -> None:
    """Hidden states, taps (each layer's raw output, now formed inside the next layer's qkv GEMV) and
    K/V caches of the GEMV path equal the GEMM path's up to summation order."""
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import RefAttentionBackend, assert_close, build_model

    arch, path, taps = model_case
    if dtype == torch.bfloat16 and arch != "llama":
        pytest.skip("bf16 on one architecture is enough")
    model = build_model(path, taps, dtype)
    backend = RefAttentionBackend("cpu")  # the attention both paths share; fp32 math
    want = _decode_step(model, backend, False, dtype)
    calls = []
    orig = DecoderLayer.forward_gemv
    monkeypatch.setattr(DecoderLayer, "forward_gemv", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    got = _decode_step(model, backend, True, dtype)
    assert len(calls) == model.config.num_hidden_layers and got[0].shape[0] == model.gemv_max_rows
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    H = model.config.hidden_size
    assert got[1].shape == want[1].shape == (model.gemv_max_rows, len(taps) * H)
    for g, w in zip(got, want):
        assert_close(g, w, tol)
    if arch == "llama" and dtype == torch.float32:  # o_proj / down_proj left to the Linears
        model.small_m_gemv_plain = False
        for g, w in zip(_decode_step(model, backend, True, dtype), want):
            assert_close(g, w, tol)
    if arch == "llama":  # output-major copies for the GEMVs (LlamaForCausalLM.use_gemv_output_major)
        model.small_m_gemv_plain = True
        assert model.use_gemv_output_major(any_device=True)
        w_t = model.layers[0].mlp.gate_up_proj.gemv_weight_t
        assert w_t.stride(0) == 1 and torch.equal(w_t, model.layers[0].mlp.gate_up_proj.weight_t)
        for g, w in zip(_decode_step(model, backend, True, dtype), want):
            assert_close(g, w, tol)
        model.small_m_gemv = False
        assert not model.use_gemv_output_major(any_device=True)  # the GEMV path is off: no copies


def test_fused_forward_gemv_off_for_many_rows_and_batch_invariant(model_case, monkeypatch) -> None:
    from dspark.layers.linear import use_batch_invariant
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import RefAttentionBackend, build_model, run_step

    arch, path, taps = model_case
    if arch != "llama":
        pytest.skip("one architecture is enough")

    def fail(*a, **k):
        raise AssertionError("forward_gemv with more than GEMV_MAX_ROWS rows or batch-invariant Linears")

    monkeypatch.setattr(DecoderLayer, "forward_gemv", fail)
    model = build_model(path, taps)
    model.small_m_gemv, model.gemv_max_rows = True, 8
    assert run_step(model, RefAttentionBackend("cpu"), fused=True)[0].shape[0] > 8
    use_batch_invariant(model)
    _decode_step(model, RefAttentionBackend("cpu"), True, torch.float32)


def test_engine_greedy_tokens_gemv_on_off(model_case, tmp_path_factory, wide_tiles, monkeypatch) -> None:
    """Whole engine with DSpark (verification rows, rollbacks) and an 8-token budget (chunked prefill),
    so every step has at most 8 rows and runs on the GEMV kernels: the same greedy tokens and
    acceptance with the switch on as off."""
    from dspark import LLM
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import GREEDY, engine_case

    arch, path, taps = model_case
    if arch == "qwen2":
        pytest.skip("llama and qwen3 are enough")
    prompts, kw = engine_case((arch, path, taps), tmp_path_factory, "gemv")
    calls = []
    orig = DecoderLayer.forward_gemv
    monkeypatch.setattr(DecoderLayer, "forward_gemv", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    runs = []
    for on in (False, True):
        llm = LLM(str(path), attention_backend="triton", **kw)
        assert llm.engine.runner.model.fused
        llm.engine.runner.model.small_m_gemv, llm.engine.runner.model.gemv_max_rows = on, 8
        runs.append(([o.token_ids for o in llm.generate(prompts, GREEDY)],
                     (llm.engine.spec_stats.num_drafts, llm.engine.spec_stats.num_accepted)))
    assert runs[0] == runs[1] and runs[0][1][0] > 0 and calls
