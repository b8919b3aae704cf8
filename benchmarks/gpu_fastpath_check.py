"""GPU checks and timings of the session-11 fast-path changes, on random weights (no GGUF needed, so it
runs in the device calls that bring the GGUF pieces).
Usage: python benchmarks/gpu_fastpath_check.py OUT_DIR [parts]

parts (comma-separated, default all):
  combine  paged attention with the key-split merge inside the attention launch (last split program
           merges; kernels/paged_attention.py) vs the two-launch path, bf16, SmolLM2 heads: (1) a race
           hunt: many launches with fresh random inputs each, eager and replayed in a CUDA graph, every
           output compared with the two-launch output of the same inputs; (2) µs per launch in a graph
           of 30 launches (one per layer) at batch 1/8/32, context 512/1k/4k, decode and verify (q=6).
  lmhead   the fp32 lm_head matmul [B, 576] x [576, 49152] vs bf16 weights with fp32 output
           (torch.mm(out_dtype=float32), if this torch has it), at batch 1/32, in a graph of 30 reps.
  gemm     cuBLAS products of SmolLM2's layer shapes at 1/8/32/192 rows, bf16: input-major [K, N] weights
           vs output-major [N, K] seen transposed (layers/linear.py CUDA_OUTPUT_MAJOR), µs in a graph of 30.
  engine   SmolLM2-135M shapes (random weights), bf16, greedy, EOS ignored: decode tok/s of the engine
           end to end at batch 1 (256 tokens) and batch 32 (128 tokens), async scheduling on/off, for the
           default engine and with RoPE + the K/V write inside the attention launch (models/llama.py
           ROPE_IN_ATTENTION; its tokens must equal the default's: bit-identical kernels), plus
           output-major weights when "output_major" is among the parts; tokens identical with async on/off.
  spec     the same target with the shipped drafter's shapes (random target: drafts mostly rejected, so this
           times the step pipeline), greedy DSpark with async scheduling on vs off; identical tokens.
  spec_t1  the same at temperature 1 (seeded): one-sync steps for sampled requests (runner.one_sync_sampled)
           on vs off; identical tokens.
  gemv     (not in the default list) the few-row GEMV kernels of dspark/kernels/gemv.py, bf16, SmolLM2 shapes,
           M = 1/2/8/16 rows: (a) µs in a graph of 30 of add_rms_norm_linear vs add_rms_norm + matmul
           (576 -> 960), add_rms_norm_gate_up_silu vs add_rms_norm + matmul + silu_and_mul (576 -> 2x1536),
           linear_small_m vs matmul (576 -> 576, 1536 -> 576), max abs diff vs the unfused result, the
           same with output-major weights, and at M = 1 and 8 a sweep of launch configurations (block_n,
           block_k, num_warps, num_stages; the rows as GEMV_ROWS=1,8 and the 1-row sweep off with
           GEMV_SWEEP1=0); per_layer_sum adds the four products' sums.
  gemv_engine (not in the default list) the engine (greedy, EOS ignored) at B=1 x 256 and
           B=8 x 128 tokens with models/llama.py SMALL_M_GEMV off, on, and on with cuBLAS kept for o_proj /
           down_proj (SMALL_M_GEMV_PLAIN False), and on for steps of up to 8 rows (GEMV_MAX_ROWS 8: B=8
           on the GEMVs' row loop): tok/s and the fraction of tokens identical to "off"
           (summation order differs from cuBLAS, so random-weight near-ties may flip).
  spec_gemv (not in the default list) greedy DSpark as in "spec" with the target's verification blocks of
           B=1 (6 rows) on the GEMVs (GEMV_MAX_ROWS 8) vs cuBLAS (GEMV_MAX_ROWS 1); tokens compared.
  train    (not in the default list) a drafter training step (dspark/train, B=16 x 1,024 tokens, 128 anchors per
           sequence, the shipped drafter's shapes, random SmolLM2-shaped target, random tokens): ms per
           optimizer step in fp32 lm_head products, TF32 (TrainConfig.tf32), and TF32 + compiled loss
           (compile_loss); the CUDA kernels of one step by total time (torch.profiler).
  block_verify (not in the default list) probabilistic verification at SmolLM2's vocabulary (49,152),
           N = 4 and 6 drafts, B = 1/8/32 (random p, q a perturbation of p, ragged draft counts):
           µs per call in a graph of 30 of verify_standard_triton, verify_block_triton and the torch
           verify_probabilistic(..., "block"), and over 10 fresh draws per shape the fraction of rows
           whose tokens and count the block kernel gives exactly as the torch reference (an ulp of h_i
           may flip τ where U_i ≈ h_i: kernels/rejection.py), with the mean accepted count of each method.
Writes OUT_DIR/fastpath.json and prints a summary.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark.kernels import paged_attention as pa  # noqa: E402

out_dir = Path(sys.argv[1])
parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["combine", "lmhead", "gemm", "engine", "spec", "spec_t1"]
out_dir.mkdir(parents=True, exist_ok=True)
res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
dev = torch.device("cuda")


def save():
    (out_dir / "fastpath.json").write_text(json.dumps(res, indent=1))


def report(name, row):
    print(name, json.dumps(row), flush=True)


def batch(B, ctx, q, page=16, Hq=9, Hkv=3, D=64, seed=0):
    """B requests of ctx context tokens (the q new ones included), each on its own blocks."""
    g = torch.Generator(device=dev).manual_seed(seed)
    nb = -(-ctx // page)
    num_blocks = 1 + B * nb
    kc = torch.randn(num_blocks, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(num_blocks, page, Hkv, D, device=dev, dtype=torch.bfloat16, generator=g)
    table = (1 + torch.arange(B * nb, device=dev)).view(B, nb)
    seq_lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    qsl = (torch.arange(B + 1, device=dev) * q).to(torch.int32)
    qt = torch.randn(B * q, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    return qt, kc, vc, table, seq_lens, qsl


def graph_us(fn, per_graph: int = 30, replays: int = 20) -> float:
    """µs per call of ``fn``: captured ``per_graph`` times in one CUDA graph (as layers are), replayed."""
    fn()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for _ in range(per_graph):
            fn()
    gr.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(replays):
        gr.replay()
    e1.record()
    torch.cuda.synchronize()
    return round(e0.elapsed_time(e1) * 1e3 / replays / per_graph, 2)


def smol_target():
    """A random-weight checkpoint of SmolLM2-135M's shapes and 32 random prompts of 50-300 tokens."""
    from benchmarks.smol_random import smol_checkpoint

    target = smol_checkpoint()
    g = torch.Generator().manual_seed(0)
    return target, [torch.randint(10, 49000, (int(n),), generator=g).tolist()
                    for n in torch.randint(50, 300, (32,), generator=g)]


