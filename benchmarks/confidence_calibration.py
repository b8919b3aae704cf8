"""How well the shipped drafter's confidence head predicts acceptance in the engine (what confidence-scheduled
verification, spec/adaptive.py ConfidenceScheduler, relies on): every draft's c_k = P(draft k accepted | drafts
< k accepted) as the proposer computed it, against whether the engine's verification accepted it, over
held-out ShareGPT prompts, greedy and at temperature 1. Scheduling is off here so that every slot is verified.

Prints, per temperature: per slot the mean c_k and the accepted share over the drafts that were reached
(their earlier drafts accepted), and the same by bins of c_k.

Usage: python benchmarks/confidence_calibration.py [--prompts 16] [--max-tokens 128] [--device cpu]
           [--prompt-source .model/sharegpt_prompts.json.gz] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402
from dspark.train.data import chat_prompt_ids, heldout_prompts  # noqa: E402

BINS = [0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 1.0001]


def collect(llm: LLM, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[tuple[int, float, int]]:
    """(slot, c, accepted) for every draft verification reached."""
    runner = llm.engine.runner
    prop = runner.proposer
    pending: dict[str, list[float]] = {}
    rows: list[tuple[int, float, int]] = []
    propose, verify = prop.propose, runner._verify

    def propose_and_keep(reqs, *a, **k):
        p = propose(reqs, *a, **k)
        for r, c in zip(reqs, p.confidence.tolist()):
            pending[r.request_id] = c
        return p

    def verify_and_pair(verifying, logits, offset, result):
        verify(verifying, logits, offset, result)
        for _, s in verifying:
            rid = s.request.request_id
            n, acc = result.verified[rid]
            c = pending.pop(rid, None)
            if c is not None:
                rows.extend((k, c[k], int(k < acc)) for k in range(min(acc + 1, n)))

    prop.propose, runner._verify = propose_and_keep, verify_and_pair
    try:
        llm.generate(prompts, SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=1))
    finally:
        prop.propose, runner._verify = propose, verify
    return rows


def summarise(rows: list[tuple[int, float, int]]) -> dict:
    a = np.array(rows, dtype=np.float64)
    slots = [{"slot": int(k) + 1, "n": int(m.sum()), "mean_c": round(float(a[m, 1].mean()), 3),
              "accepted": round(float(a[m, 2].mean()), 3)}
             for k in np.unique(a[:, 0]) for m in [a[:, 0] == k]]
    bins = [{"c_from": lo, "c_to": min(hi, 1.0), "n": int(m.sum()), "mean_c": round(float(a[m, 1].mean()), 3),
             "accepted": round(float(a[m, 2].mean()), 3)}
            for lo, hi in zip(BINS, BINS[1:]) for m in [(a[:, 1] >= lo) & (a[:, 1] < hi)] if m.any()]
    return {"drafts": len(rows), "by_slot": slots, "by_confidence": bins}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-source", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    llm = LLM(None, device=a.device, speculative_config={"confidence_scheduling": False})
    if getattr(llm.engine.runner.proposer.drafter, "confidence", None) is None:
        sys.exit("the drafter has no confidence head")
    prompts = chat_prompt_ids(llm.engine, heldout_prompts(a.prompts, a.prompt_source), 1024)
    out = {"date": time.strftime("%Y-%m-%d"), "device": a.device, "prompts": len(prompts), "max_tokens": a.max_tokens}
    for t in (0.0, 1.0):
        s = out[f"T={t:g}"] = summarise(collect(llm, prompts, t, a.max_tokens))
        print(f"T={t:g}: {s['drafts']} drafts reached")
        for r in s["by_slot"]:
            print(f"  slot {r['slot']}: n={r['n']:5d}  mean c {r['mean_c']:.3f}  accepted {r['accepted']:.3f}")
        for r in s["by_confidence"]:
            print(f"  c in [{r['c_from']:.1f}, {r['c_to']:.1f}): n={r['n']:5d}  mean c {r['mean_c']:.3f}  "
                  f"accepted {r['accepted']:.3f}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
