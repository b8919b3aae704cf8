"""Compile a Triton kernel for an NVIDIA GPU this machine does not have, and report what it would use there:
registers, spills, shared memory, whether the products became Hopper tensor-core (wgmma) instructions.
No GPU is needed: Triton lowers the kernel to PTX for the target's compute capability, and the ``ptxas``
bundled with Triton's wheel assembles it with ``-v``, which prints the registers and the spill bytes.

Why: device time is scarce (docs/benchmarks.md, session 45: a GPU call spent its run on launches that did not
compile — a loop-carried name changed shape, which Triton's CPU interpreter accepts — and the kernel that did
compile spilled 0.3-1.3 KB per thread). A launch shape that does not compile, or spills, can be found here first.

Usage:
  python benchmarks/offline_compile.py --kernel dspark.kernels.drafter_attention:_drafter_attention_kernel \\
      --constexprs '{"GAMMA": 5, "G": 32, ...}' [--types '{"out_ptr": "*fp32"}'] [--warps 4] [--stages 2] [--arch 90]
  python benchmarks/offline_compile.py --drafter-seed     # the drafter kernel's default launches at seed 001's shape
  python benchmarks/offline_compile.py --fewrow           # the few-row products' launches at row tiles 16-128
  python benchmarks/offline_compile.py --engine [--dtype bfloat16] [--shape tiny|smollm2]
      # every distinct launch a small engine makes (smollm2: SmolLM2's dimensions, ~20 minutes)

--engine runs a tiny random Llama with a random DSpark drafter on this CPU (Triton's interpreter, CUDA-graph steps
uncaptured, one-sync steps: greedy and seeded sampled requests, probabilistic and greedy drafts, block and standard
verification, verification from logits, then without speculation), records each distinct launch (the kernel, its
arguments' types, its constexprs, warps and stages) and compiles every one for sm_90. Why: session 57 changed kernels
that only the interpreter ran; one of them (``_verify_greedy_kernel``'s sampled rows) did not compile for a GPU — a
value whose type differs between an ``if``'s branches, which the interpreter accepts — and would have failed the next
GPU session's first graph capture. Launches behind CUDA-only gates (the few-row products, the plain-sampling and
filter kernels, GEMVs) are not made on a CPU: --fewrow covers the few-row ones. Wider, any tests' launches:
    DSPARK_RECORD_LAUNCHES=/tmp/l.json python -m pytest tests/kernels -p no:xdist    (tests/conftest.py records)
    python benchmarks/offline_compile.py --launches /tmp/l.json

Kernels with a PDL parameter compile as dspark.kernels.pdl_opts launches them on the target: with programmatic
dependent launch (the default on sm_90+; DSPARK_PDL=0 compiles the variants without it).

Argument types, unless --types says otherwise: ``*_ptr`` -> ``*bf16``, ``qk_scale``/``scale`` -> ``fp32``, an
UPPER_CASE name -> a constexpr (its value from --constexprs), any other -> ``i64``. Prints one JSON line per compile.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# Compiled, not interpreted: Triton reads this when first imported, and dspark.kernels turns the interpreter on for a
# machine without CUDA unless triton was imported before it. (--engine's recording subprocess runs interpreted, and so
# do tests importing record_launches.)
if __name__ == "__main__" and "--record-engine" not in sys.argv:
    os.environ.pop("TRITON_INTERPRET", None)
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def ptxas_path() -> Path:
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def signature_of(fn, types: dict | None = None) -> dict:
    """Triton's signature for ASTSource: each argument's type by the naming rule of the module docstring."""
    sig = {}
    for name in inspect.signature(fn.fn).parameters:
        if name.endswith("_ptr"):
            sig[name] = "*bf16"
        elif name in ("qk_scale", "scale"):
            sig[name] = "fp32"
        elif name.upper() == name:
            sig[name] = "constexpr"
        else:
            sig[name] = "i64"
    sig.update(types or {})
    return sig


def compile_report(fn, constexprs: dict, types: dict | None = None, num_warps: int = 4, num_stages: int = 2,
                   arch: int = 90) -> dict:
    """Compile ``fn`` (a @triton.jit function) for sm_<arch>; registers, spills and shared memory as ptxas and
    Triton report them, or the compile error."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from dspark import kernels

    options = {"num_warps": num_warps, "num_stages": num_stages}
    if "PDL" in inspect.signature(fn.fn).parameters:  # as dspark.kernels.pdl_opts launches it on the target
        pdl = kernels.PDL and arch >= 90
        constexprs = {**constexprs, "PDL": pdl}
        options["launch_pdl"] = pdl
    out = {"kernel": fn.fn.__name__, "arch": arch, "num_warps": num_warps, "num_stages": num_stages,
           "constexprs": constexprs}
    try:
        k = triton.compile(ASTSource(fn=fn, signature=signature_of(fn, types), constexprs=constexprs),
                           target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as e:  # noqa: BLE001 - a compile error is a result here
        return {**out, "error": f"{type(e).__name__}: {str(e)[-1500:]}"}
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    suffix = "a" if arch >= 90 else ""  # sm_90a: the wgmma instructions need the architecture-specific target
    r = subprocess.run([str(ptxas_path()), "-v", f"-arch=sm_{arch}{suffix}", f.name, "-o", "/dev/null"],
                       capture_output=True, text=True)
    Path(f.name).unlink()
    if r.returncode != 0:
        return {**out, "error": f"ptxas: {r.stderr[-1500:]}"}

    def number(pattern: str) -> int:
        m = re.search(pattern, r.stderr)
        return int(m.group(1)) if m else 0

    return {**out, "registers": number(r"Used (\d+) registers"), "spill_stores": number(r"(\d+) bytes spill stores"),
            "spill_loads": number(r"(\d+) bytes spill loads"), "stack_frame": number(r"(\d+) bytes stack frame"),
            "shared_bytes": k.metadata.shared, "wgmma": "wgmma" in ptx}


def drafter_seed_reports(arch: int = 90, sms: int = 132) -> list[dict]:
    """The shared-tile drafter kernel at its default launch (drafter_launch + split_count for ``sms`` SMs) at seed
    001's shape: Hq 32 / 64 on one 512-wide KV head, γ 5, sinks, context 128 / 512, batch 1 / 4 / 12, K = V."""
    import torch

    from dspark.kernels import next_pow2
    from dspark.kernels.drafter_attention import _drafter_attention_kernel, drafter_launch
    from dspark.kernels.paged_attention import dot_precision, split_count

    reports = []
    for hq in (32, 64):
        for ctx in (128, 512):
            for batch in (1, 4, 12):
                lm = drafter_launch(5, hq, 512, batch=batch)
                splits = split_count(batch * lm["row_tiles"], sms, ctx, lm["block_n"], lm["programs_per_sm"])
                # the constexprs drafter_attention passes for bf16 inputs
                consts = dict(GAMMA=5, G=hq, PAGE=16, HEAD_DIM=512, BLOCK_M=lm["block_m"], BLOCK_G=next_pow2(max(16, 5)),
                              BLOCK_N=lm["block_n"], BLOCK_D=next_pow2(512), NUM_SPLITS=splits, HAS_SINK=True,
                              DOT_PRECISION=dot_precision(torch.bfloat16), KV_SHARED=True)
                types = {"out_ptr": "*bf16" if splits == 1 else "*fp32", "lse_ptr": "*fp32", "sink_ptr": "*fp32",
                         "block_tables_ptr": "*i64", "ctx_lens_ptr": "*i64"}
                rep = compile_report(_drafter_attention_kernel, consts, types, lm["num_warps"], lm["num_stages"], arch)
                reports.append({"hq": hq, "ctx": ctx, "batch": batch, **rep})
    return reports


def fewrow_reports(arch: int = 90, row_tiles: tuple[int, ...] = (16, 32, 64, 128)) -> list[dict]:
    """kernels/fewrow.py's four products of a SmolLM2-135M layer (qkv + RoPE + K/V write, o + residual, gate|up +
    SwiGLU, down + residual, split-K) at the default launch of each program row tile (fewrow_config /
    qkv_rope_config with block_m = the tile: 32-64-row programs take their own settings, fewrow.WIDE_TUNING; the
    engine's programs take at most fewrow.PROGRAM_ROWS, 64), bf16: does a launch spill, or lose the tensor cores?"""
    import torch

    from dspark import kernels
    from dspark.kernels import fewrow as fr

    ptrs = {"pin_ptr": "*fp32", "pout_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "pos_ptr": "*i64",
            "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i64"}
    types = {}
    for prm in fr._fewrow_kernel.params:
        if prm.is_constexpr:
            types[prm.name] = "constexpr"
        elif prm.name.endswith("_ptr"):
            types[prm.name] = ptrs.get(prm.name, "*bf16")
        else:
            types[prm.name] = "fp32" if prm.name in ("eps", "qk_eps") else "i32"
    H, Q, I, D = 576, 960, 1536, 64
    K_OF = {"qkv_rope": H, "o_resid": H, "gate_up_silu": H, "down_resid": I}
    products = {  # name -> (its launch for programs of bm rows, flags)
        "qkv_rope": (lambda bm: fr.qkv_rope_config(H, Q, D, rows=bm, block_m=bm), dict(SCALE=True, ROPE=True, D=D)),
        "o_resid": (lambda bm: fr.fewrow_config(H, H, rows=bm, block_m=bm), dict(RESID=True, HAS_G=True)),
        "gate_up_silu": (lambda bm: fr.fewrow_config(H, I, 2, rows=bm, block_m=bm), dict(SCALE=True, GATE_UP=True)),
        "down_resid": (lambda bm: fr.fewrow_config(I, H, rows=bm, block_m=bm), dict(RESID=True, HAS_G=True)),
    }
    reports = []
    for name, (launch, flags) in products.items():
        for bm in row_tiles:
            cfg = launch(bm)  # block_n, stages, split and warps follow the program's rows (fewrow.WIDE_TUNING)
            consts = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], NUM_STAGES=cfg["NUM_STAGES"], P_PAD=32,
                          SPLIT=cfg["SPLIT"], BM=bm, SCALE=False, GATE_UP=False, RESID=False, HAS_G=False, PRECISE=True,
                          IEEE=False, ROPE=False, D=2, QK_NORM=False)
            consts.update(flags)
            # the L2 prefetch of the weight slice (with PDL) as the engine's output-major weight copies take it
            cols = {"qkv_rope": Q, "o_resid": H, "gate_up_silu": 2 * I, "down_resid": H}[name]
            w_om = torch.empty(cols, K_OF[name], dtype=torch.bfloat16).t()
            consts.update(fr._prefetch_grid(w_om, cfg, kernels.PDL and arch >= 90))
            rep = compile_report(fr._fewrow_kernel, consts, types, cfg["num_warps"], cfg["NUM_STAGES"], arch)
            reports.append({"product": name, "row_tile": bm, "block_n": cfg["BLOCK_N"], "split": cfg["SPLIT"], **rep})
    return reports


