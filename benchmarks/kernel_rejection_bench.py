"""GPU check and timing of the fused standard verification kernel (dspark/kernels/rejection.py)
against verify_probabilistic(..., "standard"), at SmolLM2 sizes (vocabulary 49,152, N = 5 drafts).

    python -m benchmarks.kernel_rejection_bench --out kernel_rejection.json

For batch 1 / 8 / 32 / 128: random target distributions, drafts sampled from a perturbation of them
(so some are accepted and some rejected), seeded requests. The kernel's tokens and counts are first
compared with the reference on the same CUDA tensors (a mismatch is reported, with how many rows);
then both are timed with ``triton.testing.do_bench`` (median ms), and the kernel also as a replayed
CUDA graph (it never synchronises with the host).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import dspark.kernels  # noqa: F401  (interpreter choice before triton is imported)
import triton.testing

from dspark.kernels.rejection import verify_block_triton, verify_standard_triton
from dspark.spec.rejection import verify_probabilistic

VOCAB, N = 49152, 5


def inputs(B: int, seed: int, n: int = N) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = 3.0 * torch.randn(B, n + 1, VOCAB, device="cuda", generator=g)
    p = logits.softmax(-1)
    q = (logits[:, :n] + 0.8 * torch.randn(B, n, VOCAB, device="cuda", generator=g)).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, VOCAB), 1, generator=g).view(B, n)
    num_drafts = torch.full((B,), n, dtype=torch.int64, device="cuda")
    num_drafts[::3] = torch.arange(0, n + 1, device="cuda").repeat(B)[: num_drafts[::3].numel()]  # ragged
    seeds = torch.arange(B, dtype=torch.int64, device="cuda") * 7919 + seed
    positions = torch.randint(0, 2000, (B,), device="cuda", generator=g)
    return p, drafts, q, num_drafts, seeds, positions


def graph_ms(fn) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay)


def sweep(batches: list[int], n: int, block_vs: list[int], splits: list[int | None]) -> list[dict]:
    """Block verification (the shipped drafter's default) at n drafts: CUDA-graph ms of verify_block_triton at
    each (block_v, splits) launch, tokens checked against the reference (the split count never changes them;
    the tile size fixes the residual masses' summation order, so a rare last-bit difference is possible)."""
    rows = []
    for B in batches:
        args = inputs(B, 4321 + B, n)
        ref_t, ref_n = verify_probabilistic(*args, "block")
        for bv in block_vs:
            for sp in splits:
                got_t, got_n = verify_block_triton(*args, block_v=bv, splits=sp)
                bad = int(((ref_t != got_t).any(1) | (ref_n != got_n)).sum())
                ms = graph_ms(lambda: verify_block_triton(*args, block_v=bv, splits=sp))
                rows.append({"method": "block", "batch": B, "drafts": n, "block_v": bv, "splits": sp,
                             "rows_differing": bad, "fused_graph_ms": ms})
                print(f"block B={B:4d} N={n} block_v {bv:5d} splits {sp!s:>4}: graph {1e3 * ms:7.1f} us, "
                      f"differing rows {bad}", flush=True)
    return rows


def from_logits(batches: list[int], n: int) -> list[dict]:
    """A sampled batch's verification as the CUDA graphs run it, both ways: softmax.temperature_softmax_argmax
    (probabilities written) then verify_*_triton on them, against softmax.temperature_softmax_stats then
    verify_*_triton on the logits with ``target_stats`` (each p made where it is read). Tokens and counts must
    be equal to the bit (rows_differing 0); CUDA-graph µs of each whole pipeline, at T = 1 and mixed
    temperatures."""
    from dspark.kernels.softmax import temperature_softmax_argmax, temperature_softmax_stats

    rows = []
    for B in batches:
        g = torch.Generator(device="cuda").manual_seed(99 + B)
        logits = 3.0 * torch.randn(B * (n + 1), VOCAB, device="cuda", generator=g)
        _, drafts, q, nd, seeds, positions = inputs(B, 7 + B, n)
        for temps in ("T=1", "mixed"):
            t = torch.ones(B, device="cuda") if temps == "T=1" else torch.rand(B, device="cuda", generator=g) * 1.5
            t = t.repeat_interleave(n + 1)
            for method, fn in (("block", verify_block_triton), ("standard", verify_standard_triton)):
                def probs_way():
                    p, _ = temperature_softmax_argmax(logits, t)
                    return fn(p.view(B, n + 1, VOCAB), drafts, q, nd, seeds, positions)

                def stats_way():
                    st, _ = temperature_softmax_stats(logits, t)
                    return fn(logits.view(B, n + 1, VOCAB), drafts, q, nd, seeds, positions,
                              target_stats=st.view(B, n + 1, 3))
                (wt, wn), (gt, gn) = probs_way(), stats_way()
                bad = int(((wt != gt).any(1) | (wn != gn)).sum())
                ms_p, ms_s = graph_ms(probs_way), graph_ms(stats_way)
                rows.append({"method": method, "batch": B, "drafts": n, "temperatures": temps, "rows_differing": bad,
                             "mean_emitted": wn.float().mean().item(), "probs_graph_ms": ms_p,
                             "stats_graph_ms": ms_s})
                print(f"{method:8s} B={B:4d} N={n} {temps:5s}: probs {1e3 * ms_p:6.1f} us, from logits "
                      f"{1e3 * ms_s:6.1f} us, differing rows {bad}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernel_rejection.json")
    ap.add_argument("--sweep", action="store_true",
                    help="block verification's launch (block_v x splits) at --batches and --drafts instead")
    ap.add_argument("--from-logits", action="store_true",
                    help="softmax + verification from written probabilities vs from the logits (target_stats), "
                         "at --batches and --drafts: tokens compared, CUDA-graph time of each")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--drafts", type=int, default=3)
    ap.add_argument("--block-v", default="512,1024,2048")
    ap.add_argument("--splits", default="0,16,24,48", help="0: the default (rejection.BLOCK_PROGRAMS_PER_SM programs per SM)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if a.from_logits:
        rows = from_logits([int(b) for b in a.batches.split(",")], a.drafts)
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(a.out, "w"),
                  indent=2)
        return 1 if any(r["rows_differing"] for r in rows) else 0
    if a.sweep:
        rows = sweep([int(b) for b in a.batches.split(",")], a.drafts, [int(v) for v in a.block_v.split(",")],
                     [int(x) or None for x in a.splits.split(",")])
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(a.out, "w"),
                  indent=2)
        return 0
    rows = []
    for B in (1, 8, 32, 128):
        args = inputs(B, 1234 + B)
        ref_t, ref_n = verify_probabilistic(*args, "standard")
        got_t, got_n = verify_standard_triton(*args)
        bad = int(((ref_t != got_t).any(1) | (ref_n != got_n)).sum())
        ms_ref = triton.testing.do_bench(lambda: verify_probabilistic(*args, "standard"))
        ms_fused = triton.testing.do_bench(lambda: verify_standard_triton(*args))
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            verify_standard_triton(*args)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            verify_standard_triton(*args)
        ms_graph = triton.testing.do_bench(graph.replay)
        row = {"batch": B, "drafts": N, "vocab": VOCAB, "rows_differing": bad,
               "mean_emitted": ref_n.float().mean().item(), "reference_ms": ms_ref, "fused_ms": ms_fused,
               "fused_graph_ms": ms_graph, "speedup": ms_ref / ms_fused}
        rows.append(row)
        print(f"B={B:4d}  differing rows {bad}  reference {ms_ref:.3f} ms  fused {ms_fused:.3f} ms "
              f"(graph {ms_graph:.3f})  {ms_ref / ms_fused:.1f}x", flush=True)
    json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, open(a.out, "w"),
              indent=2)
    return 1 if any(r["rows_differing"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
