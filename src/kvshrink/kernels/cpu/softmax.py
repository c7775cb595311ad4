"""The row softmax the kernels share (exp as a polynomial the loops vectorise, each row's log-sum-exp), and the
buffers of a partial softmax."""

from __future__ import annotations

import numpy as np

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.numba_support import _FASTMATH

if numba_support.installed():
    from numba import njit

    @njit(cache=True, fastmath=_FASTMATH)
    def _row_max(x):  # pragma: no cover - compiled
        # the largest of x [n] (-inf when empty): 16 running maxima side by side, so the loop vectorises
        n = x.shape[0]
        acc = np.full(16, -np.inf, np.float32)
        for i0 in range(0, n - 15, 16):
            for j in range(16):
                v = x[i0 + j]
                acc[j] = v if v > acc[j] else acc[j]
        top = np.float32(-np.inf)
        for j in range(16):
            top = acc[j] if acc[j] > top else top
        for i in range(n - n % 16, n):
            top = x[i] if x[i] > top else top
        return top

    @njit(cache=True, fastmath=_FASTMATH)
    def _softmax_rows(scores, lse):  # pragma: no cover - compiled
        # scores [rows, n] -> their softmax in place, lse [rows] their log-sum-exp (a row of -inf: zeros, -inf).
        # exp(v), v = score - max <= 0, as 2**k * p(f) (v = k ln 2 + f, |f| <= ln 2 / 2, p: its degree-7 Taylor
        # polynomial, under 1e-7 relative), 2**k added to p's exponent bits: loops that vectorise (numba's exp
        # does not without Intel's SVML); below -87 (under 2**-126) exactly zero
        rows, n = scores.shape
        shift = np.empty(n, np.int32)
        for r in range(rows):
            x = scores[r]
            top = _row_max(x)
            if top == -np.inf:
                x[:] = 0.0
                lse[r] = -np.inf
                continue
            for i in range(n):
                v = x[i] - top
                inside = v > np.float32(-87.0)
                v = v if inside else np.float32(-87.0)
                k = np.floor(v * np.float32(1.4426950408889634) + np.float32(0.5))
                f = v - k * np.float32(0.693359375) - k * np.float32(-2.1219444e-4)
                p = np.float32(1.0 / 5040)
                p = p * f + np.float32(1.0 / 720)
                p = p * f + np.float32(1.0 / 120)
                p = p * f + np.float32(1.0 / 24)
                p = p * f + np.float32(1.0 / 6)
                p = p * f + np.float32(0.5)
                p = p * f + np.float32(1.0)
                p = p * f + np.float32(1.0)
                x[i] = p if inside else np.float32(0.0)
                shift[i] = (np.int32(k) << 23) if inside else np.int32(0)
            bits = x.view(np.int32)
            for i in range(n):
                bits[i] += shift[i]
            total = np.float32(0.0)
            for i in range(n):
                total += x[i]
            inv = np.float32(1.0) / total
            for i in range(n):
                x[i] *= inv
            lse[r] = top + np.log(total)


def empty_partial(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Empty float32 ``out [B, H, R, d]`` and ``lse [B, H, R]`` of a grouped query's ``shape``."""
    return np.empty(tuple(shape), np.float32), np.empty(tuple(shape[:3]), np.float32)
