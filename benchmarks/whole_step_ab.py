"""Whole-step graphs on and off, end to end, in ONE engine (session 62): a one-sync DSpark step of up to 16 requests
runs as one CUDA graph (cuda_graphs.py, WHOLE_STEP_MAX_BATCH) or as the three graphs; the switch is flipped between
the timed calls (StepGraphs.whole_max_batch), which alternate, so both read the same machine state.

Random SmolLM2-135M-shaped target weights (no GGUF to carry: the device calls that bring its pieces cost device
time) and the shipped drafter, bf16, CUDA graphs: the drafts are nearly all rejected, so this times the DSpark step
(~1 token per step), not the speed-up. Reports per (batch, temperature): median tok/s and ms per engine step with
the whole-step graphs off and on, and whether the tokens are the same (greedy; seeded temperature 1).
Usage: PYTHONPATH=$PWD python benchmarks/whole_step_ab.py OUT_DIR"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

os.environ.setdefault("DSPARK_WHOLE_STEP", "1")  # on (the default for captured graphs since this A/B, session 64)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.drafters import shipped_drafter  # noqa: E402
from benchmarks.smol_random import smol_checkpoint  # noqa: E402

out_dir = Path(sys.argv[1])
out_dir.mkdir(parents=True, exist_ok=True)
RUNS = 3
llm = LLM(str(smol_checkpoint()), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_seqs=32,
          attention_backend="triton", kv_cache_memory_gb=4, enable_prefix_caching=False,
          speculative_config={"model": str(shipped_drafter("smollm2-135m-instruct")),
                              "draft_sample_method": "probabilistic", "rejection_sample_method": "block"})
engine = llm.engine
sets = list(engine.runner.graph_sets.values()) or [engine.runner.graphs]
on_size = sets[0].whole_max_batch
res: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
             "whole_max_batch": on_size, "runs": RUNS, "cells": {}}


def switch(on: bool) -> None:
    for G in sets:
        G.whole_max_batch = on_size if on else 0


for B in (1, 8):
    prompts = [[7 + i] * 300 for i in range(B)]
    for T in (0.0, 1.0):
        p = SamplingParams(temperature=T, max_tokens=256, ignore_eos=True, seed=1 if T else None)
        times: dict = {False: [], True: []}
        steps: dict = {False: [], True: []}
        shas: dict = {False: set(), True: set()}
        whole0 = sets[0].stats["whole"]
        for i in range(RUNS + 1):
            for on in (False, True) if i % 2 == 0 else (True, False):
                switch(on)
                n0 = engine.spec_stats.num_steps
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, p)
                dt = time.perf_counter() - t0
                if i == 0:
                    continue  # warm-up
                times[on].append(dt)
                steps[on].append((engine.spec_stats.num_steps - n0) / B)
                shas[on].add(hashlib.sha256(json.dumps([o.token_ids for o in outs]).encode()).hexdigest()[:12])
        switch(True)
        tokens = B * 256
        cell = {}
        for on in (False, True):
            t = statistics.median(times[on])
            cell["on" if on else "off"] = {"tok_s": round(tokens / t, 1), "ms_per_step": round(t / statistics.median(
                steps[on]) * 1e3, 4), "steps_per_request": statistics.median(steps[on]), "runs_s": times[on]}
        cell["on_vs_off"] = round(cell["on"]["tok_s"] / cell["off"]["tok_s"], 4)
        cell["same_tokens"] = len(shas[False] | shas[True]) == 1
        cell["whole_steps"] = sets[0].stats["whole"] - whole0
        key = f"B{B}/T{T:g}"
        res["cells"][key] = cell
        print(key, {k: (v if not isinstance(v, dict) else {a: b for a, b in v.items() if a != "runs_s"})
                    for k, v in cell.items()}, flush=True)
        (out_dir / "whole_step_ab.json").write_text(json.dumps(res, indent=1))
