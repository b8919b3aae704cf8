"""Run-time Triton compiles: which kernel specialisations compile after start-up, and for how long.

Triton compiles a kernel once per specialisation (its constexpr arguments, the divisibility of its
integer arguments, the launch options). CUDA-graph capture and ``LLMEngine.warm_up`` are meant to meet
every specialisation a served step needs; one they miss compiles inside a live step, stalling it for
0.1-2 s (H200, session 30: one 1.6 s compile inside a timed bench cell was the whole of an "adaptive
verification is slower" reading). This module makes such compiles visible instead of inferred:
``install`` chains Triton's JIT hooks (``triton.knobs.runtime.jit_cache_hook`` before a compile,
``jit_post_compile_hook`` after; a kernel found in Triton's disk cache goes through them too, as a
short compile) and counts every compile of the process with its kernel, constexprs and milliseconds.
``arm`` marks the start of serving: from then on each compile is also logged as a warning.
``dspark bench`` reports the compiles of each timed call (``runtime_compiles`` per cell).

Off the GPU (Triton's interpreter) nothing compiles and the counts stay 0.
"""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_events: list[dict] = []  # every compile seen since install: kernel, ms, constexprs, armed
_started: dict[int, float] = {}  # thread id -> perf_counter at the pre-compile hook
_state = {"installed": False, "armed": False}


def _constexprs(compile_kwargs: dict) -> str:
    """``NAME=value, ...`` of a compile's constexprs. Triton (3.6) keys them by their path in the
    argument list, ``(index,)``; the names come from the signature, whose keys are the parameters in order."""
    names = list((compile_kwargs.get("signature") or {}).keys())
    items = []
    for k, v in (compile_kwargs.get("constants") or {}).items():
        i = k[0] if isinstance(k, tuple) and len(k) == 1 else k
        name = names[i] if isinstance(i, int) and 0 <= i < len(names) else i
        items.append(f"{name}={v}")
    return ", ".join(items)


def _site(depth: int = 3) -> str:
    """Where in dspark the compiling launch came from: the innermost ``depth`` frames of the Python stack
    in dspark's engine, model, layer and spec code (not the kernel wrappers), innermost last. A compile
    is rare, so the stack walk costs nothing that matters; it names the step path a capture and the
    warm-up did not run (the kernel's name alone does not: several paths launch the same kernel)."""
    import os
    import traceback

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the dspark package
    kernels = os.path.join(root, "kernels") + os.sep
    frames = [f for f in traceback.extract_stack()[:-2]
              if f.filename.startswith(root) and not f.filename.startswith(kernels)]
    return " > ".join(f"{os.path.relpath(f.filename, root)}:{f.lineno} {f.name}" for f in frames[-depth:])


def _attrs(compile_kwargs: dict) -> str:
    """The specialisation beyond the constexprs (Triton's ``attrs``: which arguments were taken as
    16-divisible / 16-byte aligned), as Triton writes it, cut to 300 characters."""
    a = compile_kwargs.get("attrs")
    return "" if a is None else str(a)[:300]


def install() -> bool:
    """Chain the counting hooks onto Triton's JIT hooks (once per process; hooks already set by
    someone else still run). False if this Triton has no such hooks (then nothing is counted)."""
    with _lock:
        if _state["installed"]:
            return True
        try:
            from triton import knobs
            rt = knobs.runtime
            prev_pre, prev_post = rt.jit_cache_hook, rt.jit_post_compile_hook
        except (ImportError, AttributeError):
            return False

        def pre(*args, **kwargs):
            _started[threading.get_ident()] = time.perf_counter()
            return prev_pre(*args, **kwargs) if prev_pre is not None else None  # truthy would skip the compile

        def post(*args, **kwargs):
            t0 = _started.pop(threading.get_ident(), None)
            ms = 1e3 * (time.perf_counter() - t0) if t0 is not None else float("nan")
            fn = kwargs.get("fn")
            name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[")[0]
            ev = {"kernel": name, "ms": ms, "constexprs": _constexprs(kwargs.get("compile") or {}), "site": _site(),
                  "attrs": _attrs(kwargs.get("compile") or {}),
                  "num_warps": (kwargs.get("compile") or {}).get("num_warps"),
                  "num_stages": (kwargs.get("compile") or {}).get("num_stages"), "armed": _state["armed"]}
            with _lock:
                _events.append(ev)
            if ev["armed"]:
                logger.warning("Triton compiled %s while serving (%.0f ms; %s; from %s): a specialisation that "
                               "CUDA-graph capture and the warm-up did not meet", name, ms, ev["constexprs"], ev["site"])
            return prev_post(*args, **kwargs) if prev_post is not None else None

        rt.jit_cache_hook, rt.jit_post_compile_hook = pre, post
        _state["installed"] = True
        return True


def arm(on: bool = True) -> None:
    """From now on, log each compile as a warning (serving has started)."""
    _state["armed"] = on


def count() -> int:
    """Compiles seen since install (a bench takes differences around a timed call)."""
    with _lock:
        return len(_events)


def serving_compiles() -> tuple[int, float]:
    """(compiles, seconds) since ``arm``: what /metrics reports as dspark:triton_compiles_while_serving."""
    with _lock:
        ev = [e for e in _events if e["armed"]]
    return len(ev), sum(e["ms"] for e in ev if e["ms"] == e["ms"]) / 1e3


def events(since: int = 0) -> list[dict]:
    """The compiles from index ``since`` on: kernel, ms, constexprs, site, attrs, num_warps, num_stages, armed."""
    with _lock:
        return [dict(e) for e in _events[since:]]


__all__ = ["install", "arm", "count", "events", "serving_compiles"]
