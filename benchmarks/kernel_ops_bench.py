"""GPU timings of the fused kernels (dspark/kernels/markov_sampler.py, dspark/kernels/fused_ops.py)
against their PyTorch references, at SmolLM2-135M sizes.

    python -m benchmarks.kernel_ops_bench --out kernel_ops.json [--quick]

Shapes: hidden 576, 9 query / 3 KV heads of 64, MLP 1536, vocabulary 49152, Markov rank 64,
γ (drafts per block) 5 and 7, batch 1 / 8 / 32, bf16 activations and weights (fp32 logits). The
layer ops are timed at decode shapes (T = batch rows) and at verification shapes (T = batch ×
(1 + γ) rows, γ = 7), where the drafter's context store also runs (about half the rows rejected).

The few-row GEMVs of dspark/kernels/gemv.py with the residual add + RMSNorm prologue
(``add_rms_norm_linear``: SmolLM2's qkv, 576 -> 960; ``add_rms_norm_gate_up_silu``: gate|up + SwiGLU,
576 -> 2 x 1536) run at the shapes with at most 8 rows (the kernels take up to 16; models/llama.py uses them at 1); their
``ref ms`` is the unfused sequence they replace (add_rms_norm + cuBLAS matmul (+ silu_and_mul)), and
they are checked against their PyTorch references (the same roundings, summation order aside).

Each kernel is first checked on the GPU against its reference on the same inputs (tokens and q of
the Markov sampler; outputs and caches of the layer ops); a failed check is reported in the table and
in the JSON. Times are medians of ``triton.testing.do_bench`` (ms). For the Markov sampler,
``graph_ms`` is the fused path replayed as one CUDA graph (it never synchronises with the host, so
it can be captured; the reference cannot: it reads ``any()`` of a device tensor).

The same kernels on independent rows (``--only rows``): ``processed_probs`` against ``compute_probs`` (the
target's verification rows; the reference sorts each row) and ``sample_rows`` against ``Sampler()``
(plain top-p sampling), at 1 / 8 / 32 / 256 rows, peaked and flat; a flat row's boundary token may fall
on either side of the top-p cut (float sums in another order): counted, and bounded by the check.

The Markov sampler's base logits are made LM-like: Gaussian noise plus a few strongly boosted tokens
per slot, so top-p sets are tens of tokens rather than most of the vocabulary.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import dspark.kernels  # noqa: F401  (interpreter choice before triton is imported)
import triton
import triton.testing

from dspark.kernels.fused_ops import (
    add_rms_norm,
    add_rms_norm_reference,
    rope_qk_cache,
    silu_and_mul,
    silu_and_mul_reference,
    store_context_kv,
    store_context_kv_reference,
)
from dspark.kernels.gemv import (
    add_rms_norm_gate_up_silu,
    add_rms_norm_gate_up_silu_reference,
    add_rms_norm_linear,
    add_rms_norm_linear_reference,
)
from dspark.kernels.markov_sampler import markov_sample, markov_sample_reference, processed_probs, sample_rows
from dspark.layers.basic import RotaryEmbedding, apply_rope
GEMV_ROWS = 8  # the shapes the GEMV rows are timed at (models/llama.py uses the kernels at GEMV_MAX_ROWS = 1)
from dspark.sample.sampler import SamplingBatch
from dspark.sampling_params import SamplingParams

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, RANK = 576, 9, 3, 64, 1536, 49152, 64
EPS = 1e-5
DTYPE = torch.bfloat16

SAMPLING = {  # name -> (params for every row, probabilistic drafting)
    "greedy": (dict(temperature=0.0), False),
    "T=1": (dict(temperature=1.0), True),
    "T=0.7,top_p=0.95": (dict(temperature=0.7, top_p=0.95), True),
    "T=0.7,top_k=20,top_p=0.8": (dict(temperature=0.7, top_k=20, top_p=0.8), True),
}


def bench(fn, rep: int) -> float:
    return float(triton.testing.do_bench(fn, warmup=max(rep // 4, 5), rep=rep, return_mode="median"))


def bench_graph(fn, rep: int) -> float | None:
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))
    except Exception as e:  # noqa: BLE001 — report, don't abort the table
        print(f"  (graph capture failed: {type(e).__name__}: {e})", file=sys.stderr)
        return None


def _rows_plain(name, R, logits, batch, out, rep, tiles) -> list[dict]:
    """Temperature-only rows: kernels/softmax.py (probabilities and argmax, at each of ``tiles``) against
    torch (compute_probs + argmax) and the fused sampler's processed_probs (probabilities only)."""
    from dspark.kernels.softmax import temperature_softmax_argmax
    from dspark.sample.sampler import compute_probs

    def ref():
        return compute_probs(logits, batch), logits.argmax(-1)

    ref_q, ref_am = ref()
    am = torch.empty(R, dtype=torch.int64, device="cuda")
    t_ref, g_ref = bench(ref, rep), bench_graph(ref, rep)
    g_pp = bench_graph(lambda: processed_probs(logits, batch, probs_out=out), rep)
    print(f"  graphs: torch {g_ref * 1e3:.1f} us, processed_probs (no argmax) {g_pp * 1e3:.1f} us")
    rows = []
    for tile in tiles or [None]:
        kw = {} if tile is None else {"block_v": tile[0], "num_warps": tile[1]}

        def fused():
            return temperature_softmax_argmax(logits, batch.temperature, probs_out=out, argmax_out=am, **kw)

        q = fused()[0].clone()
        diff = float((q - ref_q).abs().max())
        ok = diff <= 1e-6 and torch.equal(am, ref_am)
        config = name if tile is None else f"{name} v{tile[0]}w{tile[1]}"
        rows.append(dict(op="softmax+argmax", config=config, batch=R, gamma=None, rows=R, ref_ms=t_ref,
                         ref_graph_ms=g_ref, processed_probs_graph_ms=g_pp, triton_ms=bench(fused, rep),
                         graph_ms=bench_graph(fused, rep), max_abs_diff=diff, correct=ok,
                         **({} if tile is None else {"block_v": tile[0], "num_warps": tile[1]})))
        rows[-1]["speedup"] = rows[-1]["ref_ms"] / rows[-1]["triton_ms"]
        print_row(rows[-1])
    return rows


