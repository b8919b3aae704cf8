"""GPU check and step timings of the CUDA-graph path, on random weights (no GGUF needed, so it can run
in the device calls that bring the GGUF pieces). Usage: python benchmarks/gpu_graphs_check.py OUT_DIR [parts]

parts (comma-separated, default all):
  correct  tiny random Llama + random DSpark drafter, fp32 and bf16: greedy and seeded temperature-1
           outputs with captured graphs == the same engine eager (enforce_eager) == the torch backend.
  steps    SmolLM2-135M shapes (random weights) with the shipped drafter's shapes, bf16: GPU time of one
           graph replay (CUDA events) for the target decode step (q=1), the verification step (q=1+N)
           and the drafter step, at batch 1/8/32, context 1k; the 1k-context decode step under
           max_model_len 8192 vs 1024 (context buckets); eager vs graph engine tok/s at batch 1.
           STEPS_ONLY (comma-separated row names, e.g. "max_model_len=8192/dspark") runs only those
           rows; STEPS_MAX_LENS (e.g. "2048") the max_model_len values; STEPS_EAGER=0 skips the eager
           engine run.
  kernels  the same shapes: the GPU kernels of one plain decode step (target + sampling graphs) and one
           greedy DSpark step (target q=1+N + verification + drafter graphs) at batch 1 and 32, context
           1k, under torch.profiler (graph replays), by kernel name: where a verification step's extra
           time over a decode step goes. KERNELS_SAMPLED=1: the temperature-1 steps instead (the sampled
           verification and the probabilistic drafter; from batch 16 the graph set of the sampled-batch rule's
           verify length, 3 drafts); KERNELS_B (e.g. "8,32") the batch sizes; KERNELS_PER_GRAPH=1 also each
           graph's kernels on their own (``per_graph``).
Writes OUT_DIR/graphs_check.json and prints a summary.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from dspark import LLM, SamplingParams

out_dir = Path(sys.argv[1])
parts = sys.argv[2].split(",") if len(sys.argv) > 2 else ["correct", "steps", "kernels"]
out_dir.mkdir(parents=True, exist_ok=True)
res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d")}
tmp = Path(tempfile.mkdtemp())
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.conftest import write_tiny_checkpoint  # noqa: E402
from tests.spec.drafters import random_drafter  # noqa: E402


def error_row(e: Exception) -> dict:
    import traceback

    return {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-3000:]}


def report(name: str, row: dict) -> None:
    print(name, json.dumps({k: v for k, v in row.items() if k != "tb"}), flush=True)
    if "tb" in row:
        print(row["tb"], flush=True)


def save():
    (out_dir / "graphs_check.json").write_text(json.dumps(res, indent=1))


def outputs(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params)]


if "correct" in parts:
    target = write_tiny_checkpoint(tmp / "t", "llama", seed=7, max_position_embeddings=512)
    drafter = random_drafter(tmp / "d", target, target_layer_ids=[0], block_size=4)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 9, 26, 40, 5)]
    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 33, 48, 12, 40)]
    sampled = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=i) for i in range(5)]
    checks = {}
    for dtype in ("float32", "bfloat16"):
        for spec in (None, {"model": str(drafter)}, {"model": str(drafter), "draft_sample_method": "probabilistic"}):
            name = f"{dtype}/{'plain' if spec is None else spec.get('draft_sample_method', 'greedy-draft')}"
            kw = dict(device="cuda", dtype=dtype, block_size=16, max_num_seqs=8, max_model_len=256)
            if spec:
                kw["speculative_config"] = spec
            try:
                t0 = time.perf_counter()
                graph = LLM(str(target), attention_backend="triton", **kw)
                cap_s = time.perf_counter() - t0
                eager = LLM(str(target), attention_backend="triton", enforce_eager=True, **kw)
                torch_b = LLM(str(target), attention_backend="torch", **kw)
                row = {"capture_s": round(cap_s, 1), "graphs": len(graph.engine.runner.graphs.target)
                       + len(graph.engine.runner.graphs.draft)}
                for pname, params in (("greedy", greedy), ("sampled", sampled)):
                    a, b, c = outputs(graph, prompts, params), outputs(eager, prompts, params), outputs(torch_b, prompts, params)
                    row[pname] = {"graph==eager": a == b, "graph==torch": a == c,
                                  "same_prompts": sum(x == y for x, y in zip(a, b))}
                row["replays"] = dict(graph.engine.runner.graphs.stats)
                row["blocks_in_use_after"] = graph.engine.kv.check_integrity()["in_use"]
                if spec:
                    st = graph.engine.spec_stats
                    row["drafts"], row["accepted"] = st.num_drafts, st.num_accepted
            except Exception as e:  # report and go on to the next configuration
                row = error_row(e)
            checks[name] = row
            report(name, row)
    res["correct"] = checks
    save()


def replay_ms(graphs, table, key, reps=200):
    c = table[key]
    for _ in range(10):
        c.graph.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(reps):
        c.graph.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) / reps


def fill(graphs, B, ctx):
    """Inputs for B requests at context ctx (blocks 1.. per request), via run_target's own code path."""
    q = graphs.q
    nb = -(-(ctx + q) // graphs.block_size)
    sched = [types.SimpleNamespace(num_tokens=q, num_spec_tokens=q - 1, samples=True) for _ in range(B)]
    ids = [5] * (B * q)
    starts = [ctx - 1] * B
    tables = [list(range(1 + b * nb, 1 + (b + 1) * nb)) for b in range(B)]
    t0 = time.perf_counter()
    _, Bg, bucket = graphs.run_target(sched, ids, starts, tables)
    torch.cuda.synchronize()
    return Bg, bucket, (time.perf_counter() - t0) * 1e3


if "steps" in parts:
    from dspark.drafters import shipped_drafter

    smol = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
                rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.02)
    target = write_tiny_checkpoint(tmp / "smol", "llama", seed=1, **smol)
    drafter = shipped_drafter("smollm2-135m-instruct")
    steps: dict = {}
    # STEPS_ONLY="max_model_len=8192/dspark,...": these rows only; STEPS_EAGER=0: no eager engine run;
    # STEPS_MAX_LENS="2048": these max_model_len values (default 8192 and 1024, DSpark at 1024 only if named)
    only = [n for n in os.environ.get("STEPS_ONLY", "").split(",") if n]
    for max_len in [int(x) for x in os.environ.get("STEPS_MAX_LENS", "8192,1024").split(",")]:
        for spec in (False, True):
            name = f"max_model_len={max_len}/{'dspark' if spec else 'plain'}"
            if (name not in only) if only else (max_len == 1024 and spec):
                continue
            kw = dict(device="cuda", dtype="bfloat16", max_model_len=max_len, max_num_seqs=32,
                      attention_backend="triton", kv_cache_memory_gb=4)
            if spec:
                kw["speculative_config"] = {"model": str(drafter)}
            try:
                t0 = time.perf_counter()
                llm = LLM(str(target), **kw)
                row = {"startup_s": round(time.perf_counter() - t0, 1)}
                gr = llm.engine.runner.graphs
                for B in (1, 8, 32):
                    Bg, bucket, host_ms = fill(gr, B, 1000)
                    row[f"B{B}"] = {"bucket": bucket, "target_ms": round(replay_ms(gr, gr.target, (Bg, bucket)), 4),
                                    "fill_and_replay_ms": round(host_ms, 3)}
                    if spec:
                        row[f"B{B}"]["draft_ms"] = round(replay_ms(gr, gr.draft, (Bg, bucket, False)), 4)
                        row[f"B{B}"]["draft_prob_ms"] = round(replay_ms(gr, gr.draft, (Bg, bucket, True)), 4)
                if max_len == 8192:
                    Bg, bucket, _ = fill(gr, 1, 1000)
                    row["B1_ctx1000_in_full_length_graph_ms"] = round(replay_ms(gr, gr.target, (1, gr.buckets[-1])), 4)
                    Bg, bucket, _ = fill(gr, 1, 4000)
                    row["B1_ctx4000"] = {"bucket": bucket, "target_ms": round(replay_ms(gr, gr.target, (1, bucket)), 4)}
                # engine end to end, batch 1, 256 tokens, graphs vs eager
                p = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
                prompt = [[7] * 200]
                llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                o = llm.generate(prompt, p)
                dt = time.perf_counter() - t0
                row["engine_b1_tok_s_graphs"] = round(len(o[0].token_ids) / dt, 1)
                del llm
                torch.cuda.empty_cache()
                if max_len == 8192 and os.environ.get("STEPS_EAGER", "1") == "1":
                    eager = LLM(str(target), enforce_eager=True, **kw)
                    eager.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o2 = eager.generate(prompt, p)
                    row["engine_b1_tok_s_eager"] = round(len(o2[0].token_ids) / (time.perf_counter() - t0), 1)
                    row["eager==graphs"] = o2[0].token_ids == o[0].token_ids
                    del eager
                    torch.cuda.empty_cache()
            except Exception as e:
                row = error_row(e)
            steps[name] = row
            report(name, row)
            res["steps"] = steps
            save()

