"""Few-row tensor-core products with the norms and SwiGLU in their epilogues (dspark/kernels/fewrow.py)
vs their PyTorch references, split-K included, and the fused decoder forward on them
(``LlamaForCausalLM.fewrow``) vs the GEMM path, down to the engine's greedy tokens.

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py). The kernels apply RMSNorm after the
product (``(g * s) @ W / rms(s)``) where the reference norms first, so bf16 results differ from the
reference by the norm's roundings (an ulp of the normed input, summed over K); fp32 agrees to ~1e-5.
The residual sum ``s`` and the sums of squares are compared exactly / to fp32 precision.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels import fewrow as fr  # noqa: E402
from dspark.kernels import interpreter_ready  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ready(), reason="Triton interpreter not active in this process")

DTYPES = [torch.float32, torch.bfloat16]
EPS = 1e-5


def _data(M: int, K: int, N: int, dtype: torch.dtype, seed: int, output_major: bool = False):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(M, K, generator=g) * 3).to(dtype)  # the rows a norm is taken of
    nw = (torch.rand(K, generator=g) + 0.5).to(dtype)
    w = (torch.randn(K, N, generator=g) * K**-0.5).to(dtype)
    if output_major:
        w = w.t().contiguous().t()
    res = (torch.randn(M, N, generator=g) * 2).to(dtype)
    return s, nw, w, res


def _assert_close(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    """fp32: 1e-5 relative plus 1e-6 of the terms' size; bf16: 2 ulp plus 2^-8 of ``bound`` = |a| @ |W|
    (every normed input may sit an ulp from the reference's)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    g, w, b = got.float(), want.float(), bound.float()
    if got.dtype == torch.float32:
        tol = 1e-5 * w.abs() + 1e-6 * b + 1e-30
    else:
        tol = 2 * torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(2.0**-126))) - 7) + 2.0**-8 * b
    assert bool(((g - w).abs() <= tol).all()), ((g - w).abs() - tol).max()


def _normed_bound(s, nw, w):
    return (fr.add_rms_norm_reference(s, None, nw, EPS)[0].float().abs() @ w.float().abs())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("M,K,N", [(1, 576, 960), (8, 100, 50), (16, 64, 16), (5, 256, 70), (24, 96, 40),
                                   (64, 64, 48)])
def test_linear_with_norm(M: int, K: int, N: int, split: int, dtype: torch.dtype) -> None:
    s, nw, w, _ = _data(M, K, N, dtype, seed=M + K)
    z, ss = fr.norm_input(s, nw)
    got = fr.linear(z, w, ss, EPS, block_n=64, block_k=32, split=split)
    _assert_close(got, fr.linear_reference(s, nw, EPS, w), _normed_bound(s, nw, w))
    plain = fr.linear(s, w, block_n=32, block_k=64, split=split)  # no norm: the product alone
    _assert_close(plain, fr.linear_reference(s, None, EPS, w), s.float().abs() @ w.float().abs())
    if dtype == torch.float32:
        assert torch.allclose(plain, s @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("M,K,I", [(8, 576, 96), (3, 128, 40), (40, 64, 32)])
def test_gate_up_silu(M: int, K: int, I: int, split: int, dtype: torch.dtype) -> None:
    s, nw, w, _ = _data(M, K, 2 * I, dtype, seed=I, output_major=True)
    z, ss = fr.norm_input(s, nw)
    got = fr.gate_up_silu(z, w, ss, EPS, block_n=32, block_k=64, split=split)
    want = fr.gate_up_silu_reference(s, nw, EPS, w)
    b = _normed_bound(s, nw, w)
    # silu(g) * u: bound the error by the gate and up products' own bounds times their sizes
    gu = fr.linear_reference(s, nw, EPS, w).float()
    bound = b[:, :I] * gu[:, I:].abs() + b[:, I:] * gu[:, :I].abs().clamp_min(1) + 1
    _assert_close(got, want, bound)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 4])
