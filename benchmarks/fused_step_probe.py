"""What the graph boundaries of a DSpark step cost: the one-sync step's pieces as the engine queues them
(target graph, verification graph, the drafter-inputs kernel, drafter graph, the three timing events, the
read-back's cat and copy) against the same work captured as ONE CUDA graph.

Question (session 62): with programmatic dependent launch every kernel inside a graph may start while the
one before it finishes, but not the first kernel of a graph, and each graph launch and each small operation
between graphs costs device time of its own (session 37: 5-12 µs each). A batch-1 DSpark step has four graph
boundaries; plain decoding has two. How much of the DSpark step is that?

Random SmolLM2-135M-shaped target weights, the shipped drafter, bf16, context 1,000 (the 1k bucket under
max_model_len 2048). GPU time per step from CUDA events over REPS replays, for batch 1, 8, 16 and 32, greedy
(greedy verification, greedy drafts) and sampled (sampled verification, probabilistic drafts; the rows'
temperatures stay 0, so this times the launches, not the acceptance). The merged graph's outputs are compared
with the separate graphs' (same inputs, same kernels: equal bits).
Usage: PYTHONPATH=$PWD python benchmarks/fused_step_probe.py OUT_DIR"""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM  # noqa: E402
from dspark.drafters import shipped_drafter  # noqa: E402
from dspark.engine.cuda_graphs import VERIFY_GREEDY, VERIFY_SAMPLED  # noqa: E402
from benchmarks.smol_random import smol_checkpoint  # noqa: E402

REPS = int(os.environ.get("PROBE_REPS", "200"))
out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
             "pdl": os.environ.get("DSPARK_PDL", "default"), "reps": REPS, "cells": {}}
llm = LLM(str(smol_checkpoint()), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
          attention_backend="triton", kv_cache_memory_gb=4, enable_prefix_caching=False,
          speculative_config={"model": str(shipped_drafter("smollm2-135m-instruct"))})  # 7 drafts at every batch
runner = llm.engine.runner
pin = torch.zeros(4096, dtype=torch.int64, pin_memory=True)


def fill(G, B, ctx):
    q = G.q
    nb = -(-(ctx + q) // G.block_size)
    sched = [types.SimpleNamespace(num_tokens=q, num_spec_tokens=q - 1, samples=True) for _ in range(B)]
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(B)]
    _, Bg, bucket = G.run_target(sched, [5] * (B * q), [ctx - 1] * B, tables)
    torch.cuda.synchronize()
    return Bg, bucket


def timed(fn) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(REPS):
        fn()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / REPS * 1e3  # µs per step


G = runner.graphs
for B in (1, 8, 16, 32):
    Bg, k = fill(G, B, 1000)
    for sampled in (False, True):
        kind = VERIFY_SAMPLED if sampled else VERIFY_GREEDY
        tg, vg, dg = G.target[(Bg, k)], G.verify[(Bg, kind)], G.draft[(Bg, k, sampled)]
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(3)]

        def pieces(events=True, readback=True):
            if events:
                evs[0].record()
            tg.graph.replay()
            vg.graph.replay()
            if events:
                evs[1].record()
            G.drafter_inputs_on_device(Bg, G.v_out[:Bg], G.v_n[:Bg])
            dg.graph.replay()
            if events:
                evs[2].record()
            if readback:
                flat = torch.cat([G.v_out[:Bg].reshape(-1), G.v_n[:Bg], dg.outputs[0].reshape(-1)])
                pin[:flat.numel()].copy_(flat, non_blocking=True)

        def body():
            G._target_step(Bg, k)
            G._verify_step(Bg, kind)
            G.drafter_inputs_on_device(Bg, G.v_out[:Bg], G.v_n[:Bg])
            return G._draft_step(Bg, k, sampled)

        cell = {"engine_sequence_us": timed(pieces), "no_events_us": timed(lambda: pieces(False)),
                "graphs_and_inputs_kernel_us": timed(lambda: pieces(False, False)),
                "target_graph_us": timed(tg.graph.replay), "verify_graph_us": timed(vg.graph.replay),
                "draft_graph_us": timed(dg.graph.replay)}
        # the same work as one graph (a pool of its own: nothing shared with the engine's graphs)
        pieces(False, False)
        torch.cuda.synchronize()
        ref = (G.v_out[:Bg].clone(), G.v_n[:Bg].clone(), dg.outputs[0].clone())
        body()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = body()
        g.replay()
        torch.cuda.synchronize()
        cell["merged_equal"] = bool(torch.equal(ref[0], G.v_out[:Bg]) and torch.equal(ref[1], G.v_n[:Bg])
                                    and torch.equal(ref[2], outs[0]))

        def merged(readback=True):
            g.replay()
            if readback:
                flat = torch.cat([G.v_out[:Bg].reshape(-1), G.v_n[:Bg], outs[0].reshape(-1)])
                pin[:flat.numel()].copy_(flat, non_blocking=True)

        cell["merged_us"] = timed(merged)
        cell["merged_graph_only_us"] = timed(lambda: merged(False))
        cell = {a: round(b, 2) if isinstance(b, float) else b for a, b in cell.items()}
        key = f"B{B}/{'sampled' if sampled else 'greedy'}"
        res["cells"][key] = cell
        print(key, cell, flush=True)
        del g
        (out_dir / "fused_step_probe.json").write_text(json.dumps(res, indent=1))
