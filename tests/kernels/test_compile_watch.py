"""dspark.kernels.compile_watch: Triton's JIT hooks counted and, once armed, logged. Off the GPU nothing
compiles (the interpreter), so the hooks are called here the way Triton's JITFunction._do_compile calls
them (triton/runtime/jit.py: keyword arguments, the pre hook's truthy return skips the compile)."""

import logging

import pytest

triton = pytest.importorskip("triton")


def _fire(name="_paged_attention_kernel", consts=None):
    """One compile as Triton 3.6 reports it: constexprs keyed by their (index,) path, the signature by name."""
    from triton import knobs
    from triton.runtime.jit import JitFunctionInfo

    signature = {"q_ptr": "*bf16", "n": "i32", "NUM_SPLITS": "constexpr", "BLOCK_R": "constexpr"}
    kw = dict(key=("k",), repr=f"{name}[num_warps=4]()", fn=JitFunctionInfo("m", name, None),
              compile={"key": ("k",), "signature": signature, "constants": consts or {(2,): 2}, "num_warps": 4,
                       "num_stages": 3},
              is_manual_warmup=False, already_compiled=False)
    skip = knobs.runtime.jit_cache_hook(**kw)
    knobs.runtime.jit_post_compile_hook(**kw)
    return skip


def test_compiles_are_counted_and_logged_once_armed(caplog):
    from dspark.kernels import compile_watch

    assert compile_watch.install() and compile_watch.install()  # idempotent
    n0 = compile_watch.count()
    compile_watch.arm(False)
    with caplog.at_level(logging.WARNING, logger="dspark.kernels.compile_watch"):
        assert not _fire()
        assert not caplog.records  # not serving yet: counted, not logged
        compile_watch.arm()
        _fire("_markov_kernel", {(3,): 32})
    compile_watch.arm(False)
    ev = compile_watch.events(n0)
    assert compile_watch.count() == n0 + 2 and [e["kernel"] for e in ev] == ["_paged_attention_kernel", "_markov_kernel"]
    assert ev[0]["constexprs"] == "NUM_SPLITS=2" and ev[0]["num_stages"] == 3 and ev[0]["ms"] >= 0
    assert [e["armed"] for e in ev] == [False, True]
    assert len(caplog.records) == 1 and "_markov_kernel while serving" in caplog.records[0].getMessage()
    n, secs = compile_watch.serving_compiles()  # what /metrics reports (armed compiles only)
    assert n >= 1 and secs >= 0 and n == sum(e["armed"] for e in compile_watch.events())
    assert "BLOCK_R=32" in caplog.records[0].getMessage()


def test_a_compile_names_the_dspark_code_that_launched_it():
    """``site``: the innermost dspark frames (not kernel wrappers) of the compiling launch, so that a
    specialisation the capture and warm-up missed can be traced to its step path; ``attrs``: Triton's
    specialisation beyond the constexprs, as given."""
    import os

    import dspark
    from dspark.kernels import compile_watch

    pkg = os.path.dirname(os.path.abspath(dspark.__file__))
    ns = {}
    exec(compile("def execute(fn):\n    return fn()\n", os.path.join(pkg, "engine", "fake_runner.py"), "exec"), ns)
    exec(compile("def wrapper(fn):\n    return fn()\n", os.path.join(pkg, "kernels", "fake_kernel.py"), "exec"), ns)
    assert compile_watch.install()
    n0 = compile_watch.count()
    ns["execute"](lambda: ns["wrapper"](_fire))
    _fire()
    ev = compile_watch.events(n0)
    assert ev[0]["site"] == "engine/fake_runner.py:2 execute"  # the kernel wrapper's frame left out
    assert ev[1]["site"] == ""  # no dspark frame (called from the test itself)
    assert ev[0]["attrs"] == ""  # none given by this fake compile
