"""Fused decoder-layer kernels (residual add + RMSNorm, q/k RoPE + KV-cache write, SwiGLU, the drafter's
context K/V store) vs their PyTorch references and vs the eager modules they replace.

Runs in Triton's interpreter on the CPU (tests/kernels/conftest.py). Shapes include SmolLM2's
non-power-of-two hidden (576) and MLP (1536) sizes, ragged row counts and padding rows. bf16 cases
are compared exactly: the kernels reproduce every intermediate rounding of the eager code.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton's first import (conftest does it too)

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from dspark.kernels import interpreter_ready  # noqa: E402
from dspark.kernels.fused_ops import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    drafter_block_inputs,
    drafter_block_inputs_reference,
    rms_norm,
    rms_norm_rows,
    rope_qk,
    rope_qk_cache,
    rope_qk_cache_reference,
    rope_qk_reference,
    silu_and_mul,
    silu_and_mul_reference,
    store_context_kv,
    store_context_kv_reference,
)
from dspark.layers.basic import RMSNorm, RotaryEmbedding, apply_rope  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ready(), reason="Triton interpreter not active in this process")

DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    """fp32: a few ulp (summation order of the norm, last bit of rsqrt/exp); bf16: identical."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-6)
    else:
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


# ------------------------------------------------------------------------------------ RMSNorm
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("T", "H"), [(1, 576), (7, 576), (5, 1536), (3, 100)])
def test_add_rms_norm(dtype: torch.dtype, T: int, H: int) -> None:
    g = torch.Generator().manual_seed(T * 1000 + H)
    x = torch.randn(T, H, generator=g).to(dtype)
    res = (torch.randn(T, H, generator=g) * 4).to(dtype)
    norm = RMSNorm(H, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(H, generator=g) + 0.5)
    out, new_res = add_rms_norm(x, res, norm.weight.detach(), 1e-5)
    ref_out, ref_res = add_rms_norm_reference(x, res, norm.weight.detach(), 1e-5)
    assert torch.equal(new_res, ref_res) and torch.equal(ref_res, res + x)
    _close(out, ref_out)
    with torch.no_grad():
        _close(out, norm(res + x))  # the eager module itself
        _close(rms_norm(x, norm.weight.detach(), 1e-5), norm(x))


def test_rms_norm_strided_rows_and_3d() -> None:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(6, 2 * 576, generator=g)
    x = big[:, :576]  # rows 1152 apart
    w = torch.rand(576, generator=g) + 0.5
    out, res = add_rms_norm(x, None, w, 1e-6)
    _close(out, add_rms_norm_reference(x, None, w, 1e-6)[0])
    assert res is x
    x3 = torch.randn(2, 3, 576, generator=g)
    r3 = torch.randn(2, 3, 576, generator=g)
    out3, res3 = add_rms_norm(x3, r3, w, 1e-6)
    ref3, refres3 = add_rms_norm_reference(x3, r3, w, 1e-6)
    _close(out3, ref3)
    assert torch.equal(res3, refres3)