if "kernels" in parts:
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.smol_random import smol_checkpoint
    from dspark.drafters import default_speculative_config, shipped_drafter
    from dspark.engine.cuda_graphs import VERIFY_GREEDY, VERIFY_SAMPLED

    target = smol_checkpoint()
    kern: dict = {}
    sampled = os.environ.get("KERNELS_SAMPLED") == "1"
    tag = "/T1" if sampled else ""
    for spec in (False, True):
        kw = dict(device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32, attention_backend="triton",
                  kv_cache_memory_gb=4)
        if spec:  # the shipped drafter's recommended settings (the sampled-batch rule) as SmolLM2's engine applies them
            kw["speculative_config"] = (default_speculative_config("smollm2-135m-instruct") if sampled
                                        else {"model": str(shipped_drafter("smollm2-135m-instruct"))})
        name = "dspark" if spec else "plain"
        try:
            llm = LLM(str(target), **kw)
            for B in (int(b) for b in os.environ.get("KERNELS_B", "1,32").split(",")):
                gr = llm.engine.runner.graphs
                rule = getattr(llm.engine, "verify_policy", None)
                if spec and sampled and B >= getattr(rule, "min_batch", 1 << 30):  # the sampled-batch rule's set
                    gr = llm.engine.runner.graph_sets[rule.short]
                Bg, bucket, _ = fill(gr, B, 1000)
                seq = [gr.target[(Bg, bucket)]] + ([gr.verify[(Bg, VERIFY_SAMPLED if sampled else VERIFY_GREEDY)],
                                                    gr.draft[(Bg, bucket, sampled)]]
                                                   if spec else [gr.sample[(Bg, False)]])
                reps = 50
                for _ in range(5):
                    for c in seq:
                        c.graph.replay()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(reps):
                        for c in seq:
                            c.graph.replay()
                    torch.cuda.synchronize()
                rows = []
                for e in prof.key_averages():
                    t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                    if t > 0:
                        rows.append({"name": e.key[:100], "per_step": round(e.count / reps, 2),
                                     "us_per_step": round(t / reps, 2)})
                rows.sort(key=lambda r: -r["us_per_step"])
                steps_ms = [replay_ms(gr, {0: c}, 0) for c in seq]
                key = f"{name}/B{B}{tag}"
                # and each graph's kernels on its own (KERNELS_PER_GRAPH=1): which graph a small op belongs to
                per_graph = {}
                if os.environ.get("KERNELS_PER_GRAPH") == "1":
                    labels = ["target"] + (["verify", "draft"] if spec else ["sample"])
                    for label, c in zip(labels, seq):
                        with profile(activities=[ProfilerActivity.CUDA]) as p1:
                            for _ in range(reps):
                                c.graph.replay()
                            torch.cuda.synchronize()
                        per_graph[label] = sorted(
                            ({"name": e.key[:100], "per_step": round(e.count / reps, 2),
                              "us_per_step": round(t / reps, 2)} for e in p1.key_averages()
                             if (t := getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0))),
                            key=lambda r: -r["us_per_step"])
                kern[key] = {"q": gr.q, "graph_ms": [round(x, 4) for x in steps_ms],
                             "total_ms": round(sum(steps_ms), 4),
                             "kernels_per_step": round(sum(r["per_step"] for r in rows), 1),
                             "kernel_us_per_step": round(sum(r["us_per_step"] for r in rows), 1),
                             "kernels": rows[:40], **({"per_graph": per_graph} if per_graph else {})}
                report(f"kernels {key}", {k: v for k, v in kern[key].items() if k != "kernels"})
                for r in rows[:25]:
                    print("   ", r, flush=True)
            del llm
            torch.cuda.empty_cache()
        except Exception as e:
            kern[name] = error_row(e)
            report(f"kernels {name}", kern[name])
        res["kernels"] = kern
        save()
save()
print("done", flush=True)
