"""Launch-parameter sweep of the engine's paged-attention call (``paged_attention(rope=)``, the RoPE +
K/V-write fused variant that ``TritonAttentionBackend.attend_rope`` runs in every captured step), at
SmolLM2-135M's attention shapes, bf16, page 16, on ragged contexts inside a context bucket.

For each (query rows per request, batch, bucket) it times the wrapper's own launch and a grid of
key tile (64 / 128) x pipeline stages (2 / 3 / 4) x key-range splits (1 .. 32, at least one key tile
per slice of the bucket), all with 4 warps (8 lost nearly everywhere in session 30's sweep), each
checked against ``paged_attention_ref`` first. The contexts are drawn uniformly in [bucket / 2,
bucket - q] per request, the launch is given ``max_seq_len = bucket`` as the engine's captured graphs
are, and times are CUDA-graph replays (``triton.testing.do_bench_cudagraph``), median µs per call.

L2: replayed alone, a kernel finds its caches in the H200's 50 MB L2 whenever they fit (batch 32 at 1k
context: 25 MB), which no engine step does (30 layers' weights and caches pass between two reads of one
layer's cache). Session 31's first sweep timed it so and its rule made batch-32 engine steps slower
(docs/benchmarks.md). So by default (``--l2 cold``) each timed call first overwrites a buffer of twice
the L2 and the time of that overwrite alone is subtracted; ``--l2 warm`` times the kernel alone.

The point is ``dspark.kernels.paged_attention.PAGED_TUNING`` / ``tuned_launch``: the rule the wrapper
applies when no launch parameter is forced. ``--out`` writes every row plus the best setting per shape
as JSON; the printed table says, per shape, the untuned launch (``tuning=False``: default_num_splits'
count, 64-key tiles for 16-row query tiles, else 128, Triton's stages), the tuned one (the rule's pick:
what the engine runs) and the best of the sweep.

Usage: PYTHONPATH=$PWD python benchmarks/paged_tuning_sweep.py --out out/paged_tuning.json
       [--q-lens 1,4,8] [--batches 1,8,32,64,128] [--buckets 512,2048] [--stages 2,3,4] [--splits 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

HQ, HKV, HEAD_DIM, PAGE = 9, 3, 64, 16
SCALE = HEAD_DIM**-0.5


def inputs(B: int, bucket: int, q_len: int, seed: int = 0) -> dict:
    """B requests with ragged contexts in the bucket's upper half, ``q_len`` new rows each, on shuffled
    blocks; q / k / v as strided views of one qkv projection (as the engine's decoder layer has them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ctx = torch.randint(bucket // 2, bucket - q_len + 1, (B,), generator=g, device="cuda")
    seq = ctx + q_len
    per = -(-bucket // PAGE)
    num_blocks = 1 + B * per
    ids = torch.randperm(num_blocks - 1, generator=g, device="cuda") + 1
    tables = ids[: B * per].view(B, per).long()
    dt = torch.bfloat16
    kc = torch.randn(num_blocks, PAGE, HKV, HEAD_DIM, generator=g, device="cuda").to(dt)
    vc = torch.randn(num_blocks, PAGE, HKV, HEAD_DIM, generator=g, device="cuda").to(dt)
    T = B * q_len
    req = torch.arange(B, device="cuda").repeat_interleave(q_len)
    positions = ctx[req] + torch.arange(q_len, device="cuda").repeat(B)
    slots = tables[req, positions // PAGE] * PAGE + positions % PAGE
    qkv = torch.randn(T, (HQ + 2 * HKV) * HEAD_DIM, generator=g, device="cuda").to(dt)
    q = qkv[:, : HQ * HEAD_DIM].view(T, HQ, HEAD_DIM)
    k = qkv[:, HQ * HEAD_DIM: (HQ + HKV) * HEAD_DIM].view(T, HKV, HEAD_DIM)
    v = qkv[:, (HQ + HKV) * HEAD_DIM:].view(T, HKV, HEAD_DIM)
    inv = 1.0 / (100000.0 ** (torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM))
    ang = torch.arange(bucket + 8, device="cuda").float()[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], -1)
    sin = emb.sin()
    rope = dict(k=k, v=v, positions=positions, cos=emb.cos(),
                sin_signed=torch.cat([-sin[:, : HEAD_DIM // 2], sin[:, HEAD_DIM // 2:]], -1), slot_mapping=slots)
    return dict(q=q, k_cache=kc, v_cache=vc, block_tables=tables, seq_lens=seq.int(),
                qsl=(torch.arange(B + 1, device="cuda") * q_len).int(), rope=rope, k=k, v=v, positions=positions,
                slots=slots)


def time_us(fn, rep: int) -> float:
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", type=Path)
    ints = lambda t: tuple(int(v) for v in t.split(","))  # noqa: E731
    ap.add_argument("--q-lens", type=ints, default=(1, 4, 8), help="query rows per request (1: decode)")
    ap.add_argument("--batches", type=ints, default=(1, 8, 32, 64, 128))
    ap.add_argument("--buckets", type=ints, default=(512, 2048), help="context buckets (max_seq_len of the launch)")
    ap.add_argument("--stages", type=ints, default=(2, 3, 4))
    ap.add_argument("--splits", type=ints, default=(1, 2, 4, 8, 16, 32))
    ap.add_argument("--rep", type=int, default=25, help="ms of replays per timing (do_bench_cudagraph rep)")
    ap.add_argument("--l2", choices=("cold", "warm"), default="cold",
                    help="cold (default): flush the L2 before each call and subtract the flush's time")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("paged_tuning_sweep needs a CUDA GPU")
    import triton

    from dspark.kernels import paged_attention as pa
    from dspark.kernels.fused_ops import rope_qk_cache

    rows, best = [], []
    flush_us = 0.0
    if args.l2 == "cold":
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        scratch = torch.empty(2 * l2 // 4, dtype=torch.float32, device="cuda")
        flush = scratch.zero_
        flush_us = time_us(flush, args.rep)
        print(f"L2 {l2 / 2**20:.0f} MiB: each timed call first overwrites {2 * l2 / 2**20:.0f} MiB "
              f"({flush_us:.1f} µs, subtracted)", flush=True)
    for q_len, B, bucket in itertools.product(args.q_lens, args.batches, args.buckets):
        x = inputs(B, bucket, q_len)
        # the reference: rope_qk_cache into a copy of the caches, then the fp32 attention reference
        kc_ref, vc_ref = x["k_cache"].clone(), x["v_cache"].clone()
        qr, _ = rope_qk_cache(x["q"], x["k"], x["v"], x["positions"], x["rope"]["cos"], x["rope"]["sin_signed"],
                              kc_ref, vc_ref, x["slots"])
        ref = pa.paged_attention_ref(qr, kc_ref, vc_ref, x["block_tables"], x["seq_lens"], x["qsl"], SCALE).float()

        def call(**kw):
            return pa.paged_attention(x["q"], x["k_cache"], x["v_cache"], x["block_tables"], x["seq_lens"], x["qsl"],
                                      SCALE, max_query_len=q_len, max_seq_len=bucket, rope=x["rope"], **kw)

        settings = {"tuned": {}, "untuned": dict(tuning=False)}
        for bn, st in itertools.product((64, 128), args.stages):
            for s in args.splits:
                if s * bn <= bucket:
                    settings[f"n{bn}_st{st}_s{s}"] = dict(block_n=bn, num_stages=st, num_splits=s, num_warps=4)
        label = f"q={q_len} B={B} bucket={bucket}"
        times = {}
        for name, kw in settings.items():
            out = call(**kw).float()
            err = ((out - ref).abs() / ref.abs().clamp(min=1.0)).max().item()
            if err > 2e-2:
                sys.exit(f"check failed: {label} {name}: max err {err:.3e}")
            if args.l2 == "cold":
                def timed(kw=kw):
                    flush()
                    call(**kw)
                times[name] = us = time_us(timed, args.rep) - flush_us
            else:
                times[name] = us = time_us(lambda kw=kw: call(**kw), args.rep)
            rows.append({"q_len": q_len, "B": B, "bucket": bucket, "setting": name, "us": us, "max_err": err})
        top = min((k for k in times if k not in ("tuned", "untuned")), key=times.get)
        best.append({"q_len": q_len, "B": B, "bucket": bucket, "untuned_us": times["untuned"],
                     "tuned_us": times["tuned"], "best": top, "best_us": times[top]})
        print(f"{label:<28} untuned {times['untuned']:7.1f}  tuned {times['tuned']:7.1f}  "
              f"best {top:<16} {times[top]:7.1f} µs", flush=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "paged_tuning": pa.PAGED_TUNING, "l2": args.l2, "l2_flush_us": flush_us, "best": best, "rows": rows}
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