@pytest.mark.parametrize("M,K,N,block_m", [(8, 1536 // 4, 576 // 4, None), (16, 96, 48, None), (2, 64, 33, None),
                                           (17, 64, 48, None), (64, 96, 32, None), (100, 64, 32, None),
                                           (40, 64, 40, 16), (200, 48, 32, None)])
def test_linear_residual(M: int, K: int, N: int, block_m, split: int, dtype: torch.dtype) -> None:
    """s = round(x @ W) + residual exactly as the reference rounds it (fp32 sums in another order: compared
    to the reference computed from the kernel's own rounded product); z = g * s; the sums of squares.
    100 and 200 rows: 2 and 4 row blocks of 64 (PROGRAM_ROWS); 40 rows in blocks of 16: 3 of them."""
    x, _, w, res = _data(M, K, N, dtype, seed=K + N)
    g = (torch.rand(N, generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype)
    cfg = dict(block_n=16, block_k=32, split=split, block_m=block_m)
    s, z, ss = fr.linear_residual(x, w, res, g, **cfg)
    prod = fr.linear(x, w, **cfg)
    _assert_close(prod, (x.float() @ w.float()).to(dtype), x.float().abs() @ w.float().abs())
    assert torch.equal(s, prod + res)  # the eager add in the dtype, on the same rounded product
    assert torch.equal(z, (s.float() * g.float()).to(dtype))
    assert ss.hidden == N and ss.partials.shape == (fr.triton.cdiv(N, 16), fr.row_tile(M))
    assert torch.allclose(ss.partials.sum(0)[:M], (s.float() ** 2).sum(-1), rtol=1e-5)
    covered = fr.triton.cdiv(M, fr.program_rows(M, block_m)) * fr.program_rows(M, block_m)
    assert not ss.partials[:, M:covered].any()  # rows past M contribute nothing (rows past the blocks: unwritten)
    s2, z2, _ = fr.linear_residual(x, w, res, None, **cfg)
    assert z2 is None and torch.equal(s2, s)
    if split > 1:  # the arrival counters are back to zero for the next launch
        assert not fr.workspace(x.device).cnt.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True], ids=["plain", "qknorm"])