_TORCH_TYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64", "int64": "i64",
                "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "i1"}


def record_launches() -> dict[str, int]:
    """(In Triton's interpreter.) From now on count each distinct kernel launch: {JSON of [module, kernel, {argument:
    type}, {constexpr: value}, warps, stages]: launches}, the dict returned (filled as launches happen)."""
    import torch
    from triton.runtime import interpreter

    seen: dict[str, int] = {}
    run = interpreter.InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        values = {**dict(zip(params, args)), **{k: v for k, v in kwargs.items() if k in params}}
        types, consts = {}, {}
        for name, prm in params.items():
            v = values.get(name, prm.default)
            if "constexpr" in str(self.fn.__annotations__.get(name, "")) or v is None:
                types[name] = "constexpr"
                consts[name] = v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
            elif isinstance(v, torch.Tensor):
                types[name] = "*" + _TORCH_TYPES[str(v.dtype).removeprefix("torch.")]
            elif isinstance(v, bool):
                types[name] = "i1"
            elif isinstance(v, int):  # as Triton's launcher types an int argument
                types[name] = "i32" if -2**31 <= v < 2**31 else "i64"
            else:
                types[name] = "fp32"
        key = json.dumps([self.fn.__module__, self.fn.__name__, types, consts, kwargs.get("num_warps", 4),
                          kwargs.get("num_stages", 3)])
        seen[key] = seen.get(key, 0) + 1
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = recording_run
    return seen