def _rows_sample(name, R, logits, batch, rep, tiles) -> list[dict]:
    """The plain step's draw of temperature-only rows, kernels/softmax.py's temperature_sample against
    Sampler()'s torch passes (the batch mixed, as the sampling graph's: both argmax reductions), and greedy rows
    (temperature None) against torch's argmax."""
    from dataclasses import replace

    from dspark.kernels.softmax import temperature_sample
    from dspark.sample.sampler import Sampler

    mixed = replace(batch, all_random=False)
    out = torch.empty(R, dtype=torch.int64, device="cuda")
    rows = []
    for op, ref, args in (("sample", lambda: Sampler()(logits, mixed, 0),
                           (batch.temperature, batch.seeds, batch.positions, 0)),
                          ("argmax", lambda: logits.argmax(-1), (None,))):
        ref_tok = ref()
        t_ref, g_ref = bench(ref, rep), bench_graph(ref, rep)
        for tile in tiles or [None]:
            kw = {} if tile is None else {"block_v": tile[0], "num_warps": tile[1]}

            def fused():
                return temperature_sample(logits, *args, out=out, **kw)

            ok = torch.equal(fused(), ref_tok)
            config = name if tile is None else f"{name} v{tile[0]}w{tile[1]}"
            rows.append(dict(op=f"temperature_sample ({op})", config=config, batch=R, gamma=None, rows=R,
                             ref_ms=t_ref, ref_graph_ms=g_ref, triton_ms=bench(fused, rep),
                             graph_ms=bench_graph(fused, rep), correct=ok,
                             **({} if tile is None else {"block_v": tile[0], "num_warps": tile[1]})))
            rows[-1]["speedup"] = rows[-1]["ref_ms"] / rows[-1]["triton_ms"]
            print(f"  {op}: torch graph {g_ref * 1e3:.1f} us")
            print_row(rows[-1])
    return rows