@pytest.mark.parametrize("split,M", [(1, 7), (3, 7), (3, 37)])
def test_qkv_rope_cache_equals_linear_then_rope_qk_cache(dtype, qk_norm: bool, split: int, M: int) -> None:
    """The fused epilogue does rope_qk_cache's work on the product it just made: q and the cache
    contents equal the two-launch reference bit for bit (fp32 with q/k norm: to the norm's summation
    order); padding rows (negative slot) and rows past M leave the cache alone. 37 rows: in 3 row blocks of 16
    (block_m), split-K over them."""
    from dspark.layers.basic import RotaryEmbedding

    H, Hq, Hkv, D = 96, 3, 1, 32
    gen = torch.Generator().manual_seed(split + 2 * qk_norm)
    s = (torch.randn(M, H, generator=gen) * 2).to(dtype)
    nw = (torch.rand(H, generator=gen) + 0.5).to(dtype)
    w = (torch.randn(H, (Hq + 2 * Hkv) * D, generator=gen) / 10).to(dtype).t().contiguous().t()
    z, ss = fr.norm_input(s, nw)
    rope = RotaryEmbedding(D, 10000.0, 64)
    pos = torch.randint(0, 64, (M,), generator=gen)
    slots = torch.tensor([3, 5, -1, 7, 8, 0, 12] + list(range(16, 16 + M - 7)))
    block_m = 16 if M > 16 else None
    qn, kn = ((torch.rand(D, generator=gen) + 0.5).to(dtype) for _ in range(2)) if qk_norm else (None, None)
    caches = [torch.full((16, 4, Hkv, D), 7.0, dtype=dtype) for _ in range(4)]
    args = (pos, rope.cos, rope.sin_signed)
    q = fr.qkv_rope_cache(z, w, ss, EPS, *args, caches[0], caches[1], slots, Hq, Hkv, qn, kn, 1e-6, split=split,
                          block_k=32, block_m=block_m)
    want = fr.qkv_rope_cache_reference(z, w, ss, EPS, *args, caches[2], caches[3], slots, Hq, Hkv, qn, kn, 1e-6,
                                       split=split, block_k=32, block_m=block_m)
    assert q.shape == (M, Hq, D)
    if dtype == torch.float32 and qk_norm:
        assert torch.allclose(q, want, rtol=1e-5, atol=1e-6) and torch.allclose(caches[0], caches[2], atol=1e-5)
    else:
        assert torch.equal(q, want) and torch.equal(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    written = torch.zeros(64, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert bool((caches[0].view(64, -1)[~written] == 7.0).all())  # slot 2 (padding row's) etc. untouched
    assert bool((caches[1].view(64, -1)[written] != 7.0).all())
    with pytest.raises(ValueError, match="heads of one size"):
        fr.qkv_rope_cache(z, w[:, :-1], ss, EPS, *args, caches[0], caches[1], slots, Hq, Hkv)
    with pytest.raises(ValueError, match="one entry per row"):
        fr.qkv_rope_cache(z, w, ss, EPS, pos[:3], rope.cos, rope.sin_signed, caches[0], caches[1], slots, Hq, Hkv)


@pytest.mark.parametrize("M,block_m", [(6, None), (40, None), (120, None), (72, 16)])
def test_a_layer_chain_matches_the_unfused_layer(M: int, block_m) -> None:
    """o_proj -> gate_up -> down as a layer chains them: the sums of squares travel from each
    linear_residual to the next product (fp32); 40 rows: one program of 64 rows; 120: row blocks of 64; 72:
    producers and consumers in programs of different rows (16 and 64, 32 for gate|up), one SumSq layout."""
    from dspark.kernels.fused_ops import add_rms_norm_reference, silu_and_mul_reference

    H, I = 64, 96
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(M, H, generator=gen)
    attn = torch.randn(M, H, generator=gen)
    wo, wgu, wd = (torch.randn(k, n, generator=gen) * k**-0.5 for k, n in ((H, H), (H, 2 * I), (I, H)))
    g_post, g_next = torch.rand(H, generator=gen) + 0.5, torch.rand(H, generator=gen) + 0.5
    s1, z1, p1 = fr.linear_residual(attn, wo, h, g_post, block_n=16, block_k=32, block_m=block_m)
    act = fr.gate_up_silu(z1, wgu, p1, EPS, block_n=32, block_k=32, block_m=block_m and 32)
    out, z2, p2 = fr.linear_residual(act, wd, s1, g_next, block_n=16, block_k=32, split=3, block_m=block_m)
    nxt = fr.linear(z2, wo, p2, EPS, block_n=32, block_k=32)  # the next layer's normed product
    r1 = attn @ wo + h
    x2 = add_rms_norm_reference(r1, None, g_post, EPS)[0]
    r2 = silu_and_mul_reference(x2 @ wgu) @ wd + r1
    want_next = add_rms_norm_reference(r2, None, g_next, EPS)[0] @ wo
    for got, want in ((s1, r1), (out, r2), (nxt, want_next)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4), (got - want).abs().max()


def test_default_configs() -> None:
    """The H200 defaults for SmolLM2's four products (session 35's sweep) and their split-K slices."""
    assert fr.fewrow_config(576, 960) == dict(BLOCK_N=16, BLOCK_K=64, NUM_STAGES=6, num_warps=4, SPLIT=1,
                                              K_PER=576, TILES=1, BM=16)
    assert fr.fewrow_config(576, 1536, 2)["BLOCK_N"] == 32
    down = fr.fewrow_config(1536, 576)
    assert (down["BLOCK_N"], down["BLOCK_K"], down["SPLIT"], down["K_PER"]) == (32, 128, 6, 256)
    odd = fr.fewrow_config(1000, 64, split=7)  # 8 K steps of 128 in 7 slices: 4 slices of 2, none empty
    assert odd["SPLIT"] == 4 and odd["K_PER"] == 256
    # qkv + RoPE (session 36): half-head tiles in pairs, split-K 3 over 9 K steps of 64, 6 stages
    assert fr.qkv_rope_config(576, 960, 64) == dict(BLOCK_N=32, BLOCK_K=64, NUM_STAGES=6, num_warps=4, SPLIT=3,
                                                    K_PER=192, TILES=2, BM=16)
    assert fr.qkv_rope_config(576, 960, 64, split=1, block_n=16)["SPLIT"] == 1  # arguments win; BLOCK_N never
    assert fr.qkv_rope_config(2048, 3072, 128)["BLOCK_N"] == 64  # long K: fewrow_config's rule
    # programs of the step's row tile up to 64 rows (PROGRAM_ROWS), then row blocks of 64; 4 warps; programs of 128
    # rows (block_m=128) 8 warps (4 spill there)
    assert fr.PROGRAM_ROWS == 64
    assert [fr.fewrow_config(576, 960, rows=m)["BM"] for m in (1, 16, 17, 33, 64, 65, 128, 256)] == [
        16, 16, 32, 64, 64, 64, 64, 64]
    assert [fr.fewrow_config(576, 960, rows=m)["num_warps"] for m in (16, 64, 65, 128)] == [4, 4, 4, 4]
    assert fr.fewrow_config(576, 960, rows=100, block_m=128)["num_warps"] == 8
    assert fr.qkv_rope_config(576, 960, 64, rows=100, block_m=128)["num_warps"] == 8
    assert fr.fewrow_config(576, 960, rows=20, block_m=128)["BM"] == 32  # never more than the step's row tile
    # programs of 32-64 rows (WIDE_TUNING, session 52's sweep): BLOCK_N 16 and 6 stages; down split-K 3; qkv one slice
    assert fr.WIDE_TUNING
    down = fr.fewrow_config(1536, 576, rows=64)
    assert (down["BLOCK_N"], down["BLOCK_K"], down["SPLIT"], down["NUM_STAGES"]) == (16, 128, 3, 6)
    assert fr.fewrow_config(576, 1536, 2, rows=40)["BLOCK_N"] == 16
    assert fr.fewrow_config(576, 576, rows=64) == dict(fr.fewrow_config(576, 576), BM=64)  # o: as at 16 rows
    assert [fr.qkv_rope_config(576, 960, 64, rows=m)["SPLIT"] for m in (16, 17, 64, 200)] == [3, 1, 1, 1]
    assert fr.qkv_rope_config(576, 960, 64, rows=64, block_m=16)["SPLIT"] == 3  # programs of 16 rows
    # default configurations run (interpreter: one small case)
    s, nw, w, res = _data(3, 1536, 40, torch.float32, seed=1)
    out, _, _ = fr.linear_residual(s, w, res, None)
    assert torch.allclose(out, s @ w + res, rtol=1e-5, atol=1e-4)


def test_bad_inputs() -> None:
    s, nw, w, res = _data(4, 64, 32, torch.float32, seed=0)
    z, ss = fr.norm_input(s, nw)
    with pytest.raises(ValueError, match=r"expected \[rows, 64\]"):
        fr.linear(s[:, :60], w)
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16"):
        fr.linear(s, w, block_m=24)
    with pytest.raises(ValueError, match="made for row tiles of 16, the product's 20 rows take tiles of 32"):
        fr.linear(torch.zeros(20, 64), w, ss)  # sums of squares of 4 rows, a product of 20
    assert [fr.row_tile(m) for m in (1, 16, 17, 32, 33, 64, 65, 128)] == [16, 16, 32, 32, 64, 64, 128, 128]
    assert fr.ENGINE_MAX_ROWS == 128  # the engine's steps of up to 128 rows (DSPARK_FEWROW_MAX_ROWS)
    with pytest.raises(ValueError, match="dtype"):
        fr.linear(s, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="sums of squares are over 64 columns"):
        fr.linear(torch.zeros(4, 32), torch.zeros(32, 8), ss)
    with pytest.raises(ValueError, match="even"):
        fr.gate_up_silu(s, w[:, :31])
    with pytest.raises(ValueError, match="residual"):
        fr.linear_residual(s, w, res[:2], None)
    with pytest.raises(ValueError, match="norm_weight"):
        fr.linear_residual(s, w, res, nw)  # 64 entries for 32 columns
    with pytest.raises(ValueError, match="power of two"):
        fr.linear(s, w, block_n=24)
    assert fr.linear(s[:0], w).shape == (0, 32)


# ----------------------------------------------------------------------- the model's fused forward
@torch.inference_mode()
def _step(model, backend, few: bool, dtype, rows: int = 8):
    """T = 8 rows: two decodes, a verification block of 1 + 4 rows, a padding request (rows 20: and a
    verification block of 12 rows)."""
    from tests.layers.test_triton_attention import ragged_layout

    cfg = model.config
    seqs, qs = ([12, 9, 30], [1, 1, 5]) if rows == 8 else ([12, 9, 30, 20], [1, 1, 5, 12])
    layout, num_blocks = ragged_layout(seqs, qs, page=4, pad_requests=1, seed=2)
    T = layout.query_start_loc[-1]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    kv = torch.randn(cfg.num_hidden_layers, 2, num_blocks, 4, cfg.num_key_value_heads, cfg.head_dim,
                     generator=g).to(dtype)
    model.fused, model.small_m_gemv, model.fewrow = True, False, few
    hidden, taps = model(ids, layout.positions, backend, backend.prepare(layout), kv)
    return hidden, taps, kv


# head_dim 32 (llama with 2 heads, qwen3 with its q/k norms): RoPE and the K/V write in the qkv product's
# epilogue; head_dim 16 (llama16): the qkv product and the separate RoPE launch
ARCHS = {"llama": (dict(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1), (2, 0)),
         "qwen3": ({}, (1,)), "llama16": (dict(num_hidden_layers=3), (1,))}


@pytest.fixture(scope="module", params=list(ARCHS))
def model_case(request, tmp_path_factory):
    from tests.conftest import write_tiny_checkpoint

    overrides, taps = ARCHS[request.param]
    arch = request.param.removesuffix("16")
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("fewrow") / request.param, arch, seed=11, **overrides)
    return request.param, path, taps


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 8), (torch.bfloat16, 8), (torch.float32, 20)])
def test_fused_forward_fewrow_matches_gemm_path(model_case, dtype, rows, monkeypatch) -> None:
    """Hidden states, taps (each layer's raw output) and K/V caches of the few-row path equal the GEMM
    path's up to the norm's roundings; the path runs for every layer. 20 rows: with fewrow_max_rows 64
    (row tiles of 32)."""
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import RefAttentionBackend, assert_close, build_model

    arch, path, taps = model_case
    if dtype == torch.bfloat16 and arch != "llama":
        pytest.skip("bf16 on one architecture is enough")
    model = build_model(path, taps, dtype)
    backend = RefAttentionBackend("cpu")
    if rows > 16 and arch != "llama":
        pytest.skip("more rows on one architecture is enough")
    want = _step(model, backend, False, dtype, rows)
    calls = []
    orig = DecoderLayer.forward_fewrow
    monkeypatch.setattr(DecoderLayer, "forward_fewrow", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    got = _step(model, backend, True, dtype, rows)
    assert len(calls) == model.config.num_hidden_layers
    assert got[1].shape == want[1].shape == (rows, len(taps) * model.config.hidden_size)
    tol = 1e-5 if dtype == torch.float32 else 2**-5
    for g, w in zip(got, want):
        assert_close(g, w, tol)


def test_fewrow_off_for_many_rows_biases_and_batch_invariant(model_case, monkeypatch) -> None:
    from dspark.layers.linear import use_batch_invariant
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import RefAttentionBackend, build_model, run_step

    arch, path, taps = model_case
    if arch != "llama":
        pytest.skip("one architecture is enough")

    def fail(*a, **k):
        raise AssertionError("forward_fewrow with more than fewrow_max_rows rows, a bias or batch-invariant Linears")

    monkeypatch.setattr(DecoderLayer, "forward_fewrow", fail)
    model = build_model(path, taps)
    model.small_m_gemv, model.fewrow, model.fewrow_max_rows = False, True, 16  # --invariant-attention's limit
    assert run_step(model, RefAttentionBackend("cpu"), fused=True)[0].shape[0] > 16
    model.fewrow_max_rows = None
    model.layers[0].self_attn.o_proj.bias = torch.nn.Parameter(torch.zeros(model.config.hidden_size),
                                                               requires_grad=False)
    _step(model, RefAttentionBackend("cpu"), True, torch.float32)
    model.layers[0].self_attn.o_proj.bias = None
    use_batch_invariant(model)
    _step(model, RefAttentionBackend("cpu"), True, torch.float32)


def test_engine_greedy_tokens_fewrow_on_off(model_case, tmp_path_factory, monkeypatch) -> None:
    """Whole engine with DSpark (verification rows, rollbacks) and an 8-token budget (chunked prefill),
    so every step has at most 8 rows and runs on the few-row kernels (with head_dim 32 the K/V cache is
    written by the qkv product's epilogue, so the attention reads what it wrote): the same greedy tokens
    and acceptance with the switch on as off (fp32)."""
    from dspark import LLM
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import GREEDY, engine_case

    arch, path, taps = model_case
    prompts, kw = engine_case((arch.removesuffix("16"), path, taps), tmp_path_factory, f"fewrow{arch}")
    calls = []
    orig = DecoderLayer.forward_fewrow
    monkeypatch.setattr(DecoderLayer, "forward_fewrow", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    rope_calls = []
    orig_rope = fr.qkv_rope_cache
    monkeypatch.setattr(fr, "qkv_rope_cache", lambda *a, **k: rope_calls.append(1) or orig_rope(*a, **k))
    runs = []
    for on in (False, True):
        llm = LLM(str(path), attention_backend="triton", **kw)
        assert llm.engine.runner.model.fused
        llm.engine.runner.model.small_m_gemv, llm.engine.runner.model.fewrow = False, on
        runs.append(([o.token_ids for o in llm.generate(prompts, GREEDY)],
                     (llm.engine.spec_stats.num_drafts, llm.engine.spec_stats.num_accepted)))
    assert runs[0] == runs[1] and runs[0][1][0] > 0 and calls
    assert bool(rope_calls) == (arch != "llama16")  # the fused RoPE epilogue from head_dim 32 on


def test_engine_greedy_tokens_fewrow_on_off_past_16_rows(model_case, tmp_path_factory, monkeypatch) -> None:
    """As above with six requests and a 64-token budget: verification steps of 6 x (1 + 4) rows and prefill
    chunks beside them, so steps of 17-64 rows run on row tiles of 32 and 64 (fp32: the same greedy tokens and
    acceptance with the few-row kernels as without); and again in programs of 16 rows (PROGRAM_ROWS), so those
    steps run 2-4 row blocks per product, session 35's launch settings instead of the wide ones."""
    from dspark import LLM
    from dspark.models.llama import DecoderLayer
    from tests.models.test_fused_forward import GREEDY, engine_case

    arch, path, taps = model_case
    if arch != "llama":
        pytest.skip("one architecture is enough")
    _, kw = engine_case((arch, path, taps), tmp_path_factory, f"fewrow64{arch}")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (9, 3, 14, 5, 7, 11)]
    kw = dict(kw, max_num_batched_tokens=64, num_kv_blocks=96)
    rows = []
    orig = DecoderLayer.forward_fewrow
    monkeypatch.setattr(DecoderLayer, "forward_fewrow",
                        lambda self, x, *a, **k: rows.append(x.shape[0]) or orig(self, x, *a, **k))
    blocks = []
    orig_launch = fr._launch
    monkeypatch.setattr(fr, "_launch", lambda a, *r, **k: blocks.append(-(-a.shape[0] // r[4]["BM"])) or
                        orig_launch(a, *r, **k))
    runs = []
    for on, program_rows in ((False, 64), (True, 64), (True, 16)):
        monkeypatch.setattr(fr, "PROGRAM_ROWS", program_rows)
        llm = LLM(str(path), attention_backend="triton", **kw)
        llm.engine.runner.model.small_m_gemv, llm.engine.runner.model.fewrow = False, on
        runs.append(([o.token_ids for o in llm.generate(prompts, GREEDY)],
                     (llm.engine.spec_stats.num_drafts, llm.engine.spec_stats.num_accepted)))
        if on:
            assert max(blocks) == (1 if program_rows == 64 else 4), (program_rows, max(blocks))
            blocks.clear()
    assert runs[0] == runs[1] == runs[2] and runs[0][1][0] > 0
    assert max(rows) > 16 and max(rows) <= 64, rows
