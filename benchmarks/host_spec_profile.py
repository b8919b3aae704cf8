"""The host's share of a pipelined DSpark (or plain) step, measured on a CPU without a GPU.

On the H200, T = 1 DSpark at batch 32 is host-bound: the host spends ~2.2 ms per engine step (launching
step t + 1, reading back and applying step t) while the step's graphs take ~1.8 ms on the GPU
(docs/benchmarks.md, session 27), and ~90 % of that host time is Python (the engine's own code), not
the launches of torch ops. This script runs exactly the engine's host code — scheduler, KV manager,
runner.launch_one_sync / finish_one_sync, verification bookkeeping, detokenizer, metrics — on the real
SmolLM2 engine (its tokenizer, the shipped drafter's config, held-out ShareGPT prompts, continuous
batching as `dspark bench` runs it), with the device's work replaced by stand-ins: the target, verification
and drafter graph replays return random outcomes of the right shapes (each request accepts k drafts with
probability ~ACCEPT^k, so tau is about the GPU's), and the two row-shifting kernels do nothing. Engine
steps the graphs do not take (the first prefill) run for real, eagerly.

Reported per engine step: wall ms; the Python engine code's own time (cProfile, torch/numpy built-ins
excluded, since their cost differs on a GPU machine); the number of torch op calls (each ~5-15 us of
launch on a GPU). Compare versions of the engine with it (a change's host saving on this CPU is roughly
its saving on the GPU machine's host, whose single-thread speed is similar); the absolute figures are
this machine's.

Usage: python benchmarks/host_spec_profile.py [--batch 32] [--prompts 128] [--max-tokens 256]
          [--temperature 1] [--systems dspark,plain] [--top 30] [--json OUT]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import os
import pstats
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # the triton backend's kernels, interpreted, for the eager first step

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402

ACCEPT = 0.5  # per-slot acceptance of the stand-in verification (the GPU's T = 1: ~0.45-0.52)


def fake_device(llm: LLM, seed: int = 0) -> None:
    """Replace the graph replays of every graph set with stand-ins (see the module docstring), and the
    two device computations of the one-sync path that are [rows, V] work on this CPU but one or two
    kernels on a GPU: the Sampler's draw of a sampled prompt's first token (the CPU's Philox is Python)
    and the [S, N, V] q of drafts the host builds when no step is in flight (runner._draft_q)."""
    runner = llm.engine.runner
    gen = torch.Generator().manual_seed(seed)
    V = runner.vocab_size

    class Sampler:
        def __call__(self, logits, batch, no_sync=False):
            return torch.randint(4, V, logits.shape[:-1], generator=gen)

    runner.sampler = Sampler()
    runner._draft_q = lambda preqs, drafts, N, V: torch.zeros(len(preqs), N, 1)
    for G in (runner.graph_sets or {0: runner.graphs}).values():
        q = G.q
        V = runner.vocab_size
        if G.probs is not None:
            G.probs = torch.zeros(G.max_batch, G.n_spec, 1)  # q of the drafts: never read by the stand-ins

        def replay_target(Bg, bucket, G=G, q=q):
            G.stats["target"] += 1
            return G.logits[:Bg * q].view(Bg, q, -1)

        def replay_verify(Bg, kind, G=G, q=q):
            G.stats["verify"] += 1
            # accepted drafts: k with probability ACCEPT^k (1 - ACCEPT), at most q - 1
            u = torch.rand(Bg, q - 1, generator=gen)
            acc = (u < ACCEPT).long().cumprod(dim=1).sum(dim=1)
            G.v_n[:Bg] = acc + 1
            G.v_out[:Bg] = torch.randint(4, V, (Bg, q), generator=gen)
            G.v_am[:Bg] = G.v_out[:Bg]
            return G.v_out[:Bg], G.v_n[:Bg], G.v_am[:Bg]

        def replay_draft(Bg, bucket, any_prob, G=G):
            G.stats["draft"] += 1
            tokens = torch.randint(4, V, (Bg, G.n_spec), generator=gen)
            return tokens, (G.probs[:Bg] if any_prob else None)

        def replay_sample(Bg, filtered, G=G):
            G.stats["sample"] += 1
            return torch.randint(4, V, (Bg,), generator=gen)

        G.replay_target, G.replay_verify, G.replay_draft, G.replay_sample = (
            replay_target, replay_verify, replay_draft, replay_sample)
        G.rows_from_previous_step = lambda *a, **k: None
        G.drafter_inputs_on_device = lambda *a, **k: None
        G.stage_q = lambda *a, **k: None


def _is_engine_code(fn: tuple) -> bool:
    path = fn[0]
    # sample/rng.py: the CPU's Philox in Python (the Sampler's draws on a CPU); on a GPU they are a kernel
    return "/dspark/" in path and "/kernels/" not in path and not path.endswith("sample/rng.py")


def run(system: str, a, prompts_text: list[str]) -> dict:
    from dspark.drafters import default_speculative_config

    spec = default_speculative_config(None) if system == "dspark" else None
    spec = json.loads(spec) if isinstance(spec, str) else spec
    # a step budget of graph_prefill_tokens (or a whole batch of blocks, at large batch): prefill chunks fit the graphs' prefill rows, so few steps run
    # eagerly (the eager forward would run the real model on interpreted Triton kernels: minutes per step)
    llm = LLM(None, device="cpu", dtype="float32", max_model_len=2048, max_num_seqs=a.batch, num_kv_blocks=4096,
              enable_prefix_caching=False, attention_backend="triton", async_scheduling=True,
              max_num_batched_tokens=max(512, 8 * a.batch + 256), graph_prefill_tokens=512, speculative_config=spec)
    runner = llm.engine.runner
    runner.enable_graphs(capture=False)
    runner.one_sync_sampled = True
    fake_device(llm)

    from dspark.engine.runner import StepResult

    gen = torch.Generator().manual_seed(1)
    eager = [0]

    def execute(sched, kv):
        """A step the graphs do not take (on the H200 about one per 128 prompts: a mixed step with a
        one-token row): the outcome of such a step, random as the stand-ins' (no device work, no host
        verification work: its host share is not what this measures)."""
        eager[0] += 1
        res = StepResult({})
        V = runner.vocab_size
        for s in sched.scheduled:
            r = s.request
            if not s.samples:
                continue
            n = s.num_spec_tokens
            acc = 0
            while acc < n and torch.rand(1, generator=gen).item() < ACCEPT:
                acc += 1
            res.new_tokens[r.request_id] = torch.randint(4, V, (acc + 1,), generator=gen).tolist()
            if n:
                res.verified[r.request_id] = (n, acc)
            k = runner._num_drafts(r, acc + 1) if runner.proposer is not None else 0
            if k > 0:
                res.drafts[r.request_id] = torch.randint(4, V, (k,), generator=gen).tolist()
        return res

    runner.execute = execute
    from dspark.train.data import chat_prompt_ids

    # room for the new tokens under max_model_len (longer prompts are dropped, as `dspark bench` drops them)
    prompts = chat_prompt_ids(llm.engine, prompts_text, 2048 - a.max_tokens - 16)
    p = SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=True, seed=None)
    llm.generate(prompts[:a.batch], SamplingParams(temperature=a.temperature, max_tokens=16, ignore_eos=True))
    steps = [0]
    real_step = llm.engine.step

    def step(**kw):
        steps[0] += 1
        return real_step(**kw)

    llm.engine.step = step
    gc.collect()
    gc.freeze()
    res = {}
    for profiled in (False, True):
        steps[0] = eager[0] = 0
        prof = cProfile.Profile() if profiled else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        outs = llm.generate(prompts, p)
        if prof:
            prof.disable()
        wall = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        key = "cprofile" if profiled else "plain_pass"
        res[key] = {"steps": steps[0], "eager_steps": eager[0], "tokens": n, "wall_s": round(wall, 3),
                    "ms_per_step": round(1e3 * wall / steps[0], 4)}
        if prof:
            st = pstats.Stats(prof).stats
            ns = steps[0]
            own = sum(v[2] for f, v in st.items() if _is_engine_code(f))
            torch_calls = sum(v[1] for f, v in st.items() if f[0] == "~" and "torch" in f[2])
            res[key]["engine_python_own_ms_per_step"] = round(1e3 * own / ns, 4)
            res[key]["torch_calls_per_step"] = round(torch_calls / ns, 2)
            top = sorted(((f, v) for f, v in st.items() if _is_engine_code(f)), key=lambda kv: -kv[1][2])[:a.top]
            res[key]["top_engine_functions"] = [
                {"fn": f"{Path(f[0]).parent.name}/{Path(f[0]).name}:{f[1]}:{f[2]}", "calls_per_step": round(v[1] / ns, 2),
                 "own_us_per_step": round(1e6 * v[2] / ns, 2), "cum_us_per_step": round(1e6 * v[3] / ns, 2)}
                for f, v in top]
            tops = sorted(((f, v) for f, v in st.items() if f[0] == "~" and "torch" in f[2]), key=lambda kv: -kv[1][1])
            res[key]["torch_calls"] = {f[2]: round(v[1] / ns, 2) for f, v in tops[:15]}
    if spec:
        res["tau"] = round(llm.engine.spec_stats.tau, 3)
    gc.unfreeze()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--systems", default="dspark,plain")
    ap.add_argument("--prompt-source", default=None)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    torch.set_num_threads(1)
    from dspark.train.data import heldout_prompts

    texts = heldout_prompts(a.prompts, a.prompt_source)
    out = {"date": time.strftime("%Y-%m-%d"), "batch": a.batch, "prompts": a.prompts, "max_tokens": a.max_tokens,
           "temperature": a.temperature}
    for system in a.systems.split(","):
        out[system] = run(system, a, texts)
        r = out[system]
        c = r["cprofile"]
        print(f"{system}: {r['plain_pass']['ms_per_step']:.3f} ms/step ({r['plain_pass']['steps']} steps), "
              f"engine Python own {c['engine_python_own_ms_per_step']:.3f} ms/step under cProfile, "
              f"{c['torch_calls_per_step']:.1f} torch calls/step" + (f", tau {r['tau']}" if "tau" in r else ""),
              flush=True)
        for t in c["top_engine_functions"]:
            print(f"   {t['own_us_per_step']:8.1f} {t['cum_us_per_step']:9.1f} {t['calls_per_step']:8.2f}  {t['fn']}")
        print("   torch calls/step:", c["torch_calls"])
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
