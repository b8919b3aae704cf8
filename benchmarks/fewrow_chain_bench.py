"""Few-row decoder-layer chains on the GPU: the GEMM path (cuBLAS + add_rms_norm + silu_and_mul) against
kernels/fewrow.py (tensor-core products with the norms and SwiGLU in their epilogues).

Random SmolLM2-shaped bf16 weights, a distinct set per layer (30 layers: ~200 MB, streamed from HBM as in
the model, unlike a microbenchmark that replays one weight from L2); attention is left out (the same
kernels in both), RoPE + the K/V cache write are in (rope_qk_cache after the qkv GEMM; the few-row chain
does them in its qkv epilogue, as DecoderLayer.forward_fewrow). Each chain is captured as one CUDA graph
and replayed.

    python3 benchmarks/fewrow_chain_bench.py OUT.json [--rows 2,8,16] [--sweep [--quick] [--kinds qkvr,o,gu,d]]
                                                      [--block-m 32,64,128]

Any row count: programs of the step's row tile (fewrow.row_tile) up to fewrow.PROGRAM_ROWS (64) rows, more rows in
row blocks (fewrow.program_rows). --block-m also times the chain with programs of at most that many rows, each value.

--sweep: each product alone (a graph of 30 launches over the 30 layers' weights) over block_n / block_k /
split-K / stages / warps, against cuBLAS (qkvr: against cuBLAS + rope_qk_cache); the chains then use each
product's best setting as well as the defaults.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import torch

from dspark.kernels import fewrow as fr
from dspark.kernels.fused_ops import add_rms_norm, rope_qk_cache, silu_and_mul
from dspark.layers.basic import RotaryEmbedding

H, Q, I, L, EPS = 576, 960, 1536, 30, 1e-5
HQ, HKV, D = 9, 3, 64
_ROPE = {}


def rope_args(M: int):
    """Positions 1,000.. of M rows, SmolLM2's RoPE tables, one paged K/V cache (every layer writes the
    same slots: the cost is the same)."""
    if M not in _ROPE:
        rope = RotaryEmbedding(D, 100000.0, 2048)
        cos, sin = rope.cos.cuda(), rope.sin_signed.cuda()
        kc = torch.zeros(64, 16, HKV, D, device="cuda", dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        pos = torch.arange(1000, 1000 + M, device="cuda")
        _ROPE[M] = (pos, cos, sin, kc, vc, torch.arange(M, device="cuda"))
    return _ROPE[M]


def gemm_qkv_rope(x, w):
    pos, cos, sin, kc, vc, slots = rope_args(x.shape[0])
    q, k, v = torch.matmul(x, w).split([HQ * D, HKV * D, HKV * D], dim=-1)
    T = x.shape[0]
    return rope_qk_cache(q.view(T, HQ, D), k.view(T, HKV, D), v.view(T, HKV, D), pos, cos, sin, kc, vc, slots)[0]


def fewrow_qkv_rope(x, w, ss, **cfg):
    pos, cos, sin, kc, vc, slots = rope_args(x.shape[0])
    return fr.qkv_rope_cache(x, w, ss, EPS, pos, cos, sin, kc, vc, slots, HQ, HKV, **cfg)


def graph_us(fn, reps: int = 200) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / reps * 1e6)
    return best


def make_layers(output_major: bool):
    def w(k, n):
        t = torch.randn(k, n, device="cuda", dtype=torch.bfloat16) / k**0.5
        return t.t().contiguous().t() if output_major else t
    return [dict(qkv=w(H, Q), o=w(H, H), gu=w(H, 2 * I), d=w(I, H),
                 g1=(torch.rand(H, device="cuda") + 0.5).bfloat16(), g2=(torch.rand(H, device="cuda") + 0.5).bfloat16())
            for _ in range(L)]


def chain_gemm(layers, h0, attn):
    x, res = add_rms_norm(h0, None, layers[0]["g1"], EPS)
    for i, p in enumerate(layers):
        gemm_qkv_rope(x, p["qkv"])
        o = torch.matmul(attn, p["o"])
        x2, res = add_rms_norm(o, res, p["g2"], EPS)
        act = silu_and_mul(torch.matmul(x2, p["gu"]))
        d = torch.matmul(act, p["d"])
        g = layers[i + 1]["g1"] if i + 1 < L else layers[0]["g1"]
        x, res = add_rms_norm(d, res, g, EPS)
    return x, res


def chain_fewrow(layers, h0, attn, cfg):
    x, h = add_rms_norm(h0, None, layers[0]["g1"], EPS)
    ss = None
    for i, p in enumerate(layers):
        fewrow_qkv_rope(x, p["qkv"], ss, **cfg.get("qkvr", {}))
        s1, z1, p1 = fr.linear_residual(attn, p["o"], h, p["g2"], **cfg.get("o", {}))
        act = fr.gate_up_silu(z1, p["gu"], p1, EPS, **cfg.get("gu", {}))
        g = layers[i + 1]["g1"] if i + 1 < L else layers[0]["g1"]
        h, x, ss = fr.linear_residual(act, p["d"], s1, g, **cfg.get("d", {}))
    return x, h


def sweep(layers, M, only=None, quick=False):
    """Each product alone, 30 launches over the 30 layers' weights. ``quick``: 4 warps, BLOCK_K 64 / 128,
    split-K 1-3 (and the default's), 3 or 6 stages: ~1/6 of the space (the full one outlasts a device call at 64
    rows: 2 products in 240 s, session 52)."""
    a_h = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    a_i = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)
    ss = fr.SumSq(torch.rand(1, fr.row_tile(M), device="cuda") * 100 + 1, H)  # the step's row tile
    res = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    g = layers[0]["g1"]
    kinds = {
        "qkvr": (lambda cfg: [fewrow_qkv_rope(a_h, p["qkv"], ss, **cfg) for p in layers],
                 lambda: [gemm_qkv_rope(a_h, p["qkv"]) for p in layers]),
        "o": (lambda cfg: [fr.linear_residual(a_h, p["o"], res, g, **cfg) for p in layers],
              lambda: [torch.matmul(a_h, p["o"]) for p in layers]),
        "gu": (lambda cfg: [fr.gate_up_silu(a_h, p["gu"], ss, EPS, **cfg) for p in layers],
               lambda: [torch.matmul(a_h, p["gu"]) for p in layers]),
        "d": (lambda cfg: [fr.linear_residual(a_i, p["d"], res, g, **cfg) for p in layers],
              lambda: [torch.matmul(a_i, p["d"]) for p in layers]),
    }
    out, best = {}, {}
    for kind, (fn, cublas) in kinds.items():
        if only and kind not in only:
            continue
        rows = {"cublas": graph_us(cublas) / L}
        seen = set()
        K, N = (I if kind == "d" else H), {"qkvr": Q, "o": H, "gu": I, "d": H}[kind]
        block_ns = (32,) if kind == "qkvr" else (16, 32, 64) if kind == "gu" else (16, 32)
        space = ((block_ns, (64, 128), (1, 2, 3, 6), (3, 6), (4,)) if quick
                 else (block_ns, (32, 64, 128, 256), (1, 2, 3, 4, 6), (3, 6), (4, 8)))
        for bn, bk, sp, st, nw in itertools.product(*space):
            if (bk == 32 or (nw == 8 and M <= 16)) and kind not in ("gu", "qkvr"):
                continue  # the first sweep's space (session 35) for the products it settled (8 warps: larger tiles)
            cfg = dict(block_n=bn, block_k=bk, split=sp, num_stages=st, num_warps=nw)
            key = tuple(sorted(fr.fewrow_config(K, N, rows=M, **cfg).items()))
            if key in seen:
                continue
            seen.add(key)
            name = f"bn{bn}_bk{bk}_sp{sp}_st{st}_w{nw}"
            try:
                rows[name] = graph_us(lambda: fn(cfg), reps=100) / L
            except Exception as e:  # out of shared memory etc.
                rows[name] = repr(e)[:80]
        timed = {k: v for k, v in rows.items() if k != "cublas" and isinstance(v, float)}
        k_best = min(timed, key=timed.get)
        bn, bk, sp, st, nw = (int(x.lstrip("bnkspstw")) for x in k_best.split("_"))
        best[kind] = dict(block_n=bn, block_k=bk, split=sp, num_stages=st, num_warps=nw)
        out[kind] = rows
        print(f"M={M} {kind}: cublas {rows['cublas']:.2f} us, default "
              f"{graph_us(lambda: fn({}), reps=100) / L:.2f}, best {k_best} {timed[k_best]:.2f}", flush=True)
    return out, best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", default="2,8,16")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="--sweep over a smaller space (see sweep)")
    ap.add_argument("--output-major", type=int, default=1)
    ap.add_argument("--kinds", default="", help="sweep only these products (qkvr,o,gu,d)")
    ap.add_argument("--block-m", default="", help="also time the chain with programs of at most these rows (32,64,128)")
    args = ap.parse_args()
    torch.manual_seed(0)
    layers = make_layers(bool(args.output_major))
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": {}}
    best = {}
    for j, M in enumerate(int(m) for m in args.rows.split(",")):
        h0 = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        attn = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
        r = {}
        if args.sweep and j == 0:  # the first row count's best settings serve the others
            r["sweep"], best = sweep(layers, M, [k for k in args.kinds.split(",") if k], args.quick)
        xa, ha = chain_gemm(layers, h0, attn)
        xb, hb = chain_fewrow(layers, h0, attn, {})
        r["max_abs_diff_h"] = (ha.float() - hb.float()).abs().max().item()
        r["max_abs_h"] = ha.float().abs().max().item()
        r["gemm_us_per_layer"] = graph_us(lambda: chain_gemm(layers, h0, attn)) / L
        r["fewrow_default_us_per_layer"] = graph_us(lambda: chain_fewrow(layers, h0, attn, {})) / L
        for bm in (int(b) for b in args.block_m.split(",") if b):
            cfg = {k: dict(block_m=bm) for k in ("qkvr", "o", "gu", "d")}
            r[f"fewrow_bm{bm}_us_per_layer"] = graph_us(lambda: chain_fewrow(layers, h0, attn, cfg)) / L
        if best:
            r["best"] = best
            r["fewrow_best_us_per_layer"] = graph_us(lambda: chain_fewrow(layers, h0, attn, best)) / L
        print(f"M={M}: " + json.dumps({k: v for k, v in r.items() if k != "sweep"}), flush=True)
        res["rows"][M] = r
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
