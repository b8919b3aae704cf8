"""Would a shorter block pass cost acceptance? τ of the shipped drafter when its block pass runs fewer slots
than the block size it was trained with (the drafter attends bidirectionally within the block, so the mask
slots past the drafts a step verifies still shape the drafts' hidden states).

Why: at batch 32 and temperature 1 a step verifies 3 of the 7 drafts (the sampled-batch rule), but the
drafter's block pass runs all 7 slots: 224 rows at batch 32 against 96 or 128 for 3 or 4 slots. Runs the
engine on the CPU (eager, the PyTorch proposer, whose block pass takes ``DSparkProposer.num_slots``) with the
shipped drafter's default config (probabilistic drafts, block verification), 3 drafts, each slot count in
turn on the same prompts, and prints τ and the acceptance per position.

Usage: python benchmarks/drafter_slots_probe.py [--prompts 64] [--max-tokens 128] [--slots 7,4,3]
          [--prompt-source .model/sharegpt_prompts.json.gz]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time

import torch

from dspark import LLM, SamplingParams
from dspark.drafters import default_speculative_config
from dspark.spec.metrics import SpecStats


def probe_args(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The options every τ probe on the shipped drafter takes (also draft_temperature_probe.py's)."""
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-source", default=".model/sharegpt_prompts.json.gz")
    return ap.parse_args()


def shipped_engine(a: argparse.Namespace) -> tuple[LLM, list[list[int]]]:
    """The SmolLM2 engine on the CPU with the shipped drafter's default config at 3 drafts (the sampled-batch rule's
    length), confidence scheduling off, and the first ``a.prompts`` held-out prompts of at most 512 tokens."""
    torch.set_num_threads(2)
    held_out = json.load(gzip.open(a.prompt_source))["heldout"]
    spec = {**default_speculative_config(None), "num_speculative_tokens": 3, "confidence_scheduling": False}
    llm = LLM(None, speculative_config=spec, seed=0, max_num_seqs=32, max_model_len=512 + a.max_tokens,
              kv_cache_memory_gb=1.0)
    prompts = []
    for c in held_out:
        ids = llm.engine.tokenize_chat([{"role": "user", "content": c}] if isinstance(c, str) else c)
        if len(ids) <= 512:
            prompts.append(ids)
        if len(prompts) == a.prompts:
            break
    return llm, prompts


def run_tau(llm: LLM, prompts: list[list[int]], temperature: float, max_tokens: int, label: str) -> None:
    """Generate the prompts (seed 1234) and print τ and the acceptance by position."""
    eng = llm.engine
    eng.spec_stats = SpecStats()
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=1234))
    st = eng.spec_stats.as_dict()
    acc = ", ".join(f"{x:.3f}" for x in st["spec_conditional_acceptance"])
    print(f"{label}: tau {st['spec_tau']:.4f}, acceptance by position [{acc}], "
          f"{st['spec_num_steps']} steps, {time.perf_counter() - t:.0f} s", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", default="7,4,3")
    a = probe_args(ap)
    llm, prompts = shipped_engine(a)
    prop = llm.engine.runner.proposer
    print(f"block size {prop.num_slots}, {llm.engine.runner.num_spec_tokens} drafts verified, {len(prompts)} prompts")
    for temp in (1.0, 0.0):
        for G in (int(x) for x in a.slots.split(",")):
            prop.num_slots = G
            run_tau(llm, prompts, temp, a.max_tokens, f"T = {temp:g}, {G} slots")


if __name__ == "__main__":
    main()
