"""Triton kernels for the GPU fast path, each next to the PyTorch reference it must match.

Without CUDA, Triton can run kernels only in its interpreter (numpy), which is how the CPU tests
check them. The interpreter must be chosen before ``triton`` is first imported (Triton's own library
functions such as ``tl.sum`` are decorated then), so on a machine without CUDA this package sets
``TRITON_INTERPRET=1`` if nothing imported triton before it; ``interpreter_ready`` tells whether the
kernels can run on a CPU in this process.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (after the interpreter choice above)
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

# Programmatic dependent launch (PDL, Hopper and later): a kernel launched with ``launch_pdl`` may start
# while the kernel before it on the stream still runs (its programs get scheduled, compute their indices),
# and waits in ``pdl_wait`` until that kernel has finished and its writes are visible. It hides part of
# each launch's latency, which is what a small model's decode step is made of (SmolLM2 at batch 1: ~150
# kernels of a few µs each in one CUDA graph; stream capture keeps the programmatic edges). Every kernel
# launched with ``pdl_opts`` calls ``pdl_wait(PDL)`` before it reads or writes anything an earlier kernel
# may write (weights it may read before). Kernels launched without it are ordinary stream-ordered
# launches, so mixing is safe. Measured (H100, session 60, SmolLM2 shapes, graph replays): plain decode step
# -20 % at batch 1 (0.725 -> 0.581 ms), -15 % at 8, -12 % at 32; DSPARK_PDL=0 turns it off (the A/B).
PDL = os.environ.get("DSPARK_PDL", "1") != "0"
# With PDL, the weight-streaming kernels (gemv.py, fewrow.py) start loading their weights before pdl_wait:
# nothing in a step writes a weight, so that load overlaps the previous kernel. DSPARK_PDL_PREFETCH=0: not (the A/B).
PDL_PREFETCH = os.environ.get("DSPARK_PDL_PREFETCH", "1") != "0"
_CAPABILITY: dict = {}


def pdl_on(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: CUDA, compute capability 9.0 or later, PDL on."""
    if not PDL or t.device.type != "cuda":
        return False
    idx = t.device.index if t.device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)[0]
    return _CAPABILITY[idx] >= 9


def pdl_opts(t: torch.Tensor) -> dict:
    """Launch keywords of a kernel that has a ``PDL: tl.constexpr`` parameter and calls pdl_wait(PDL)."""
    return {"PDL": True, "launch_pdl": True} if pdl_on(t) else {"PDL": False}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait for the previous kernel on the stream to finish (its writes visible), then let the
    next kernel's programs launch (they overlap this kernel's work and wait in their own pdl_wait)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def interpreter_ready() -> bool:
    """Whether Triton kernels run here on CPU tensors: interpreter mode was on when triton was imported."""
    return type(tl.sum).__name__ == "InterpretedFunction"


def check_device(t: torch.Tensor) -> None:
    """Kernels take CUDA tensors, or CPU tensors where Triton runs in its interpreter."""
    if t.device.type != "cuda" and not interpreter_ready():
        raise RuntimeError(
            f"Triton kernels got {t.device.type} tensors but Triton is not in interpreter mode: set "
            "TRITON_INTERPRET=1 before triton is first imported to run them on a CPU"
        )


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _fix_interpreter_scalars() -> None:
    """Work around triton-lang/triton#9171 (Triton <= 3.6 with numpy >= 2.4): the interpreter keeps
    scalars as shape-(1,) arrays and turns them into ints with ``int(array)``, which numpy 2.4
    refuses, so a loop whose bounds are loaded at run time (``range(lo, hi, BLOCK)``) fails. Wrap its
    tensor patch so ``__index__`` reads the one element. Does nothing where ``int`` still works."""
    try:
        int(np.ones(1, dtype=np.int64))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "dspark_fixed", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.dspark_fixed = True
    interpreter._patch_lang_tensor = patched


class _NoPatch:
    def restore(self) -> None:
        pass


