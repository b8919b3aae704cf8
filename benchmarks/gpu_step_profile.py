"""Where the GPU time of a decode step goes: the engine (random SmolLM2-135M-shaped weights, bf16, triton,
CUDA graphs, async scheduling) generating greedily at batch 1 and 32, under torch.profiler: every
kernel by total GPU time with its count (graph kernels included, as CUPTI reports them), per step.
Usage: python benchmarks/gpu_step_profile.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402
from benchmarks.smol_random import smol_checkpoint  # noqa: E402

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
target = smol_checkpoint()
llm = LLM(str(target), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
          attention_backend="triton", kv_cache_memory_gb=4, enable_prefix_caching=False)
res = {}
for B in (1, 32):
    prompts = [[7 + i] * 300 for i in range(B)]
    p = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate(prompts, p)
    torch.cuda.synchronize()
    steps0 = llm.engine.runner.graphs.stats["target"]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, p)
        torch.cuda.synchronize()
    steps = llm.engine.runner.graphs.stats["target"] - steps0
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append({"name": e.key[:110], "count": e.count, "us_total": round(t, 1),
                         "us_per_step": round(t / max(steps, 1), 2), "count_per_step": round(e.count / max(steps, 1), 2)})
    rows.sort(key=lambda r: -r["us_total"])
    total = sum(r["us_total"] for r in rows)
    res[f"B{B}"] = {"graph_steps": steps, "gpu_us_per_step_all_kernels": round(total / max(steps, 1), 1),
                    "kernels": rows[:40]}
    print(f"=== B={B}: {steps} graph steps, {total / max(steps, 1):.1f} µs of kernels per step", flush=True)
    for r in rows[:30]:
        print(f"{r['us_per_step']:9.2f} us/step {r['count_per_step']:7.2f}/step  {r['name']}", flush=True)
(out_dir / "step_profile.json").write_text(json.dumps(res, indent=1))
