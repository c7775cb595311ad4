"""A Triton kernel checked on the device before it is trusted.

The first time a kernel runs for a given device and signature (the dtypes and sizes that select its compiled
variant), `trusted` runs it once on small random inputs beside the torch path and compares the two (a few
milliseconds; never counted by ``counting``, and CUDA's sync debug mode off meanwhile: the torch path reads the
device). When they disagree it warns once and answers False from then on: the caller takes the torch path for
that kernel on that device, so a compiler or hardware the kernels were never run on gives slower answers, not
wrong ones.

What one verdict covers is the caller's choice. The exact-attention and merge kernels are checked one by one:
each has a torch twin that takes the same inputs. A method whose step chains several kernels (Shard's middle
blocks and stream, LRQK's factor update, proxy ranking, slot plan and gathered attention) is checked as one
step: a fresh layer of the same options runs a short prefill and a few decode steps on small random tokens
(`kvshrink.cache.probe`) once with its kernels and once on its torch path, and the outputs are compared. One
kernel's inputs are built by another (a block's kernel inputs, the slot plan the attention reads), so the
only fallback that needs no mixed state is the whole step's torch path; and the step runs every kernel of the
method at the real layer's dtype, head shapes and options. A check may run other checks inside it (the step's exact
attention): the lock is re-entrant.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable

import torch

from kvshrink.kernels import counting

__all__ = ["trusted", "options_signature", "forget"]

_verdicts: dict[tuple, bool] = {}
_lock = threading.RLock()


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


def options_signature(options) -> tuple:
    """A method's options (a dataclass) as part of a signature: ``(name, value)`` pairs, hashable."""
    return tuple((f.name, getattr(options, f.name)) for f in dataclasses.fields(options))


def forget() -> None:
    """Drop every verdict (tests: check again)."""
    with _lock:
        _verdicts.clear()
