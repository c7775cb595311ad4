"""Attention on the CPU over TurboQuant codes (Shard's decode stream) in one pass, without decoding them into
tensors, and the views and tables its kernels read."""

from __future__ import annotations

import weakref

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.half_words import _HALF_POW2, _half_float
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy
from kvshrink.kernels.cpu.softmax import empty_partial

_TURBO_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


if numba_support.installed():
    from numba import njit

    @njit(cache=True, fastmath=_FASTMATH)
    def _unpack_row(row, per_byte, vec):  # pragma: no cover - compiled
        # one vector's codes (bytes of 8 // bits codes) -> their centroids, in vec
        per = per_byte.shape[1]
        for j in range(row.shape[0]):
            levels = per_byte[row[j]]
            for m in range(per):
                vec[j * per + m] = levels[m]

    @njit(cache=True, fastmath=_FASTMATH)
    def _turbo_attention(q, rotation_t, k_codes, k_norm, v_codes, v_norm, centre, per_byte, pow2, scaling, out,
                         lse):  # pragma: no cover - compiled
        # queries q [B, H, R, d] (the model's channels) over n TurboQuant-coded keys and values [B, H, n, bytes]
        # (norms as float16 words [B, H, n]) of vectors less their centre [2, B, H, d] (keys', values'): rotated
        # (q @ M; rotation_t = M.T), attended in the rotated domain, the output rotated back (@ M.T) -> out
        # [B, H, R, d], lse [B, H, R]. The key centre adds q . centre to every score: to the lse alone; the value
        # centre adds itself to the output (the probabilities sum to one)
        batch, heads, rows, d = q.shape
        n = k_codes.shape[2]
        scores = np.empty((rows, n), np.float32)
        vec = np.empty(k_codes.shape[3] * per_byte.shape[1], np.float32)
        qr = np.empty((rows, d), np.float32)
        acc = np.empty((rows, d), np.float32)
        for b in range(batch):
            for h in range(heads):
                for r in range(rows):
                    for e in range(d):
                        x = np.float32(0.0)
                        for j in range(d):
                            x += q[b, h, r, j] * rotation_t[e, j]
                        qr[r, e] = x
                for t in range(n):
                    _unpack_row(k_codes[b, h, t], per_byte, vec)
                    weight = _half_float(k_norm[b, h, t], pow2) * scaling
                    for r in range(rows):
                        x = np.float32(0.0)
                        for e in range(d):
                            x += qr[r, e] * vec[e]
                        scores[r, t] = x * weight
                for r in range(rows):
                    row = scores[r]
                    top = -np.inf
                    for t in range(n):
                        top = max(top, row[t])
                    total = np.float32(0.0)
                    for t in range(n):
                        row[t] = np.exp(row[t] - top)
                        total += row[t]
                    shift = np.float32(0.0)
                    for e in range(d):
                        shift += q[b, h, r, e] * centre[0, b, h, e]
                    lse[b, h, r] = top + np.log(total) + shift * scaling
                    acc[r] = 0.0
                    for t in range(n):
                        row[t] /= total
                for t in range(n):
                    _unpack_row(v_codes[b, h, t], per_byte, vec)
                    norm = _half_float(v_norm[b, h, t], pow2)
                    for r in range(rows):
                        p = scores[r, t] * norm
                        for e in range(d):
                            acc[r, e] += p * vec[e]
                for r in range(rows):
                    for e in range(d):
                        x = np.float32(0.0)
                        for j in range(d):
                            x += acc[r, j] * rotation_t[j, e]
                        out[b, h, r, e] = x + centre[1, b, h, e]


def turbo_supported(turbo) -> bool:
    """Whether `turbo_attention` reads this `codecs.lloyd_max.TurboQuantizer`'s codes: widths dividing a byte, no
    QJL sketch."""
    return numba_support.available() and 8 % turbo.bits == 0 and not turbo.qjl


def turbo_attention(turbo, query: torch.Tensor, keys, values, scaling: float,
                    centre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped ``query [B, H_kv, R, d]`` over TurboQuant-coded ``keys`` and ``values``
    (`codecs.lloyd_max.TurboCode` of ``[B, H_kv, n]`` vectors, each coded less its ``centre [2, B, H_kv, d]``:
    the keys', the values'; None: zero) on CPU, in one pass: ``(out [B, H_kv, R, d] float32, lse [B, H_kv, R])``,
    what ``turbo.inner_products``, a softmax and ``turbo.weighted_sum`` give with the centres added back,
    without decoding the codes into tensors (`turbo_supported` says when it applies)."""
    out, lse = empty_partial(query.shape)
    _turbo_into(turbo, _numpy(query.float()), turbo_arrays(keys), turbo_arrays(values), np.float32(scaling), out, lse,
                centre_array(centre, query.shape))
    return torch.from_numpy(out), torch.from_numpy(lse)


def centre_array(centre: torch.Tensor | None, shape: tuple[int, ...]) -> np.ndarray:
    """A stream's centres ``[2, B, H, d]`` as the kernels read them (float32 numpy; zeros for None), for vectors of
    batch and heads ``shape[:2]``."""
    if centre is None:
        return np.zeros((2, shape[0], shape[1], shape[-1]), np.float32)
    return _numpy(centre.float())


def turbo_arrays(code) -> tuple[np.ndarray, np.ndarray]:
    """A `codecs.lloyd_max.TurboCode` as numpy views (no copy, strides kept): its codes ``[..., bytes]`` uint8 and
    its float16 norms as words ``[...]`` (uint16), as `turbo_attention`'s kernel reads them."""
    return code.codes.detach().numpy(), code.norm.detach().view(torch.int16).numpy().view(np.uint16)


def _turbo_into(turbo, query: np.ndarray, keys: tuple, values: tuple, scaling: np.float32, out: np.ndarray,
                lse: np.ndarray, centre: np.ndarray) -> None:
    rotation_t, _, per_byte = turbo_tables(turbo)
    _turbo_attention(query, rotation_t, *keys, *values, centre, per_byte, _HALF_POW2, scaling, out, lse)


def stream_words(codes: torch.Tensor, norm: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """A stream buffer's ``codes [2, B, H, cap, bytes]`` and float16 ``norm [2, B, H, cap]`` as numpy ``[2·B·H, cap,
    bytes]`` and words ``[2·B·H, cap]`` (no copy): what `ring_step` and `_turbo_encode` write."""
    return (codes.view(-1, *codes.shape[-2:]).numpy(),
            norm.view(torch.int16).numpy().view(np.uint16).reshape(-1, norm.shape[-1]))


def turbo_tables(turbo) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``turbo``'s rotation transposed (``M.T``: rotate(x) = x @ M), its level boundaries, and the centroids of each
    byte's codes (``[256, 8 // bits]``), float32 numpy: what the CPU kernels read (kept while ``turbo`` lives; not on
    it, so never saved with it)."""
    held = _TURBO_TABLES.get(turbo)
    if held is None:
        _, bounds, _, per_byte = turbo._tables("cpu")
        held = _TURBO_TABLES[turbo] = (turbo.rotation.matrix("cpu", torch.float32).T.contiguous().numpy(),
                                       bounds.numpy().copy(), None if per_byte is None else per_byte.numpy().copy())
    return held