def _patch_lang_once_per_launch() -> None:
    """Speed of Triton's interpreter (<= 3.6): a kernel launch patches ``triton.language`` for its whole
    run (``_patch_lang``: inspect.getmembers over the language modules its globals name, ~1.5 ms) and
    restores it at the end, but every call of a ``@triton.jit`` function inside the kernel (our helpers
    such as cast_rtne, and tl.sum / tl.max themselves) patches the modules its own globals name again,
    once per call per program: a CPU engine test spent ~30 % of its time there (session 21 profile:
    40k such calls for 760 launches). Inside a launch, a call whose modules are patched already (by the
    launch, or by an earlier call in it: upstream never undoes a call's patch) skips it; the launch's
    own patch and restore are unchanged."""
    import inspect
    import threading

    from triton.runtime import interpreter

    orig = getattr(interpreter, "_patch_lang", None)
    if orig is None or getattr(orig, "dspark_once", False):
        return
    langs = (tl, tl.core)
    # per thread (a launch in another thread patches as upstream does): whether a launch is running, and
    # the language modules patched in it
    state = threading.local()

    # (id, size) of a function's globals -> the language modules they name: scanned once per module and size (the
    # interpreter's rewrite of a function adds names), not per call (3 % of an engine test's time, session 63)
    found: dict[tuple[int, int], frozenset[int]] = {}

    def modules(fn) -> frozenset[int]:
        key = (id(fn.__globals__), len(fn.__globals__))
        mods = found.get(key)
        if mods is None:
            mods = found[key] = frozenset(id(v) for v in fn.__globals__.values()
                                          if inspect.ismodule(v) and any(v is m for m in langs))
        return mods

    def patch_lang(fn):
        mods = modules(fn)
        patched = getattr(state, "patched", None)
        if patched is not None:  # a jit function called by a kernel running in this thread
            if mods <= patched:
                return _NoPatch()
            patched.update(mods)
            return orig(fn)
        scope = orig(fn)  # a kernel launch
        state.patched = set(mods)
        restore = scope.restore

        def restore_once() -> None:
            state.patched = None
            restore()

        scope.restore = restore_once
        return scope

    patch_lang.dspark_once = True
    interpreter._patch_lang = patch_lang


def _lazy_tuple_type_names() -> None:
    """Speed of Triton's interpreter (<= 3.6): every tl.tuple it builds (a block's shape, once or more per
    tl op and program) makes a ``tuple_type`` whose __init__ formats its ``name`` string right away, from
    the reprs of the types it holds; the interpreter never reads it. 10 % of an engine test's time went
    there (session 63 profile). The name is formatted when first read instead; everything else is
    upstream's __init__."""
    import inspect
    import re

    from triton.language import core

    cls = core.tuple_type
    if getattr(cls, "dspark_lazy_name", False) or "name" in vars(cls):
        return
    try:  # only the __init__ this replaces (Triton 3.6's); another version's is left as it is
        src = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return
    if (list(inspect.signature(cls.__init__).parameters) != ["self", "types", "fields"]
            or re.findall(r"self\.(\w+) =", src) != ["types", "fields", "name"]):
        return

    def __init__(self, types, fields=None):
        self.types = types
        self.fields = fields or [""] * len(types)

    def _get(self):
        name = self.__dict__.get("_name")
        if name is None:
            name = self._name = "[" + ",".join([f"{k}:{v}" for k, v in zip(self.fields, self.types)]) + "]"
        return name

    def _set(self, value):
        self._name = value

    cls.__init__ = __init__
    cls.name = property(_get, _set)
    cls.dspark_lazy_name = True