def write_launches(seen: dict[str, int], path: str) -> None:
    Path(path).write_text(json.dumps([json.loads(k) + [n] for k, n in seen.items()]))


# --shape smollm2: the target's and the shipped drafter's shapes (SmolLM2-135M: hidden 576, 9 heads of 64, 3 KV heads,
# vocabulary 49,152; the drafter's block of 7, Markov rank 64, three taps) with 3 target layers and random weights,
# so that the launches' shape-dependent constexprs (block sizes, key and vocabulary splits) are SmolLM2's.
SHAPES = {
    "tiny": ({}, {"target_layer_ids": [0], "block_size": 4, "mask_token_id": 3, "markov_rank": 512}),
    "smollm2": ({"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 3,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "rope_theta": 100000.0},
                {"block_size": 7, "mask_token_id": 16, "markov_rank": 64}),
}


def record_engine_launches(path: str, dtype: str, shape: str = "tiny") -> None:
    """(In Triton's interpreter.) Run the tiny engines of --engine and write each distinct launch to ``path``
    (JSON: [module, kernel, {argument: type}, {constexpr: value}, warps, stages, launches]). ``shape``: a key of
    SHAPES, the models' dimensions."""
    import torch

    from dspark import LLM, SamplingParams
    from dspark.config import ModelConfig
    from dspark.engine import cuda_graphs
    from dspark.models.dspark_drafter import (DrafterConfig, drafter_config_dict, random_drafter_state_dict,
                                              write_drafter)
    from tests.conftest import write_tiny_checkpoint

    seen = record_launches()  # fused_ops' row-wise kernels at the interpreter's width (compile_launches: the GPU's)
    cuda_graphs.VERIFY_FROM_LOGITS_MIN_ROWS = 0  # the verification from logits too (a GPU's 128-row steps take it)
    root = Path(tempfile.mkdtemp())
    target_shape, drafter_shape = SHAPES[shape]
    target = write_tiny_checkpoint(root / "t", "llama", seed=3, tie_word_embeddings=True, initializer_range=0.1,
                                   **target_shape)
    tc = ModelConfig.from_hf(json.loads((target / "config.json").read_text()))
    cfg = drafter_config_dict(tc, **drafter_shape)
    drafter = write_drafter(root / "d", cfg, random_drafter_state_dict(DrafterConfig.from_dict(cfg), 0, std=0.2))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(4, 512, (n,), generator=g).tolist() for n in (3, 9, 26)]
    params = [SamplingParams(temperature=1.0, seed=1, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0.6, seed=9, max_tokens=8, ignore_eos=True)]
    for spec in ({"draft_sample_method": "probabilistic", "rejection_sample_method": "block"},
                 {"draft_sample_method": "greedy", "rejection_sample_method": "standard"}, None):
        kw = {"speculative_config": {"model": str(drafter), **spec}} if spec else {}
        llm = LLM(str(target), device="cpu", dtype=dtype, block_size=4, num_kv_blocks=128, attention_backend="triton",
                  max_num_seqs=4, async_scheduling=True, **kw)
        llm.engine.runner.enable_graphs(capture=False, batch_sizes=[2, 4], buckets=[64, 128])
        llm.engine.runner.one_sync_sampled = spec is not None
        for p, sp in zip(prompts, params):
            llm.engine.add_request(p, sp)
        while llm.engine.has_unfinished():
            llm.engine.step()
    write_launches(seen, path)


