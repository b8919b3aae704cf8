"""Which Triton matmul launches give bit-identical rows, and what each costs, on the GPU (batch-invariant mode).

    python benchmarks/invariance_check.py OUT_DIR [--quick] [--parts bitwise,timing,engine,attention]
    TRITON_INTERPRET=1 python benchmarks/invariance_check.py OUT_DIR --smoke   # CPU: the script runs

Batch-invariant mode (dspark/kernels/matmul.py) runs every target matmul through one tile configuration
(64 x 64 x 64, 4 warps) so that a row's products are summed in the same order whatever the row count:
plain batch 1 ran at ~0.5x the default's speed in session 11. A faster mode would pick the tile by the row
count, which keeps rows bit-identical only if the row tile, the column tile, the K step, the warps and the
pipeline stages do not change a row's sums as long as its K range is walked in the same order. Whether
that holds is a property of the tensor-core instructions (mma.sync for 16-row tiles, wgmma from 64 rows on
sm_90) that the CPU interpreter cannot see, so this measures it:

0. engine (``--parts engine``): the shipped launch rule (matmul_invariant) and cuBLAS, each against the
   fixed launch, row for row at 1 - 1,024 rows, and their times.
1. bitwise: for SmolLM2-135M's products (qkv 576 -> 960, o 576 -> 576, gate|up 576 -> 3072, down
   1536 -> 576, the lm_head 576 -> 49152 with fp32 output), the reference launch on 333 random bf16 rows
   against every candidate launch on 1, 7, 64 and 333 of those rows (and on the rows shuffled): the count of
   rows that differ in any bit. A candidate that "splits" K into fixed segments (each summed from zero, the
   segments added in order) is compared with the same segmented sum done inside one program and with
   split programs plus a combine launch (what a few-row launch would do to fill the GPU).
2. timing: median µs per call (CUDA-graph replay, triton.testing.do_bench_cudagraph) of cuBLAS
   (torch.matmul; the lm_head: torch.mm with out_dtype float32), the reference launch and the candidates, at
   1 - 1,024 rows.

3. attention (``--parts attention``): paged attention's decode rows against the same rows verified as the first
   of 8, bit for bit, for the default launch, batch-invariant mode's and the tensor-core row sums
   (``rowsum_mma``), with their times.

Results: docs/benchmarks.md, session 46 (H100: all 140 launch variants and cuBLAS at 1 - 1,024 rows gave the
fixed launch's bits). Writes OUT_DIR/invariance.json (after each part) and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import dspark.kernels  # noqa: F401  (the interpreter's fixes, before triton is used)
import triton
import triton.language as tl
import triton.testing

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
REF = {"BM": 64, "BN": 64, "BK": 64, "warps": 4, "stages": 3}


@triton.jit
def _k_range(x_ptr, w_ptr, rm, rn, rk, lo, hi, M, N, K, stride_xm, stride_wk, BK: tl.constexpr, acc):
    """acc + x[rm, lo:hi] @ w[lo:hi, rn], K walked in order in steps of BK (past K the masks load zeros: exact + 0)."""
    for k0 in range(lo, hi, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(w_ptr + kk[:, None] * stride_wk + rn[None, :], mask=(kk[:, None] < K) & (rn[None, :] < N), other=0.0)
        acc = tl.dot(a, w, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _mm(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wk, stride_ym,
        SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """y = x @ w with K summed in segments of SEG (each from zero, added in order); SEG >= K: one segment, the
    arithmetic of dspark/kernels/matmul.py's kernel (kept as its own copy so that one kernel runs every variant
    measured here; ``engine`` runs the shipped kernel itself)."""
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    total = tl.zeros([BM, BN], dtype=tl.float32)
    for s0 in range(0, K, SEG):  # SEG: a multiple of BK
        total += _k_range(x_ptr, w_ptr, rm, rn, rk, s0, s0 + SEG, M, N, K, stride_xm, stride_wk, BK,
                          tl.zeros([BM, BN], dtype=tl.float32))
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], total.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _mm_split(x_ptr, w_ptr, p_ptr, M, N, K, stride_xm, stride_wk,
              SEG: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """Program (m, n, s): segment s of K into p[s] (fp32), summed from zero."""
    rm = (tl.program_id(0) * BM + tl.arange(0, BM)).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.program_id(2)
    acc = _k_range(x_ptr, w_ptr, rm, rn, tl.arange(0, BK), s * SEG, s * SEG + SEG, M, N, K, stride_xm, stride_wk, BK,
                   tl.zeros([BM, BN], dtype=tl.float32))
    tl.store(p_ptr + s * M * N + rm[:, None] * N + rn[None, :], acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _combine(p_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(S):
        total += tl.load(p_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, total.to(y_ptr.dtype.element_ty), mask=ok)


def run(cfg: dict, x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype, ws: torch.Tensor | None = None):
    """One launch of ``cfg`` (BM, BN, BK, warps, stages, seg, split) -> y [M, N]; returns a callable for timing."""
    M, K = x.shape
    N = w.shape[1]
    y = torch.empty(M, N, dtype=out_dtype, device=x.device)
    seg = cfg.get("seg") or K
    if cfg.get("split"):
        S = triton.cdiv(K, seg)
        p = ws[: S * M * N] if ws is not None else torch.empty(S * M * N, dtype=torch.float32, device=x.device)

        def fn():
            _mm_split[(triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]), S)](
                x, w, p, M, N, K, x.stride(0), w.stride(0), SEG=seg, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"],
                num_warps=cfg["warps"], num_stages=cfg["stages"])
            _combine[(triton.cdiv(M * N, 1024),)](p, y, M * N, S=S, BLOCK=1024, num_warps=4)
    else:
        def fn():
            _mm[(triton.cdiv(M, cfg["BM"]), triton.cdiv(N, cfg["BN"]))](
                x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), SEG=seg, BM=cfg["BM"], BN=cfg["BN"],
                BK=cfg["BK"], num_warps=cfg["warps"], num_stages=cfg["stages"])
    return y, fn


def name(cfg: dict) -> str:
    s = f"m{cfg['BM']}n{cfg['BN']}k{cfg['BK']}w{cfg['warps']}s{cfg['stages']}"
    if cfg.get("seg"):
        s += f"_seg{cfg['seg']}" + ("_split" if cfg.get("split") else "")
    return s


def candidates(quick: bool) -> list[dict]:
    out = [dict(REF)]
    for key, values in (("BM", (16, 32, 128)), ("BN", (16, 32, 128)), ("BK", (32, 128)), ("warps", (2, 8)), ("stages", (2, 4))):
        for v in values:
            out.append({**REF, key: v})
    combos = [(16, 32, 64, 2, 3), (16, 64, 128, 4, 3), (16, 16, 64, 1, 3), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4),
              (32, 64, 64, 4, 3), (16, 32, 32, 2, 4)]
    for bm, bn, bk, w, st in combos if not quick else combos[:3]:
        out.append({"BM": bm, "BN": bn, "BK": bk, "warps": w, "stages": st})
    return out


def seg_len(K: int) -> int:
    """The K segment of the segmented candidates: 3 segments of 192 at K = 576, 6 of 256 at K = 1,536."""
    return 192 if K % 192 == 0 and K < 1024 else 256 if K % 256 == 0 else 64


def seg_candidates(K: int) -> list[dict]:
    """Segmented sums: one program, and split programs + combine, at several tiles (K steps dividing the
    segment)."""
    out = []
    for bm, bn, bk, w in ((64, 64, 64, 4), (16, 32, 64, 2), (16, 64, 32, 4), (128, 128, 64, 8)):
        for split in (False, True):
            out.append({"BM": bm, "BN": bn, "BK": bk, "warps": w, "stages": 3, "seg": seg_len(K), "split": split})
    return out


def bitwise(dev, quick: bool) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for shape_name, (K, N) in SHAPES.items():
        out_dtype = torch.float32 if shape_name == "lm_head" else torch.bfloat16
        x = torch.randn(333, K, generator=g, device=dev).to(torch.bfloat16)
        w = (torch.randn(K, N, generator=g, device=dev) / K ** 0.5).to(torch.bfloat16)
        perm = torch.randperm(333, generator=g, device=dev)
        for family, ref_cfg, cands in (("plain", REF, candidates(quick)),
                                       ("seg", {**REF, "seg": seg_len(K)}, seg_candidates(K))):
            ref, fn = run(ref_cfg, x, w, out_dtype)
            fn()
            for cfg in cands:
                diff = {}
                iv = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
                try:
                    for m in (1, 7, 64, 333):
                        y, fn = run(cfg, x[:m].contiguous(), w, out_dtype)
                        fn()
                        diff[str(m)] = int((y.view(iv) != ref[:m].view(iv)).any(1).sum())
                    y, fn = run(cfg, x[perm].contiguous(), w, out_dtype)
                    fn()
                    diff["shuffled"] = int((y.view(iv) != ref[perm].view(iv)).any(1).sum())
                    err = None
                except Exception as e:  # noqa: BLE001 (a launch that does not compile is a result)
                    err = f"{type(e).__name__}: {str(e)[:200]}"
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                rows.append({"shape": shape_name, "family": family, "cfg": name(cfg), "rows_differing": diff,
                             "error": err, "identical": err is None and not any(diff.values())})
                print(f"bitwise {shape_name:8s} {family:7s} {name(cfg):34s} {diff if err is None else err}", flush=True)
        # how far the default cuBLAS product is from the reference (the size of the rounding that flips)
        ref, fn = run(REF, x, w, out_dtype)
        fn()
        cub = (torch.mm(x, w, out_dtype=torch.float32) if dev.type == "cuda" else x.float() @ w.float()) \
            if out_dtype == torch.float32 else x @ w
        rows.append({"shape": shape_name, "family": "cublas", "cfg": "torch.matmul",
                     "rows_differing": {"333": int((cub != ref).any(1).sum())},
                     "max_abs_diff": float((cub.float() - ref.float()).abs().max()), "identical": bool(torch.equal(cub, ref))})
    return rows


def timing(dev, quick: bool, rows: list[dict], save) -> list[dict]:
    ms = (1, 8, 32, 128, 512) if quick else (1, 8, 16, 32, 64, 128, 256, 512, 1024)
    ws = torch.empty(8 * 64 * 49152, dtype=torch.float32, device=dev)
    for shape_name, (K, N) in SHAPES.items():
        out_dtype = torch.float32 if shape_name == "lm_head" else torch.bfloat16
        w = (torch.randn(K, N, device=dev) / K ** 0.5).to(torch.bfloat16)
        cfgs = candidates(quick) + seg_candidates(K)
        for m in ms:
            x = torch.randn(m, K, device=dev).to(torch.bfloat16)
            if out_dtype == torch.float32:
                y32 = torch.empty(m, N, dtype=torch.float32, device=dev)
                cub = lambda: torch.mm(x, w, out_dtype=torch.float32, out=y32)  # noqa: E731
            else:
                yb = torch.empty(m, N, dtype=torch.bfloat16, device=dev)
                cub = lambda: torch.mm(x, w, out=yb)  # noqa: E731
            t = {"cublas": 1e3 * triton.testing.do_bench_cudagraph(cub, rep=20, return_mode="median")}
            if shape_name == "lm_head":  # what batch-invariant mode does now: fp32 weights, exact fp32 products
                wf = w.float()
                xf = x.float()
                yf = torch.empty(m, N, dtype=torch.float32, device=dev)
                from dspark.kernels.matmul import matmul_invariant

                t["bi_fp32_now"] = 1e3 * triton.testing.do_bench_cudagraph(
                    lambda: matmul_invariant(xf, wf, out=yf), rep=20, return_mode="median")
            for cfg in cfgs:
                if cfg.get("split") and m > 64:
                    continue
                try:
                    _, fn = run(cfg, x, w, out_dtype, ws)
                    fn()
                    t[name(cfg)] = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")
                except Exception as e:  # noqa: BLE001
                    t[name(cfg)] = None
                    print(f"  {shape_name} M={m} {name(cfg)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            best = min((k for k in t if k != "cublas" and t[k] is not None), key=lambda k: t[k])
            rows.append({"shape": shape_name, "M": m, "us": t, "best": best})
            print(f"time {shape_name:8s} M={m:5d} cublas {t['cublas']:7.2f}  ref {t[name(REF)]:7.2f}  "
                  f"best {best} {t[best]:7.2f}", flush=True)
            save()
    return rows


def engine(dev) -> dict:
    """The shipped rule (dspark/kernels/matmul.py: matmul_invariant, its launch picked by invariant_launch)
    against the fixed launch, row for row, at every row count from 1 to 64 and then in steps up to 1,024;
    and cuBLAS (the default mode's products: torch.matmul, the lm_head's torch.mm with fp32 output) against
    the same rows — where cuBLAS changes its K order with the row count, the default mode's rows change."""
    from dspark.kernels import matmul as mm

    ms = list(range(1, 65)) + list(range(80, 257, 16)) + [320, 384, 448, 512, 640, 768, 896, 1024]
    g = torch.Generator(device=dev).manual_seed(1)
    out = {"row_counts": ms, "shapes": {}}
    for shape_name, (K, N) in SHAPES.items():
        fp32_out = shape_name == "lm_head"
        x = torch.randn(max(ms), K, generator=g, device=dev).to(torch.bfloat16)
        w = (torch.randn(K, N, generator=g, device=dev) / K ** 0.5).to(torch.bfloat16)
        ref = torch.empty(max(ms), N, dtype=torch.float32 if fp32_out else torch.bfloat16, device=dev)
        mm._matmul_kernel[(triton.cdiv(max(ms), mm.BLOCK_M), triton.cdiv(N, mm.BLOCK_N))](
            x, w, w, ref, max(ms), N, K, x.stride(0), w.stride(0), ref.stride(0), HAS_BIAS=False,
            DOT_PRECISION="tf32", BM=mm.BLOCK_M, BN=mm.BLOCK_N, BK=mm.BLOCK_K, num_warps=mm.NUM_WARPS)
        iv = torch.int32 if fp32_out else torch.int16
        rule_bad, cublas_bad, launches = {}, {}, {}
        for m in ms:
            xm = x[-m:].contiguous()  # the last m rows: a row sits elsewhere in its tile than in the reference
            y = mm.matmul_invariant(xm, w, out_dtype=ref.dtype)
            n = int((y.view(iv) != ref[-m:].view(iv)).any(1).sum())
            if n:
                rule_bad[m] = n
            launches[str(mm.invariant_launch(m, N, xm))] = launches.get(str(mm.invariant_launch(m, N, xm)), 0) + 1
            c = torch.mm(xm, w, out_dtype=torch.float32) if fp32_out else torch.matmul(xm, w)
            n = int((c.view(iv) != ref[-m:].view(iv)).any(1).sum())
            if n:
                cublas_bad[m] = n
        out["shapes"][shape_name] = {"rule_rows_differing": rule_bad, "cublas_rows_differing": cublas_bad,
                                     "launches": launches}
        print(f"engine {shape_name:8s} rule differs at {rule_bad or 'no row count'}; cuBLAS differs at "
              f"{sorted(cublas_bad) or 'no row count'}", flush=True)
        t = {}
        for m in (1, 8, 64, 256, 512, 1024):
            xm = x[:m].contiguous()
            y = torch.empty(m, N, dtype=ref.dtype, device=dev)

            def fixed():
                mm._matmul_kernel[(triton.cdiv(m, mm.BLOCK_M), triton.cdiv(N, mm.BLOCK_N))](
                    xm, w, w, y, m, N, K, xm.stride(0), w.stride(0), y.stride(0), HAS_BIAS=False,
                    DOT_PRECISION="tf32", BM=mm.BLOCK_M, BN=mm.BLOCK_N, BK=mm.BLOCK_K, num_warps=mm.NUM_WARPS)

            t[m] = {k: 1e3 * triton.testing.do_bench_cudagraph(f, rep=20, return_mode="median") for k, f in (
                ("fixed", fixed), ("rule", lambda: mm.matmul_invariant(xm, w, out=y)),
                ("cublas", (lambda: torch.mm(xm, w, out_dtype=torch.float32, out=y)) if fp32_out
                 else (lambda: torch.mm(xm, w, out=y))))}
            print(f"engine {shape_name:8s} M={m:5d} " + "  ".join(f"{k} {v:7.2f}" for k, v in t[m].items()), flush=True)
        out["shapes"][shape_name]["us"] = t
    return out


