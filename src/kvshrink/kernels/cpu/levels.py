"""Scalar levels on the CPU: the levels each byte of packed codes holds (the table Shard's coded-block kernel
decodes keys with), and the codes of values among ascending bounds in one pass (`quantize_unit`: what
`codecs.scalar_levels.quantize_unit` gives, on this pass where it applies)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvshrink.codecs.scalar_levels import quantize_unit as quantize_unit_torch
from kvshrink.codecs.scalar_levels import unit_bounds, unit_levels
from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.numba_support import _numpy


@functools.lru_cache(maxsize=16)


def byte_levels(kind: str, widths: tuple[int, ...]) -> np.ndarray:
    """float32 ``[8 * 256, 8]``: for each code width ``w`` in ``widths`` (rows ``(w-1)*256 ..``; the other
    rows zero) and byte value, the unit levels of the codes it packs (code ``m`` of the byte in column
    ``m``) when ``w`` divides 8; for the other widths, the level of code value ``v`` in row ``v``, column 0.
    Only the widths asked for: a Lloyd-Max width not yet used costs about a second to compute."""
    table = np.zeros((8 * 256, 8), np.float32)
    values = np.arange(256)
    for width in widths:
        levels = unit_levels(width, kind).numpy()
        rows = table[(width - 1) * 256: width * 256]
        if 8 % width == 0:
            for m in range(8 // width):
                rows[:, m] = levels[(values >> (m * width)) & ((1 << width) - 1)]
        else:
            rows[: 1 << width, 0] = levels
    return table


if numba_support.installed():
    from numba import njit

    @njit(cache=True)
    def _level_codes(z, bounds, nan_last, out):  # pragma: no cover - compiled
        # out[i] = how many bounds (ascending) lie below z[i], bound by bound (the loop over values
        # vectorises: faster than a binary search up to 255 bounds); NaN: 0 as comparisons give it, or
        # with nan_last the number of bounds, as torch.bucketize gives it
        out[:] = 0
        for b in bounds:
            for i in range(z.shape[0]):
                out[i] += np.uint8(z[i] > b)
        if nan_last:
            for i in range(z.shape[0]):
                if z[i] != z[i]:
                    out[i] = bounds.shape[0]


def level_codes(z: torch.Tensor, bounds: torch.Tensor, nan_last: bool) -> torch.Tensor:
    """uint8 codes ``[...]`` of ``z`` (CPU, float32) among ascending float32 ``bounds`` (at most 255): the number
    of bounds below each value, what `scalar_levels.quantize_unit`'s torch ops give (NaN: 0 as its comparisons
    give it, or with ``nan_last`` the number of bounds, as `torch.bucketize`), with no temporary per bound."""
    out = np.empty(z.numel(), np.uint8)
    _level_codes(_numpy(z.float()).reshape(-1), _numpy(bounds.float()), nan_last, out)
    return torch.from_numpy(out).view(z.shape)


def quantize_unit(z: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """`codecs.scalar_levels.quantize_unit` (the same codes), in one pass (`level_codes`, uint8) for Lloyd-Max levels
    of CPU values when numba is there."""
    if kind != "uniform" and z.device.type == "cpu" and bits <= 8 and numba_support.available():
        return level_codes(z, unit_bounds(bits, kind, z.device), nan_last=bits > 4)
    return quantize_unit_torch(z, bits, kind)
