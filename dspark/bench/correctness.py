"""`dspark bench correctness`: greedy output equality, dspark + DSpark vs dspark vs HF transformers, in one process.

Three systems generate greedily from the same chat-templated token-id prompts, every request exactly
``--max-tokens`` new tokens (EOS ignored: ``SamplingParams(ignore_eos=True)`` for dspark, EOS unset
for HF ``generate``), so outputs are compared over their full length:
  dspark_spec   dspark with DSpark (the drafter dspark ships for the model, or --speculative-config);
  dspark_plain  dspark without speculation, same engine options (device, dtype, attention backend,
                --enforce-eager, prefix caching, ...);
  hf            HF transformers ``generate`` (eager, dynamic cache) on the same weights in the engine's
                dtype (dspark.bench.decode._hf_model, as ``dspark bench`` uses).
Two pairs are checked per prompt (three with ``--hf-control-batch-size``: HF against itself at another batch
size, the yardstick for the second): spec vs plain (greedy speculation is lossless, so any difference is
numerics: the verification forward batches K+1 tokens per request where plain decode runs one, and bf16
rounding differs between those shapes) and plain vs HF (different kernels). A pair passes when at least
``--threshold`` (95 %) of the prompts are identical token for token.

Both dspark engines take all prompts at once (``LLM.generate``; max_num_seqs is raised to the prompt
count). HF runs one prompt per ``generate`` call by default (``--hf-batch-size 1``): left padding
changes every matmul's shape and puts an explicit mask into attention (SDPA then picks another
kernel), so in bf16 a padded batch rounds differently from the prompt alone; unpadded calls are the
faithful HF reference. They are also the slow part of the run (64 x 128 = 8k eager forwards at batch 1,
a few minutes on a GPU for a small model); ``--hf-batch-size B`` batches with left padding (faster,
less faithful; the JSON records which).

Where a pair differs, the record holds the first diverging position (0-based, in the generated
tokens), the two tokens there, a few tokens of context, and the target's view of that position from
ONE reference forward: the HF model upcast to float32 (the weights as the engines hold them, rounded to
the engine dtype, but computed in fp32) on prompt + the common prefix, fp32 logits of its last row.
Reported: the reference's top-2 logits and their gap, the logits of the two diverging tokens and their
gap (a logit difference is a log-probability ratio: gap 0.05 means the two tokens are 5 % apart in
probability). bf16 carries ~3 significant digits (its spacing is 0.125 for logits of 16-32), so gaps
below ``--near-tie-gap`` (0.5) are counted as near-ties that bf16 rounding can flip; a larger gap at the
first divergence points at a bug rather than rounding. One forward per differing (prompt, pair),
only after all generation, so it costs nothing when the outputs agree.

Defaults: 64 prompts x 128 tokens on CUDA (the issue's check, run in the same GPU run as the
benchmark), 4 x 32 on the CPU (a smoke run; in fp32 spec vs plain must be 100 % identical). Held-out
ShareGPT prompts (``--prompts code`` for the built-in code prompts). The exit code is 0 on a miss too:
this is a measurement; stdout says which pairs met the threshold, ``--out`` holds per-prompt records.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dspark.bench.common import add_prompt_source_args, run_header

PAIRS = {  # name -> (system a, system b, label)
    "spec_vs_plain": ("dspark_spec", "dspark_plain", "dspark + DSpark vs dspark (no spec)"),
    "plain_vs_hf": ("dspark_plain", "hf", "dspark (no spec) vs HF transformers"),
    # --hf-control-batch-size: HF against itself at another batch size (a yardstick, not a floor)
    "hf_vs_hf": ("hf", "hf_control", "HF vs HF at another batch size"),
}
SYSTEM_LABELS = {"dspark_spec": "dspark + DSpark", "dspark_plain": "dspark", "hf": "HF",
                 "hf_control": "HF (control batch)"}
DEVICE_DEFAULTS = {
    "cuda": dict(num_prompts=64, max_tokens=128, max_prompt_tokens=1024),
    "cpu": dict(num_prompts=4, max_tokens=32, max_prompt_tokens=256),
}
GAP_NOTE = ("gap = difference of two fp32 logits of the reference forward (the HF model upcast to float32) at "
            "the first diverging position, on prompt + the common prefix; a logit difference is a log-probability "
            "ratio. top2_gap: the two largest logits; pair_gap: logit(token a) - logit(token b). Gaps below "
            "near_tie_gap are near-ties that bf16 rounding (~3 significant digits; spacing 0.125 for logits of "
            "16-32) can flip; a larger gap at the first divergence points at a bug rather than rounding.")
CONTEXT_TOKENS = 8


def add_bench_correctness_parser(bench_subparsers: Any,
                                 engine_args: Callable[[argparse.ArgumentParser], None]) -> argparse.ArgumentParser:
    """Register ``correctness`` on the ``dspark bench`` subparsers (engine_args: dspark.cli._engine_args)."""
    from dspark.bench.matrix import PROMPT_SETS

    p = bench_subparsers.add_parser(
        "correctness", help="greedy output equality: dspark + DSpark vs dspark vs HF transformers, per prompt, "
                            "with the first divergence and its top-2 logit gap")
    engine_args(p)
    p.add_argument("--num-prompts", type=int, default=None, help="prompts (default: 64 on CUDA, 4 on CPU)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="new tokens per prompt, EOS ignored (default: 128 on CUDA, 32 on CPU)")
    p.add_argument("--prompts", default="sharegpt", choices=PROMPT_SETS,
                   help="prompt set: sharegpt (held-out ShareGPT chat prompts) or code (built-in) (default: sharegpt)")
    add_prompt_source_args(p)
    p.add_argument("--hf-batch-size", type=int, default=1,
                   help="prompts per HF generate call; > 1 left-pads, which changes bf16 numerics (default: 1)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers comparison")
    p.add_argument("--hf-control-batch-size", type=int, default=0,
                   help="also run HF a second time at this batch size and compare HF with itself: what the batch "
                        "shape and left padding alone do to HF's greedy output in the engine dtype, the yardstick "
                        "for the dspark vs HF pair (0: off)")
    p.add_argument("--threshold", type=float, default=0.95,
                   help="fraction of identical prompts a pair needs to pass (default: 0.95)")
    p.add_argument("--near-tie-gap", type=float, default=0.5,
                   help="a divergence whose fp32 reference logit gap between the two tokens is below this counts "
                        "as a near-tie (default: 0.5)")
    p.add_argument("--out", default=None, help="JSON file (default: out/bench_correctness_{cuda,cpu}.json)")
    p.set_defaults(func=run_bench_correctness)
    return p


# ---------------------------------------------------------------------------------------- comparison
def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """The first index where a and b differ; min(len) when one is a proper prefix of the other; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(a: Sequence[int], b: Sequence[int]) -> dict:
    """Token-for-token comparison of two outputs: identical?, and where and how they first differ."""
    pos = first_divergence(a, b)
    rec: dict[str, Any] = dict(identical=pos is None, position=pos, length_a=len(a), length_b=len(b),
                               token_a=None, token_b=None)
    if pos is not None:
        rec["token_a"] = a[pos] if pos < len(a) else None
        rec["token_b"] = b[pos] if pos < len(b) else None
    return rec