def _cached_np_dtypes() -> None:
    """Speed of Triton's interpreter (3.6): ``_get_np_dtype``, called for every value an op makes, builds its
    17-entry table of numpy dtypes anew on each call (10 % of an engine test's time, session 65 profile). The
    table is built once here, by asking upstream's function about every scalar type of ``triton.language``; a
    type it does not hold goes to upstream's function as before (which raises as before)."""
    from triton.runtime import interpreter

    orig = getattr(interpreter, "_get_np_dtype", None)
    if orig is None or getattr(orig, "dspark_cached", False):
        return
    table = {}
    for v in vars(tl).values():
        if isinstance(v, tl.dtype) and not isinstance(v, (tl.pointer_type, tl.block_type)):
            try:
                table[v] = orig(v)
            except (KeyError, TypeError):
                pass
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        el = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(el, tl.pointer_type):
            return pointer
        got = table.get(el)
        return got if got is not None else orig(tt_dtype)

    get_np_dtype.dspark_cached = True
    interpreter._get_np_dtype = get_np_dtype


def _shared_block_types() -> None:
    """Speed of Triton's interpreter (3.6): every op's result makes a ``block_type`` (unwrapping its shape into a
    tl.tuple with its tuple_type, validating it, formatting a name string nobody reads) and a ``tensor`` (a second
    tl.tuple of constexprs for the same shape): together ~30 % of an engine test's time (session 65 profile),
    for a few distinct (element type, shape) pairs per kernel. Here a block_type of a pair seen before takes that
    one's attributes (the name formatted when first read), and a tensor takes its shape and numel from its type,
    made once per type. Shapes are never changed after construction, so sharing them changes no value. Applied
    only where upstream's two __init__ are the ones this replaces."""
    import builtins
    import inspect
    import math
    import re

    from triton.language import core

    bt, tt = core.block_type, core.tensor
    if getattr(bt, "dspark_shared", False):
        return
    try:
        bt_src, tt_src = inspect.getsource(bt.__init__), inspect.getsource(tt.__init__)
    except (OSError, TypeError):
        return
    if (re.findall(r"self\.(\w+) =", bt_src) != ["element_ty", "shape", "numel", "name"]
            or re.findall(r"self\.(\w+) =", tt_src) != ["handle", "shape", "numel", "type", "dtype", "shape"]
            or "name" in vars(bt)):
        return
    seen: dict = {}

    def _tensor_shape(type):  # upstream tensor.__init__'s shape and numel for a value of this type
        shape = type.shape if type.is_block() else ()
        return core.tuple([core.constexpr(s) for s in shape]), core.constexpr(math.prod(shape))

    def bt_init(self, element_ty, shape):
        assert isinstance(shape, (list, core.tuple))  # as upstream: its module's `tuple` is tl.tuple
        try:
            key = (element_ty, builtins.tuple(s.value if isinstance(s, core.constexpr) else s for s in shape))
            hit = seen.get(key)
        except TypeError:  # an unhashable element type or shape entry: upstream's way
            key = hit = None
        if hit is not None:
            self.__dict__.update(hit)
            return
        self.element_ty = element_ty
        self.shape = core.tuple(core._unwrap_shape(shape))
        if not self.shape:
            raise TypeError('0d block_type is forbidden')
        self.numel = core.validate_block_shape(self.shape)
        self._dspark_tensor_shape = _tensor_shape(self)  # what tensor_init reads, kept with the rest
        if key is not None and all(type(x) is int for x in key[1]):
            seen[key] = dict(self.__dict__)

    def bt_name(self):
        name = self.__dict__.get("_name")
        if name is None:
            name = self._name = f'<{self.shape}, {self.element_ty}>'
        return name

    def bt_set_name(self, value):
        self._name = value

    def tensor_init(self, handle, type):
        self.handle = handle
        self.type = type
        self.dtype = type.scalar
        shaped = getattr(type, "_dspark_tensor_shape", None)
        if shaped is None:  # a scalar type (or a block type made before the patch)
            shaped = _tensor_shape(type)
            try:
                type._dspark_tensor_shape = shaped
            except AttributeError:
                pass
        self.shape, self.numel = shaped

    bt.__init__ = bt_init
    bt.name = property(bt_name, bt_set_name)
    tt.__init__ = tensor_init
    bt.dspark_shared = True


if triton.knobs.runtime.interpret:
    _fix_interpreter_scalars()
    _patch_lang_once_per_launch()
    _lazy_tuple_type_names()
    _cached_np_dtypes()
    _shared_block_types()
