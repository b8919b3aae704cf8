"""Where the time of a DSpark step goes, greedy vs temperature 1: the engine (random SmolLM2-135M-shaped
target, the shipped drafter; bf16, triton, CUDA graphs) generating at batch 1 and 32 under torch.profiler.
Random target weights reject most drafts, so this times the step pipeline, not acceptance.

Reports per engine step: (1) host time of the runner's phases (each wrapped in a record_function:
execute, the target graph replay, verification, its sampling batch and target probabilities, the fused
verify kernel, drafting), (2) the CPU ops with the most self time (launch and Python overhead), and
(3) the GPU kernels with the most time. Written to answer why a T = 1 DSpark step's "target" time is
about twice the greedy one on the H200 (2.3 vs 1.1 ms at batch 1, `dspark bench`, session 12).
Usage: python benchmarks/gpu_spec_profile.py OUT_DIR"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.drafters import shipped_drafter  # noqa: E402
from dspark.engine import runner as runner_mod  # noqa: E402
from benchmarks.smol_random import smol_checkpoint  # noqa: E402

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
target = smol_checkpoint()
llm = LLM(str(target), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
          attention_backend="triton", kv_cache_memory_gb=4, enable_prefix_caching=False,
          speculative_config={"model": str(shipped_drafter("smollm2-135m-instruct")),
                              "draft_sample_method": "probabilistic"})  # as the shipped config drafts
engine, runner = llm.engine, llm.engine.runner
PHASES = []


def wrap(obj, name: str, label: str) -> None:
    fn = getattr(obj, name, None)
    if fn is None:  # a phase of an older runner
        return

    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, name, wrapped)
    PHASES.append(label)


wrap(engine, "step", "phase:engine.step")
wrap(engine.scheduler, "schedule", "phase:scheduler.schedule")
wrap(runner, "execute", "phase:runner.execute")
wrap(runner, "_verify", "phase:runner._verify")
wrap(runner, "_sampling_batch", "phase:runner._sampling_batch")
wrap(runner, "_verify_probabilistic", "phase:runner._verify_probabilistic")
wrap(runner, "_draft", "phase:runner._draft")
wrap(runner.graphs, "replay_target", "phase:graphs.replay_target")
wrap(runner.graphs, "run_draft", "phase:graphs.run_draft")
wrap(runner.graphs, "upload", "phase:graphs.upload")
wrap(runner, "launch_one_sync", "phase:runner.launch_one_sync")
wrap(runner, "finish_one_sync", "phase:runner.finish_one_sync")
wrap(runner.graphs, "replay_verify", "phase:graphs.replay_verify")
wrap(runner.graphs, "prepare_target", "phase:graphs.prepare_target")
wrap(runner.graphs, "prepare_sampling", "phase:graphs.prepare_sampling")
wrap(runner.graphs, "replay_draft", "phase:graphs.replay_draft")
wrap(runner.graphs, "drafter_inputs_on_device", "phase:graphs.drafter_inputs_on_device")
wrap(runner_mod, "compute_probs", "phase:compute_probs")
res = {}
for T in (1.0, 0.0):  # T = 1 first: the question (a session-12 run timed out after the greedy half)
    for B in (1, 32):
        prompts = [[7 + i] * 300 for i in range(B)]
        p = SamplingParams(temperature=T, max_tokens=48, ignore_eos=True, seed=1 if T else None)
        llm.generate(prompts, p)
        torch.cuda.synchronize()
        n0 = engine.spec_stats.num_steps
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, p)
            torch.cuda.synchronize()
        steps = max((engine.spec_stats.num_steps - n0) / B, 1)  # verification steps (per request)
        cpu, gpu, phases = [], [], {}
        for e in prof.key_averages():
            if e.key.startswith("phase:"):
                phases[e.key[6:]] = {"count_per_step": round(e.count / steps, 2),
                                     "host_us_per_step": round(e.cpu_time_total / steps, 1)}
                continue
            if e.self_cpu_time_total > 0:
                cpu.append({"name": e.key[:90], "count_per_step": round(e.count / steps, 2),
                            "self_cpu_us_per_step": round(e.self_cpu_time_total / steps, 1)})
            t = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if t > 0:
                gpu.append({"name": e.key[:90], "count_per_step": round(e.count / steps, 2),
                            "us_per_step": round(t / steps, 1)})
        cpu.sort(key=lambda r: -r["self_cpu_us_per_step"])
        gpu.sort(key=lambda r: -r["us_per_step"])
        key = f"T{T:g}/B{B}"
        # every kernel (session 61: which ones in the step are not Triton, i.e. launch without PDL); with PDL a
        # kernel's time includes its wait for the one before, so times add up past the step's
        res[key] = {"verify_steps": steps, "phases": phases, "cpu_ops": cpu[:40], "gpu_kernels": gpu}
        print(f"=== {key}: {steps:.0f} verification steps per request", flush=True)
        for k, v in sorted(phases.items(), key=lambda kv: -kv[1]["host_us_per_step"]):
            print(f"  phase {k:28s} {v['host_us_per_step']:9.1f} us/step  x{v['count_per_step']}", flush=True)
        for r in cpu[:18]:
            print(f"  cpu {r['self_cpu_us_per_step']:9.1f} us/step x{r['count_per_step']:6.2f}  {r['name']}", flush=True)
        for r in gpu[:10]:
            print(f"  gpu {r['us_per_step']:9.1f} us/step x{r['count_per_step']:6.2f}  {r['name']}", flush=True)
        (out_dir / "spec_profile.json").write_text(json.dumps(res, indent=1))
