"""τ at temperature 1 on the CPU (fp32, the shipped drafter, eager engine, confidence scheduling off) for draft
temperatures other than the request's, for other draft counts and for a shorter drafter block (``--slots``): would drafting sharper or flatter, or verifying
more drafts, raise acceptance? Lossless either way: verification takes q = the distribution the drafts were drawn
from. The draft temperature is scaled by wrapping the runner's ``draft_params`` (an experiment, not an engine
option). One process per setting, the same held-out ShareGPT prompts and request seeds:

    python benchmarks/t1_draft_tau.py --scales 1.0,0.8,0.6,1.15,1.3 --drafts 3 --prompts 32 --max-tokens 64
    python benchmarks/t1_draft_tau.py --scales 1.0 --drafts 2,3,4,5
    python benchmarks/t1_draft_tau.py --slots 8,4,5 --temperatures 1.0,0.0 --threads 2

Prints steps, drafts, accepted, τ = 1 + accepted / steps, and the steps that reached each slot.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import torch


def run(scale: float, drafts: int, prompts: list[str], max_tokens: int, threads: int, slots: int | None = None,
        temperature: float = 1.0) -> dict:
    import dspark.engine.runner as runner_module
    import dspark.spec.proposer as proposer_module
    from dspark import LLM, SamplingParams
    from dspark.drafters import default_speculative_config
    from dspark.sample.sampler import draft_params

    runner_module.draft_params = lambda p: dataclasses.replace(draft_params(p), temperature=p.temperature * scale)
    torch.set_num_threads(threads)
    spec = default_speculative_config(None) | {"num_speculative_tokens": drafts, "confidence_scheduling": False,
                                               "sampled_verify_length": None}
    init = proposer_module.DSparkProposer.__init__
    if slots:  # a shorter block than the drafter's (its slots attend to each other: other hidden states, other q)
        def shorter(self, *args, **kwargs):
            init(self, *args, **kwargs)
            self.num_slots = slots

        proposer_module.DSparkProposer.__init__ = shorter
    llm = LLM(None, speculative_config=spec, device="cpu", enable_prefix_caching=False)
    proposer_module.DSparkProposer.__init__ = init
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1000 + i)
              for i in range(len(prompts))]
    t0 = time.time()
    llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    st = llm.engine.spec_stats
    runner_module.draft_params = draft_params
    return dict(scale=scale, drafts=drafts, slots=slots, temperature=temperature, steps=st.num_steps, drafted=st.num_drafts, accepted=st.num_accepted,
                tau=1 + st.num_accepted / max(st.num_steps, 1), reached=st.reached, seconds=round(time.time() - t0, 1))


def main() -> None:
    from dspark.train.data import heldout_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="1.0", help="draft temperature / request temperature, comma-separated")
    ap.add_argument("--drafts", default="3", help="drafts per step (num_speculative_tokens), comma-separated")
    ap.add_argument("--slots", default="0", help="block slots the drafter runs (0: its block size), comma-separated")
    ap.add_argument("--temperatures", default="1.0", help="request temperatures, comma-separated")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-source", default=None, help="held-out prompt file (default: the bundled split)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file")
    a = ap.parse_args()
    prompts = heldout_prompts(a.prompts, a.prompt_source)
    rows = []
    for t in (float(x) for x in a.temperatures.split(",")):
        for g in (int(x) for x in a.slots.split(",")):
            for d in (int(x) for x in a.drafts.split(",")):
                for s in (float(x) for x in a.scales.split(",")):
                    rows.append(run(s, d, prompts, a.max_tokens, a.threads, g or None, t))
                    print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