# ----------------------------------------------------------------------------- Markov sampler
def markov_inputs(B: int, gamma: int, sampling: str, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    base = torch.randn(B, gamma, VOCAB, device="cuda", generator=g) * 2.0
    hot = torch.randint(0, VOCAB, (B, gamma, 24), device="cuda", generator=g)
    base.scatter_add_(2, hot, 6.0 + 8.0 * torch.rand(B, gamma, 24, device="cuda", generator=g))
    w1 = (torch.randn(VOCAB, RANK, device="cuda", generator=g) * 0.3).to(DTYPE)
    w2_t = (torch.randn(RANK, VOCAB, device="cuda", generator=g) * 0.3).to(DTYPE)
    anchors = torch.randint(0, VOCAB, (B,), device="cuda", generator=g)
    anchor_pos = torch.randint(0, 4000, (B,), device="cuda", generator=g)
    kw, prob = SAMPLING[sampling]
    params = [SamplingParams(**kw) for _ in range(B)]
    batch = SamplingBatch.build(params, list(range(1, B + 1)), (anchor_pos + 1).tolist(), [[]] * B, [[]] * B,
                                VOCAB, "cuda")
    return base, anchors, anchor_pos + 1, w1, w2_t, batch, [prob] * B


def run_markov(batches: list[int], gammas: list[int], rep: int, tiles: list[tuple[int, int]] | None = None,
               configs: list[str] | None = None) -> list[dict]:
    """``tiles``: (block_v, num_warps) settings of the fused kernels to time side by side (default: the
    kernel's own defaults only); the config column then names them."""
    rows = []
    for sampling in SAMPLING:
        if configs and sampling not in configs:
            continue
        for gamma in gammas:
            for B in batches:
                base, anchors, key_pos, w1, w2_t, batch, prob = markov_inputs(B, gamma, sampling)
                prob_mask = torch.tensor(prob, device="cuda")
                args = (base, anchors, w1, w2_t, batch, key_pos, prob)
                ref_tok, ref_q = markov_sample_reference(*args)
                t_ref = bench(lambda: markov_sample_reference(*args), rep)
                # a temperature-only batch: the one-launch slots (the default) and the general launches
                modes = [True, False] if batch.no_top_k and batch.no_top_p and batch.no_min_p else [None]
                for tile, temp_only in [(t, m) for t in tiles or [None] for m in modes]:
                    kw = {"prob_mask": prob_mask} | ({} if tile is None else {"block_v": tile[0], "num_warps": tile[1]})
                    if temp_only is not None:
                        kw["temp_only"] = temp_only
                    tok, q = markov_sample(*args, **kw)
                    match = float((tok == ref_tok).float().mean())
                    qdiff = None if q is None else float((q - ref_q).abs().max())
                    ok = match == 1.0 and (qdiff is None or qdiff <= 1e-5)
                    t_tri = bench(lambda: markov_sample(*args, **kw), rep)
                    t_graph = bench_graph(lambda: markov_sample(*args, **kw), rep)
                    config = sampling if tile is None else f"{sampling} v{tile[0]}w{tile[1]}"
                    config += " general" if temp_only is False else ""
                    rows.append(dict(op="markov_sampler", config=config, batch=B, gamma=gamma, rows=B,
                                     ref_ms=t_ref, triton_ms=t_tri, graph_ms=t_graph, speedup=t_ref / t_tri,
                                     token_match=match, q_max_abs_diff=qdiff, correct=ok,
                                     **({} if tile is None else {"block_v": tile[0], "num_warps": tile[1]})))
                    print_row(rows[-1])
    return rows


# ------------------------------------------------------------- independent rows (Sampler(fused=True))
ROW_SAMPLING = {  # name -> (params, logit scale, hot tokens per row)
    "T=1": (dict(temperature=1.0), 2.0, 24),  # the verification of a sampled batch: probs and argmax
    "T=1,top_p=0.9": (dict(temperature=1.0, top_p=0.9), 2.0, 24),
    "T=0.7,top_k=20,top_p=0.8": (dict(temperature=0.7, top_k=20, top_p=0.8), 2.0, 24),
    "T=1,top_p=0.9,flat": (dict(temperature=1.0, top_p=0.9), 1.0, 0),  # thousands kept: bisection
}


def run_rows(row_counts: list[int], rep: int, tiles: list[tuple[int, int]] | None = None,
             configs: list[str] | None = None) -> list[dict]:
    """The target's verification rows (``processed_probs`` against ``compute_probs``, which sorts each
    row) and plain top-p sampling (``sample_rows`` against ``Sampler()``), R independent rows. The
    temperature-only rows ("T=1") time what a sampled batch's verification graph runs: the probabilities
    and every row's argmax (kernels/softmax.py against ``compute_probs`` + ``argmax``), at each
    (block_v, num_warps) of ``tiles``."""
    from dspark.sample.sampler import Sampler, compute_probs

    rows = []
    for name, (kw, scale, hot) in ROW_SAMPLING.items():
        if configs and name not in configs:
            continue
        for R in row_counts:
            g = torch.Generator(device="cuda").manual_seed(R)
            logits = torch.randn(R, VOCAB, device="cuda", generator=g) * scale
            if hot:
                idx = torch.randint(0, VOCAB, (R, hot), device="cuda", generator=g)
                logits.scatter_add_(1, idx, 6.0 + 8.0 * torch.rand(R, hot, device="cuda", generator=g))
            pos = torch.randint(0, 4000, (R,), generator=torch.Generator().manual_seed(R)).tolist()
            batch = SamplingBatch.build([SamplingParams(**kw)] * R, list(range(1, R + 1)), pos, [[]] * R, [[]] * R,
                                        VOCAB, "cuda")
            out = torch.empty(R, VOCAB, device="cuda")
            if name == "T=1":
                rows += _rows_plain(name, R, logits, batch, out, rep, tiles)
                rows += _rows_sample(name, R, logits, batch, rep, tiles)
                continue
            q, ref_q = processed_probs(logits, batch, probs_out=out), compute_probs(logits, batch)
            # Flat rows put thousands of tokens above the top-p cut, where the float sums of the two ways
            # (a sorted cumsum, tile sums) may disagree on the boundary token: counted, and it must be rare
            # and carry little mass.
            differ = (q > 0) != (ref_q > 0)
            set_diffs = int(differ.sum())
            diff_mass = float(torch.where(differ, torch.maximum(q, ref_q), 0).sum(-1).max())
            diff = float(torch.where(differ, 0, q - ref_q).abs().max())
            rows.append(dict(op="processed_probs", config=name, batch=R, gamma=None, rows=R,
                             ref_ms=bench(lambda: compute_probs(logits, batch), rep),
                             triton_ms=bench(lambda: processed_probs(logits, batch, probs_out=out), rep),
                             graph_ms=bench_graph(lambda: processed_probs(logits, batch, probs_out=out), rep),
                             max_abs_diff=diff, boundary_tokens_differing=set_diffs, differing_mass=diff_mass,
                             correct=diff <= 1e-5 and set_diffs <= max(1, R // 16) and diff_mass < 1e-4))
            rows[-1]["speedup"] = rows[-1]["ref_ms"] / rows[-1]["triton_ms"]
            print_row(rows[-1])
            if R > 64:
                continue
            tok, ref_tok = sample_rows(logits, batch, 0), Sampler()(logits, batch, 0)
            match = float((tok == ref_tok).float().mean())
            rows.append(dict(op="sample_rows", config=name, batch=R, gamma=None, rows=R,
                             ref_ms=bench(lambda: Sampler()(logits, batch, 0, no_sync=True), rep),
                             triton_ms=bench(lambda: sample_rows(logits, batch, 0), rep),
                             graph_ms=bench_graph(lambda: sample_rows(logits, batch, 0), rep),
                             token_match=match, correct=match == 1.0))
            rows[-1]["speedup"] = rows[-1]["ref_ms"] / rows[-1]["triton_ms"]
            print_row(rows[-1])
    return rows


# ---------------------------------------------------------------------------------- layer ops
def eager_rope_cache(q, k, v, positions, rope: RotaryEmbedding, k_cache, v_cache, slots):
    """The eager Attention path: cos_sin, apply_rope on q and k, the backend's index_copy_."""
    cs = rope.cos_sin(positions, q.dtype)
    q, k = apply_rope(q, *cs), apply_rope(k, *cs)
    k_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
    v_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)
    return q, k


def run_layer_ops(batches: list[int], rep: int, verify_gamma: int = 7) -> list[dict]:
    rows = []
    rope = RotaryEmbedding(HEAD_DIM, 100000.0, 8192).cuda()
    num_blocks, bs = 2048, 16
    for B in batches:
        for shape, T in (("decode", B), ("verify", B * (1 + verify_gamma))):
            g = torch.Generator(device="cuda").manual_seed(T)
            cfg = f"{shape} T={T}"

            # residual add + RMSNorm
            x = torch.randn(T, HIDDEN, device="cuda", generator=g).to(DTYPE)
            res = torch.randn(T, HIDDEN, device="cuda", generator=g).to(DTYPE)
            w = (torch.rand(HIDDEN, device="cuda", generator=g) + 0.5).to(DTYPE)
            out, new_res = add_rms_norm(x, res, w, EPS)
            ref_out, ref_res = add_rms_norm_reference(x, res, w, EPS)
            diff = float((out.float() - ref_out.float()).abs().max())
            ok = torch.equal(new_res, ref_res) and diff <= 2 * float(ref_out.abs().max()) * 2**-8
            rows.append(record("add_rms_norm", cfg, B, T, lambda: add_rms_norm_reference(x, res, w, EPS),
                               lambda: add_rms_norm(x, res, w, EPS), rep, ok, diff))

            # RoPE on q, k + KV-cache write
            qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", generator=g).to(DTYPE)
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            q, k, v = q.view(T, HEADS, HEAD_DIM), k.view(T, KV_HEADS, HEAD_DIM), v.view(T, KV_HEADS, HEAD_DIM)
            positions = torch.randint(0, 8000, (T,), device="cuda", generator=g)
            slots = torch.randperm(num_blocks * bs, device="cuda", generator=g)[:T]
            caches = [torch.zeros(num_blocks, bs, KV_HEADS, HEAD_DIM, device="cuda", dtype=DTYPE) for _ in range(4)]
            qo, ko = rope_qk_cache(q, k, v, positions, rope.cos, rope.sin_signed, caches[0], caches[1], slots)
            qr, kr = eager_rope_cache(q, k, v, positions, rope, caches[2], caches[3], slots)
            ok = all(torch.equal(a, b) for a, b in ((qo, qr), (ko, kr), (caches[0], caches[2]), (caches[1], caches[3])))
            diff = float((qo.float() - qr.float()).abs().max())
            rows.append(record("rope_qk_cache", cfg, B, T,
                               lambda: eager_rope_cache(q, k, v, positions, rope, caches[2], caches[3], slots),
                               lambda: rope_qk_cache(q, k, v, positions, rope.cos, rope.sin_signed, caches[0],
                                                     caches[1], slots), rep, ok, diff))

            # SwiGLU
            gate_up = torch.randn(T, 2 * INTER, device="cuda", generator=g).to(DTYPE)
            a, r = silu_and_mul(gate_up), silu_and_mul_reference(gate_up)
            diff = float((a.float() - r.float()).abs().max())
            ok = diff <= 2 * float(r.abs().max()) * 2**-8
            rows.append(record("silu_and_mul", cfg, B, T, lambda: silu_and_mul_reference(gate_up),
                               lambda: silu_and_mul(gate_up), rep, ok, diff))

            # few-row GEMVs with the residual add + RMSNorm prologue vs the unfused sequence they replace
            if T <= GEMV_ROWS:
                w_qkv = (torch.randn(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device="cuda", generator=g)
                         * HIDDEN**-0.5).to(DTYPE)
                w_gu = (torch.randn(HIDDEN, 2 * INTER, device="cuda", generator=g) * HIDDEN**-0.5).to(DTYPE)
                gemvs = (
                    ("add_rms_norm_linear", lambda: add_rms_norm_linear(x, res, w, EPS, w_qkv)[0],
                     lambda: torch.matmul(add_rms_norm(x, res, w, EPS)[0], w_qkv),
                     lambda: add_rms_norm_linear_reference(x, res, w, EPS, w_qkv)[0]),
                    ("add_rms_norm_gate_up_silu", lambda: add_rms_norm_gate_up_silu(x, res, w, EPS, w_gu)[0],
                     lambda: silu_and_mul(torch.matmul(add_rms_norm(x, res, w, EPS)[0], w_gu)),
                     lambda: add_rms_norm_gate_up_silu_reference(x, res, w, EPS, w_gu)[0]),
                )
                for op, fused, unfused, reference in gemvs:
                    y, y_ref = fused(), reference()
                    diff = float((y.float() - y_ref.float()).abs().max())
                    ok = diff <= 2 * float(y_ref.abs().max()) * 2**-8
                    rows.append(record(op, cfg, B, T, unfused, fused, rep, ok, diff))

            # drafter context K/V store (verify shapes: about half of the rows are rejected drafts)
            if shape == "verify":
                valid = torch.rand(T, device="cuda", generator=g) < 0.5
                kw = dict(positions=positions, cos=rope.cos, sin_signed=rope.sin_signed)
                c2 = [torch.zeros_like(caches[0]) for _ in range(4)]
                store_context_kv(k, v, c2[0], c2[1], slots, valid, **kw)
                store_context_kv_reference(k, v, c2[2], c2[3], slots, valid, **kw)
                ok = torch.equal(c2[0], c2[2]) and torch.equal(c2[1], c2[3])
                diff = float((c2[0].float() - c2[2].float()).abs().max())
                rows.append(record("store_context_kv", cfg, B, T,
                                   lambda: store_context_kv_reference(k, v, c2[2], c2[3], slots, valid, **kw),
                                   lambda: store_context_kv(k, v, c2[0], c2[1], slots, valid, **kw), rep, ok, diff))
    return rows


def record(op: str, cfg: str, B: int, T: int, ref, tri, rep: int, ok: bool, diff: float) -> dict:
    t_ref, t_tri = bench(ref, rep), bench(tri, rep)
    row = dict(op=op, config=cfg, batch=B, gamma=None, rows=T, ref_ms=t_ref, triton_ms=t_tri, graph_ms=None,
               speedup=t_ref / t_tri, max_abs_diff=diff, correct=bool(ok))
    print_row(row)
    return row


HEADER = f"{'op':<25} {'config':<26} {'B':>3} {'γ':>2} {'rows':>5} {'ref ms':>8} {'triton ms':>9} " \
         f"{'graph ms':>8} {'speedup':>7}  check"


def print_row(r: dict) -> None:
    graph = f"{r['graph_ms']:8.4f}" if r.get("graph_ms") is not None else f"{'-':>8}"
    gamma = r["gamma"] if r["gamma"] is not None else "-"
    print(f"{r['op']:<25} {r['config']:<26} {r['batch']:>3} {gamma!s:>2} {r['rows']:>5} {r['ref_ms']:8.4f} "
          f"{r['triton_ms']:9.4f} {graph} {r['speedup']:6.2f}x  {'ok' if r['correct'] else 'MISMATCH'}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="kernel_ops_bench.json", help="JSON results path")
    ap.add_argument("--quick", action="store_true", help="batch 1 and 32, γ 7 only, fewer repetitions")
    ap.add_argument("--only", choices=["markov", "rows", "layers"], help="run one group only")
    ap.add_argument("--markov-tiles", default=None, metavar="V:W,...",
                    help="time the Markov sampler at these block_v:num_warps settings side by side, e.g. "
                         "256:4,1024:4,2048:8 (default: its defaults)")
    ap.add_argument("--batches", default=None, help="batch sizes, e.g. 32,128 (default: 1,8,32; --quick 1,32)")
    ap.add_argument("--markov-configs", default=None, help="these SAMPLING names only, e.g. greedy,T=1")
    ap.add_argument("--gammas", default=None, help="Markov draft counts, e.g. 3,7 (default: 5,7; --quick 7)")
    ap.add_argument("--rows", default="1,8,32,256", help="--only rows: row counts (default 1,8,32,256)")
    ap.add_argument("--rows-configs", default=None, help="--only rows: these ROW_SAMPLING names only, e.g. T=1")
    ap.add_argument("--rows-tiles", default=None, metavar="V:W,...",
                    help="--only rows: time the temperature-only rows at these block_v:num_warps settings")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_ops_bench needs a CUDA GPU", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")] if args.batches else [1, 32] if args.quick else [1, 8, 32]
    tiles = [tuple(int(x) for x in t.split(":")) for t in args.markov_tiles.split(",")] if args.markov_tiles else None
    gammas = [int(g) for g in args.gammas.split(",")] if args.gammas else [7] if args.quick else [5, 7]
    rep = 30 if args.quick else 100
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    print(HEADER)
    rows: list[dict] = []
    if args.only in (None, "markov"):
        rows += run_markov(batches, gammas, rep, tiles, args.markov_configs.split(",") if args.markov_configs else None)
    if args.only in (None, "rows"):
        rtiles = [tuple(int(x) for x in t.split(":")) for t in args.rows_tiles.split(",")] if args.rows_tiles else None
        rows += run_rows([int(r) for r in args.rows.split(",")], rep, rtiles,
                         args.rows_configs.split(",") if args.rows_configs else None)
    if args.only in (None, "layers"):
        rows += run_layer_ops(batches, rep)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                dtype=str(DTYPE), seconds=round(time.time() - t0, 1),
                sizes=dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           intermediate=INTER, vocab=VOCAB, markov_rank=RANK))
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "results": rows}, f, indent=1)
    bad = [r for r in rows if not r["correct"]]
    print(f"wrote {args.out}; {len(rows)} rows, {len(bad)} failed checks")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
