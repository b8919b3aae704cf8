"""Where the time of continuous batching goes, with and without DSpark: the `dspark bench` B=32 cell
(128 held-out ShareGPT prompts at concurrency 32, 256 new tokens, greedy) with every engine step
classified and timed.

Written for the question session 14 left open: at B=32 in continuous cells DSpark runs at 0.46x of
plain (4.0 ms per step against 2.1 ms in static waves), although mixed prefill + verification steps
now run as a graph sub-step plus an eager prefill sub-step (ModelRunner._split).

Every ``engine.step()`` call is filed under what it ran: a synchronous ``runner.execute``, classified as
  graph   decode / verification rows only, on the CUDA graphs (runner.graphs.covers), verified on the
          device (runner._one_sync); graph_host: the same, verified / sampled on the host;
  graph_prefill  prefill chunks as q-token rows of a one-sync graph step (runner._graph_prefill);
  split   a mixed step run as a graph sub-step + an eager sub-step (runner._split);
  eager   anything else (a prefill alone, or a step the graphs cannot take);
or a step launched for async scheduling (``launch_spec``: DSpark one-sync, ``launch``: plain), joined
with "+" when one call runs several (an async call reads back step t after launching t+1). A DSpark
step pipelines only while every request verifies a full block (LLMEngine._launchable_spec) and the
scheduler can continue (no request ended or admitted), so in continuous batching every admission and
every finish falls back to a synchronous step; this counts how often. Timed twice: an unsynchronised
pass (the real pipeline: total tok/s, host-side wall per kind) and a pass synchronising the device
around every call (async overlap lost: each kind's device-inclusive time). Per kind: calls, ms per
call, rows, verification rows, prefill tokens.

Usage (GPU; the real model needs the GGUF, DSPARK_SMOLLM2_GGUF or the embedded default):
    python benchmarks/gpu_continuous_profile.py OUT_DIR [--prompt-source FILE] [--batch 32] [--prompts 128]
        [--temperature T] [--systems plain,dspark] [--cprofile N] [--torch-trace P [--no-trace-file]] [--stop-at-eos]
        [--timeline] [--segments] [--graph-prefill-alone]
Writes OUT_DIR/continuous_profile.json and prints a summary.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark import LLM, SamplingParams  # noqa: E402


def classify(runner, scheduled) -> str:
    if runner.graphs is not None and runner.graphs.covers(scheduled):
        return "graph" if runner._one_sync(scheduled) else "graph_host"
    if runner._graph_prefill(scheduled):
        return "graph_prefill"
    if runner._split(scheduled):
        return "split"
    return "eager"


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_system(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int, sync: bool,
                   temperature: float = 0.0, cprofile: int = 0) -> dict:
    """Every ``engine.step()`` is timed (device-synchronised before and after when ``sync``) and filed under
    what it ran: ``execute:graph|split|eager`` (a synchronous step, classified), ``launch_spec`` /
    ``launch`` (a DSpark / plain step launched for async scheduling; its tokens are read back in the next
    call; ``launch_spec_prefill``: with prompts as prefill rows; ``_first``: launched with no step in
    flight), joined with "+" when one call does several (an async call reads back step t and launches t+1)."""
    engine, runner = llm.engine, llm.engine.runner
    engine.scheduler.max_num_seqs = batch
    stats: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    current: list[str] = []
    rows: list[tuple[int, int, int]] = []  # (rows, verify rows, prefill tokens) of the runner calls of this step
    saved = {name: getattr(runner, name) for name in ("execute", "launch_one_sync", "launch")}
    saved_step = engine.step

    def count(scheduled) -> None:
        v = sum(1 for s in scheduled if s.num_tokens == 1 + s.num_spec_tokens and s.samples)
        rows.append((len(scheduled), v, sum(s.num_tokens for s in scheduled
                                            if not (s.num_tokens == 1 + s.num_spec_tokens and s.samples))))

    def execute(sched, kv):
        current.append("execute:" + classify(runner, sched.scheduled))
        count(sched.scheduled)
        return saved["execute"](sched, kv)

    def launch_one_sync(sched, kv, prev):
        # launch_spec_prefill: prompts admitted as prefill rows (on top of the step in flight when prev)
        prefill = any(not runner.graphs._decode_row(s) for s in sched.scheduled)
        current.append("launch_spec" + ("_prefill" if prefill else "") + ("" if prev is not None else "_first"))
        count(sched.scheduled)
        return saved["launch_one_sync"](sched, kv, prev)

    def launch(sched, kv, prev):
        current.append("launch")
        count(sched.scheduled)
        return saved["launch"](sched, kv, prev)

    def step(**kw):  # final_only (LLM.generate)
        current.clear()
        rows.clear()
        if sync:
            _sync()
        t0 = time.perf_counter()
        out = saved_step(**kw)
        if sync:
            _sync()
        dt = time.perf_counter() - t0
        st = stats["+".join(current) or "readback_only"]
        st["calls"] += 1
        st["s"] += dt
        for r, v, pt in rows:
            st["rows"] += r
            st["verify_rows"] += v
            st["prefill_tokens"] += pt
        return out

    runner.execute, runner.launch_one_sync, runner.launch = execute, launch_one_sync, launch
    engine.step = step
    # host timers: wall time inside these functions (an async step's finish_one_sync includes waiting for
    # the device, i.e. the GPU-bound share); nested ones are counted in their callers too
    timers: dict[str, float] = defaultdict(float)
    # (the graphs' methods on their class: DSpark has a set of graphs per verification length)
    G = type(runner.graphs) if runner.graphs is not None else None
    timed = [(runner, "launch_one_sync"), (runner, "finish_one_sync"), (engine.scheduler, "schedule_on_top"),
             (engine.scheduler, "update"), (engine.scheduler, "schedule"), (engine, "_apply"), (engine, "_outputs"),
             (G, "prepare_target"), (G, "prepare_sampling"), (G, "upload"), (G, "flip"),
             (G, "rows_from_previous_step"), (G, "drafter_inputs_on_device"), (G, "stage_q"),
             (G, "replay_target"), (G, "replay_draft"), (runner, "_sampling_batch"), (runner, "_index"),
             (runner, "_copy_back"), (G, "replay_verify"), (runner, "_prefill_outcome"), (engine.kv, "truncate")]
    originals = []
    for obj, name in timed:
        if obj is None or not hasattr(obj, name):
            continue
        fn = getattr(obj, name)
        originals.append((obj, name, fn))

        def wrapped(*a, _fn=fn, _name=name, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                timers[_name] += time.perf_counter() - t

        setattr(obj, name, wrapped)
    try:
        p = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=IGNORE_EOS)
        gc.collect()
        _sync()
        prof = cProfile.Profile() if cprofile else None
        t0 = time.perf_counter()
        if prof is not None:
            prof.enable()
        outs = llm.generate(prompts, p)
        if prof is not None:
            prof.disable()
        _sync()
        wall = time.perf_counter() - t0
    finally:
        for obj, name, fn in reversed(originals):
            setattr(obj, name, fn)
        for name, fn in saved.items():
            setattr(runner, name, fn)
        engine.step = saved_step
    n = sum(len(o.token_ids) for o in outs)
    kinds = {}
    for kind, st in sorted(stats.items(), key=lambda kv: -kv[1]["s"]):
        k = st["calls"]
        kinds[kind] = {"calls": int(k), "ms_per_call": round(1e3 * st["s"] / k, 3), "total_s": round(st["s"], 3),
                       "rows_per_call": round(st["rows"] / k, 2), "verify_rows_per_call": round(st["verify_rows"] / k, 2),
                       "prefill_tokens": int(st["prefill_tokens"])}
    calls = sum(v["calls"] for v in kinds.values())
    _OUTPUTS[(id(llm), sync)] = [list(o.token_ids) for o in outs]
    top = None
    if prof is not None:  # own (tottime) and cumulative ms per step call of the top functions (cProfile slows
        # the host, so compare these with each other, not with the unprofiled pass's wall time)
        st = pstats.Stats(prof)
        rows_ = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[:cprofile]
        top = [{"fn": f"{Path(f).name}:{line}:{name}", "ncalls": nc, "own_ms_per_step": round(1e3 * tt / max(calls, 1), 4),
                "cum_ms_per_step": round(1e3 * ct / max(calls, 1), 4)} for (f, line, name), (cc, nc, tt, ct, _) in rows_]
    return {"sync": sync, "tokens": n, "wall_s": round(wall, 3), "tok_s": round(n / wall, 1), "step_calls": calls,
            "ms_per_call": round(1e3 * wall / max(calls, 1), 3),
            "step_share": round(sum(v["total_s"] for v in kinds.values()) / wall, 3), "kinds": kinds,
            "host_ms_per_step_call": {k: round(1e3 * v / max(calls, 1), 3) for k, v in sorted(timers.items(), key=lambda kv: -kv[1])},
            **({"cprofile_top": top} if top else {})}


MAX_MODEL_LEN = 2048
IGNORE_EOS = True  # --stop-at-eos: False (requests end at the EOS, as `dspark bench --stop-at-eos`)
_OUTPUTS: dict = {}  # (id(llm), sync) -> token ids per prompt, for the cross-system agreement count


def gpu_gaps(marks: list[tuple[str, float, float]], top: int = 12) -> dict:
    """Where the GPU waited for the host, from per-step device times: ``marks`` [(kind, start, end)] in
    launch order, ms on one device clock, ``start`` the time the step's first device work could begin
    (an event recorded before it: it completes when the work queued before it has, or at once if the
    stream was idle) and ``end`` the time its last work finished. The gap before step i is
    max(0, start_i - end_{i-1}); busy is end_i - max(start_i, end_{i-1}). Per kind of step i: count, gap ms
    in all and per step, busy ms per step; and the largest gaps."""
    by: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    gaps = []
    prev_end = None
    for i, (kind, start, end) in enumerate(marks):
        gap = 0.0 if prev_end is None else max(0.0, start - prev_end)
        busy = end - (start if prev_end is None else max(start, prev_end))
        st = by[kind]
        st["steps"] += 1
        st["gap_ms"] += gap
        st["busy_ms"] += busy
        gaps.append((gap, i, kind))
        prev_end = end if prev_end is None else max(prev_end, end)
    span = marks[-1][2] - marks[0][1] if marks else 0.0
    kinds = {k: {"steps": int(v["steps"]), "gap_ms": round(v["gap_ms"], 3), "gap_ms_per_step": round(v["gap_ms"] / v["steps"], 4),
                 "busy_ms_per_step": round(v["busy_ms"] / v["steps"], 4)}
             for k, v in sorted(by.items(), key=lambda kv: -kv[1]["gap_ms"])}
    return {"span_ms": round(span, 3), "gap_ms": round(sum(g for g, _, _ in gaps), 3), "kinds": kinds,
            "largest_gaps": [{"step": i, "kind": k, "gap_ms": round(g, 3)} for g, i, k in sorted(gaps, reverse=True)[:top]]}


def _generate_timed(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float) -> tuple[list, float]:
    """One generate() of the prompts from the same collector state, timed between device synchronisations."""
    p = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=IGNORE_EOS)
    gc.collect()
    _sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, p)
    _sync()
    return outs, time.perf_counter() - t


def timeline(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float) -> dict:
    """One generate() with two CUDA events per engine step, no profiler: the device time each step could
    start (an event recorded before its launch) and ended (one recorded after it), so the GPU's idle time
    between steps is measured without slowing the host (torch.profiler doubles it at batch 1). A step's
    kind: what the runner ran (as profile_system files it), with "+drop" when the engine dropped a launched
    step (every request of it ended) since the previous one, "+finish" when the previous step() call
    ended a request. Only on CUDA."""
    engine, runner = llm.engine, llm.engine.runner
    saved = {name: getattr(runner, name) for name in ("execute", "launch_one_sync", "launch", "drop")}
    marks: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
    flags = {"drop": False, "finish": False}

    def timed(name, label):
        def call(sched, *args):
            kind = label(sched, *args)
            if flags["drop"]:
                kind += "+drop"
            if flags["finish"]:
                kind += "+finish"
            flags["drop"] = flags["finish"] = False
            t0 = torch.cuda.Event(enable_timing=True)
            t0.record()
            out = saved[name](sched, *args)
            t1 = torch.cuda.Event(enable_timing=True)
            t1.record()
            marks.append((kind, t0, t1))
            return out
        return call

    def drop(step):
        flags["drop"] = True
        return saved["drop"](step)

    runner.execute = timed("execute", lambda sched, kv: "execute:" + classify(runner, sched.scheduled))
    runner.launch_one_sync = timed("launch_one_sync", lambda sched, kv, prev: "launch_spec" + (
        "_prefill" if any(not runner.graphs._decode_row(s) for s in sched.scheduled) else "") + (
        "" if prev is not None else "_first"))
    runner.launch = timed("launch", lambda sched, kv, prev: "launch" + ("" if prev is not None else "_first"))
    runner.drop = drop
    saved_step = engine.step

    def step(**kw):
        out = saved_step(**kw)
        if any(o.finished for o in out):
            flags["finish"] = True
        return out

    engine.step = step
    try:
        outs, wall = _generate_timed(llm, prompts, max_tokens, temperature)
    finally:
        for name, fn in saved.items():
            setattr(runner, name, fn)
        engine.step = saved_step
    base = marks[0][1]
    res = gpu_gaps([(k, base.elapsed_time(a), base.elapsed_time(b)) for k, a, b in marks])
    n = sum(len(o.token_ids) for o in outs)
    return {"tokens": n, "wall_s": round(wall, 3), "tok_s": round(n / wall, 1), "requests": len(outs), **res}


def segments(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float) -> dict:
    """One generate() with a CUDA event after each piece of device work a launched step queues (the pinned
    uploads, the row shift, the target / verification / sampling graphs, the drafter's inputs, the drafter
    graph, the copy back) and one before it, no profiler. An event completes when the work queued before it
    has, so the time between two consecutive events is that piece's device time **plus any time the GPU
    waited for the host to queue it** (the host's Python between the pieces of a launch, once the GPU has
    caught up). Per kind of launch: mean and median ms per piece, in launch order; ``before`` is the GPU's
    idle time between the previous step's end and this step's first event; ``host_ms``: the host's mean wall
    time from one mark to the next. Only on CUDA."""
    engine, runner = llm.engine, llm.engine.runner
    G = runner.graphs
    cur: list | None = None
    steps: list[tuple[str, list]] = []

    def mark(label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        cur.append((label, e, time.perf_counter()))

    hooked = []

    def hook(obj, name: str) -> None:
        if not hasattr(obj, name):
            return
        fn = getattr(obj, name)

        def call(*args, **kw):
            out = fn(*args, **kw)
            if cur is not None:
                mark(name)
            return out
        setattr(obj, name, call)
        hooked.append((obj, name))

    for g in {id(g): g for g in (G, *runner.graph_sets.values())}.values():  # every verification length's set
        for name in ("upload", "rows_from_previous_step", "replay_target", "stage_q", "replay_verify",
                     "replay_sample", "drafter_inputs_on_device", "replay_draft"):
            hook(g, name)
    hook(runner, "_copy_back")

    def launcher(name: str):
        fn = getattr(runner, name)

        def call(sched, kv, prev):
            nonlocal cur
            cur = []
            mark("start")
            out = fn(sched, kv, prev)
            mark("end")
            pre = any(not G._decode_row(s) for s in sched.scheduled)
            steps.append((name + ("_prefill" if pre else "") + ("" if prev is not None else "_first"), cur))
            cur = None
            return out
        setattr(runner, name, call)
        hooked.append((runner, name))

    launcher("launch_one_sync")
    launcher("launch")
    try:
        outs, wall = _generate_timed(llm, prompts, max_tokens, temperature)
    finally:
        for obj, name in hooked:
            delattr(obj, name)  # the class's method again
    by: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    host: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    order: dict[str, list[str]] = {}
    prev_end = None
    for kind, marks in steps:
        t = [marks[0][1].elapsed_time(e) for _, e, _ in marks]
        if prev_end is not None:
            by[kind]["before"].append(max(0.0, prev_end.elapsed_time(marks[0][1])))
        labels = []
        for i in range(1, len(marks)):
            label = marks[i][0]
            while label in labels:
                label += "'"
            labels.append(label)
            by[kind][label].append(t[i] - t[i - 1])
            host[kind][label].append(1e3 * (marks[i][2] - marks[i - 1][2]))
        order.setdefault(kind, ["before"] + labels)
        prev_end = marks[-1][1]
    res = {}
    for kind, pieces in by.items():
        n = len(pieces[order[kind][1]])
        res[kind] = {"steps": n, "ms": {lab: {"mean": round(sum(v) / len(v), 4), "median": round(sorted(v)[len(v) // 2], 4)}
                                       for lab in order[kind] if (v := pieces.get(lab))},
                     # the host's wall time from the previous mark to this one (its Python and CUDA calls)
                     "host_ms": {lab: round(sum(v) / len(v), 4) for lab in order[kind] if (v := host[kind].get(lab))}}
    n = sum(len(o.token_ids) for o in outs)
    return {"tokens": n, "wall_s": round(wall, 3), "tok_s": round(n / wall, 1), "launches": res}


def torch_trace(llm: LLM, prompts: list[list[int]], max_tokens: int, temperature: float, trace_file: Path | None,
                top: int = 25) -> dict:
    """One generate() under torch.profiler (CPU + CUDA activities), for the question a host-side profile
    cannot answer: is the GPU busy (GPU-bound) or waiting for the host? ``gpu_busy_share``: the kernels'
    device time (one stream, so they do not overlap) over the wall time; the CUDA runtime calls with their
    host time (cudaGraphLaunch, cudaEventSynchronize / cudaStreamSynchronize: the host waiting, a pageable
    cudaMemcpy: a hidden wait); the torch ops of most host time. The profiler slows the host (a few us per
    op), so the busy share is a lower bound; compare its tok/s with the unprofiled pass's."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    p = SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=IGNORE_EOS)
    gc.collect()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, p)
        _sync()
        wall = time.perf_counter() - t0
    ka = prof.key_averages()

    def dev_us(e) -> float:
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    kernels = [e for e in ka if e.device_type == DeviceType.CUDA]
    busy_us = sum(dev_us(e) for e in kernels)
    runtime = sorted((e for e in ka if e.device_type == DeviceType.CPU and e.key.startswith("cuda")),
                     key=lambda e: -e.cpu_time_total)
    ops = sorted((e for e in ka if e.device_type == DeviceType.CPU and not e.key.startswith("cuda")),
                 key=lambda e: -e.self_cpu_time_total)
    n = sum(len(o.token_ids) for o in outs)
    res = {"tokens": n, "wall_s": round(wall, 3), "tok_s": round(n / wall, 1), "gpu_busy_s": round(busy_us / 1e6, 3),
           "gpu_busy_share": round(busy_us / 1e6 / wall, 3),
           "cuda_runtime": [{"name": e.key, "calls": e.count, "host_ms": round(e.cpu_time_total / 1e3, 2)}
                            for e in runtime[:12]],
           "top_kernels": [{"name": e.key[:90], "calls": e.count, "device_ms": round(dev_us(e) / 1e3, 2)}
                           for e in sorted(kernels, key=lambda e: -dev_us(e))[:top]],
           "top_host_ops": [{"name": e.key[:90], "calls": e.count, "self_host_ms": round(e.self_cpu_time_total / 1e3, 2)}
                            for e in ops[:top]]}
    if trace_file is not None:
        import gzip
        import shutil

        raw = trace_file.with_suffix("")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as f, gzip.open(trace_file, "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()
        res["trace"] = trace_file.name
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompt-source", default=None, help="prompt split file (dspark.train.data)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--speculative-config", default=None,
                    help="keys over the shipped drafter's config (dspark.drafters), as `dspark bench` takes them; one "
                         'naming a "model" replaces it')
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run (fp32, tiny sizes)")
    ap.add_argument("--systems", default="plain,dspark",
                    help="which of plain,dspark,dspark-eager-prefill,dspark-sync-admit to profile "
                         "(dspark-eager-prefill: graph_prefill_tokens=0, admissions' prefill eager as before "
                         "session 16; dspark-sync-admit: admissions never launched on top of the step in "
                         "flight, LLMEngine.admit_on_top=False, as before session 20)")
    ap.add_argument("--cprofile", type=int, default=0, metavar="N",
                    help="a third pass under cProfile: the N functions of most own time, ms per step call")
    ap.add_argument("--no-trace-file", dest="trace_file", action="store_false",
                    help="--torch-trace: the summary only, no Chrome trace file (a batch-32 trace is several MB)")
    ap.add_argument("--trace-top", type=int, default=25, help="--torch-trace: kernels and host ops listed")
    ap.add_argument("--torch-trace", type=int, default=0, metavar="P",
                    help="a last pass under torch.profiler over P prompts: GPU busy share, CUDA runtime calls, "
                         "top kernels and host ops; its chrome trace as OUT/trace_SYSTEM.json.gz")
    ap.add_argument("--verify-length", type=int, default=0, metavar="N",
                    help="with verify_lengths in --speculative-config: switch the adaptive policy off and verify "
                         "N drafts in every step (one of the engine's graph sets)")
    ap.add_argument("--timeline", action="store_true",
                    help="a pass with two CUDA events per engine step and no profiler: the GPU's idle time before "
                         "each step, by kind of step (gpu_gaps; CUDA only)")
    ap.add_argument("--graph-prefill-alone", action="store_true",
                    help="EngineConfig.graph_prefill_alone: with no request decoding, prompt chunks cut to the graphs' "
                         "prefill rows (graph steps) instead of one eager step")
    ap.add_argument("--segments", action="store_true",
                    help="a pass with a CUDA event after each piece of a launched step (uploads, row shift, graphs, "
                         "copy back): the device time of each, with the GPU's waits for the host inside (CUDA only)")
    ap.add_argument("--stop-at-eos", action="store_true",
                    help="requests end at the EOS (or max tokens), as `dspark bench --stop-at-eos`: the per-request "
                         "costs (admission, the step launched past a request's end) weigh as in that bench")
    a = ap.parse_args()
    global IGNORE_EOS
    IGNORE_EOS = not a.stop_at_eos
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from dspark.train.data import heldout_prompts

    res: dict = {"gpu": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "batch": a.batch, "prompts": a.prompts, "max_tokens": a.max_tokens, "temperature": a.temperature}
    texts = heldout_prompts(2 * a.prompts, a.prompt_source)  # those that fit max_model_len are kept, below
    from dspark.drafters import default_speculative_config

    spec = default_speculative_config(a.model)
    spec = json.loads(spec) if isinstance(spec, str) else spec
    if a.speculative_config:  # its keys over the shipped drafter's settings (as dspark bench takes them)
        given = json.loads(a.speculative_config)
        spec = given if spec is None or "model" in given else {**spec, **given}
    tokens: dict[str, list[list[int]]] = {}
    systems = {"plain": (None, 512), "dspark": (spec, 512), "dspark-eager-prefill": (spec, 0),
               "dspark-sync-admit": (spec, 512)}
    for name in a.systems.split(","):
        spec, prefill_tokens = systems[name]
        cuda = a.device == "cuda"
        llm = LLM(a.model, device=a.device, dtype="bfloat16" if cuda else "float32", max_model_len=MAX_MODEL_LEN,
                  max_num_seqs=a.batch, kv_cache_memory_gb=16 if cuda else 0.5, enable_prefix_caching=False,
                  speculative_config=spec, graph_prefill_tokens=prefill_tokens,
                  graph_prefill_alone=a.graph_prefill_alone)
        llm.engine.admit_on_top = name != "dspark-sync-admit"
        if a.verify_length and spec:  # an adaptive engine held at one of its lengths (its policy off)
            if a.verify_length not in llm.engine.runner.graph_sets:
                raise SystemExit(f"--verify-length {a.verify_length}: the engine has graph sets for "
                                 f"{sorted(llm.engine.runner.graph_sets)} drafts only (CUDA graphs needed)")
            llm.engine.verify_policy = None
            llm.engine.runner.use_verify_length(a.verify_length)
        # the first a.prompts that fit max_model_len with their max_tokens (B = 128's 512 held-out prompts hold
        # one of 2,100 tokens); the same for every system (one tokenizer)
        prompts = [x for x in (llm.engine.tokenize_chat([{"role": "user", "content": t}]) for t in texts)
                   if len(x) + a.max_tokens <= MAX_MODEL_LEN][:a.prompts]
        llm.generate(prompts, SamplingParams(temperature=a.temperature, max_tokens=a.max_tokens, ignore_eos=IGNORE_EOS))  # warm-up
        gc.collect()
        gc.freeze()  # the engine out of the collector's sight while it runs, as dspark bench / serve do
        row = {"async": profile_system(llm, prompts, a.batch, a.max_tokens, sync=False, temperature=a.temperature),
               "synced": profile_system(llm, prompts, a.batch, a.max_tokens, sync=True, temperature=a.temperature)}
        if a.cprofile:
            row["cprofile"] = profile_system(llm, prompts, a.batch, a.max_tokens, sync=False, temperature=a.temperature,
                                             cprofile=a.cprofile)
        if a.timeline and cuda:
            row["timeline"] = timeline(llm, prompts, a.max_tokens, a.temperature)
        if a.segments and cuda:
            row["segments"] = segments(llm, prompts, a.max_tokens, a.temperature)
        if a.torch_trace:
            row["torch_trace"] = torch_trace(llm, prompts[:a.torch_trace], a.max_tokens, a.temperature,
                                             out / f"trace_{name}.json.gz" if cuda and a.trace_file else None,
                                             top=a.trace_top)
        if spec:
            row["tau"] = round(llm.engine.spec_stats.tau, 3)
        tokens[name] = _OUTPUTS.pop((id(llm), False))
        _OUTPUTS.pop((id(llm), True), None)
        row["identical_to"] = {other: sum(a_ == b_ for a_, b_ in zip(tokens[name], t)) for other, t in tokens.items()
                               if other != name}  # of a.prompts; bf16 near-ties may split them (docs/benchmarks.md)
        res[name] = row
        print(name, json.dumps(row, indent=1), flush=True)
        (out / "continuous_profile.json").write_text(json.dumps(res, indent=1))
        gc.unfreeze()
        del llm
        if cuda:
            torch.cuda.empty_cache()
    print("done", flush=True)


if __name__ == "__main__":
    main()
