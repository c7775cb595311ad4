"""Exact attention on the CPU over the tokens a decode step holds uncoded: float tokens, 8-bit codes decoded on
the fly, and a 16-bit ring's words read in place (each one pass per head, with its log-sum-exp)."""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.half_words import _HALF_POW2, _half_value, _widen_rows
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy
from kvshrink.kernels.cpu.softmax import _softmax_rows

_SPLIT = {torch.float16: 2.0 ** 13 + 1, torch.bfloat16: 2.0 ** 16 + 1}
_NO_TOKENS = np.zeros((1, 1, 0, 1), np.float32)


if numba_support.installed():
    from numba import njit

    @njit(inline="always")
    def _rounded(x, split):  # pragma: no cover - compiled (no fastmath: the split must not be reassociated)
        # x rounded to nearest with the mantissa of the exact dtype (Veltkamp's split: split = 2**(24 - bits) + 1;
        # 1 leaves x as it is), as ``.to(dtype)`` rounds the reference path's decoded codes
        if split == 1.0:
            return x
        c = x * split
        return c - (c - x)

    @njit(cache=True, fastmath=_FASTMATH)
    def _vector_attention(q, keys, values, scaling, out, lse, scores):  # pragma: no cover - compiled
        # query rows q [R, d] over keys/values [m, d] (float32), every one visible -> out [R, d], lse [R]; scores:
        # room for R * m floats. The softmax is `_softmax_rows`' vectorised one; the value rows are summed into a
        # local accumulator, each value row read once for the R query rows (both measured faster than the
        # row-at-a-time loops with np.exp)
        m, d = keys.shape
        n_rows = q.shape[0]
        probs = scores[:n_rows * m].reshape(n_rows, m)
        for r in range(n_rows):
            for t in range(m):
                acc = np.float32(0.0)
                for j in range(d):
                    acc += q[r, j] * keys[t, j]
                probs[r, t] = acc * scaling
        _softmax_rows(probs, lse)
        total = np.zeros((n_rows, d), np.float32)
        for t in range(m):
            for r in range(n_rows):
                w = probs[r, t]
                for j in range(d):
                    total[r, j] += w * values[t, j]
        out[:] = total

    @njit(cache=True)
    def _exact_attention(q, keys, values, scaling, out, lse):  # pragma: no cover - compiled
        # grouped queries q [B, H, R, d] over keys/values [B, H, m, d] (float32), every one visible
        scores = np.empty(q.shape[2] * keys.shape[2], np.float32)
        for b in range(q.shape[0]):
            for h in range(q.shape[1]):
                _vector_attention(q[b, h], keys[b, h], values[b, h], scaling, out[b, h], lse[b, h], scores)

    @njit(cache=True)
    def _decode_int8(codes, scale, zero, pow2, split, out):  # pragma: no cover - compiled (no fastmath: `_rounded`)
        # m token vectors held as 8-bit codes [m, G, g] with an fp16 step and zero point per group (uint16 bits
        # [m, G]) -> out [m, G * g] float32, rounded to the exact dtype
        m, groups, group = codes.shape
        for t in range(m):
            for k in range(groups):
                step, low = _half_value(scale[t, k], pow2), _half_value(zero[t, k], pow2)
                row, code = out[t, k * group:(k + 1) * group], codes[t, k]
                if split == 1.0:    # the branch outside the loops: each one vectorises (2x measured)
                    for j in range(group):
                        row[j] = np.float32(code[j]) * step + low
                else:
                    for j in range(group):
                        row[j] = _rounded(np.float32(code[j]) * step + low, split)

    @njit(cache=True)
    def _int8_attention(q, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, pow2, split, scaling, out,
                        lse):  # pragma: no cover - compiled
        # grouped queries q [B, H, R, d] over m token vectors per head held as 8-bit codes [B, H, m, G, g] with an
        # fp16 step and zero point per group (uint16 bits [B, H, m, G]), every one visible -> out [B, H, R, d], lse
        batch, heads, rows, d = q.shape
        m = k_codes.shape[2]
        keys = np.empty((m, d), np.float32)
        values = np.empty((m, d), np.float32)
        scores = np.empty(rows * m, np.float32)
        for b in range(batch):
            for h in range(heads):
                _decode_int8(k_codes[b, h], k_scale[b, h], k_zero[b, h], pow2, split, keys)
                _decode_int8(v_codes[b, h], v_scale[b, h], v_zero[b, h], pow2, split, values)
                _vector_attention(q[b, h], keys, values, scaling, out[b, h], lse[b, h], scores)

    @njit(cache=True)
    def _ring_attention(q, kv, live, bf16, pow2, new_k, new_v, scaling, out, lse, key_bits, value_bits,
                        scores):  # pragma: no cover - compiled
        # grouped queries q [B, H, R, d] over the first `live` rows of a 16-bit ring kv [2, B*H, S, d] (float16
        # words, or bfloat16 ones with bf16) and the float32 rows new_k/new_v [B, H, m, d], every one visible;
        # key_bits/value_bits [live + m, d] uint32 and scores [R * (live + m)]: scratch (kept by the caller: a fresh
        # allocation of that size is mapped page by page on every call)
        batch, heads, rows, d = q.shape
        m = new_k.shape[2]
        keys, values = key_bits.view(np.float32), value_bits.view(np.float32)
        for b in range(batch):
            for h in range(heads):
                bh = b * heads + h
                _widen_rows(kv[0, bh], live, bf16, pow2, key_bits)
                _widen_rows(kv[1, bh], live, bf16, pow2, value_bits)
                for t in range(m):
                    keys[live + t] = new_k[b, h, t]
                    values[live + t] = new_v[b, h, t]
                _vector_attention(q[b, h], keys, values, scaling, out[b, h], lse[b, h], scores)


def _exact_into(query: np.ndarray, keys: torch.Tensor, values: torch.Tensor, scaling: np.float32, out: np.ndarray,
                lse: np.ndarray) -> None:
    # torch converts half vectorised: numpy's astype took ~5x as long
    _exact_attention(query, _numpy(keys.float()), _numpy(values.float()), scaling, out, lse)


def int8_arrays(code) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An 8-bit `codecs.groupwise.GroupCode` as numpy views (no copy), as `StepParts.int8`'s kernel reads it: codes
    ``[..., groups, group]`` uint8, the float16 steps and zero points as uint16 words ``[..., groups]``."""
    if code.bits != 8:
        raise ValueError(f"StepParts.int8 reads 8-bit codes, got {code.bits} bits")
    codes = code.codes.reshape(*code.scale.shape, code.group_size)
    return _numpy(codes), *(_numpy(x.view(torch.int16)).view(np.uint16) for x in (code.scale, code.zero))


def _int8_into(query: np.ndarray, keys: tuple, values: tuple, scaling: np.float32, dtype: torch.dtype,
               out: np.ndarray, lse: np.ndarray) -> None:
    _int8_attention(query, *keys, *values, _HALF_POW2, np.float32(_SPLIT.get(dtype, 1.0)), scaling, out, lse)


def ring_words(kv: torch.Tensor) -> np.ndarray:
    """A float16 ring buffer ``kv [2, B, H, S, d]`` (contiguous) as numpy words ``[2, B·H, S, d]`` (no copy)."""
    return kv.view(torch.int16).numpy().view(np.uint16).reshape(2, -1, kv.shape[-2], kv.shape[-1])
