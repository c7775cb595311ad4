"""TurboQuant encoding on the CPU in one pass: codes written straight into the stream's buffers
(`turbo_encode_into`), and a full ring's decode commit (`ring_step`: the leaving token coded into the stream, the
new one stored)."""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.half_words import (_F32_FP16_OVERFLOW, _F32_INF, _HALF_POW2, _half_value, half_bits,
                                             largest_word, narrow_row)
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy
from kvshrink.kernels.cpu.stream import stream_words, turbo_tables

if numba_support.installed():
    from numba import njit

    @njit(cache=True)
    def _ring_step(kv, slot, key, value, pow2, rotation_t, bounds, bits, codes, norm_words, centre,
                   at):  # pragma: no cover - compiled
        # A full ring's decode step: the token in ``slot`` of ``kv [2, R, S, d]`` (float16 words), less its row's
        # ``centre [2R, d]``, TurboQuant-coded into token ``at`` of the stream (``codes [2R, cap, bytes]``,
        # ``norm_words [2R, cap]``, rows keys then values, as `_turbo_encode`), then the new ``key/value [R, d]``
        # (float32) narrowed into that slot; nothing done when a new value is beyond float16's range. Returns the
        # largest float32 word read, without sign.
        words = (key.view(np.uint32), value.view(np.uint32))
        largest = max(largest_word(words[0]), largest_word(words[1]))
        if _F32_FP16_OVERFLOW <= largest <= _F32_INF:
            return largest
        rows, d = key.shape
        leaving = np.empty((2 * rows, 1, d), np.float32)
        for i in range(2):
            for r in range(rows):
                for e in range(d):
                    w = kv[i, r, slot, e]
                    if (w & 0x7C00) == 0x7C00:     # inf or NaN (the ring's put lets a NaN in)
                        leaving[i * rows + r, 0, e] = np.nan if w & 0x3FF else (-np.inf if w & 0x8000 else np.inf)
                    else:
                        leaving[i * rows + r, 0, e] = _half_value(w, pow2)
        _turbo_encode(leaving, centre, rotation_t, bounds, bits, codes, norm_words, at)
        for i in range(2):
            for r in range(rows):
                narrow_row(words[i][r], kv[i, r, slot])
        return largest

    @njit(cache=True, fastmath=_FASTMATH)
    def _turbo_encode(x, centre, rotation_t, bounds, bits, codes, norm_words, at):  # pragma: no cover - compiled
        # rows x [M, n, d] (float32) less their row's centre [M, d] -> TurboQuant codes written into tokens at ..
        # at+n-1 of codes [M, cap, bytes] and their norms (float16 words) into norm_words [M, cap]:
        # `TurboQuantizer.encode` without QJL (rotation_t: the rotation's transpose, so each rotated channel is a
        # contiguous dot product)
        rows, n, d = x.shape
        per_byte = 8 // bits
        unit = np.empty(d, np.float32)
        norm_box = np.empty(1, np.float32)
        norm_bits = norm_box.view(np.uint32)
        for m in range(rows):
            for t in range(n):
                v = x[m, t]
                c = centre[m]
                total = np.float32(0.0)
                for e in range(d):
                    unit[e] = v[e] - c[e]
                    total += unit[e] * unit[e]
                norm = np.float32(np.sqrt(total))
                scale = max(norm, np.float32(1e-12))
                for e in range(d):
                    unit[e] = unit[e] / scale
                out = codes[m, at + t]
                out[:] = 0
                for j in range(d):
                    y = np.float32(0.0)
                    for e in range(d):
                        y += unit[e] * rotation_t[j, e]
                    code = 0
                    for b in range(bounds.shape[0]):
                        code += y > bounds[b]
                    out[j // per_byte] |= np.uint8(code << ((j % per_byte) * bits))
                norm_box[0] = norm
                norm_words[m, at + t] = half_bits(np.int64(norm_bits[0]))


def turbo_encode_into(turbo, x: torch.Tensor, codes: torch.Tensor, norm: torch.Tensor, at: int,
                      centre: torch.Tensor | None = None) -> None:
    """`TurboQuantizer.encode` (no QJL; `turbo_supported`) of float ``x [..., n, d]`` less ``centre [..., d]`` (one
    vector per leading row; None: zero) on CPU in one pass, written into tokens ``at .. at+n-1`` of ``codes [...,
    capacity, bytes]`` (uint8) and ``norm [..., capacity]`` (float16), contiguous buffers with the same leading dims
    (the stream's): nothing allocated per token. The same codes as ``encode(x.float() - centre)`` but where float32
    rounding puts a rotated channel on the other side of a boundary (summation order)."""
    *lead, n, d = x.shape
    rows = x.numel() // max(1, n * d)
    rotation_t, bounds, _ = turbo_tables(turbo)
    codes_out, norm_words = stream_words(codes, norm)
    _turbo_encode(_numpy(x.float().reshape(rows, n, d)), _row_centres(centre, rows, d), rotation_t, bounds,
                  turbo.bits, codes_out, norm_words, at)


def _row_centres(centre: torch.Tensor | None, rows: int, d: int) -> np.ndarray:
    """``centre`` (one vector per row, any leading shape) as ``[rows, d]`` float32 numpy; zeros for None."""
    if centre is None:
        return np.zeros((rows, d), np.float32)
    return _numpy(centre.float().reshape(rows, d))


def ring_step(turbo, kv: np.ndarray, slot: int, key: torch.Tensor, value: torch.Tensor, codes: np.ndarray,
              norm: np.ndarray, at: int, centre: torch.Tensor | None = None) -> float | None:
    """A full ring's decode step on CPU in one pass: the key and value in ``slot`` of the ring ``kv`` (`ring_words`),
    less their ``centre [2, B, H, d]`` (None: zero), coded by ``turbo`` (`turbo_supported`) into token ``at`` of the
    stream's ``codes`` and ``norm`` (`stream_words`; as `turbo_encode_into` codes them), then the new float32
    ``key/value [B, H, 1, d]`` stored in the slot, rounded as ``.to(float16)``. Returns None when done; when a new
    value is beyond float16's range, its magnitude, having changed nothing."""
    rows, d = kv.shape[1], key.shape[-1]
    rotation_t, bounds, _ = turbo_tables(turbo)
    largest = _ring_step(kv, slot, _numpy(key).reshape(rows, d), _numpy(value).reshape(rows, d), _HALF_POW2,
                         rotation_t, bounds, turbo.bits, codes, norm, _row_centres(centre, 2 * rows, d), at)
    if _F32_FP16_OVERFLOW <= largest <= _F32_INF:
        return float(np.array(largest, dtype=np.uint32).view(np.float32))
    return None