def timed_generate(llm, prompts, n: int, warm_tokens: int = 16, temperature: float = 0.0) -> tuple[dict, list]:
    """Best of 3 timed calls (after a warm-up; greedy, or seeded at ``temperature``): tok/s, wall, and
    the engine's per-step figures."""
    from dspark import SamplingParams

    B = len(prompts)
    seed = 1 if temperature else None
    p = SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, seed=seed)
    llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=warm_tokens, ignore_eos=True, seed=seed))
    best = outs = None
    for _ in range(3):
        st, G = llm.engine.spec_stats, llm.engine.runner.graphs
        before = (st.num_steps, st.verify_time_s, st.draft_time_s, G.stats["target"])
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, p)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        graph_steps = max(G.stats["target"] - before[3], 1)
        cand = {"tok_s": round(B * n / dt, 1), "wall_s": round(dt, 4), "graph_steps": graph_steps,
                "gpu_ms_per_graph_step": round(1e3 * (st.verify_time_s - before[1]) / graph_steps, 4)}
        if st.num_steps > before[0]:  # DSpark: target / drafter GPU ms per engine step
            steps = (st.num_steps - before[0]) / B
            cand["target_ms_per_step"] = round(1e3 * (st.verify_time_s - before[1]) / steps, 4)
            cand["drafter_ms_per_step"] = round(1e3 * (st.draft_time_s - before[2]) / steps, 4)
        if best is None or cand["tok_s"] > best["tok_s"]:
            best = cand
    return best, [o.token_ids for o in outs]


