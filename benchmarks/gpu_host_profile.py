"""Where the host time of a graph-replayed step goes: batch-1 generation on random SmolLM2-135M-shaped
weights (bf16, triton backend, CUDA graphs), plain and with the shipped drafter's shapes, under
max_model_len 1024 and 8192, greedy and at temperature 1 (seeded: the general, non-one-sync path):
tok/s, ms per step, a cProfile of one run (top functions by own time) and, for the temperature-1
cells, a torch.profiler table of one run (ops and kernels by self CUDA time, with call counts).
Usage: python benchmarks/gpu_host_profile.py OUT_DIR"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.drafters import shipped_drafter  # noqa: E402
from tests.conftest import write_tiny_checkpoint  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
smol = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
            tie_word_embeddings=True, initializer_range=0.02)
target = write_tiny_checkpoint(Path(tempfile.mkdtemp()) / "smol", "llama", seed=1, **smol)
res = {}
prompt = [[7] * 200]
cells = (("plain-1024", 1024, False, 0.0), ("plain-8192", 8192, False, 0.0), ("dspark-8192", 8192, True, 0.0),
         ("plain-1024-T1", 1024, False, 1.0), ("dspark-1024-T1", 1024, True, 1.0))
for name, max_len, spec, temp in cells:
    p = SamplingParams(temperature=temp, max_tokens=256, ignore_eos=True, seed=1 if temp else None)
    kw = dict(device="cuda", dtype="bfloat16", max_model_len=max_len, max_num_seqs=8, attention_backend="triton")
    if spec:
        kw["speculative_config"] = {"model": str(shipped_drafter("smollm2-135m-instruct")),
                                    "draft_sample_method": "probabilistic"}
    llm = LLM(str(target), **kw)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    row = {}
    for rep in range(2):
        torch.cuda.synchronize()
        s0 = llm.engine.runner.graphs.stats["target"]
        t0 = time.perf_counter()
        llm.generate(prompt, p)
        dt = time.perf_counter() - t0
        steps = llm.engine.runner.graphs.stats["target"] - s0
        row[f"run{rep}"] = {"tok_s": round(256 / dt, 1), "ms_per_step": round(dt / max(steps, 1) * 1e3, 3),
                            "graph_steps": steps}
    pr = cProfile.Profile()
    pr.enable()
    llm.generate(prompt, p)
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    row["profile_tottime"] = buf.getvalue()[-6000:]
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(40)
    row["profile_cumulative"] = buf.getvalue()[-8000:]
    if temp:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompt, p)
        row["torch_profile"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40)[-9000:]
        print(row["torch_profile"][-5000:], flush=True)
    res[name] = row
    print(name, json.dumps({k: v for k, v in row.items() if not k.startswith("profile")}), flush=True)
    print(row["profile_tottime"][-3500:], flush=True)
    del llm
    torch.cuda.empty_cache()
(out / "host_profile.json").write_text(json.dumps(res, indent=1))