def compile_launches(path: str, arch: int = 90) -> list[dict]:
    """Compile each launch of a file that record_launches' counts were written to (write_launches). fused_ops'
    row-wise kernels compile with the GPU's rows per program (fused_ops.GPU_ROWS), whatever the interpreter took:
    their launches differ only in that constexpr (ROWS) and the grid, so widths that differ are one GPU launch."""
    from dspark.kernels import fused_ops

    counts: dict[str, int] = {}  # JSON of [module, kernel, types, constexprs, warps, stages] -> launches
    for module, name, types, consts, warps, stages, count in json.loads(Path(path).read_text()):
        if not module.startswith("dspark."):  # kernels the tests define themselves
            continue
        if module == fused_ops.__name__ and "ROWS" in consts:
            consts = {**consts, "ROWS": fused_ops.GPU_ROWS}
        key = json.dumps([module, name, types, consts, warps, stages])
        counts[key] = counts.get(key, 0) + count
    reports = []
    for key, count in counts.items():
        module, name, types, consts, warps, stages = json.loads(key)
        fn = getattr(importlib.import_module(module), name)
        types = {k: types[k] for k in inspect.signature(fn.fn).parameters}  # the kernel's argument order
        rep = compile_report(fn, consts, types, warps, stages, arch)
        reports.append({**rep, "constexprs": {k: v for k, v in rep["constexprs"].items() if v is not None},
                        "launches": count})
    return reports


