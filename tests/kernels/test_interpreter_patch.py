"""dspark/kernels/__init__.py's interpreter speed-up: inside a kernel launch, calls of ``@triton.jit``
functions no longer patch ``triton.language`` again (``_patch_lang_once_per_launch``), and results and the
restore after a launch are unchanged."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from dspark.kernels import interpreter_ready  # noqa: E402

pytestmark = pytest.mark.skipif(not interpreter_ready(), reason="Triton interpreter not active in this process")


@triton.jit
def _twice(x):
    return x * 2.0


@triton.jit
def _helper_calls_kernel(x_ptr, out_ptr, CALLS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + i)
    for _ in tl.static_range(CALLS):  # CALLS helper calls per program, each also calling tl.sum (a jit function)
        x = _twice(x) - tl.sum(x, 0) * 0.0
    tl.store(out_ptr + i, x)


def _launch(calls: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.arange(32, dtype=torch.float32)
    out = torch.empty_like(x)
    _helper_calls_kernel[(4,)](x, out, CALLS=calls, BLOCK=8)
    return x, out


def test_helper_calls_do_not_patch_again(monkeypatch) -> None:
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang, "dspark_once", False)
    counts = []
    orig = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a, **k: counts.append(1) or orig(*a, **k))
    _launch(1)  # a first launch: rewriting tl.sum adds names to its module's globals (what it patches)
    n = {}
    for calls in (2, 8):
        counts.clear()
        x, out = _launch(calls)
        assert torch.equal(out, x * 2.0**calls)
        n[calls] = len(counts)
    # the launch patches once, and a jit function whose modules are patched already adds nothing: 4 programs
    # x 8 helper calls (+ 8 tl.sum calls) patch as often as 4 x 2 (upstream: once more per call)
    assert n[8] == n[2], n
    assert tl.core.is_builtin(tl.program_id)  # triton.language restored after the launch


def test_tuple_types_format_their_names_when_read() -> None:
    """_lazy_tuple_type_names: a tl.tuple's type leaves its name unformatted until read; then it is
    upstream's format, and it can still be set."""
    if not getattr(tl.core.tuple_type, "dspark_lazy_name", False):
        pytest.skip("this Triton's tuple_type.__init__ is not the one replaced")
    t = tl.core.tuple_type([tl.int32, tl.core.constexpr_type(3)], ["a", "b"])
    assert "_name" not in vars(t)
    assert t.name == str(t) == "[a:int32,b:constexpr_type[3]]"
    t.name = "renamed"
    assert t.name == "renamed"
    x, out = _launch(2)  # kernels build tuples (shapes) as before
    assert torch.equal(out, x * 4.0)


def test_numpy_dtypes_from_the_table_built_once() -> None:
    """_cached_np_dtypes: the same numpy dtype upstream's _get_np_dtype gives, for every scalar type of
    triton.language, its blocks and pointers; a type upstream does not know still raises."""
    from triton.runtime import interpreter

    fast = interpreter._get_np_dtype
    if not getattr(fast, "dspark_cached", False):
        pytest.skip("this Triton's _get_np_dtype is not the one replaced")
    import inspect

    upstream = inspect.getclosurevars(fast).nonlocals["orig"]
    types = [v for v in vars(tl).values() if isinstance(v, tl.dtype) and not isinstance(v, tl.block_type)]
    known = 0
    for t in types + [tl.pointer_type(tl.float32), tl.block_type(tl.pointer_type(tl.int64), [4])]:
        for ty in (t, tl.block_type(t, [2, 8])) if not isinstance(t, tl.block_type) else (t,):
            try:
                want = upstream(ty)
            except KeyError:
                with pytest.raises(KeyError):
                    fast(ty)
                continue
            assert fast(ty) == want, ty
            known += 1
    assert known >= 30  # 17 scalar types and pointers, each alone and as a block


def test_block_types_shared_by_element_type_and_shape() -> None:
    """_shared_block_types: a block type of an (element type, shape) seen before takes its attributes; its
    name is upstream's format when read, equality and shapes are unchanged, a tensor's shape and numel come
    from its type; a 0-d shape still raises; kernels give the same results."""
    core = tl.core
    if not getattr(core.block_type, "dspark_shared", False):
        pytest.skip("this Triton's block_type / tensor __init__ are not the ones replaced")
    a = core.block_type(tl.float32, [4, core.constexpr(8)])
    b = core.block_type(tl.float32, core.tuple([4, 8]))
    c = core.block_type(tl.bfloat16, [4, 8])
    assert a == b and a != c and list(a.shape) == [4, 8] == list(b.shape) and a.numel == 32
    assert "_name" not in vars(a) and a.name == str(b) == "<['4', '8'], fp32>" and str(c) == "<['4', '8'], bf16>"
    assert a.get_block_shapes() is b.get_block_shapes()  # shared: nothing changes a shape once made
    with pytest.raises(TypeError, match="0d block_type"):
        core.block_type(tl.float32, [])
    with pytest.raises(AssertionError):
        core.block_type(tl.float32, (4, 8))  # upstream's check: a list or a tl.tuple
    t = core.tensor(None, a)
    assert [s.value for s in t.shape] == [4, 8] and t.numel.value == 32 and t.dtype == tl.float32 and t.type is a
    s = core.tensor(None, tl.int32)
    assert len(s.shape) == 0 and s.numel.value == 1 and s.dtype == tl.int32
    x, out = _launch(3)
    assert torch.equal(out, x * 8.0)