@torch.inference_mode()
def reference_gap(model: torch.nn.Module, ids: Sequence[int], token_a: int, token_b: int) -> dict:
    """One forward of ``model`` on ``ids``; fp32 logits of the last row: top-2 and the two tokens' logits."""
    dev = next(model.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=dev)
    logits = model(input_ids=x, logits_to_keep=1).logits[0, -1].float()
    top = torch.topk(logits, 2)
    (l1, l2), (t1, t2) = top.values.tolist(), top.indices.tolist()
    la, lb = float(logits[token_a]), float(logits[token_b])
    rank = lambda v: int((logits > v).sum())  # noqa: E731  (0 = the argmax)
    return dict(top1=t1, top1_logit=l1, top2=t2, top2_logit=l2, top2_gap=l1 - l2, logit_a=la, logit_b=lb,
                pair_gap=la - lb, rank_a=rank(la), rank_b=rank(lb),
                argmax_is="a" if t1 == token_a else "b" if t1 == token_b else "neither")


def summarize(records: list[dict], pair: str, threshold: float) -> dict:
    cmp = [r[pair] for r in records if r.get(pair) is not None]
    div = [c for c in cmp if not c["identical"]]
    n_same = len(cmp) - len(div)
    frac = n_same / len(cmp) if cmp else None
    return dict(label=PAIRS[pair][2], compared=len(cmp), identical=n_same, fraction_identical=frac,
                threshold=threshold, passed=None if frac is None else frac >= threshold,
                near_tie_divergences=sum(1 for c in div if c.get("near_tie") is True),
                other_divergences=sum(1 for c in div if c.get("near_tie") is not True),
                # whose token the fp32 reference ranks first at each divergence: with bf16 near-ties, the system
                # that picks the fp32 argmax more often rounds closer to fp32 (a: the pair's first system)
                reference_argmax={k: sum(1 for c in div if (c.get("reference") or {}).get("argmax_is") == k)
                                  for k in ("a", "b", "neither")},
                first_divergence_positions=[c["position"] for c in div])