# --------------------------------------------------------------------------------- RoPE + cache
def _qkv(T: int, Hq: int, Hkv: int, D: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D, generator=g).to(dtype)  # the fused projection's output
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    return q.view(T, Hq, D), k.view(T, Hkv, D), v.view(T, Hkv, D)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("Hq", "Hkv", "D", "qk_norm"), [(9, 3, 64, False), (4, 2, 32, True)])
def test_rope_qk_cache(dtype: torch.dtype, Hq: int, Hkv: int, D: int, qk_norm: bool) -> None:
    T, num_blocks, bs = 7, 4, 8
    q, k, v = _qkv(T, Hq, Hkv, D, dtype, seed=Hq + D)
    rope = RotaryEmbedding(D, 10000.0, 4096)
    positions = torch.tensor([0, 5, 100, 4095, 7, 8, 9])
    slots = torch.tensor([3, -1, 10, 31, 0, 17, -1])  # -1: padding rows, not written
    g = torch.Generator().manual_seed(1)
    q_norm = (torch.rand(D, generator=g) + 0.5).to(dtype) if qk_norm else None
    k_norm = (torch.rand(D, generator=g) + 0.5).to(dtype) if qk_norm else None
    caches = [torch.full((num_blocks, bs, Hkv, D), 7.0, dtype=dtype) for _ in range(4)]
    q_out, k_out = rope_qk_cache(q, k, v, positions, rope.cos, rope.sin_signed, caches[0], caches[1], slots,
                                 q_norm, k_norm, 1e-6)
    q_ref, k_ref = rope_qk_cache_reference(q, k, v, positions, rope.cos, rope.sin_signed, caches[2], caches[3],
                                           slots, q_norm, k_norm, 1e-6)
    _close(q_out, q_ref)
    _close(k_out, k_ref)
    _close(caches[0], caches[2])
    assert torch.equal(caches[1], caches[3])
    written = torch.zeros(num_blocks * bs, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert bool((caches[0].view(-1, Hkv, D)[~written] == 7.0).all())
    # rope_qk (the drafter's block rows): the same rotation, no cache written, strided inputs
    q2, k2 = rope_qk(q, k, positions, rope.cos, rope.sin_signed, q_norm, k_norm, 1e-6)
    assert torch.equal(q2, q_out) and torch.equal(k2, k_out) and q2.is_contiguous() and k2.is_contiguous()
    q3, k3 = rope_qk_reference(q, k, positions, rope.cos, rope.sin_signed, q_norm, k_norm, 1e-6)
    assert torch.equal(q3, q_ref) and torch.equal(k3, k_ref)
    if not qk_norm:  # the reference is the eager Attention path: cos_sin + apply_rope
        cs = rope.cos_sin(positions, dtype)
        _close(q_out, apply_rope(q, *cs))
        _close(k_out, apply_rope(k, *cs))


# ------------------------------------------------------------------------------------- SwiGLU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1536), (5, 1536), (3, 100), (2, 3, 1536)])
def test_silu_and_mul(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(sum(shape))
    gate_up = (torch.randn(*shape[:-1], 2 * shape[-1], generator=g) * 3).to(dtype)
    out = silu_and_mul(gate_up)
    assert out.shape == (*shape[:-1], shape[-1])
    _close(out, silu_and_mul_reference(gate_up))


# ---------------------------------------------------------------------- drafter context store
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_context_kv_skips_padding_and_rejected_rows(dtype: torch.dtype) -> None:
    R, Hkv, D, num_blocks, bs = 9, 3, 64, 4, 4
    _, k, v = _qkv(R, 1, Hkv, D, dtype, seed=5)
    rope = RotaryEmbedding(D, 10000.0, 512)
    positions = torch.tensor([0, 1, 2, 3, 10, 11, 12, 40, 41])
    slots = torch.tensor([0, 1, 2, 3, 8, 9, -1, 14, 15])
    valid = torch.tensor([True, True, True, True, True, False, True, True, False])  # rejected drafts
    k_norm = (torch.rand(D, generator=torch.Generator().manual_seed(2)) + 0.5).to(dtype)
    for kn, pos in ((None, positions), (k_norm, positions), (None, None)):
        caches = [torch.full((num_blocks, bs, Hkv, D), -3.0, dtype=dtype) for _ in range(4)]
        kw = dict(positions=pos, cos=rope.cos, sin_signed=rope.sin_signed, k_norm=kn)
        store_context_kv(k, v, caches[0], caches[1], slots, valid, **kw)
        store_context_kv_reference(k, v, caches[2], caches[3], slots, valid, **kw)
        _close(caches[0], caches[2])
        assert torch.equal(caches[1], caches[3])
        keep = (slots >= 0) & valid
        untouched = torch.ones(num_blocks * bs, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert bool((caches[0].view(-1, Hkv, D)[untouched] == -3.0).all())
        assert bool((caches[1].view(-1, Hkv, D)[untouched] == -3.0).all())


def test_store_context_kv_matches_drafter_layer() -> None:
    """The kernel fed with the K/V projection of context entries writes what DrafterLayer.context_kv
    computes (Qwen3 drafter: k_norm, then RoPE at the entries' positions)."""
    from dspark.models.dspark_drafter import DrafterConfig, DrafterLayer

    cfg = DrafterConfig.from_dict({
        "architectures": ["Qwen3DSparkModel"], "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 100, "block_size": 5, "mask_token_id": 3, "target_layer_ids": [1], "num_target_layers": 4,
        "markov_rank": 8,
    })
    torch.manual_seed(0)
    layer = DrafterLayer(cfg)
    with torch.no_grad():
        layer.qkv_proj.weight_t.normal_(0, 0.2)
        layer.k_norm.weight.uniform_(0.5, 1.5)
    rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, 256)
    R = 6
    ctx = torch.randn(R, cfg.hidden_size)
    positions = torch.tensor([3, 4, 5, 6, 7, 8])
    slots = torch.tensor([3, 4, 5, 6, 7, 8])
    valid = torch.tensor([True, True, True, False, True, False])
    with torch.no_grad():
        k_ref, v_ref = layer.context_kv(ctx, rope.cos_sin(positions, ctx.dtype))
        kv = ctx @ layer.qkv_proj.weight_t[:, layer.q_size:]
    k, v = kv.view(R, 2 * cfg.num_key_value_heads, cfg.head_dim).split(cfg.num_key_value_heads, dim=1)
    k_cache = torch.zeros(2, 8, cfg.num_key_value_heads, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    store_context_kv(k, v, k_cache, v_cache, slots, valid, positions, rope.cos, rope.sin_signed,
                     layer.k_norm.weight.detach(), cfg.rms_norm_eps)
    rows = k_cache.view(-1, cfg.num_key_value_heads, cfg.head_dim)[slots]
    torch.testing.assert_close(rows[valid], k_ref[valid], rtol=2e-6, atol=2e-6)
    assert torch.equal(v_cache.view(-1, cfg.num_key_value_heads, cfg.head_dim)[slots][valid], v_ref[valid])
    assert bool((rows[~valid] == 0).all())


# ------------------------------------------------------------------- the drafter's block rows
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "G", "H"), [(1, 7, 576), (5, 4, 576), (3, 1, 100), (0, 7, 64)])
def test_drafter_block_inputs(dtype: torch.dtype, B: int, G: int, H: int) -> None:
    """The block rows of a drafter step in one launch: the anchor's then the mask token's embedding, the first
    norm of them (exact in bf16, as add_rms_norm), the rows' positions and the draft noise's key positions."""
    g = torch.Generator().manual_seed(B * 100 + G)
    V, mask_id = 50, 7
    embed = (torch.randn(V, H, generator=g) * 3).to(dtype)
    weight = (torch.rand(H, generator=g) + 0.5).to(dtype)
    anchors = torch.randint(0, V, (B,), generator=g)
    anchor_pos = torch.randint(0, 4000, (B,), generator=g)
    got = drafter_block_inputs(anchors, anchor_pos, embed, mask_id, G, weight, 1e-5)
    want = drafter_block_inputs_reference(anchors, anchor_pos, embed, mask_id, G, weight, 1e-5)
    _close(got[0], want[0])
    for a, b in zip(got[1:], want[1:]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    if B:  # against the eager modules: nn.Embedding of the block's tokens and RMSNorm.forward
        tokens = torch.full((B, G), mask_id)
        tokens[:, 0] = anchors
        assert torch.equal(got[1], embed[tokens].view(B * G, H))
        norm = RMSNorm(H, 1e-5).to(dtype)
        with torch.no_grad():
            norm.weight.copy_(weight)
            _close(got[0], norm(embed[tokens].view(B * G, H)))
        assert got[2].tolist() == [p + k for p in anchor_pos.tolist() for k in range(G)]
        assert got[3].tolist() == (anchor_pos + 1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("B", "G", "n"), [(3, 7, 3), (2, 4, 4), (4, 5, 1), (1, 3, 0)])
def test_rms_norm_rows(dtype: torch.dtype, B: int, G: int, n: int) -> None:
    """The first n rows of every G, normed after the residual add: add_rms_norm's rows, selected."""
    g = torch.Generator().manual_seed(B * 10 + G + n)
    H = 576
    x = torch.randn(B * G, H, generator=g).to(dtype)
    res = (torch.randn(B * G, H, generator=g) * 4).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    keep = (torch.arange(B * G) % G) < n
    for r in (res, None):
        got = rms_norm_rows(x, r, w, 1e-5, n, G)
        want = add_rms_norm_reference(x, r, w, 1e-5)[0][keep]
        assert got.shape == (B * n, H) and got.is_contiguous()
        _close(got, want)
    with pytest.raises(ValueError, match="n_keep"):
        rms_norm_rows(x, res, w, 1e-5, G + 1, G)


# ------------------------------------------------------------------------------ rows per program
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_per_program_change_no_bit(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The row-wise kernels take one row per program on the GPU and up to fused_ops.INTERPRETER_ROWS here: 70 ragged
    rows (padding and rejected rows among them) at 1 row per program (the GPU's form), 4 (18 programs, the last
    partial) and 64 give the same bits, and bf16 equals the references."""
    from dspark.kernels import fused_ops

    T, H, Hq, Hkv, D, I = 70, 576, 9, 3, 64, 1536
    g = torch.Generator().manual_seed(70)
    x = torch.randn(T, H, generator=g).to(dtype)
    res = (torch.randn(T, H, generator=g) * 4).to(dtype)
    w = (torch.rand(H, generator=g) + 0.5).to(dtype)
    q, k, v = _qkv(T, Hq, Hkv, D, dtype, seed=7)
    rope = RotaryEmbedding(D, 10000.0, 512)
    positions = torch.randint(0, 512, (T,), generator=g)
    slots = torch.randperm(128, generator=g)[:T]
    slots[::5] = -1  # padding rows
    valid = torch.rand(T, generator=g) < 0.6  # rejected drafts
    qn, kn = ((torch.rand(D, generator=g) + 0.5).to(dtype) for _ in range(2))
    gate_up = (torch.randn(T, 2 * I, generator=g) * 3).to(dtype)

    def run() -> list[torch.Tensor]:
        caches = [torch.full((16, 8, Hkv, D), 7.0, dtype=dtype) for _ in range(4)]
        qo, ko = rope_qk_cache(q, k, v, positions, rope.cos, rope.sin_signed, caches[0], caches[1], slots, qn, kn)
        store_context_kv(k, v, caches[2], caches[3], slots, valid, positions, rope.cos, rope.sin_signed, kn)
        return [*add_rms_norm(x, res, w, 1e-5), rms_norm_rows(x, res, w, 1e-5, 3, 7), qo, ko, *caches,
                silu_and_mul(gate_up)]

    outs = {}
    for rows in (1, 4, 64):
        monkeypatch.setattr(fused_ops, "INTERPRETER_ROWS", rows)
        outs[rows] = run()
    assert fused_ops.rows_per_program(x, T) == 64 and fused_ops.rows_per_program(x, 3) == 4
    for rows in (4, 64):
        for a, b in zip(outs[1], outs[rows]):
            assert torch.equal(a, b), rows
    caches = [torch.full((16, 8, Hkv, D), 7.0, dtype=dtype) for _ in range(4)]
    qr, kr = rope_qk_cache_reference(q, k, v, positions, rope.cos, rope.sin_signed, caches[0], caches[1], slots,
                                     qn, kn)
    store_context_kv_reference(k, v, caches[2], caches[3], slots, valid, positions, rope.cos, rope.sin_signed, kn)
    keep = (torch.arange(T) % 7) < 3
    refs = [*add_rms_norm_reference(x, res, w, 1e-5), add_rms_norm_reference(x, res, w, 1e-5)[0][keep], qr, kr,
            *caches, silu_and_mul_reference(gate_up)]
    for a, b in zip(outs[64], refs):
        _close(a, b)