def attention(dev, sweep: bool = False, only: tuple[str, ...] = ()) -> dict:
    """Paged attention (SmolLM2's 9 / 3 heads of 64, bf16, pages of 16): one query row per request decoded
    (batch 1 and 32) against the same row verified as the first of 8 (batch 32), bit for bit, and the time
    of each step, for the default launch, batch-invariant mode's (fixed 128-key slices, 64-row query tile)
    and the same slices with the row sums on the tensor cores and the default query tile (rowsum_mma)."""
    from dspark.kernels.paged_attention import paged_attention
    from dspark.layers.triton_attention import seq_len_hint

    g = torch.Generator(device="cpu").manual_seed(2)
    B, page, Hq, Hkv, D, N = 32, 16, 9, 3, 64, 8
    pos = torch.randint(60, 900, (B,), generator=g)  # the decoded row's position
    blocks = [-(-(int(p) + N) // page) for p in pos]
    table = torch.zeros(B, max(blocks) + 1, dtype=torch.int32)
    nxt = 1
    for b, n in enumerate(blocks):
        table[b, :n] = torch.arange(nxt, nxt + n)
        nxt += n
    kc = torch.randn(nxt, page, Hkv, D, generator=g).to(torch.bfloat16).to(dev)
    vc = torch.randn(nxt, page, Hkv, D, generator=g).to(torch.bfloat16).to(dev)
    table = table.to(dev)
    qv = torch.randn(B * N, Hq, D, generator=g).to(torch.bfloat16).to(dev)
    qd = qv[::N].contiguous()  # row 0 of each request's verification block
    configs = {"default": {}, "pinned64": {"split_keys": 128, "block_n": 64, "block_m": 64},
               "rowsum_mma": {"split_keys": 128, "block_n": 64, "rowsum_mma": True},
               # what each part costs: the default launch with the row sums on the tensor cores; the fixed
               # slices with the default query tile and tl.sum (not invariant)
               "default+mma": {"rowsum_mma": True}, "slices_only": {"split_keys": 128, "block_n": 64},
               # the engine's invariant attention (session 47; "rowsum_mma" above is its 128-key form): warps, stages
               # and slices per program by invariant_attention_launch
               "engine_k64": {"split_keys": 64, "block_n": 64, "rowsum_mma": True}}
    if sweep:  # rowsum_mma's free launch parameters (warps, stages, the merge in the launch) and its slice size,
        # each compared bit for bit with rowsum_mma at the same slice size
        for sk in (64, 128):
            for w in (1, 2, 4, 8):
                for st in (1, 2, 3, 4):
                    configs[f"mma_k{sk}_w{w}_s{st}"] = {"split_keys": sk, "block_n": 64, "rowsum_mma": True,
                                                        "num_warps": w, "num_stages": st}
            configs[f"mma_k{sk}_fused"] = {"split_keys": sk, "block_n": 64, "rowsum_mma": True, "fuse_combine": True}
            for spp in (2, 4):  # several slices per program (each into its own partial): fewer programs
                for w in (2, 4):
                    configs[f"mma_k{sk}_w{w}_s1_spp{spp}"] = {"split_keys": sk, "block_n": 64, "rowsum_mma": True,
                                                              "num_warps": w, "num_stages": 1, "slices_per_program": spp}
    if only:  # these configs (name substrings), the default launch and the engine's for comparison
        configs = {k: v for k, v in configs.items() if k in ("default", "engine_k64") or any(o in k for o in only)}

    def step(nb: int, q_per: int, kw: dict):
        sl = (pos[:nb] + q_per).to(torch.int32).to(dev)
        qsl = (torch.arange(nb + 1) * q_per).to(torch.int32).to(dev)
        q = qd[:nb] if q_per == 1 else qv[: nb * N]
        hint = seq_len_hint(int(sl.max()))
        return lambda: paged_attention(q, kc, vc, table[:nb], sl, qsl, 0.125, max_query_len=q_per, max_seq_len=hint, **kw)

    out = {}
    refs = {}  # split_keys -> the first rowsum_mma launch's verified rows
    for name, kw in configs.items():
        r = {}
        try:
            dec32, dec1, ver32 = step(B, 1, kw)(), step(1, 1, kw)(), step(B, N, kw)()
            if kw.get("rowsum_mma") and "split_keys" in kw:
                ref = refs.setdefault(kw["split_keys"], ver32)
                r["verify32_vs_group_ref_rows_differing"] = int((ref.view(torch.int16) != ver32.view(torch.int16))
                                                                .flatten(1).any(1).sum())
            r["decode32_vs_verify32_rows_differing"] = int((dec32.view(torch.int16) != ver32[::N].view(torch.int16))
                                                           .flatten(1).any(1).sum())
            r["decode1_vs_decode32_row0_equal"] = bool(torch.equal(dec1[0], dec32[0]))
            r["decode1_vs_verify32_row0_equal"] = bool(torch.equal(dec1[0], ver32[0]))
            for label, (nb, qp) in (("decode_b1", (1, 1)), ("decode_b32", (B, 1)), ("verify_b1", (1, N)),
                                    ("verify_b32", (B, N))):
                r[f"{label}_us"] = 1e3 * triton.testing.do_bench_cudagraph(step(nb, qp, kw), rep=20, return_mode="median")
        except Exception as e:  # noqa: BLE001
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out[name] = r
        print(f"attention {name:10s} {r}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="attention: sweep rowsum_mma's warps, stages, slices")
    ap.add_argument("--parts", default="bitwise,timing")
    ap.add_argument("--only", default="", help="attention: only the launch configs whose names contain one of these "
                    "comma-separated substrings (and the default and engine launches)")
    ap.add_argument("--smoke", action="store_true", help="small shapes, bitwise only, on the CPU (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    if a.smoke:
        SHAPES.clear()
        SHAPES.update({"o": (192, 48), "lm_head": (64, 80)})
        a.parts = "bitwise"
    dev = torch.device("cpu" if a.smoke else "cuda")
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
           "date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv)}
    t0 = time.time()
    if "bitwise" in a.parts:
        res["bitwise"] = bitwise(dev, a.quick)
        print(f"bitwise done at {time.time() - t0:.0f}s", flush=True)
    def save():
        with open(os.path.join(a.out_dir, "invariance.json"), "w") as f:
            json.dump(res, f, indent=1)

    save()
    if "engine" in a.parts:
        res["engine"] = engine(dev)
        save()
    if "attention" in a.parts:
        res["attention"] = attention(dev, a.sweep, tuple(o for o in a.only.split(",") if o))
        save()
    if "timing" in a.parts:
        res["timing"] = []
        timing(dev, a.quick, res["timing"], save)
        print(f"timing done at {time.time() - t0:.0f}s", flush=True)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