def attend(qt, kc, vc, table, seq_lens, qsl, q, bucket, fuse, out=None):
    return pa.paged_attention(qt, kc, vc, table, seq_lens, qsl, 0.125, max_query_len=q, max_seq_len=bucket,
                              fuse_combine=fuse, out=out)


if "combine" in parts:
    rows = {}
    # (1) race hunt
    worst, n_cmp, bad = 0.0, 0, 0
    for B, ctx, q in ((1, 1000, 1), (1, 4000, 1), (8, 1000, 6), (32, 700, 1), (32, 3000, 6), (3, 130, 1)):
        qt, kc, vc, table, seq_lens, qsl = batch(B, ctx, q)
        bucket = 1 << max(9, (ctx - 1).bit_length())
        out_f, out_u = torch.empty_like(qt), torch.empty_like(qt)
        for i in range(150):  # eager, fresh inputs every time
            qt.normal_()
            attend(qt, kc, vc, table, seq_lens, qsl, q, bucket, True, out_f)
            attend(qt, kc, vc, table, seq_lens, qsl, q, bucket, False, out_u)
            d = (out_f.float() - out_u.float()).abs().max().item()
            worst, n_cmp, bad = max(worst, d), n_cmp + 1, bad + (d > 0.02)
        # in a CUDA graph: 30 launches per replay (as 30 layers), fresh q per replay
        static_q = qt.clone()
        outs = [torch.empty_like(qt) for _ in range(30)]
        attend(static_q, kc, vc, table, seq_lens, qsl, q, bucket, True, outs[0])  # warm-up sizes the counters
        torch.cuda.synchronize()
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            for o in outs:
                attend(static_q, kc, vc, table, seq_lens, qsl, q, bucket, True, o)
        for i in range(100):
            static_q.normal_()
            gr.replay()
            attend(static_q, kc, vc, table, seq_lens, qsl, q, bucket, False, out_u)
            d = max((o.float() - out_u.float()).abs().max().item() for o in outs)
            worst, n_cmp, bad = max(worst, d), n_cmp + 1, bad + (d > 0.02)
        del gr
        ref = pa.paged_attention_ref(static_q, kc, vc, table, seq_lens, qsl, 0.125)
        attend(static_q, kc, vc, table, seq_lens, qsl, q, bucket, True, out_f)
        rows[f"ref_B{B}_ctx{ctx}_q{q}_maxdiff"] = round((out_f.float() - ref.float()).abs().max().item(), 5)
    rows["race_hunt"] = {"comparisons": n_cmp, "max_abs_diff_vs_two_launch": worst, "bad(>0.02)": bad,
                         "counters_zero_after": all(int(b.abs().sum()) == 0 for b in pa._COUNTER_BUFS.values())}
    report("combine/race_hunt", rows["race_hunt"])
    # (2) timing: µs per launch, 30 launches per graph
    timing = {}
    for q in (1, 6):
        for B in (1, 8, 32):
            for ctx in (512, 1000, 4000):
                qt, kc, vc, table, seq_lens, qsl = batch(B, ctx, q)
                bucket = 1 << max(9, (ctx - 1).bit_length())
                row = {}
                for fuse in (False, True):
                    o = torch.empty_like(qt)
                    row["fused_us" if fuse else "two_launch_us"] = graph_us(
                        lambda: attend(qt, kc, vc, table, seq_lens, qsl, q, bucket, fuse, o), replays=50)
                row["splits"] = pa.default_num_splits(B * 3, dev, bucket, 64 if q == 1 else 128)
                timing[f"q{q}_B{B}_ctx{ctx}"] = row
                report(f"combine/q{q}_B{B}_ctx{ctx}", row)
    rows["timing"] = timing
    res["combine"] = rows
    save()

