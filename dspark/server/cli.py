"""``dspark serve``: the OpenAI-compatible server, with vLLM's flag names.

Wire it into the main CLI with ``add_serve_parser(subparsers)``; it can also run on its own as
``python -m dspark.server.cli [MODEL] [flags]``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from dspark.server.defaults import (DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_HOST, DEFAULT_MAX_BODY_BYTES,
                                    DEFAULT_PORT)


def add_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("model_tag", nargs="?", default=None,
                   help="model name or path (default: smollm2-135m-instruct, embedded); same as --model")
    p.add_argument("--model", default=None, help="model name or path (overrides the positional MODEL)")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default: {DEFAULT_HOST}, local only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default: {DEFAULT_PORT})")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model'; the first is reported (default: the model name)")
    p.add_argument("--api-key", default=os.environ.get("DSPARK_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and /debug routes (default: $DSPARK_API_KEY)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N (default: cuda if available)")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16 (auto: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch (default: 64)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one engine step; longer prompts are prefilled in chunks (default: 2048)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache block size in tokens (default: 16)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="fraction of GPU memory for weights + KV cache (default 0.9; sizes the KV cache on CUDA, "
                        "ignored on CPU)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None,
                   help="KV-cache size in GiB; overrides --gpu-memory-utilization (CPU default: 1.0)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="automatic prefix caching (default: on)")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding, as a JSON object passed to the engine (default: off); '
                        '\'{"method": "dspark"}\' without "model" uses the drafter dspark ships for the model, '
                        'with its settings (probabilistic drafts, block verification) for keys not named')
    from dspark.cli import add_backend_args

    add_backend_args(p)
    p.add_argument("--seed", type=int, default=0, help="engine seed for requests that bring none (default: 0)")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"larger request bodies get a 413 (default: {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--log-level", default="info", help="dspark log level (default: info)")
    p.add_argument("--uvicorn-log-level", default="warning", help="uvicorn log level (default: warning)")
    p.add_argument("--disable-uvicorn-access-log", action="store_true", help="no per-request access log lines")
    return p


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the main CLI's subparsers."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serve a model over the OpenAI API on HOST:PORT (127.0.0.1:8000 by default).",
    )
    add_serve_arguments(p)
    p.set_defaults(func=run_serve)
    return p


# ---------------------------------------------------------------------- engine construction
def _estimate_weight_bytes(model: str | None, dtype_bytes: int) -> int:
    """Rough size of the weights on the device: the checkpoint's file size, rescaled from 2-byte
    weights to the serving dtype. Only used to size the KV cache from --gpu-memory-utilization."""
    try:
        from dspark.models.loader import DEFAULT_MODEL

        name = model or DEFAULT_MODEL
        if name.lower() == DEFAULT_MODEL:
            from dspark.models.gguf_loader import default_gguf_path

            size = default_gguf_path().stat().st_size
        else:
            p = Path(name).expanduser()
            size = p.stat().st_size if p.is_file() else sum(f.stat().st_size for f in p.glob("*.safetensors"))
    except Exception:
        return 0
    return int(size * max(1.0, dtype_bytes / 2))


def kv_cache_gb(args: argparse.Namespace, device: str, dtype_bytes: int, log: logging.Logger) -> float | None:
    """KV-cache size: --kv-cache-memory-gb if given; on CUDA, from free memory x utilization minus the
    weights and an activation reserve; on CPU, the engine default (--gpu-memory-utilization ignored)."""
    util = args.gpu_memory_utilization
    if util is not None and not 0.0 < util <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {util}")
    if args.kv_cache_memory_gb is not None:
        if args.kv_cache_memory_gb <= 0:
            raise ValueError(f"--kv-cache-memory-gb must be > 0, got {args.kv_cache_memory_gb}")
        return args.kv_cache_memory_gb
    if not device.startswith("cuda"):
        if util is not None:
            log.info("--gpu-memory-utilization %.2f is ignored on %s; the KV cache uses --kv-cache-memory-gb "
                     "(default 1.0 GiB)", util, device)
        return None
    import torch

    util = DEFAULT_GPU_MEMORY_UTILIZATION if util is None else util
    dev = torch.device(device)
    free, total = torch.cuda.mem_get_info(dev)
    in_use_by_others = total - free
    weights = _estimate_weight_bytes(args.model or args.model_tag, dtype_bytes)
    reserve = max(1 << 30, int(0.03 * total))  # activations, logits, sampler workspace
    kv = total * util - in_use_by_others - weights - reserve
    if kv <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {util}: {total / 2**30:.1f} GiB x {util} leaves no room for a KV cache "
            f"({in_use_by_others / 2**30:.1f} GiB already in use, ~{weights / 2**30:.1f} GiB of weights)"
        )
    log.info("KV cache: %.2f GiB (%.2f of %.1f GiB, %.1f GiB in use, ~%.2f GiB weights, %.1f GiB reserve)",
             kv / 2**30, util, total / 2**30, in_use_by_others / 2**30, weights / 2**30, reserve / 2**30)
    return kv / 2**30


def build_engine(args: argparse.Namespace, log: logging.Logger) -> Any:
    import torch

    from dspark.engine.llm_engine import LLMEngine, resolve_device, resolve_dtype

    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    kw: dict[str, Any] = dict(
        device=device, dtype=dtype, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        attention_backend=args.attention_backend, enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant, invariant_attention=args.invariant_attention,
        async_scheduling=not args.no_async_scheduling,
        warmup=False if args.no_warmup else None, graph_prefill_tokens=args.graph_prefill_tokens,
        graph_prefill_alone=args.graph_prefill_alone,
    )
    if args.max_model_len is not None:
        kw["max_model_len"] = args.max_model_len
    gb = kv_cache_gb(args, device, torch.empty((), dtype=dtype).element_size(), log)
    if gb is not None:
        kw["kv_cache_memory_gb"] = gb
    if args.speculative_config:  # only when given: the engine validates the JSON and its keys
        kw["speculative_config"] = args.speculative_config
    model = args.model or args.model_tag
    try:
        engine = LLMEngine(model, **kw)
    except TypeError as e:
        if "speculative_config" in kw and "speculative_config" in str(e):
            raise ValueError("this dspark engine does not support --speculative-config yet") from None
        raise
    for note in getattr(engine, "spec_notes", None) or []:
        log.info("speculative decoding: %s", note)
    watch = sys.modules.get("dspark.kernels.compile_watch")  # loaded by a CUDA engine
    if watch is not None:
        watch.arm()  # built, captured and warmed up: a compile from now on stalls a served step (logged, /metrics)
    cap = engine.kv.num_usable_blocks * engine.kv.block_size
    if cap < engine.config.max_model_len:
        raise ValueError(
            f"the KV cache holds {cap} tokens, fewer than max_model_len {engine.config.max_model_len}: "
            f"raise --kv-cache-memory-gb / --gpu-memory-utilization or lower --max-model-len"
        )
    return engine


def build_served_engine(args: argparse.Namespace) -> Any:
    """The engine `dspark serve` serves, built and logged (runs in the engine process)."""
    log = logging.getLogger("dspark.server")
    t0 = time.perf_counter()
    engine = build_engine(args, log)
    log.info("loaded %s on %s (%s) in %.1fs: %d KV blocks of %d tokens, max_model_len %d",
             engine.model_name, engine.config.device, str(engine.config.dtype).removeprefix("torch."),
             time.perf_counter() - t0, engine.kv.num_usable_blocks, engine.kv.block_size, engine.config.max_model_len)
    if engine.warmup_s is not None:
        log.info("warm-up requests (the eager paths' kernels compiled before the first request) took %.1fs",
                 engine.warmup_s)
    return engine


def run_serve(args: argparse.Namespace) -> int:
    import functools

    import uvicorn

    from dspark.server.app import build_app
    from dspark.server.engine_process import ProcessEngineClient

    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("dspark.server")
    # The engine runs in its own process (engine_process.py says why: the GIL), built there.
    client = ProcessEngineClient(functools.partial(build_served_engine, args), log_level=level)
    app = build_app(client, args.served_model_name, api_key=args.api_key,
                    max_body_bytes=args.max_request_body_bytes)
    # Everything built so far out of the garbage collector's sight, so its full passes during serving
    # walk only what requests create (as vLLM does; the engine process does the same for the engine).
    # `dspark bench` does the same; on the H200 (session 20) the collector's passes over the engines'
    # objects had made identical timed calls vary by 30 % and DSpark at B = 32 run at 1.22–1.30x plain
    # instead of 1.51x.
    gc.collect()
    gc.freeze()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server is reachable from other machines%s", args.host,
                    "" if args.api_key else " and has no --api-key")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log, timeout_keep_alive=5,
                            timeout_graceful_shutdown=5)  # then in-flight streams are cut and aborted
    server = uvicorn.Server(config)
    log.info("serving %s on http://%s:%d/v1", app.state.served_model_names[0], args.host, args.port)
    server.run()
    return 0


def main(argv: list[str] | None = None) -> int:
    from dspark.models.errors import ModelLoadError
    from dspark.sampling_params import InvalidRequestError

    parser = argparse.ArgumentParser(prog="dspark serve", description="dspark OpenAI-compatible server")
    add_serve_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_serve(args)
    except (ModelLoadError, InvalidRequestError, ValueError) as e:
        print(f"dspark: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
