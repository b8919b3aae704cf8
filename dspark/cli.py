"""Command line: ``dspark generate`` and ``dspark bench``."""

from __future__ import annotations

import argparse
import sys
import time

DEFAULT_CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model name or path (default: smollm2-135m-instruct, embedded)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0)
    p.add_argument("--no-prefix-caching", action="store_true", help="disable automatic prefix caching")
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests without their own")
    p.add_argument("--speculative-config", default=None,
                   help='DSpark speculation as JSON, vLLM keys: {"method": "dspark", "model": DRAFTER_DIR, '
                        '"num_speculative_tokens": N, "draft_sample_method": "greedy"|"probabilistic", '
                        '"rejection_sample_method": "standard"|"block"}; default: the drafter dspark ships '
                        'for the model, if any (dspark/drafters), drafting probabilistically, verifying '
                        'sampled requests by block verification, all-sampled batches of >= 16 and batches with greedy '
                        'requests of 12-32 verifying 3 drafts (dspark\'s keys "sampled_verify_length", '
                        '"sampled_verify_min_batch", "greedy_verify_batches"; "verify_lengths" for adaptive '
                        'verification); eager steps (CPU, --enforce-eager) schedule per-request verify '
                        'lengths from the confidence head and pause drafting when plain decoding is faster '
                        '("confidence_scheduling": false turns that off)')
    p.add_argument("--no-spec", action="store_true", help="no speculative decoding (ignore the shipped drafter)")
    add_backend_args(p)


def add_backend_args(p: argparse.ArgumentParser) -> None:
    from dspark.config import ATTENTION_BACKENDS

    p.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS,
                   help="attention over the paged KV cache: torch (PyTorch SDPA, any device), triton (Triton "
                        "paged-attention kernels; CUDA, or a CPU only in Triton's interpreter), auto (triton on CUDA, "
                        "torch elsewhere) (default: auto)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="the target's results per row do not depend on the batch (batch-invariant Triton matmul, "
                        "attention over fixed key slices): greedy speculative output equals plain output in bf16 "
                        "too; slower (H100: plain 0.58x at batch 1, 0.77x at batch 32); needs the triton backend")
    p.add_argument("--invariant-attention", action="store_true",
                   help="only the attention batch-invariant (fixed key slices), the products as by default: greedy "
                        "speculative output equals plain output on the GPU where the plain and verification steps "
                        "both multiply on cuBLAS (>= 17 requests in flight; 63-64 of 64 prompts on an H100; at "
                        "smaller batches the fused few-row kernels still round apart: --batch-invariant); "
                        "plain decoding +0.3-1 %% step time at batch 1, +6-10 %% at batch 32 (max_model_len 2,048; "
                        "~5 %% at batch 1 above 4,096); needs the triton backend")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run every step eagerly (graphs are captured at start-up on CUDA with the "
                        "triton attention backend)")
    p.add_argument("--no-async-scheduling", action="store_true",
                   help="wait for each step's tokens before scheduling the next one (by default, with CUDA graphs "
                        "(plain decoding; greedy DSpark), step t+1 is launched before step t's tokens are read back)")
    p.add_argument("--graph-prefill-tokens", type=int, default=512,
                   help="with CUDA graphs: prompt tokens one graph step can carry as prefill rows besides the "
                        "batch's decode / verification rows (an admission then costs one graph step instead of an "
                        "eager prefill; without DSpark each prompt token is a row of the decode graph); 0: prefill "
                        "chunks always run eagerly (default: 512)")
    p.add_argument("--graph-prefill-alone", action="store_true",
                   help="with CUDA graphs, also when no request decodes (a first wave, an idle server's long prompt): "
                        "cut prompt chunks to the graph's prefill rows, so a long prompt runs as graph steps instead "
                        "of one eager step (off: no measured gain at batch 1 or 32 on the H200, session 38)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the throwaway requests run at start-up on CUDA (they compile the eager paths' Triton "
                        "kernels before the first real request)")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    kw = dict(
        device=a.device, dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        kv_cache_memory_gb=a.kv_cache_memory_gb, enable_prefix_caching=not a.no_prefix_caching, seed=a.seed,
        attention_backend=a.attention_backend, enforce_eager=a.enforce_eager, batch_invariant=a.batch_invariant,
        invariant_attention=a.invariant_attention, async_scheduling=not a.no_async_scheduling,
        warmup=False if a.no_warmup else None,
        graph_prefill_tokens=a.graph_prefill_tokens, graph_prefill_alone=a.graph_prefill_alone,
    )
    if a.max_model_len is not None:
        kw["max_model_len"] = a.max_model_len
    spec = resolve_speculative_config(a.model, a.speculative_config, a.no_spec)
    if spec is not None:
        kw["speculative_config"] = spec
    return kw


def resolve_speculative_config(model: str | None, given: str | None, no_spec: bool):
    """--speculative-config if given, else the shipped drafter for the model (None with --no-spec)."""
    if no_spec:
        if given:
            raise SystemExit("dspark: --no-spec and --speculative-config contradict each other; pass one")
        return None
    if given:
        return given
    from dspark.drafters import default_speculative_config

    return default_speculative_config(model)


