"""Would drafting at another temperature than the request's accept more at temperature 1? τ of the shipped drafter
when its sampled drafts are drawn from softmax((U + bias) / α) instead of softmax(U + bias), α the draft temperature
factor, with q (what verification divides by) the same tempered distribution, so every α is lossless.

Why: at batch 32 and temperature 1 DSpark runs at 1.265x plain (H100, session 56), the floor 1.3x; τ at T = 1 is
~1.97 against ~2.5 greedy. A drafter trained by KL against the target can still be mis-calibrated (too flat or too
sharp), and sampling its drafts sharper (α < 1) or flatter (α > 1) would then raise the acceptance of block
verification, a change of one scalar per request. Runs the engine on the CPU (eager, the PyTorch proposer, whose
logits are ``drafter.base_logits(h) + drafter.markov_bias(prev)``: both are divided by α here) with the shipped
drafter's default config, 3 drafts (the sampled-batch rule's length), each α in turn on the same prompts and
seeds, and prints τ and the acceptance per position.

Usage: python benchmarks/draft_temperature_probe.py [--prompts 64] [--max-tokens 128] [--alphas 1.0,0.9,1.1]
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--alphas", default="1.0,0.9,1.1")
    ap.add_argument("--prompt-source", default=".model/sharegpt_prompts.json.gz")
    a = ap.parse_args()
    torch.set_num_threads(2)
    held_out = json.load(gzip.open(a.prompt_source))["heldout"]
    spec = {**default_speculative_config(None), "num_speculative_tokens": 3, "confidence_scheduling": False}
    llm = LLM(None, speculative_config=spec, seed=0, max_num_seqs=32, max_model_len=512 + a.max_tokens,
              kv_cache_memory_gb=1.0)
    eng = llm.engine
    prompts = []
    for c in held_out:
        ids = eng.tokenize_chat([{"role": "user", "content": c}] if isinstance(c, str) else c)
        if len(ids) <= 512:
            prompts.append(ids)
        if len(prompts) == a.prompts:
            break
    prop = eng.runner.proposer
    if prop.use_triton:
        raise SystemExit("the probe tempers the PyTorch proposer's logits: run it where the engine uses that path "
                         "(the CPU)")
    d = prop.drafter
    base, bias = d.base_logits, d.markov_bias
    print(f"{eng.runner.num_spec_tokens} drafts verified, {len(prompts)} prompts, T = 1")
    for alpha in (float(x) for x in a.alphas.split(",")):
        d.base_logits = lambda h, al=alpha: base(h) / al  # noqa: E731 (the instance's, for this run)
        d.markov_bias = lambda prev, al=alpha: bias(prev) / al  # noqa: E731
        eng.spec_stats = SpecStats()
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=a.max_tokens, seed=1234))
        st = eng.spec_stats.as_dict()
        acc = ", ".join(f"{x:.3f}" for x in st["spec_conditional_acceptance"])
        print(f"alpha {alpha:g}: tau {st['spec_tau']:.4f}, acceptance by position [{acc}], "
              f"{st['spec_num_steps']} steps, {time.perf_counter() - t:.0f} s", flush=True)


if __name__ == "__main__":
    main()
