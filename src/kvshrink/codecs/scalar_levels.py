"""Scalar quantizer levels of PCA coefficients: symmetric integers (``"uniform"``, with the
Gaussian-optimal step) or the Lloyd-Max levels of a unit Gaussian (``"lloyd"``), and the codes of
coefficients divided by their step."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from .bitpack import byte_codes


def _gaussian_grid() -> tuple[torch.Tensor, torch.Tensor]:
    """``(z, w)``: points of ``[-9, 9]`` and their unit-Gaussian weights (summing to 1), for expectations
    by numerical integration."""
    z = torch.linspace(-9, 9, 36001, dtype=torch.float64)
    w = torch.exp(-0.5 * z * z)
    return z, w / w.sum()


@functools.lru_cache(maxsize=None)
def gaussian_uniform_step(bits: int) -> float:
    """MSE-optimal step of the symmetric mid-tread quantizer with levels ``[-qmax, qmax]``
    (``qmax = 2**(bits-1) - 1``) for a unit Gaussian (numerical integration + grid search)."""
    qmax = (1 << (bits - 1)) - 1
    if qmax < 1:
        raise ValueError(f"symmetric quantization needs bits >= 2, got {bits}")
    z, w = _gaussian_grid()

    def mse(step: float) -> float:
        q = torch.clamp(torch.round(z / step), -qmax, qmax) * step
        return float((w * (z - q) ** 2).sum())

    lo, hi = 1e-3, 3.0
    for _ in range(3):  # coarse-to-fine log grid search (the MSE is unimodal in the step)
        grid = torch.logspace(math.log10(lo), math.log10(hi), 40, dtype=torch.float64).tolist()
        errs = [mse(s) for s in grid]
        k = min(range(len(grid)), key=errs.__getitem__)
        lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    return (lo + hi) / 2


COEFF_LEVELS = ("uniform", "lloyd")


@functools.lru_cache(maxsize=None)
def gaussian_distortion(bits: int, kind: str) -> float:
    """Mean squared error of a unit Gaussian coded at ``bits`` with `unit_levels` ``kind`` and the step
    the encoder starts from (the Gaussian-optimal one for ``uniform``, 1 for ``lloyd``): the error per
    unit of variance that the bit allocation weighs (numerical integration)."""
    z, w = _gaussian_grid()
    step = gaussian_uniform_step(bits) if kind == "uniform" else 1.0
    levels = unit_levels(bits, kind).double() * step
    codes = quantize_unit((z / step).float(), bits, kind).long()
    return float((w * (z - levels[codes]) ** 2).sum())


def unit_levels(bits: int, kind: str, device=None) -> torch.Tensor:
    """Reconstruction value of each code ``0 .. 2**bits-1`` for a unit step.

    ``uniform``: symmetric integers ``code - qmax`` (``2**bits - 1`` levels used, as int4 in [-7, 7]);
    ``lloyd``: the ``2**bits`` Lloyd-Max levels of a unit Gaussian (the step is then the component's
    scale): one more level and non-uniform spacing, which matters most at 2 bits (4 levels, not 3).
    """
    if kind == "uniform":
        return torch.arange(1 << bits, dtype=torch.float32, device=device) - ((1 << (bits - 1)) - 1)
    if kind == "lloyd":
        from .lloyd_max import lloyd_max_centroids

        return lloyd_max_centroids(bits, device=device)
    raise ValueError(f"coefficient levels must be one of {COEFF_LEVELS}, got {kind!r}")


@functools.lru_cache(maxsize=32)
def byte_level_table(bits: int, levels: str, device: str) -> torch.Tensor:
    """``[256, 8 // bits]``: the levels of the codes packed in each byte value (`pack_bits` order)."""
    return unit_levels(bits, levels, device)[byte_codes(bits, device)]


def unit_bounds(bits: int, kind: str, device=None) -> torch.Tensor:
    """The decision bounds between consecutive `unit_levels` (``2**bits - 1`` of them, ascending)."""
    levels = unit_levels(bits, kind, device)
    return (levels[1:] + levels[:-1]) / 2


# A coder of coefficients divided by their step: ``(z, bits, kind) -> codes`` (`quantize_unit`'s)
QuantizeUnit = Callable[[torch.Tensor, int, str], torch.Tensor]


def quantize_unit(z: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """Codes of ``z`` (coefficients divided by their step) for `unit_levels`."""
    if kind == "uniform":
        qmax = (1 << (bits - 1)) - 1
        return torch.clamp(torch.round(z), -qmax, qmax).long() + qmax
    bounds = unit_bounds(bits, kind, z.device)
    if bits > 4:
        return torch.bucketize(z.contiguous(), bounds)
    # Few boundaries: counting the ones below is faster than a binary search on CPU. uint8 codes (an
    # eighth of int64: they are packed next); callers that index with them must widen them first.
    codes = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)
    for b in bounds.tolist():
        codes += z > b
    return codes