def cmd_generate(a: argparse.Namespace) -> int:
    from dspark import LLMEngine, SamplingParams

    params = SamplingParams(
        max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        seed=a.sample_seed, stop=a.stop or [],
    )
    t0 = time.perf_counter()
    engine = LLMEngine(a.model, **_engine_kwargs(a))
    print(f"[dspark] loaded {engine.model_name} on {engine.config.device} ({engine.config.dtype}) "
          f"in {time.perf_counter() - t0:.1f}s; {engine.runner.num_kv_blocks} KV blocks", file=sys.stderr)
    if a.prompt is not None:
        engine.add_request(a.prompt, params)
    else:
        engine.add_request(engine.tokenize_chat([{"role": "user", "content": a.chat or DEFAULT_CHAT}]), params)
        print(f">>> {a.chat or DEFAULT_CHAT}", file=sys.stderr)
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            if out.finished:
                final = out
    sys.stdout.write("\n")
    s = final.stats
    tps = s["decode_tokens_per_s"]
    print(f"[dspark] {s['num_output_tokens']} tokens, finish={final.finish_reason}, "
          f"TTFT {s['time_to_first_token_s'] * 1000:.0f} ms, "
          f"{'%.1f' % tps if tps else 'n/a'} tok/s decode", file=sys.stderr)
    if engine.spec_config is not None:
        print(format_spec_stats(engine), file=sys.stderr)
    return 0


def format_spec_stats(engine) -> str:
    st = engine.spec_stats
    cs = engine.runner.conf_sched
    sched = ("" if cs is None else
             f"; confidence scheduling: {cs.stats['drafts_kept']}/{cs.stats['drafts_made']} drafts verified, "
             f"{cs.stats['paused_steps']} steps without drafting")
    if not st.num_steps:
        return "[dspark] speculation: no verification steps" + sched
    cond = " ".join("-" if c is None else f"{c:.2f}" for c in st.conditional_acceptance)
    return (f"[dspark] DSpark: tau {st.tau:.2f} tokens/step over {st.num_steps} steps, "
            f"{st.num_accepted}/{st.num_drafts} drafts accepted; conditional acceptance by position: {cond}; "
            f"per engine step ({st.engine_steps}): draft {st.draft_time_s * 1000 / max(st.engine_steps, 1):.1f} ms, "
            f"target + verification {st.verify_time_s * 1000 / max(st.engine_steps, 1):.1f} ms"
            + (f"; steps by drafts verified (adaptive): {dict(sorted(st.length_steps.items()))}"
               if len(st.length_steps) > 1 else "") + sched)


def cmd_init_drafter(a: argparse.Namespace) -> int:
    """Write a random-weight DSpark drafter for a target (the starting point of training)."""
    from dspark.config import ModelConfig
    from dspark.models.dspark_drafter import (DrafterConfig, drafter_config_dict, random_drafter_state_dict,
                                              write_drafter)
    from dspark.models.loader import load_model_config

    target = ModelConfig.from_hf(load_model_config(a.model))
    ids = [int(x) for x in a.target_layer_ids.split(",")] if a.target_layer_ids else None
    cfg = drafter_config_dict(target, num_hidden_layers=a.num_layers, block_size=a.block_size,
                              mask_token_id=a.mask_token_id, target_layer_ids=ids, markov_rank=a.markov_rank)
    DrafterConfig.from_dict(cfg).check_target(target)
    write_drafter(a.out, cfg, random_drafter_state_dict(DrafterConfig.from_dict(cfg), a.seed))
    print(f"wrote a random DSpark drafter for {a.model or 'smollm2-135m-instruct'} to {a.out}: "
          f"{a.num_layers} layers, block {a.block_size}, taps {cfg['target_layer_ids']}, markov rank {a.markov_rank}")
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from dspark.bench.matrix import run_bench_matrix

    return run_bench_matrix(a)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="dspark: LLM inference with DSpark speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    from dspark.server.cli import add_serve_parser

    add_serve_parser(sub)

    g = sub.add_parser("generate", help="generate text for one prompt or chat message, streaming to the terminal")
    _engine_args(g)
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", default=None, help="raw prompt (no chat template)")
    src.add_argument("--chat", default=None, help="user message, wrapped in the model's chat template (default mode)")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(func=cmd_generate)

    d = sub.add_parser("init-drafter", help="write a random-weight DSpark drafter for a target model")
    d.add_argument("--model", default=None, help="target model (default: smollm2-135m-instruct)")
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument("--num-layers", type=int, default=2)
    d.add_argument("--block-size", type=int, default=5)
    d.add_argument("--markov-rank", type=int, default=64)
    d.add_argument("--mask-token-id", type=int, default=16, help="an unused special token (16 = <empty_output> in SmolLM2)")
    d.add_argument("--target-layer-ids", default=None, help="comma-separated; default: 3 spread layers")
    d.add_argument("--seed", type=int, default=0)
    d.set_defaults(func=cmd_init_drafter)

    from dspark.bench.correctness import add_bench_correctness_parser
    from dspark.bench.decode import add_bench_decode_parser
    from dspark.bench.matrix import add_bench_matrix_arguments
    from dspark.bench.serve import add_bench_serve_parser

    b = sub.add_parser("bench", help="HF transformers vs dspark vs dspark + DSpark, side by side over batch sizes, "
                                     "prompt sets and temperatures (bench decode: greedy batch-1; bench serve: a server)")
    _engine_args(b)
    add_bench_matrix_arguments(b)
    b.set_defaults(func=cmd_bench)
    bench_sub = b.add_subparsers(dest="bench_command", required=False, metavar="{decode,serve,correctness}")
    add_bench_decode_parser(bench_sub, _engine_args)
    add_bench_serve_parser(bench_sub)
    add_bench_correctness_parser(bench_sub, _engine_args)

    from dspark.train.cli import add_eval_parser, add_train_parser

    add_train_parser(sub)
    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from dspark.models.errors import ModelLoadError
    from dspark.sampling_params import InvalidRequestError
    from dspark.spec.config import SpeculativeConfigError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ModelLoadError, InvalidRequestError, SpeculativeConfigError, ValueError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
