"""Which code path a decode step takes: the CPU path (torch ops, numba kernels) or the GPU path (Triton
kernels, fused attention, no host synchronisation).

A tensor on a CUDA device takes the GPU path. `force_gpu_path()` makes CPU tensors take it too, so the
very code a GPU runs is tested on CPU: Triton kernels then run in Triton's interpreter
(``TRITON_INTERPRET=1``, set here when no GPU is present, before Triton is imported). The environment
variable ``KVSHRINK_GPU_PATH=1`` forces it for a whole process.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from types import ModuleType

import torch

__all__ = ["gpu_path", "force_gpu_path", "gpu_path_forced", "triton", "triton_available",
           "triton_unavailable_reason", "interpreting"]

_forced = os.environ.get("KVSHRINK_GPU_PATH", "") not in ("", "0")
_triton: ModuleType | None = None
_triton_error: str | None = None


def _choose_interpreter(probe_device: bool = True) -> None:
    """Without a GPU a Triton kernel can only run in the interpreter, which must be chosen before Triton is
    imported: Triton decorates its own library functions (``tl.max``, ``tl.sum``...) at import, and
    transformers imports Triton when it is installed. ``kvshrink/__init__`` imports this module first;
    at import only a CPU build of torch is recognised (``probe_device=False``: no CUDA initialisation,
    which would stop forked workers from using CUDA), the device itself is asked on first use."""
    if "triton" in sys.modules:
        return
    cpu_build = torch.version.cuda is None and getattr(torch.version, "hip", None) is None
    if cpu_build or (probe_device and not torch.cuda.is_available()):
        os.environ.setdefault("TRITON_INTERPRET", "1")


_choose_interpreter(probe_device=False)


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


def _load_triton() -> None:
    global _triton, _triton_error
    if _triton is not None or _triton_error is not None:
        return
    _choose_interpreter()
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # Something imported Triton before kvshrink (transformers does): its library functions were made
        # for compiled kernels, which cannot run here. Import its Python modules again under the
        # interpreter (the compiled extension, triton._C, is kept: it cannot be loaded twice).
        # An explicit TRITON_INTERPRET=0 is kept (kernels then compile, e.g. for another machine, but
        # cannot run here).
        os.environ["TRITON_INTERPRET"] = "1"
        for name in [m for m in sys.modules if (m == "triton" or m.startswith("triton.")) and
                     not m.startswith("triton._C")]:
            del sys.modules[name]
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
        _triton = triton
    except Exception as exc:  # pragma: no cover - depends on the environment
        _triton_error = f"{type(exc).__name__}: {exc}"


def triton_available() -> bool:
    _load_triton()
    return _triton is not None


def triton_unavailable_reason() -> str | None:
    _load_triton()
    return _triton_error


def triton() -> ModuleType:
    """The triton module (imported on first use); ImportError naming the extra when it is missing."""
    _load_triton()
    if _triton is None:
        raise ImportError(f"kvshrink's GPU kernels need Triton ({_triton_error}); install it with: "
                          "pip install 'kvshrink[gpu]' (CUDA builds of torch bring it)")
    return _triton


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
