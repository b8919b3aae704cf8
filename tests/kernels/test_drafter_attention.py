"""DSpark drafter attention kernels (shared-tile and naive) vs their PyTorch reference, and the
reference vs the attention the engine's drafting step actually computes (DSparkDrafter.block_hidden
over context K/V that DSparkProposer wrote into its paged cache). Runs in Triton's interpreter on the
CPU (see conftest.py): shapes are kept small."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from dspark.kernels.drafter_attention import (  # noqa: E402
    DRAFTER_TUNING,
    drafter_attention,
    drafter_attention_naive,
    drafter_attention_ref,
    drafter_launch,
    kv_shared,
)
from dspark.layers.attention import context_slots  # noqa: E402


def make_inputs(ctx_lens: list[int], *, gamma: int, heads: tuple[int, int], head_dim: int, page: int,
                seed: int = 0) -> dict:
    """Random block rows and a paged context cache; requests own distinct random blocks (never the
    dummy block 0); a request with no context keeps a table of zeros, like a padded row."""
    g = torch.Generator().manual_seed(seed)
    Hq, Hkv = heads
    B = len(ctx_lens)
    n_blocks = [-(-c // page) for c in ctx_lens]
    num_blocks = 1 + sum(n_blocks) + 2
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    table = torch.zeros(B, max(n_blocks + [1]) + 1, dtype=torch.int64)
    for b, n in enumerate(n_blocks):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int64)
        ids = ids[n:]
    return dict(
        q=torch.randn(B, gamma, Hq, head_dim, generator=g),
        k_block=torch.randn(B, gamma, Hkv, head_dim, generator=g),
        v_block=torch.randn(B, gamma, Hkv, head_dim, generator=g),
        k_cache=torch.randn(num_blocks, page, Hkv, head_dim, generator=g),
        v_cache=torch.randn(num_blocks, page, Hkv, head_dim, generator=g),
        block_tables=table,
        ctx_lens=torch.tensor(ctx_lens),
        scale=head_dim**-0.5,
    )


CTX = [0, 1, 13, 35]  # no context (padding), one entry, non-multiples of the page (4) and key tile (16)


@pytest.mark.parametrize("gamma", [5, 7])
@pytest.mark.parametrize("heads,head_dim", [((2, 2), 32), ((9, 3), 64)], ids=["gqa1", "gqa3"])
@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_shared_tile_matches_reference(gamma, heads, head_dim, sinks, num_splits):
    x = make_inputs(CTX, gamma=gamma, heads=heads, head_dim=head_dim, page=4, seed=gamma)
    s = torch.randn(heads[0], generator=torch.Generator().manual_seed(5)) * 2 if sinks else None
    ref = drafter_attention_ref(**x, sinks=s)
    out = drafter_attention(**x, sinks=s, num_splits=num_splits, block_n=16)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(16, 1), (12, 2)], ids=["g16", "g6"])
@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_row_tiles_match_reference(heads, sinks, num_splits):
    """16-row tiles: (16, 1) stacks 5 × 16 rows into 5 full tiles of one block row each; (12, 2) stacks 5 × 6
    rows per KV head into tiles of 16 and 14 rows, the first ending inside block row 2, over two KV heads."""
    x = make_inputs(CTX, gamma=5, heads=heads, head_dim=32, page=4, seed=3)
    s = torch.randn(heads[0], generator=torch.Generator().manual_seed(5)) * 2 if sinks else None
    out = drafter_attention(**x, sinks=s, num_splits=num_splits, block_m=16, block_n=16)
    torch.testing.assert_close(out, drafter_attention_ref(**x, sinks=s), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_head_dim_512_matches_reference(num_splits):
    """DeepSeek-V4's drafter head_dim at the default launch: 16-row tiles (40 rows: two full, one of 8), sinks."""
    x = make_inputs([0, 5, 37], gamma=5, heads=(8, 1), head_dim=512, page=4, seed=4)
    s = torch.randn(8, generator=torch.Generator().manual_seed(5)) * 2
    assert drafter_launch(5, 8, 512)["row_tiles"] == 3
    out = drafter_attention(**x, sinks=s, num_splits=num_splits)
    torch.testing.assert_close(out, drafter_attention_ref(**x, sinks=s), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim,heads,num_splits", [(32, (9, 3), 1), (32, (9, 3), 3), (512, (8, 1), 2)],
                         ids=["gqa3", "gqa3-split", "v4"])
