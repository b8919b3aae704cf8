"""`dspark bench decode`: greedy batch-1 decode speed, dspark vs HF transformers eager, side by side in one process.

Both systems generate the same number of new tokens from the same chat prompts, greedily, ignoring
EOS. Each does one untimed warm-up; then runs alternate (dspark, HF, dspark, HF, ...) so that machine
noise hits both alike. Reported: new tokens / wall time of the whole generate call (prefill included,
identical for both) and the ratio. dspark speculates with the shipped drafter unless ``--no-spec``
(the plain-decode figures in docs/benchmarks.md use ``--no-spec``); the JSON records which.
The full matrix (batch sizes, prompt sets, temperatures, HF static+compiled) is ``dspark bench``
(dspark/bench/matrix.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

import torch

from dspark.bench.common import run_header

PROMPTS = [
    "Explain how a hash map works, in a few paragraphs.",
    "Write a short story about a robot learning to paint.",
    "What are the main differences between TCP and UDP?",
]


def _hf_model(engine) -> torch.nn.Module:
    import transformers

    from dspark.models.gguf_loader import default_gguf_path
    from dspark.models.loader import DEFAULT_MODEL

    if engine.model_name != DEFAULT_MODEL and not engine.model_name.endswith(".gguf"):
        m = transformers.AutoModelForCausalLM.from_pretrained(engine.model_name, dtype=engine.config.dtype)
    else:
        p = default_gguf_path() if engine.model_name == DEFAULT_MODEL else __import__("pathlib").Path(engine.model_name)
        m = transformers.AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=engine.config.dtype)
    return m.to(engine.config.device).eval()


def add_bench_decode_parser(bench_subparsers: Any, engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Register ``decode`` on the ``dspark bench`` subparsers (engine_args: dspark.cli._engine_args)."""
    p = bench_subparsers.add_parser("decode", help="greedy batch-1 decode tok/s: dspark vs HF transformers eager")
    engine_args(p)
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per run")
    p.add_argument("--runs", type=int, default=3, help="timed runs per system (after one warm-up)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--json", default=None, help="write results to this JSON file")
    p.set_defaults(func=run_decode_bench)


def run_decode_bench(a: argparse.Namespace) -> int:
    from dspark import LLM, SamplingParams
    from dspark.cli import _engine_kwargs

    llm = LLM(a.model, **_engine_kwargs(a))
    engine = llm.engine
    dev = engine.config.device
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    prompts = [engine.tokenize_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    hf = None if a.no_hf else _hf_model(engine)

    def sync() -> None:
        if dev.startswith("cuda"):
            torch.cuda.synchronize()

    def run_dspark(ids: list[int]) -> float:
        sync()
        t = time.perf_counter()
        out = llm.generate([ids], params)[0]
        sync()
        assert len(out.token_ids) == a.max_tokens
        return a.max_tokens / (time.perf_counter() - t)

    def run_hf(ids: list[int]) -> float:
        x = torch.tensor([ids], device=dev)
        gc = hf.generation_config
        saved, gc.eos_token_id = gc.eos_token_id, None
        try:
            sync()
            t = time.perf_counter()
            with torch.inference_mode():
                out = hf.generate(x, max_new_tokens=a.max_tokens, do_sample=False, pad_token_id=0)
            sync()
        finally:
            gc.eos_token_id = saved
        assert out.shape[1] - len(ids) == a.max_tokens
        return a.max_tokens / (time.perf_counter() - t)

    run_dspark(prompts[0])  # warm-up
    if hf is not None:
        run_hf(prompts[0])
    ours: list[float] = []
    theirs: list[float] = []
    for r in range(a.runs):
        ids = prompts[r % len(prompts)]
        ours.append(run_dspark(ids))
        if hf is not None:
            theirs.append(run_hf(ids))
        print(f"run {r + 1}/{a.runs}: dspark {ours[-1]:.1f} tok/s"
              + (f", HF {theirs[-1]:.1f} tok/s" if theirs else ""), file=sys.stderr)

    res = run_header("greedy batch-1 decode, chat prompts, ignore_eos", engine, dev) | {
        "max_tokens": a.max_tokens,
        "runs": a.runs,
        "speculative_config": None if engine.spec_config is None else asdict(engine.spec_config),
        "dspark_tok_s": statistics.median(ours),
        "hf_eager_tok_s": statistics.median(theirs) if theirs else None,
        "dspark_runs": ours,
        "hf_runs": theirs,
    }
    if engine.spec_config is not None:
        from dspark.cli import format_spec_stats

        print(format_spec_stats(engine), file=sys.stderr)
    if theirs:
        res["speedup_vs_hf_eager"] = res["dspark_tok_s"] / res["hf_eager_tok_s"]
    name = "dspark" if engine.spec_config is None else "dspark + DSpark"
    print(f"{'system':<22}{'tok/s (median)':>16}")
    print(f"{name:<22}{res['dspark_tok_s']:>16.1f}")
    if theirs:
        print(f"{'HF transformers eager':<22}{res['hf_eager_tok_s']:>16.1f}")
        print(f"speedup: {res['speedup_vs_hf_eager']:.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
