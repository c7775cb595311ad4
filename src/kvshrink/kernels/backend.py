"""Which code path a decode step takes: the CPU path (torch ops, numba kernels) or the GPU path (Triton
kernels, fused attention, no host synchronisation).

A tensor on a CUDA device takes the GPU path. `force_gpu_path()` makes CPU tensors take it too, so the
very code a GPU runs is tested on CPU. The environment variable ``KVSHRINK_GPU_PATH=1`` forces it for a
whole process.

Without a GPU, kvshrink's Triton kernels run in Triton's interpreter. The choice is made per kernel, by
`jit` (what ``triton().jit`` is): importing kvshrink changes nothing in the process (no environment
variable, no re-imported module), and other code's Triton kernels compile as they would without kvshrink.
``TRITON_INTERPRET``, when set, decides for kvshrink's kernels as it does for Triton's own (``0``
compiles even without a GPU: for ahead-of-time compile checks).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["gpu_path", "force_gpu_path", "gpu_path_forced", "triton", "triton_available",
           "triton_unavailable_reason", "interpreting", "jit"]

_forced = os.environ.get("KVSHRINK_GPU_PATH", "") not in ("", "0")
_triton: Any = None
_triton_error: str | None = None


def gpu_path_forced() -> bool:
    return _forced


def gpu_path(tensor: torch.Tensor) -> bool:
    """Whether work on ``tensor`` takes the GPU path (a CUDA tensor, or the path forced)."""
    return tensor.is_cuda or _forced


@contextlib.contextmanager
def force_gpu_path(enabled: bool = True) -> Iterator[None]:
    """Run the GPU code path on any device within the block (Triton kernels interpreted on CPU)."""
    global _forced
    before = _forced
    _forced = enabled
    try:
        yield
    finally:
        _forced = before


def interpreting() -> bool:
    """Whether kvshrink's Triton kernels run in the interpreter: ``TRITON_INTERPRET`` when set, else
    whenever no CUDA device is present (read on first use, never at ``import kvshrink``: asking the device
    at import would initialise CUDA in processes that fork workers)."""
    chosen = os.environ.get("TRITON_INTERPRET")
    if chosen is not None:
        return chosen not in ("", "0")
    return _no_cuda_device()


_no_cuda: bool | None = None


def _no_cuda_device() -> bool:
    global _no_cuda
    if _no_cuda is None:
        cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
        _no_cuda = cpu_build or not torch.cuda.is_available()
    return _no_cuda


# ---- kvshrink's kernels in the interpreter, whatever the process chose for Triton -------------------------

# Triton decorates its library functions (tl.zeros, tl.sum, tl.cumsum...) when it is imported; imported
# without TRITON_INTERPRET they are compiled-mode functions, which an interpreted kernel cannot call. For
# the duration of one interpreted launch they are replaced by interpreted twins, the way Triton's
# interpreter itself patches the language's builtins for a launch. The combine functions the interpreter
# recognises by identity (and runs as numpy reductions) are left as they are.
_RECOGNISED_COMBINES = ("_argmin_combine_tie_break_left", "_argmin_combine_tie_break_fast",
                        "_argmax_combine_tie_break_left", "_argmax_combine_tie_break_fast",
                        "_elementwise_max", "_elementwise_min", "_sum_combine", "_prod_combine")
_library_lock = threading.RLock()
_twins: dict[int, Any] = {}


@contextlib.contextmanager
def _interpreted_library() -> Iterator[None]:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    with contextlib.suppress(ImportError):
        # Imported lazily by the launch (to specialise arguments); it wraps library functions when imported,
        # which must happen outside the patch.
        import triton.experimental.gluon  # noqa: F401
    with _library_lock:
        replaced = []
        for module in {id(m): m for m in (tl, tl.core, tl.standard, tl.math)}.values():
            for name, value in list(vars(module).items()):
                if not isinstance(value, JITFunction) or (module is tl.standard and name in _RECOGNISED_COMBINES):
                    continue
                if id(value) not in _twins:
                    _twins[id(value)] = InterpretedFunction(value.fn)
                twin = _twins[id(value)]
                replaced.append((module, name, value))
                setattr(module, name, twin)
        try:
            yield
        finally:
            for module, name, value in replaced:
                setattr(module, name, value)


@functools.lru_cache(maxsize=1)
def _interpreted_kernel_type() -> type:
    from triton.runtime.interpreter import InterpretedFunction

    class InterpretedKernel(InterpretedFunction):
        """A kvshrink kernel run by Triton's interpreter, with the language library interpreted too."""

        def run(self, *args, **kwargs):
            with _interpreted_library():
                return super().run(*args, **kwargs)

    return InterpretedKernel


def jit(fn=None, **options):
    """``triton.jit`` for kvshrink's kernels: interpreted when `interpreting()`, compiled otherwise."""
    def decorate(f):
        if interpreting():
            return _interpreted_kernel_type()(f, **options)
        return triton()._module.jit(f, **options)

    return decorate(fn) if fn is not None else decorate


class _KernelTriton:
    """Triton as kvshrink's kernel modules use it: the module itself, except that ``jit`` is `jit`."""

    def __init__(self, module: ModuleType):
        self._module = module
        self.jit = jit

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _load_triton() -> None:
    global _triton, _triton_error
    if _triton is not None or _triton_error is not None:
        return
    try:
        import triton as module
        import triton.language  # noqa: F401
        _triton = _KernelTriton(module)
    except Exception as exc:  # pragma: no cover - depends on the environment
        _triton_error = f"{type(exc).__name__}: {exc}"


def triton_available() -> bool:
    _load_triton()
    return _triton is not None


def triton_unavailable_reason() -> str | None:
    _load_triton()
    return _triton_error


def triton() -> Any:
    """Triton for kvshrink's kernels (imported on first use; its ``jit`` chooses the interpreter without a
    GPU); ImportError naming the extra when it is missing."""
    _load_triton()
    if _triton is None:
        raise ImportError(f"kvshrink's GPU kernels need Triton ({_triton_error}); install it with: "
                          "pip install 'kvshrink[gpu]' (CUDA builds of torch bring it)")
    return _triton
