"""Programmatic dependent launch (dspark.kernels.pdl_opts / pdl_wait): off on a CPU, and every kernel that takes
a PDL parameter waits for the previous kernel before it touches memory an earlier kernel may write.

A kernel launched with PDL may start while the kernel before it still runs, so a load or store ahead of its
pdl_wait would race with that kernel. The GPU cannot be asked here, so the rule is checked on the kernels' source:
before ``pdl_wait(PDL)`` only index arithmetic, and weight reads inside the prefetch branches (``if PREFETCH:``,
``if PF_K > 0:``), which read nothing any kernel writes."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import dspark.kernels as kernels
from dspark.kernels import pdl_opts

KERNEL_DIR = Path(kernels.__file__).parent
MEMORY_OPS = {"load", "store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min", "atomic_or",
              "atomic_and", "inline_asm_elementwise"}
PREFETCH_BRANCHES = ("PREFETCH", "PF_K > 0")


def test_pdl_off_on_cpu() -> None:
    assert pdl_opts(torch.zeros(1)) == {"PDL": False}
    assert not kernels.pdl_on(torch.zeros(1))


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    def jitted(fn: ast.FunctionDef) -> bool:
        return any("jit" in ast.unparse(d) for d in fn.decorator_list)

    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and jitted(n)}


def _touches_memory(node: ast.AST, helpers: dict[str, ast.FunctionDef], seen: set[str]) -> list[str]:
    """The memory operations node performs, following calls into the module's own jit helpers."""
    found = []
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        name = ast.unparse(call.func)
        if name.split(".")[-1] in MEMORY_OPS:
            found.append(name)
        elif name in helpers and name not in seen:
            seen.add(name)
            found += [f"{name} -> {op}" for op in _touches_memory(helpers[name], helpers, seen)]
    return found


def _pdl_kernels(source: str) -> list[tuple[ast.FunctionDef, dict]]:
    funcs = _jit_functions(ast.parse(source))
    return [(fn, funcs) for fn in funcs.values() if "PDL" in [a.arg for a in fn.args.args] and fn.name != "pdl_wait"]


def _all_pdl_kernels() -> list[tuple[str, ast.FunctionDef, dict]]:
    return [(path.name, fn, funcs) for path in sorted(KERNEL_DIR.glob("*.py"))
            for fn, funcs in _pdl_kernels(path.read_text())]


def violations(source: str) -> list[str]:
    """Kernels of ``source`` that take PDL and touch memory before pdl_wait(PDL) (outside the prefetch branches), or
    never wait."""
    bad = []
    for fn, helpers in _pdl_kernels(source):
        for stmt in fn.body:
            if isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "pdl_wait(PDL)":
                break
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):  # the docstring
                continue
            if isinstance(stmt, ast.If) and ast.unparse(stmt.test) in PREFETCH_BRANCHES:
                continue  # weight reads (gemv's first tile, fewrow's L2 prefetch)
            ops = _touches_memory(stmt, helpers, set())
            if ops:
                bad.append(f"{fn.name} line {stmt.lineno}: {ops} before pdl_wait(PDL)")
        else:
            bad.append(f"{fn.name} takes PDL but never calls pdl_wait(PDL) in its body")
    return bad


def test_the_step_kernels_take_pdl() -> None:
    names = {fn.name for _, fn, _ in _all_pdl_kernels()}
    assert len(names) >= 25
    for k in ("_gemv_kernel", "_fewrow_kernel", "_paged_attention_kernel", "_combine_splits_kernel",
              "_rms_norm_kernel", "_rope_cache_kernel", "_markov_temp_kernel", "_verify_block_kernel",
              "_drafter_attention_kernel", "_sample_partials_kernel"):
        assert k in names, k


def test_pdl_kernels_wait_before_touching_memory() -> None:
    for path in sorted(KERNEL_DIR.glob("*.py")):
        assert violations(path.read_text()) == [], path.name


def test_the_check_finds_an_early_access() -> None:
    bad = """
@triton.jit
def _helper(p):
    return tl.load(p)

@triton.jit
def _k(x_ptr, w_ptr, PDL: tl.constexpr, PREFETCH: tl.constexpr):
    \"\"\"doc\"\"\"
    i = tl.program_id(0)
    if PREFETCH:
        w = tl.load(w_ptr + i)
    v = _helper(x_ptr + i)
    pdl_wait(PDL)

@triton.jit
def _never(x_ptr, PDL: tl.constexpr):
    tl.store(x_ptr, 1)
"""
    found = violations(bad)
    assert len(found) == 3 and "_helper -> tl.load" in found[0], found  # the prefetch branch's load is allowed
    assert "tl.store" in found[1] and "never calls" in found[2], found


def test_prefetch_branches_read_only_weights() -> None:
    """The prefetch branches load from w_ptr only (the weights, which no kernel writes)."""
    for fname, fn, _ in _all_pdl_kernels():
        for stmt in fn.body:
            if isinstance(stmt, ast.If) and ast.unparse(stmt.test) in PREFETCH_BRANCHES:
                for call in (n for n in ast.walk(stmt) if isinstance(n, ast.Call)):
                    if ast.unparse(call.func) in ("tl.load", "_prefetch_l2"):
                        assert ast.unparse(call.args[0]).startswith("w_ptr"), f"{fname}:{fn.name}"
                    assert ast.unparse(call.func) not in ("tl.store",) and "atomic" not in ast.unparse(call.func)