def test_kv_shared_matches_reference(head_dim, heads, num_splits):
    """DeepSeek-V4's one KV vector per token (K = V): the same tensors passed as keys and values take the one-gather
    path (kv_shared), in both kernels, and agree with the reference; equal values in other memory do not."""
    x = make_inputs(CTX, gamma=5, heads=heads, head_dim=head_dim, page=4, seed=8)
    x.update(v_block=x["k_block"], v_cache=x["k_cache"])
    s = torch.randn(heads[0], generator=torch.Generator().manual_seed(5)) * 2
    assert kv_shared(x["k_block"], x["v_block"], x["k_cache"], x["v_cache"])
    assert not kv_shared(x["k_block"], x["k_block"].clone(), x["k_cache"], x["v_cache"])
    assert not kv_shared(x["k_block"], x["v_block"], x["k_cache"], x["k_cache"][:, :2])
    ref = drafter_attention_ref(**x, sinks=s)
    torch.testing.assert_close(drafter_attention(**x, sinks=s, num_splits=num_splits), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(drafter_attention_naive(**x, sinks=s), ref, atol=2e-5, rtol=1e-5)


def test_default_launch():
    """SmolLM2's drafter (γ 7, 9 query / 3 KV heads, head_dim 64) keeps one 32-row tile and DRAFTER_TUNING's
    launch, the one its timings were measured with; V4's (γ 5, 32 or 64 heads on one 512-wide KV head) gets
    WIDE_TILES: 16-row tiles of 32 keys at 4 warps below WIDE_LARGE_MIN_BATCH requests, 32 x 64 at 8 warps from
    there, aiming at one program per SM."""
    assert drafter_launch(7, 3, 64) == {"block_m": 32, "row_tiles": 1, **DRAFTER_TUNING, "programs_per_sm": 4}
    assert drafter_launch(5, 3, 64, batch=12) == {"block_m": 16, "row_tiles": 1, **DRAFTER_TUNING,
                                                  "programs_per_sm": 4}
    for G, tiles in ((32, 10), (64, 20)):
        for B in (1, 2, 3):
            assert drafter_launch(5, G, 512, batch=B) == {"block_m": 16, "row_tiles": tiles, "block_n": 32,
                                                          "num_warps": 4, "num_stages": DRAFTER_TUNING["num_stages"],
                                                          "programs_per_sm": 1}
        for B in (4, 12, 32):
            assert drafter_launch(5, G, 512, batch=B) == {"block_m": 32, "row_tiles": tiles // 2, "block_n": 64,
                                                          "num_warps": 8, "num_stages": DRAFTER_TUNING["num_stages"],
                                                          "programs_per_sm": 1}
    # a given row tile keeps the register-based rule (what the benchmark sweeps use)
    assert drafter_launch(5, 32, 512, block_m=16) == {"block_m": 16, "row_tiles": 10, "block_n": 32, "num_warps": 8,
                                                      "num_stages": DRAFTER_TUNING["num_stages"], "programs_per_sm": 4}


def test_wide_head_split_counts():
    """The split counts session 44's grid (H100, 132 SMs) found fastest or near it at seed 001's shape: programs
    up to one per SM, each split at least one key tile of the context bucket; 4 per SM for SmolLM2's shape."""
    from dspark.kernels.paged_attention import split_count

    def splits(G, B, ctx, head_dim=512):
        lm = drafter_launch(5 if head_dim == 512 else 7, G, head_dim, batch=B)
        return split_count(B * lm["row_tiles"], 132, ctx, lm["block_n"], lm["programs_per_sm"])

    expected = {(32, 1, 128): 4, (32, 1, 512): 8, (32, 4, 128): 2, (32, 4, 512): 4, (32, 12, 128): 2,
                (32, 12, 512): 2, (64, 1, 128): 4, (64, 1, 512): 4, (64, 4, 128): 2, (64, 4, 512): 2,
                (64, 12, 128): 1, (64, 12, 512): 1}
    assert {k: splits(*k) for k in expected} == expected
    assert splits(3, 12, 1000, head_dim=64) == 8 and splits(3, 1, 128, head_dim=64) == 2  # capped: 64-key splits


    assert drafter_launch(5, 64, 512, block_m=64)["row_tiles"] == 5
    with pytest.raises(ValueError):
        drafter_launch(5, 3, 64, block_m=24)


@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sink"])
def test_naive_matches_reference(sinks):
    x = make_inputs([0, 21], gamma=3, heads=(3, 1), head_dim=32, page=4)
    s = torch.randn(3, generator=torch.Generator().manual_seed(5)) if sinks else None
    out = drafter_attention_naive(**x, sinks=s, block_n=8)
    torch.testing.assert_close(out, drafter_attention_ref(**x, sinks=s), atol=2e-5, rtol=1e-5)


def test_naive_head_dim_512():
    """At its default key tile there (16 keys)."""
    x = make_inputs([0, 5, 37], gamma=5, heads=(4, 1), head_dim=512, page=4, seed=6)
    s = torch.randn(4, generator=torch.Generator().manual_seed(5)) * 2
    torch.testing.assert_close(drafter_attention_naive(**x, sinks=s), drafter_attention_ref(**x, sinks=s),
                               atol=2e-5, rtol=1e-5)


def test_int32_tables_and_strided_views():
    """q and the block K/V as views into one fused projection output, int32 metadata."""
    x = make_inputs([9, 30], gamma=5, heads=(9, 3), head_dim=64, page=16)
    B, gamma, Hq, D = x["q"].shape
    qkv = torch.cat([x["q"].reshape(B, gamma, -1), x["k_block"].reshape(B, gamma, -1),
                     x["v_block"].reshape(B, gamma, -1)], -1)
    views = dict(x, q=qkv[..., :Hq * D].view(B, gamma, Hq, D), k_block=qkv[..., Hq * D:(Hq + 3) * D].view(B, gamma, 3, D),
                 v_block=qkv[..., (Hq + 3) * D:].view(B, gamma, 3, D), block_tables=x["block_tables"].int(),
                 ctx_lens=x["ctx_lens"].int())
    torch.testing.assert_close(drafter_attention(**views, block_n=16), drafter_attention_ref(**x), atol=2e-5, rtol=1e-5)


def test_reference_is_the_drafting_step(monkeypatch):
    """Run the engine's drafting step for real (a one-layer drafter, context K/V written by
    DSparkProposer.write_context into its paged cache, then gathered and masked as propose() and
    block_hidden() do) and catch the attention call: the reference and the kernel reproduce it."""
    from dspark.layers.linear import Linear
    from dspark.models.dspark_drafter import DrafterConfig, DSparkDrafter
    from dspark.spec.proposer import DSparkProposer

    H, V, gamma, page = 64, 40, 5, 4
    cfg = DrafterConfig.from_dict({
        "architectures": ["LlamaDSparkModel"], "hidden_size": H, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": V, "block_size": gamma, "mask_token_id": V - 1, "target_layer_ids": [0],
        "num_target_layers": 2, "markov_rank": 0,
    })
    torch.manual_seed(0)
    lm_head = Linear(H, V)
    drafter = DSparkDrafter(cfg, torch.nn.Embedding(V, H), lm_head, max_positions=64)
    with torch.no_grad():
        lm_head.weight_t.normal_(0, 0.2)
        for p in drafter.parameters():
            p.normal_(0, 0.3)
    proposer = DSparkProposer(drafter)
    anchor_pos = torch.tensor([1, 6, 19])  # context entries: positions [0, anchor_pos)
    proposer.allocate_cache(num_blocks=16, block_size=page)
    table = torch.zeros(3, 6, dtype=torch.int64)
    table[0, :1], table[1, :2], table[2, :5] = torch.tensor([9]), torch.tensor([3, 14]), torch.tensor([2, 7, 1, 11, 5])
    pos = torch.cat([torch.arange(a) for a in anchor_pos.tolist()])
    req = torch.repeat_interleave(torch.arange(3), anchor_pos)
    proposer.write_context(torch.randn(pos.shape[0], H), pos, table[req, pos // page] * page + pos % page)

    calls = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        o = sdpa(q, k, v, **kw)
        calls.append((q, k, v, o))
        return o

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    slots, valid = context_slots(table, anchor_pos, page)  # as DSparkProposer.propose gathers it
    kc, vc = proposer.kv[0, 0], proposer.kv[0, 1]
    ctx_kv = [(kc.view(-1, *kc.shape[2:])[slots], vc.view(-1, *vc.shape[2:])[slots])]
    with torch.inference_mode():
        drafter.block_hidden(torch.tensor([4, 8, 15]), anchor_pos, ctx_kv, valid, gamma)
    monkeypatch.undo()

    (q, keys, values, o), = calls  # [B, Hq, γ, D], [B, Hkv, C + γ, D], .., [B, Hq, γ, D]
    C = keys.shape[2] - gamma
    args = (q.transpose(1, 2), keys[:, :, C:].transpose(1, 2), values[:, :, C:].transpose(1, 2), kc, vc, table,
            anchor_pos, cfg.head_dim**-0.5)
    want = o.transpose(1, 2)
    torch.testing.assert_close(drafter_attention_ref(*args), want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(drafter_attention(*args, block_n=16), want, atol=2e-5, rtol=1e-5)