def engine_reports(arch: int = 90, dtype: str = "bfloat16", shape: str = "tiny") -> list[dict]:
    """--engine: record the tiny engines' launches in a subprocess under Triton's interpreter, then compile each
    distinct launch for sm_<arch> here."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "launches.json")
        r = subprocess.run([sys.executable, __file__, "--record-engine", path, "--dtype", dtype, "--shape", shape],
                           env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"recording the engine's launches failed: {r.stderr[-3000:]}")
        return compile_launches(path, arch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--kernel", help="module:function of a @triton.jit kernel")
    ap.add_argument("--constexprs", default="{}", help="JSON: the values of its constexpr arguments")
    ap.add_argument("--types", default="{}", help='JSON: argument types overriding the naming rule, e.g. {"out_ptr": "*fp32"}')
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (default 90: H100 / H200)")
    ap.add_argument("--drafter-seed", action="store_true",
                    help="the drafter kernel's default launches at seed 001's shape instead of --kernel")
    ap.add_argument("--fewrow", action="store_true",
                    help="kernels/fewrow.py's four SmolLM2 products at their default launches, row tiles 16-128")
    ap.add_argument("--engine", action="store_true",
                    help="every distinct launch of a tiny engine's steps (module docstring), each compiled")
    ap.add_argument("--dtype", default="bfloat16", help="--engine: the engine's dtype")
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                    help="--engine: the models' dimensions (smollm2: SmolLM2's and its drafter's, 3 layers; slower)")
    ap.add_argument("--launches", metavar="PATH",
                    help="compile each launch recorded in PATH (e.g. by the kernel tests: DSPARK_RECORD_LAUNCHES)")
    ap.add_argument("--record-engine", metavar="PATH", help=argparse.SUPPRESS)  # --engine's recording subprocess
    args = ap.parse_args()
    if args.record_engine:
        record_engine_launches(args.record_engine, args.dtype, args.shape)
        return
    if args.engine:
        reports = engine_reports(args.arch, args.dtype, args.shape)
    elif args.launches:
        reports = compile_launches(args.launches, args.arch)
    elif args.drafter_seed:
        reports = drafter_seed_reports(args.arch)
    elif args.fewrow:
        reports = fewrow_reports(args.arch)
    elif args.kernel:
        module, _, name = args.kernel.partition(":")
        fn = getattr(importlib.import_module(module), name)
        reports = [compile_report(fn, json.loads(args.constexprs), json.loads(args.types), args.warps, args.stages,
                                  args.arch)]
    else:
        ap.error("give --kernel, --drafter-seed, --fewrow, --engine or --launches")
    for rep in reports:
        print(json.dumps(rep), flush=True)
    if any("error" in rep for rep in reports):
        sys.exit(1)


if __name__ == "__main__":
    main()