# ---------------------------------------------------------------------------------------- output
def _tok(tokenizer, t: int | None) -> str:
    if t is None:
        return "<end>"
    s = repr(tokenizer.decode([t])) if tokenizer is not None else "?"
    return f"{t} {s}"


def format_report(res: dict) -> str:
    lines = [f"{'pair':<40}{'identical':>11}{'fraction':>10}{'need':>7}  result"]
    lines.append("-" * len(lines[0]))
    for pair, s in res["summary"].items():
        if s is None or not s["compared"]:
            lines.append(f"{PAIRS[pair][2]:<40}{'skipped':>11}")
            continue
        frac = s["fraction_identical"]
        lines.append(f"{s['label']:<40}{s['identical']:>5}/{s['compared']:<5}{100 * frac:>9.1f}%"
                     f"{100 * s['threshold']:>6.0f}%  {'PASS' if s['passed'] else 'MISS'}"
                     f" ({s['near_tie_divergences']} near-tie, {s['other_divergences']} other divergences)")
    for pair, s in res["summary"].items():
        ref = (s or {}).get("reference_argmax")
        if ref and sum(ref.values()):
            a, b = (SYSTEM_LABELS.get(x, x) for x in PAIRS[pair][:2])
            lines.append(f"  {s['label']}: at the divergences the fp32 reference's argmax is {a}'s token in "
                         f"{ref['a']}, {b}'s in {ref['b']}, neither in {ref['neither']}")
    divs = [(r, pair) for r in res["records"] for pair in PAIRS if r.get(pair) and not r[pair]["identical"]]
    if divs:
        lines += ["", f"divergences (gap: fp32 reference logits at the first diverging position; near-tie if "
                      f"|pair gap| < {res['near_tie_gap']:g}):",
                  f"{'prompt':>6}  {'pair':<14}{'pos':>5}  {'token a':<22}{'token b':<22}{'top2 gap':>9}"
                  f"{'a-b gap':>9}  {'ref argmax':<11}near-tie  context"]
        for r, pair in divs:
            c = r[pair]
            ref = c.get("reference") or {}
            g = lambda k: f"{ref[k]:.3f}" if k in ref else "n/a"  # noqa: E731
            lines.append(f"{r['index']:>6}  {pair:<14}{c['position']:>5}  {c['token_a_text'][:21]:<22}"
                         f"{c['token_b_text'][:21]:<22}{g('top2_gap'):>9}{g('pair_gap'):>9}  "
                         f"{ref.get('argmax_is', 'n/a'):<11}{str(c.get('near_tie')):<10}{c.get('context', '')!r}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- main
def run_bench_correctness(a: argparse.Namespace) -> int:
    from dspark import LLM, SamplingParams
    from dspark.bench.decode import _hf_model
    from dspark.bench.matrix import HFSystem, prompt_texts
    from dspark.cli import _engine_kwargs
    from dspark.engine.llm_engine import resolve_device

    device = resolve_device(a.device)
    kind = "cuda" if device.startswith("cuda") else "cpu"
    defaults = DEVICE_DEFAULTS[kind]
    num_prompts = a.num_prompts or defaults["num_prompts"]
    max_tokens = a.max_tokens or defaults["max_tokens"]
    max_prompt_tokens = a.max_prompt_tokens or defaults["max_prompt_tokens"]
    if num_prompts < 1 or max_tokens < 1 or a.hf_batch_size < 1 or not 0 < a.threshold <= 1:
        raise ValueError("need --num-prompts, --max-tokens, --hf-batch-size >= 1 and 0 < --threshold <= 1")
    if a.hf_control_batch_size < 0 or (a.hf_control_batch_size and a.no_hf):
        raise ValueError("--hf-control-batch-size must be >= 0 (0: off) and needs HF (not with --no-hf)")
    out_path = Path(a.out or f"out/bench_correctness_{kind}.json")
    texts = prompt_texts(a.prompts, a.prompt_source)  # errors before any loading

    log = lambda msg: print(f"[correctness] {msg}", file=sys.stderr, flush=True)  # noqa: E731
    kw = _engine_kwargs(a)
    spec = kw.pop("speculative_config", None)
    kw.update(device=device, max_num_seqs=max(a.max_num_seqs, num_prompts))
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    plain = LLM(a.model, **kw)
    engine = plain.engine
    tok = engine.tokenizer
    spec_llm, spec_info = None, None
    if spec is not None:
        spec_llm = LLM(a.model, speculative_config=spec, **kw)
        spec_info = asdict(spec_llm.engine.spec_config) | {"num_spec_tokens": spec_llm.engine.runner.num_spec_tokens}
    else:
        log("no drafter for this model (or --no-spec): the spec vs plain pair is skipped")
    hf = None if a.no_hf else _hf_model(engine)
    timings["load_s"] = time.perf_counter() - t0
    log(f"loaded {engine.model_name} on {device} ({engine.config.dtype}): dspark"
        + (", dspark + DSpark" if spec_llm else "") + ("" if hf is None else ", HF transformers")
        + f" in {timings['load_s']:.1f}s")

    kept, prompts = select_prompts(engine, texts, num_prompts, max_prompt_tokens)
    if len(prompts) < num_prompts:
        log(f"only {len(prompts)} {a.prompts} prompts of at most {max_prompt_tokens} tokens (asked for {num_prompts})")
    slack = 1 + (spec_info["num_spec_tokens"] if spec_info else 0)
    need = sum(len(p) + max_tokens + slack for p in prompts)
    capacity = engine.runner.num_kv_blocks * engine.config.block_size
    if need > capacity:
        log(f"note: the prompts need ~{need} KV slots at once, the engine has {capacity}: some requests wait or "
            f"are preempted (raise --kv-cache-memory-gb to run them all in one batch)")

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs: dict[str, list[list[int]]] = {}

    def timed(name: str, fn: Callable[[], list[list[int]]]) -> None:
        t = time.perf_counter()
        outputs[name] = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        timings[f"{name}_s"] = time.perf_counter() - t
        log(f"{name}: {len(prompts)} x {max_tokens} tokens in {timings[f'{name}_s']:.1f}s")

    timed("dspark_plain", lambda: [o.token_ids for o in plain.generate(prompts, params)])
    if spec_llm is not None:
        timed("dspark_spec", lambda: [o.token_ids for o in spec_llm.generate(prompts, params)])
    if hf is not None:
        pad = tok.pad_token_id if tok is not None and tok.pad_token_id is not None else 0
        hfs = HFSystem(hf, "eager", device, pad)
        def run_hf(B: int) -> list[list[int]]:
            return [ids for i in range(0, len(prompts), B) for ids in hfs.run(prompts[i:i + B], 0.0, max_tokens).token_ids]

        timed("hf", lambda: run_hf(a.hf_batch_size))
        if a.hf_control_batch_size:
            timed("hf_control", lambda: run_hf(a.hf_control_batch_size))
    for name, outs in outputs.items():
        short = [i for i, o in enumerate(outs) if len(o) != max_tokens]
        if short:  # not expected (EOS is ignored on every side); compared up to the shorter output then
            log(f"warning: {name} generated other than {max_tokens} tokens for prompts {short}")

    # ---- compare, and one fp32 reference forward per divergence
    ref_model = None
    records: list[dict] = []
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        rec: dict[str, Any] = dict(index=i, prompt_tokens=len(p), prompt=kept[i][:200],
                                   tokens={n: o[i] for n, o in outputs.items()})
        for pair, (x, y, _) in PAIRS.items():
            if x not in outputs or y not in outputs:
                rec[pair] = None
                continue
            c = compare(outputs[x][i], outputs[y][i])
            if not c["identical"]:
                j, common = c["position"], outputs[x][i][:c["position"]]
                c["token_a_text"], c["token_b_text"] = _tok(tok, c["token_a"]), _tok(tok, c["token_b"])
                c["context"] = tok.decode(common[-CONTEXT_TOKENS:]) if tok is not None else None
                if c["token_a"] is not None and c["token_b"] is not None:
                    if ref_model is None:
                        ref_model = _reference_model(hf, engine, _hf_model)
                    c["reference"] = reference_gap(ref_model, list(p) + common, c["token_a"], c["token_b"])
                    c["near_tie"] = abs(c["reference"]["pair_gap"]) < a.near_tie_gap
                else:
                    c["reference"], c["near_tie"] = None, None
                log(f"prompt {i}: {PAIRS[pair][2]} differ at token {j}: {c['token_a_text']} vs {c['token_b_text']}"
                    + (f", fp32 gap {c['reference']['pair_gap']:+.3f}" if c.get("reference") else ""))
            rec[pair] = c
        records.append(rec)
    timings["reference_s"] = time.perf_counter() - t

    summary = {pair: (summarize(records, pair, a.threshold) if x in outputs and y in outputs else None)
               for pair, (x, y, _) in PAIRS.items()}
    res = run_header("dspark bench correctness: greedy output equality, dspark + DSpark vs dspark vs HF transformers",
                     engine, device) | {
        "speculative_config": spec_info,
        "prompt_set": a.prompts,
        "num_prompts": len(prompts),
        "mean_prompt_tokens": statistics.mean(map(len, prompts)),
        "max_tokens": max_tokens,
        "fixed_length": all(len(o) == max_tokens for outs in outputs.values() for o in outs),
        "hf": None if hf is None else {"mode": "eager", "batch_size": a.hf_batch_size,
                                       "left_padding": a.hf_batch_size > 1, "dtype": str(hf.dtype)}
        | ({"control_batch_size": a.hf_control_batch_size} if a.hf_control_batch_size else {}),
        "reference": "HF model upcast to float32 (engine-dtype weights, fp32 compute), one forward on prompt + "
                     "common prefix per divergence, fp32 logits of the last row",
        "near_tie_gap": a.near_tie_gap,
        "gap_note": GAP_NOTE,
        "threshold": a.threshold,
        "timings": timings,
        "summary": summary,
        "records": records,
    }
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=2))

    print(format_report(res))
    print()
    for pair, s in summary.items():
        if s is not None:
            verdict = "meets" if s["passed"] else "MISSES"
            print(f"{s['label']}: {s['identical']}/{s['compared']} identical "
                  f"({100 * s['fraction_identical']:.1f}%), {verdict} the {100 * a.threshold:.0f}% threshold")
    print(f"[correctness] JSON: {out_path}")
    return 0  # a measurement: a miss is reported, not an error


def select_prompts(engine, texts: Sequence[str], n: int, max_prompt_tokens: int) -> tuple[list[str], list[list[int]]]:
    """The first n user messages whose chat-templated token ids fit max_prompt_tokens (as
    dspark.bench.matrix.prompt_ids), with their texts."""
    kept: list[str] = []
    ids: list[list[int]] = []
    for t in texts:
        x = engine.tokenize_chat([{"role": "user", "content": t}])
        if len(x) <= max_prompt_tokens:
            kept.append(t)
            ids.append(x)
            if len(ids) == n:
                break
    if not ids:
        raise ValueError(f"no prompt of at most {max_prompt_tokens} tokens")
    return kept, ids


def _reference_model(hf: torch.nn.Module | None, engine, load: Callable) -> torch.nn.Module:
    """The HF model in float32: ``hf`` itself when it already is fp32, else an upcast copy (weights rounded to
    the engine dtype as the engines hold them, compute in fp32)."""
    m = hf if hf is not None else load(engine)
    if m.dtype == torch.float32:
        return m
    # nn.Module.to: PreTrainedModel.to/.float() refuse models loaded from GGUF (flagged as quantized)
    return torch.nn.Module.to(copy.deepcopy(m), dtype=torch.float32).eval()
