"""A Triton kernel checked on the device before it is trusted.

The first time a kernel runs for a given device and signature (the dtypes and sizes that select its compiled
variant), `trusted` runs it once on small random inputs beside the torch path and compares the two (a few
milliseconds, one host synchronisation, never counted by ``counting``). When they disagree it warns once
and answers False from then on: the caller takes the torch path for that kernel on that device, so a
compiler or hardware the kernels were never run on gives slower answers, not wrong ones.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import torch

from kvshrink.kernels import counting

__all__ = ["trusted", "forget"]

_verdicts: dict[tuple, bool] = {}
_lock = threading.Lock()


def trusted(kernel: str, device: torch.device, signature: tuple,
            compare: Callable[[], tuple[torch.Tensor, torch.Tensor, float]]) -> bool:
    """Whether ``kernel`` may run on ``device`` for ``signature``. ``compare()`` returns the kernel's result,
    the torch path's result on the same inputs and the tolerance; it runs once per key."""
    key = (kernel, str(device), signature)
    verdict = _verdicts.get(key)
    if verdict is not None:
        return verdict
    with _lock, counting.uncounted():
        if key not in _verdicts:
            _verdicts[key] = _agree(kernel, device, signature, compare)
    return _verdicts[key]


def _agree(kernel: str, device: torch.device, signature: tuple,
           compare: Callable[[], tuple[torch.Tensor, torch.Tensor, float]]) -> bool:
    try:
        got, want, tolerance = compare()
        error = float((got.float() - want.float()).abs().nan_to_num(nan=float("inf")).max())
        failure = None if error <= tolerance else f"differs from the torch path by {error:.3g} (tolerance {tolerance:g})"
    except Exception as exc:  # a kernel that cannot compile or run here
        failure = f"failed: {type(exc).__name__}: {exc}"
    if failure is None:
        return True
    warnings.warn(f"kvshrink: the Triton kernel {kernel} on {device} for {signature} {failure}; the torch path "
                  "is used for it instead (slower, same answers)", RuntimeWarning, stacklevel=4)
    return False


def forget() -> None:
    """Drop every verdict (tests: check again)."""
    with _lock:
        _verdicts.clear()