if "lmhead" in parts:
    rows = {}
    w32 = torch.randn(576, 49152, device=dev) * 0.02
    w16 = w32.to(torch.bfloat16)
    w32 = w16.float()  # the engine's fp32 lm_head is an upcast of bf16 weights
    for B in (1, 32):
        h = torch.randn(B, 576, device=dev, dtype=torch.bfloat16)
        variants = {"fp32": lambda: torch.matmul(h.float(), w32)}
        try:
            torch.mm(h, w16, out_dtype=torch.float32)
            variants["bf16_out_fp32"] = lambda: torch.mm(h, w16, out_dtype=torch.float32)
        except Exception as e:  # noqa: BLE001
            rows["out_dtype_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        row = {}
        for name, fn in variants.items():
            row[f"{name}_us"] = graph_us(fn)
        if "bf16_out_fp32" in variants:
            a, b = variants["fp32"](), variants["bf16_out_fp32"]()
            row["max_abs_diff"] = (a - b).abs().max().item()
            row["argmax_equal"] = bool((a.argmax(-1) == b.argmax(-1)).all())
        rows[f"B{B}"] = row
        report(f"lmhead/B{B}", row)
    res["lmhead"] = rows
    save()

if "gemm" in parts:
    # cuBLAS at few rows: input-major weights [K, N] (the default) vs output-major [N, K] seen transposed
    rows = {}
    for K, N in ((576, 960), (576, 576), (576, 3072), (1536, 576)):
        w_in = torch.randn(K, N, device=dev, dtype=torch.bfloat16) * 0.02
        w_out = w_in.t().contiguous().t()
        for M in (1, 8, 32, 192):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            row = {}
            for name, w in (("input_major", w_in), ("output_major", w_out)):
                row[f"{name}_us"] = graph_us(lambda: torch.matmul(x, w), replays=30)
            row["equal"] = bool(torch.equal(torch.matmul(x, w_in), torch.matmul(x, w_out)))
            rows[f"K{K}_N{N}_M{M}"] = row
            report(f"gemm/K{K}_N{N}_M{M}", row)
    res["gemm"] = rows
    save()

if "engine" in parts:
    from dspark import LLM

    target, prompts = smol_target()
    rows, tokens = {}, {}
    from dspark.layers import linear
    from dspark.models import llama

    configs = [("base", True), ("base", False), ("rope_in_attention", True), ("rope_in_attention", False)]
    if "output_major" in parts:
        configs.append(("output_major", True))
    for layout, async_ in configs:
        linear.CUDA_OUTPUT_MAJOR = layout == "output_major"
        llama.ROPE_IN_ATTENTION = layout == "rope_in_attention"
        name = f"{layout}/async={async_}"
        llm = LLM(str(target), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
                  attention_backend="triton", kv_cache_memory_gb=4, async_scheduling=async_,
                  enable_prefix_caching=False)
        row = {}
        for B, n in ((1, 256), (32, 128)):
            row[f"B{B}"], toks = timed_generate(llm, prompts[:B], n)
            tokens.setdefault(f"{layout}/B{B}", []).append(toks)
        row["async_steps"] = llm.engine.runner.graphs.stats["async"]
        rows[name] = row
        report(f"engine/{name}", row)
        del llm
        torch.cuda.empty_cache()
    linear.CUDA_OUTPUT_MAJOR = False
    llama.ROPE_IN_ATTENTION = False
    # async on vs off must give the same tokens (the same graphs compute every row); fused vs two-launch
    # merges round differently in fp32, so random-weight near-ties may flip between those
    rows["async_tokens_identical"] = {k: all(x == v[0] for x in v) for k, v in tokens.items()}
    rows["rope_in_attention_tokens_identical"] = {
        f"B{B}": tokens.get(f"rope_in_attention/B{B}", [None])[0] == tokens.get(f"base/B{B}", [None])[0]
        for B in (1, 32)}
    report("engine/async_tokens_identical", rows["async_tokens_identical"])
    report("engine/rope_in_attention_tokens_identical", rows["rope_in_attention_tokens_identical"])
    res["engine"] = rows
    save()
if "gemv" in parts:
    from dspark.kernels import gemv as gv
    from dspark.kernels.fused_ops import add_rms_norm, silu_and_mul

    H, I, QKV, EPS = 576, 1536, 960, 1e-5
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(torch.bfloat16)

    nw = (torch.rand(H, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    W = {"qkv": rnd(H, QKV, scale=H**-0.5), "gate_up": rnd(H, 2 * I, scale=H**-0.5), "o": rnd(H, H, scale=H**-0.5),
         "down": rnd(I, H, scale=I**-0.5)}
    # a small sweep at M = 1 only: every setting is a Triton compile per kernel (~1-2 s each)
    SWEEP = {"bn4": dict(block_n=4), "bn16": dict(block_n=16), "warps8": dict(num_warps=8),
             "bk128_s3": dict(block_k=128), "bn16_bk128_s3": dict(block_n=16, block_k=128)}
    # at M = 8 (a batch-1 verification block of 1 + 7 drafts): the row loop's launch settings. Session 32
    # also timed a [rows, K, N] partial-product path here (commit 77bfe8c, removed again): 2-4x slower than
    # the row loop for qkv and gate_up (docs/benchmarks.md, "H200 session 32").
    SWEEP8 = {"bk32": dict(block_k=32), "bk128": dict(block_k=128), "bn16": dict(block_n=16),
              "warps8": dict(num_warps=8)}
    gemv_rows = tuple(int(m) for m in os.environ.get("GEMV_ROWS", "1,2,8,16").split(","))
    rows = {}
    for M in gemv_rows:
        x, r, xi = rnd(M, H), rnd(M, H, scale=4.0), rnd(M, I)

        def cases(w):
            return {  # name -> (fused(config), unfused, (M, K, N, tiles) for gemv_config)
                "qkv": (lambda c: gv.add_rms_norm_linear(x, r, nw, EPS, w["qkv"], **c)[0],
                        lambda: torch.matmul(add_rms_norm(x, r, nw, EPS)[0], w["qkv"]), (M, H, QKV, 1)),
                "gate_up": (lambda c: gv.add_rms_norm_gate_up_silu(x, r, nw, EPS, w["gate_up"], **c)[0],
                            lambda: silu_and_mul(torch.matmul(add_rms_norm(x, r, nw, EPS)[0], w["gate_up"])),
                            (M, H, I, 2)),
                "o": (lambda c: gv.linear_small_m(x, w["o"], **c), lambda: torch.matmul(x, w["o"]), (M, H, H, 1)),
                "down": (lambda c: gv.linear_small_m(xi, w["down"], **c), lambda: torch.matmul(xi, w["down"]),
                         (M, I, H, 1)),
            }

        W_om = {k: v.t().contiguous().t() for k, v in W.items()}  # output-major copies seen [K, N]
        om = cases(W_om)
        for name, (fused, unfused, shape) in cases(W).items():
            row = {"unfused_us": graph_us(unfused), "fused_us": graph_us(lambda: fused({})),
                   "config": gv.gemv_config(*shape)}
            a, b = fused({}).float(), unfused().float()
            row["max_abs_diff"] = (a - b).abs().max().item()
            row["max_abs_ref"] = b.abs().max().item()
            row["frac_equal"] = round((a == b).float().mean().item(), 4)
            try:
                row["fused_output_major_us"] = graph_us(lambda: om[name][0]({}))
                row["unfused_output_major_us"] = graph_us(om[name][1])
            except Exception as e:  # noqa: BLE001
                row["output_major_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            if M == 8 or (M == 1 and os.environ.get("GEMV_SWEEP1", "1") == "1"):
                sweep = {}
                for label, cfg in (SWEEP if M == 1 else SWEEP8).items():
                    try:
                        sweep[label] = graph_us(lambda: fused(cfg))
                    except Exception as e:  # noqa: BLE001  (e.g. out of registers / shared memory)
                        sweep[label] = f"{type(e).__name__}: {str(e)[:120]}"
                row["sweep_us"] = sweep
                timed = {k: v for k, v in sweep.items() if isinstance(v, float)}
                if timed:
                    row["best_sweep"] = min(timed, key=timed.get)
            rows[f"{name}_M{M}"] = row
            report(f"gemv/{name}_M{M}", row)
    per_layer = {}
    for M in gemv_rows:
        un = sum(rows[f"{n}_M{M}"]["unfused_us"] for n in ("qkv", "gate_up", "o", "down"))
        fu = sum(rows[f"{n}_M{M}"]["fused_us"] for n in ("qkv", "gate_up", "o", "down"))
        fu_keep_cublas = sum(rows[f"{n}_M{M}"]["fused_us"] for n in ("qkv", "gate_up")) + sum(
            rows[f"{n}_M{M}"]["unfused_us"] for n in ("o", "down"))
        per_layer[f"M{M}"] = {"unfused_us": round(un, 2), "gemv_all_us": round(fu, 2),
                              "gemv_k1_k2_cublas_o_down_us": round(fu_keep_cublas, 2)}
    rows["per_layer_sum"] = per_layer
    report("gemv/per_layer_sum", per_layer)
    res["gemv"] = rows
    save()

if "gemv_engine" in parts:  # (b) the engine with SMALL_M_GEMV on vs off
    from dspark import LLM
    from dspark.models import llama

    target, prompts = smol_target()
    eng, tokens = {}, {}
    # off; on (o_proj / down_proj on linear_small_m too); on with cuBLAS for o_proj / down_proj
    for name, on, plain, rows in (("off", False, True, 1), ("on", True, True, 1), ("on_cublas_o_down", True, False, 1),
                                  ("on_8_rows", True, True, 8)):
        llama.SMALL_M_GEMV, llama.SMALL_M_GEMV_PLAIN = on, plain  # read when the model is built
        llama.GEMV_MAX_ROWS = rows  # on_8_rows: B = 2..8 decode steps on the GEMVs too
        llm = LLM(str(target), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
                  attention_backend="triton", kv_cache_memory_gb=4, enable_prefix_caching=False)
        model = llm.engine.runner.model
        row = {"small_m_gemv": model.small_m_gemv, "plain": model.small_m_gemv_plain}
        for B, n in ((1, 256), (8, 128)):
            row[f"B{B}"], toks = timed_generate(llm, prompts[:B], n)
            tokens.setdefault(f"B{B}", {})[name] = toks
        eng[name] = row
        report(f"gemv/engine/{name}", row)
        del llm, model
        torch.cuda.empty_cache()
    llama.SMALL_M_GEMV, llama.SMALL_M_GEMV_PLAIN, llama.GEMV_MAX_ROWS = None, True, 1
    same = {}
    for key, (off, on) in ((f"{B}/{name}", (runs["off"], runs[name])) for B, runs in tokens.items()
                           for name in ("on", "on_cublas_o_down", "on_8_rows")):
        total = sum(len(t) for t in off)
        equal = sum(a == b for t0, t1 in zip(off, on) for a, b in zip(t0, t1))
        prefix = 0
        for t0, t1 in zip(off, on):
            k = 0
            while k < min(len(t0), len(t1)) and t0[k] == t1[k]:
                k += 1
            prefix += k
        same[key] = {"frac_identical_tokens": round(equal / total, 4), "frac_common_prefix": round(prefix / total, 4),
                     "identical_outputs": sum(t0 == t1 for t0, t1 in zip(off, on)), "outputs": len(off)}
    eng["tokens_on_vs_off"] = same
    report("gemv/engine/tokens_on_vs_off", same)
    res["gemv_engine"] = eng
    save()


def spec_part(part: str, switch: str, temperature: float, stat: str, setup) -> None:
    """DSpark (the shipped drafter's shapes; random target weights, so drafts are mostly rejected: the
    timing of the step pipeline, not of acceptance) with ``switch`` on vs off (``setup(target,
    llm_kwargs, on)`` builds the LLM with it); B=1 x 256 and B=32 x 128 tokens; the tokens must be identical."""
    from dspark.drafters import shipped_drafter

    target, prompts = smol_target()
    rows, tokens = {}, {}
    for on in (True, False):
        kw = dict(device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32, attention_backend="triton",
                  kv_cache_memory_gb=4, enable_prefix_caching=False,
                  speculative_config={"model": str(shipped_drafter("smollm2-135m-instruct"))})
        llm = setup(target, kw, on)
        row = {}
        for B, n in ((1, 256), (32, 128)):
            row[f"B{B}"], toks = timed_generate(llm, prompts[:B], n, warm_tokens=32, temperature=temperature)
            tokens.setdefault(f"B{B}", []).append(toks)
        row[f"{stat}_steps"] = llm.engine.runner.graphs.stats[stat]
        rows[f"{switch}={on}"] = row
        report(f"{part}/{switch}={on}", row)
        del llm
        torch.cuda.empty_cache()
    rows["tokens_identical"] = {k: all(x == v[0] for x in v) for k, v in tokens.items()}
    report(f"{part}/tokens_identical", rows["tokens_identical"])
    res[part] = rows
    save()


def _async(target, kw, on):
    from dspark import LLM

    return LLM(str(target), **kw, async_scheduling=on)


def _one_sync_sampled(target, kw, on):
    from dspark import LLM

    llm = LLM(str(target), **kw)
    llm.engine.runner.one_sync_sampled = on
    return llm


if "spec" in parts:  # greedy DSpark, async scheduling on vs off
    spec_part("spec", "async", 0.0, "async", _async)
if "spec_t1" in parts:  # T = 1 DSpark, one-sync steps for sampled requests on vs off
    spec_part("spec_t1", "one_sync_sampled", 1.0, "one_sync", _one_sync_sampled)



def _gemv_rows(target, kw, on):
    from dspark import LLM
    from dspark.models import llama

    llama.GEMV_MAX_ROWS = 8 if on else 1  # read when the model is built
    try:
        return LLM(str(target), **kw)
    finally:
        llama.GEMV_MAX_ROWS = 1


if "spec_gemv" in parts:  # greedy DSpark, B=1 verification (1 + 7 rows) on the GEMVs vs cuBLAS
    spec_part("spec_gemv", "gemv_max_rows_8", 0.0, "async", _gemv_rows)

if "train" in parts:  # the trainer's step time, fp32 vs TF32 lm_head products vs + compiled loss
    import tempfile

    from dspark.train.data import TokenData
    from dspark.train.trainer import Trainer, TrainConfig

    target, _ = smol_target()
    g = torch.Generator().manual_seed(0)
    n = 64
    tmp = Path(tempfile.mkdtemp())
    TokenData.from_sequences([torch.randint(10, 49000, (200,), generator=g).tolist() for _ in range(n)],
                             [torch.randint(10, 49000, (900,), generator=g).tolist() for _ in range(n)],
                             {}).save(tmp / "data.safetensors")
    rows = {}
    for name, kw in (("fp32", {}), ("tf32", dict(tf32=True)), ("tf32_compiled_loss", dict(tf32=True, compile_loss=True))):
        row: dict = {}
        try:
            cfg = TrainConfig(out=str(tmp / name), data=str(tmp / "data.safetensors"), model=str(target),
                              batch_size=16, device="cuda", eval_every=0, save_every=0, steps=1000, **kw)
            tr = Trainer(cfg, ["check"])
            t0 = time.perf_counter()
            for _ in range(3):
                tr._optimizer_step()
            torch.cuda.synchronize()
            row["first_3_steps_s"] = round(time.perf_counter() - t0, 2)
            t0 = time.perf_counter()
            for _ in range(10):
                out, _, _ = tr._optimizer_step()
            torch.cuda.synchronize()
            row["ms_per_step"] = round((time.perf_counter() - t0) * 100, 1)
            row["rows_per_step"] = out.num_rows
            row["loss"] = round(out.total.item(), 4)
            row["peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                tr._optimizer_step()
                torch.cuda.synchronize()
            ka = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
            total = sum(e.device_time_total for e in ka)
            row["profiled_cuda_ms"] = round(total / 1e3, 1)
            row["top_kernels"] = [[e.key[:90], round(e.device_time_total / 1e3, 2), e.count] for e in ka[:18]]
            del tr
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        rows[name] = row
        report(f"train/{name}", {k: v for k, v in row.items() if k != "top_kernels"})
        for k in row.get("top_kernels", [])[:10]:
            print("   ", k, flush=True)
    res["train"] = rows
    save()



def block_verify_part(vocab: int = 49152, drafts=(4, 6), batches=(1, 8, 32), draws: int = 10) -> dict:
    """The block_verify part (see the module docstring); the sizes are arguments so that it can be
    tried small, in Triton's interpreter."""
    from dspark.kernels.rejection import verify_block_triton, verify_standard_triton
    from dspark.spec.rejection import verify_probabilistic

    def inputs(B: int, N: int, seed: int) -> tuple:
        g = torch.Generator(device=dev).manual_seed(seed)
        logits = 3.0 * torch.randn(B, N + 1, vocab, device=dev, generator=g)
        q = (logits[:, :N] + 0.8 * torch.randn(B, N, vocab, device=dev, generator=g)).softmax(-1)
        drafts_ = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(B, N)
        nd = torch.full((B,), N, dtype=torch.int64, device=dev)
        nd[1::3] = torch.arange(N + 1, device=dev).repeat(B)[:nd[1::3].numel()]  # ragged, 0..N
        seeds = torch.randint(0, 2**62, (B,), device=dev, generator=g)
        pos = torch.randint(0, 4096, (B,), device=dev, generator=g)
        return logits.softmax(-1), drafts_, q, nd, seeds, pos

    rows = {}
    for N in drafts:
        for B in batches:
            args = inputs(B, N, 100 * N + B)
            row = {}
            for name, fn in (("standard_triton_us", lambda: verify_standard_triton(*args)),
                             ("block_triton_us", lambda: verify_block_triton(*args)),
                             ("block_torch_us", lambda: verify_probabilistic(*args, "block"))):
                try:
                    row[name] = graph_us(fn)
                except Exception as e:  # noqa: BLE001
                    row[name] = f"{type(e).__name__}: {str(e)[:200]}"
            same = total = 0
            acc = {"standard": 0, "block": 0}
            for d in range(draws):
                a = args if d == 0 else inputs(B, N, 100 * N + B + 7919 * d)
                ref_t, ref_n = verify_probabilistic(*a, "block")
                got_t, got_n = verify_block_triton(*a)
                same += int(((ref_t == got_t).all(1) & (ref_n == got_n)).sum())
                total += B
                acc["block"] += int(ref_n.sum()) - B
                acc["standard"] += int(verify_probabilistic(*a, "standard")[1].sum()) - B
            row["block_rows_identical"] = round(same / total, 6)
            row["rows_compared"] = total
            row["mean_accepted"] = {k: round(v / total, 3) for k, v in acc.items()}
            rows[f"N{N}_B{B}"] = row
            report(f"block_verify/N{N}_B{B}", row)
    return rows


if "block_verify" in parts:  # the fused block verification kernel vs standard's and the torch reference
    res["block_verify"] = block_verify_part()
    save()

print("done", flush=True)
