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

from drafter_slots_probe import probe_args, run_tau, shipped_engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--alphas", default="1.0,0.9,1.1")
    a = probe_args(ap)
    llm, prompts = shipped_engine(a)
    prop = llm.engine.runner.proposer
    if prop.use_triton:
        raise SystemExit("the probe tempers the PyTorch proposer's logits: run it where the engine uses that path "
                         "(the CPU)")
    d = prop.drafter
    base, bias = d.base_logits, d.markov_bias
    print(f"{llm.engine.runner.num_spec_tokens} drafts verified, {len(prompts)} prompts, T = 1")
    for alpha in (float(x) for x in a.alphas.split(",")):
        d.base_logits = lambda h, al=alpha: base(h) / al  # noqa: E731 (the instance's, for this run)
        d.markov_bias = lambda prev, al=alpha: bias(prev) / al  # noqa: E731
        run_tau(llm, prompts, 1.0, a.max_tokens, f"alpha {alpha:g}")


if __name__ == "__main__":
    main()
