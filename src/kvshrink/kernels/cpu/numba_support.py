"""What the numba CPU kernels share: whether numba imported, the fastmath flags, the choice between a kernel's
serial and parallel variants (numba's threading layer and thread count), each thread's scratch buffers, numpy
views of tensors, and a prefetch hint.

numba is optional (``kvshrink[fast]``): `installed()` says whether it imported, `available()` whether callers run the
kernels now (not while `first_use` compiles them in the background); callers keep their torch reference path and
use it when they do not. The kernels are compiled once per machine (``cache=True``; `warm_up` compiles them
before anything is timed). numba's cache checks only the file that defines a kernel: after editing a helper that
kernels in other files inline (this file, `half_words`, `softmax`), delete the ``__pycache__`` folders of
``kernels/cpu`` so that they are compiled again.
"""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

try:  # the fast path is optional: a missing or broken numba leaves the reference path
    import numba
    from llvmlite import ir as llvm_ir
    from numba import njit
    from numba.extending import intrinsic
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    numba = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


# No fastmath "nnan"/"ninf": masked scores are -inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


_held = None   # while set, a callable that says whether the kernels are still to be left alone (`first_use`)


def installed() -> bool:
    """Whether numba imported: the kernels are defined (module-level ``if installed():``)."""
    return numba is not None


def available() -> bool:
    """Whether callers run the kernels now: numba imported, and no background compilation of them is under
    way in this process (`first_use`: until it ends, a call would compile the kernel here, in the foreground)."""
    global _held
    if numba is None:
        return False
    if _held is not None:
        if _held():
            return False
        _held = None
    return True


def hold_kernels(still_held) -> None:
    """``still_held()`` (polled by `available`) says whether to leave the kernels alone; None releases them."""
    global _held
    _held = still_held


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR


if numba is not None:
    @intrinsic
    def _prefetch(typingctx, address):  # pragma: no cover - compiled
        # a hint to bring the cache line at ``address`` (an integer) in for reading (LLVM's prefetch: x86 prefetcht0,
        # arm64 prfm; nothing where the target has none); it never faults, so an address past an array is harmless
        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], llvm_ir.IntType(8).as_pointer())
            hint = builder.module.declare_intrinsic(
                "llvm.prefetch.p0", fnty=llvm_ir.FunctionType(llvm_ir.VoidType(), [pointer.type] + [llvm_ir.IntType(32)] * 3))
            builder.call(hint, [pointer] + [llvm_ir.Constant(llvm_ir.IntType(32), v) for v in (0, 3, 1)])
            return context.get_dummy_value()
        return numba.types.void(numba.types.intp), codegen

    @njit(inline="always")
    def prefetch_row(block, i, j):  # pragma: no cover - compiled
        """Ask for ``block[i, j]`` (the contiguous sub-array at those two leading indices) to be brought into the
        cache: scattered rows read later (LRQK's slow tier in DRAM, ~400 ns a row one at a time) arrive together."""
        start = block.ctypes.data + i * block.strides[0] + j * block.strides[1]
        for line in range(0, block.strides[1], 64):
            _prefetch(start + line)

    @njit(cache=True, parallel=True)
    def _start_threads(x):  # pragma: no cover - compiled
        # the smallest parallel loop: calling it starts numba's threading layer (`threading_layer_usable`)
        for i in numba.prange(x.shape[0]):
            x[i] = i


_WORKSPACE = threading.local()
_THREADED_LAYERS = ("omp", "tbb")  # numba's pools that start a parallel kernel in microseconds
_threads_usable: bool | None = None
_threads_forced: bool | None = None  # `each_kernel_variant`'s choice of kernels, whatever the threads


def _use_threads() -> bool:
    """Whether the kernels with a parallel variant run it now: torch is given more than one thread (the eval's
    ``--threads``; numba's are set to as many, no more), and numba's threading layer starts a parallel loop in
    microseconds (OpenMP or TBB; its portable work queue costs ~150 us a call, more than the loops it would
    split: then the serial kernels run)."""
    if _threads_forced is not None:
        return _threads_forced
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads < 2 or not threading_layer_usable():
        return False
    if getattr(_WORKSPACE, "numba_threads", None) != threads:
        numba.set_num_threads(threads)          # numba's count is per calling thread, as the workspace is
        _WORKSPACE.numba_threads = threads
    return True


def threading_layer_usable() -> bool:
    """Whether numba's threading layer is one that starts a parallel loop in microseconds (`_use_threads`), found
    once by starting it with a tiny parallel kernel (the warm-ups call it: that kernel is compiled then)."""
    global _threads_usable
    if _threads_usable is None:
        _start_threads(np.zeros(2, np.int64))
        _threads_usable = numba.threading_layer() in _THREADED_LAYERS
    return _threads_usable


def each_kernel_variant():
    """``for parallel in each_kernel_variant(): f()`` runs ``f`` with the serial kernels, then with their
    parallel variants, whatever the threads (the warm-ups compile both)."""
    global _threads_forced
    before = _threads_forced
    try:
        for forced in (False, True):
            _threads_forced = forced
            yield forced
    finally:
        _threads_forced = before


_VIEWS_KEPT = 256    # scratch views kept by (name, shape): a model's layers ask for a few shapes each step


def scratch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 scratch tensor of ``shape``, the calling thread's, reused by the next call of the same ``name``
    (grown when too small): per-step operands are written in memory already mapped and warm, not in a fresh
    allocation (above glibc's mmap threshold, one that is mapped and faulted in page by page every time)."""
    try:
        return _WORKSPACE.views[name, shape]     # the common case: the shape of the last call (one dict lookup)
    except (AttributeError, KeyError):
        pass
    if not hasattr(_WORKSPACE, "views"):
        _WORKSPACE.buffers, _WORKSPACE.views = {}, {}
    buffers = _WORKSPACE.buffers
    numel = math.prod(shape)
    if name not in buffers or buffers[name].numel() < numel:
        buffers[name] = torch.empty(numel)
        _WORKSPACE.views = {key: v for key, v in _WORKSPACE.views.items() if key[0] != name}   # their memory is gone
    view = buffers[name][:numel].view(shape)
    if len(_WORKSPACE.views) < _VIEWS_KEPT:
        _WORKSPACE.views[name, shape] = view
    return view


def _numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    # a dozen per layer and decode step: skip the calls that would return the tensor itself (arrays made once
    # and kept by the caller pass through)
    if isinstance(t, np.ndarray):
        return t
    if t.requires_grad:
        t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


class NumpyViews:
    """Numpy views (no copy) of tensors that stay the same objects from step to step, each made again when its
    tensor is replaced: a view costs a few calls per layer and decode step otherwise. Never saved or copied
    (a copy makes its own)."""

    def __init__(self):
        self._held: dict = {}

    def get(self, name: str, tensor: torch.Tensor, make):
        """``make(tensor)``, kept under ``name`` while ``tensor`` is the same object."""
        held = self._held.get(name)
        if held is None or held[0] is not tensor:
            held = self._held[name] = (tensor, make(tensor))
        return held[1]

    def __getstate__(self) -> dict:
        return {"_held": {}}
