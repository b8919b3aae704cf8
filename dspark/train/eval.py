"""Acceptance of a drafter in the engine: τ and per-position conditional acceptance, greedy and at
temperature 1, over a prompt set (issue 4 §3).

One engine with the drafter (probabilistic drafting, so temperature-1 requests draft from the
Markov-corrected q; greedy requests draft argmax whatever the setting) runs the prompts twice, once
per temperature; the engine's SpecStats are reset between the two runs.

Prompt files are JSON lines, each ``{"prompt": "user message"}``, ``{"messages": [{role, content}, ...]}``
or a bare JSON string; every prompt goes through the target's chat template.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Sequence

Messages = list[dict[str, str]]
TEMPERATURES = {"greedy": 0.0, "temperature_1": 1.0}


def read_prompt_file(path: str | Path) -> list[Messages]:
    convs: list[Messages] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        d = json.loads(line)
        if isinstance(d, str):
            convs.append([{"role": "user", "content": d}])
        elif isinstance(d, dict) and isinstance(d.get("prompt"), str):
            convs.append([{"role": "user", "content": d["prompt"]}])
        elif isinstance(d, dict) and isinstance(d.get("messages"), list):
            convs.append(d["messages"])
        else:
            raise ValueError(f"{path}:{n}: expected a string, {{\"prompt\": ...}} or {{\"messages\": [...]}}")
    return convs


def evaluate_acceptance(model: str | None, drafter: str, conversations: Sequence[Messages], *, num_prompts: int,
                        max_tokens: int = 256, max_prompt_tokens: int = 1024, device: str | None = None,
                        dtype: str | None = None, num_speculative_tokens: int | None = None,
                        rejection_sample_method: str = "standard", seed: int = 0,
                        max_num_seqs: int = 64, kv_cache_memory_gb: float = 2.0) -> dict[str, Any]:
    """The first num_prompts conversations whose chat-templated prompt fits max_prompt_tokens, run to
    max_tokens new tokens (or EOS) at each temperature. Returns the JSON-ready report."""
    from dspark import LLM, SamplingParams
    from dspark.spec.metrics import SpecStats

    # every draft verified: τ and the per-position acceptance measure the drafter, not confidence scheduling's
    # choices (which on eager steps follow measured step times)
    spec: dict[str, Any] = {"model": drafter, "draft_sample_method": "probabilistic",
                            "rejection_sample_method": rejection_sample_method, "confidence_scheduling": False}
    if num_speculative_tokens is not None:
        spec["num_speculative_tokens"] = num_speculative_tokens
    llm = LLM(model, device=device, dtype=dtype, speculative_config=spec, seed=seed, max_num_seqs=max_num_seqs,
              max_model_len=max_prompt_tokens + max_tokens, kv_cache_memory_gb=kv_cache_memory_gb)
    eng = llm.engine
    prompts: list[list[int]] = []
    for conv in conversations:
        ids = eng.tokenize_chat(conv)
        if len(ids) <= max_prompt_tokens:
            prompts.append(ids)
        if len(prompts) == num_prompts:
            break
    report: dict[str, Any] = {"model": eng.model_name, "drafter": str(drafter), "num_prompts": len(prompts),
                              "max_tokens": max_tokens, "device": eng.config.device, "dtype": str(eng.config.dtype),
                              "speculative_config": spec, "num_speculative_tokens": eng.runner.num_spec_tokens}
    for name, temp in TEMPERATURES.items():
        eng.spec_stats = SpecStats()
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(temperature=temp, max_tokens=max_tokens))
        wall = time.perf_counter() - t
        st = eng.spec_stats.as_dict()
        n_out = sum(len(o.token_ids) for o in outs)
        report[name] = {"temperature": temp, "tau": st["spec_tau"],
                        "conditional_acceptance": st["spec_conditional_acceptance"],
                        "acceptance_rate": st["spec_acceptance_rate"], "num_steps": st["spec_num_steps"],
                        "output_tokens": n_out, "wall_s": wall, "output_tokens_per_s": n_out / wall}
    return report


def plot_acceptance(report: dict[str, Any], path: str | Path) -> None:
    """Conditional acceptance by draft position, one line per temperature, τ in the legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in TEMPERATURES:
        r = report[name]
        ys = [float("nan") if a is None else a for a in r["conditional_acceptance"]]
        tau = "n/a" if r["tau"] is None else f"{r['tau']:.2f}"
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=f"{name} (τ = {tau})")
    n = max(len(report[name]["conditional_acceptance"]) for name in TEMPERATURES)
    ax.set_xticks(range(1, n + 1))
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(draft k accepted | drafts < k accepted)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    name = "/".join(Path(report["drafter"]).parts[-2:])
    ax.set_title(f"{name}: {report['num_prompts']} prompts × {report['max_tokens']} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
