"""Checks deferred on the GPU path: a decode step never waits for the device to learn whether a value was out
of range; the largest magnitudes are kept on the device and `raise_deferred` raises at the next point that
synchronises anyway (the cache framework calls it: the next prefill, every ``DEFERRED_CHECK_EVERY`` decode
steps, ``cache.nbytes()``). Kernels that narrow to float16 raise the running maximum in place
(`deferred_peak_slot`)."""

from __future__ import annotations

import torch

__all__ = ["DEFERRED_CHECK_EVERY", "FP16_MAX", "FP16_OVERFLOW", "peak_magnitude", "defer_nan", "defer_peak", "deferred_peak_slot", "raise_deferred",
           "storage_overflow_check"]

FP16_MAX = torch.finfo(torch.float16).max


def storage_overflow_check(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether storing ``x`` in ``dtype`` must be checked for fp16 overflow (it narrows to float16)."""
    return dtype == torch.float16 and x.dtype != dtype and bool(x.numel())


FP16_OVERFLOW = ("stored as float16 it would become inf. Store exact tokens in the model's dtype (the method's "
             "dtype option: 'model') for this model.")

# How often (in decode steps) a kvshrink cache on the GPU path synchronises once to raise deferred errors.
DEFERRED_CHECK_EVERY = 64
_DEFERRED: dict[tuple[str, str], tuple[torch.Tensor, float]] = {}


def peak_magnitude(x: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``x`` (NaN if it holds one) as a 0-d float32 device tensor, one launch."""
    if x.dtype == torch.float64:  # vector_norm refuses to narrow its accumulation dtype
        return torch.linalg.vector_norm(x.detach(), ord=float("inf")).float()
    return torch.linalg.vector_norm(x.detach(), ord=float("inf"), dtype=torch.float32)


def defer_peak(value: torch.Tensor, limit: float, message: str) -> None:
    """Keep the running maximum of the 0-d device tensor ``value``; `raise_deferred` raises ValueError
    with ``message`` once it has exceeded ``limit``. Nothing waits for the device here."""
    key = (message, str(value.device))
    held = _DEFERRED.get(key)
    value = value.detach().float()
    _DEFERRED[key] = (value if held is None else torch.maximum(held[0], value), limit)


def deferred_peak_slot(device: torch.device) -> torch.Tensor:
    """The running maximum `to_storage`'s deferred fp16-overflow check keeps on ``device`` (a 0-d float32
    tensor, made when none is held) for a kernel to raise in place: it maxes the value's bits as an
    int32 (non-negative floats order as their bits, NaN above inf), so nothing else is launched."""
    key = (FP16_OVERFLOW, str(device))
    if key not in _DEFERRED:
        _DEFERRED[key] = (torch.zeros((), dtype=torch.float32, device=device), FP16_MAX)
    return _DEFERRED[key][0]


def defer_nan(x: torch.Tensor, message: str) -> None:
    """`raise_deferred` raises ValueError with ``message`` if ``x`` held a NaN (two launches: the largest
    magnitude, which NaN propagates into, and the running maximum)."""
    defer_peak(peak_magnitude(x), float("inf"), message)


def raise_deferred() -> None:
    """Raise the first error recorded by `defer_peak` (or `defer_nan`) since the last call (synchronises)."""
    if not _DEFERRED:
        return
    pending = list(_DEFERRED.items())
    _DEFERRED.clear()
    for (message, _), (value, limit) in pending:
        peak = float(value)
        if peak > limit or peak != peak:  # beyond the limit, or NaN (which a maximum propagates)
            what = f" (largest magnitude {peak:.4g})" if peak == peak else ""
            raise ValueError(f"kvshrink: in a recent step on the GPU path{what}: {message}")
