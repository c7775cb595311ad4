"""Fused CPU kernels (numba) for attention computed on packed codes, with a clear fallback.

`code_attention` is one block of Shard's compressed middle answered in two passes over its packed
codes, without materialising the block's keys or values:

1. per token: its pre-RoPE key is summed from lookup-table rows chosen by its packed key codes
   (`codecs.table_decoder.SlotPlan`: one row per byte of byte-aligned runs, one per code of the others, the
   mean as the start), rotated by RoPE (channels in pair order: one complex product per pair), and
   scored against the grouped queries;
2. per KV head: the softmax of those scores (held rows masked), and its probabilities summed per
   value codeword and channel group (the value VQ codes), so the caller finishes with one small
   product by the codebook.

numba is optional: `available()` says whether it imported; callers keep their torch reference path
and use it when it did not. The kernels run with ``torch.get_num_threads()`` threads (torch and the
kernels never run at once, so they share the cores without oversubscription) and are compiled once
per machine (``cache=True``; `warm_up` compiles them before anything is timed).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

try:  # the fast path is optional: a missing or broken numba leaves the reference path
    import numba
    from numba import njit, prange
    if "NUMBA_THREADING_LAYER" not in os.environ:
        # numba's OpenMP layer next to torch's OpenMP pool measured 2-4x slower (the pools spin against
        # each other); the work-queue layer's threads sleep between kernels.
        numba.config.THREADING_LAYER = "workqueue"
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    numba = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["available", "unavailable_reason", "code_attention", "warm_up"]

# Tokens per parallel work item of the key pass (enough to amortise scheduling, small enough to share).
_CHUNK = 64
# No fastmath "nnan"/"ninf": masked scores are -inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def available() -> bool:
    return numba is not None


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR


if numba is not None:
    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _key_scores(codes, slot_byte, slot_shift, slot_bits, slot_row, n_slots, tables, mean, cos, sin,
                    query, scaling, heads_per_scope, scores):  # pragma: no cover - compiled
        batch, n_scopes, n, n_bytes = codes.shape
        width = tables.shape[1]
        rows, head_dim = query.shape[2], query.shape[3]
        half = head_dim // 2
        chunks = (n + _CHUNK - 1) // _CHUNK
        for job in prange(batch * n_scopes * chunks):
            b = job // (n_scopes * chunks)
            s = (job // chunks) % n_scopes
            first = (job % chunks) * _CHUNK
            count = min(n, first + _CHUNK) - first
            # slot-major over the chunk's tokens: one slot's table (256 rows) stays in cache for all of them
            acc = np.empty((count, width), np.float32)
            for i in range(count):
                for w in range(width):
                    acc[i, w] = mean[s, w]
            for k in range(n_slots[s]):
                at, shift, bits, base = slot_byte[s, k], slot_shift[s, k], slot_bits[s, k], slot_row[s, k]
                for i in range(count):
                    value = np.int32(codes[b, s, first + i, at])
                    if bits != 8:
                        if shift + bits > 8:
                            value |= np.int32(codes[b, s, first + i, at + 1]) << 8
                        value = (value >> shift) & ((1 << bits) - 1)
                    row = base + value
                    for w in range(width):
                        acc[i, w] += tables[row, w]
            for i in range(count):
                t = first + i
                for j in range(heads_per_scope):
                    h = s * heads_per_scope + j
                    o = j * head_dim
                    for p in range(half):
                        re, im = acc[i, o + 2 * p], acc[i, o + 2 * p + 1]
                        c, si = cos[b, t, p], sin[b, t, p]
                        acc[i, o + 2 * p] = re * c - im * si
                        acc[i, o + 2 * p + 1] = re * si + im * c
                    for r in range(rows):
                        dot = np.float32(0.0)
                        for e in range(head_dim):
                            dot += query[b, h, r, e] * acc[i, o + e]
                        scores[b, h, r, t] = dot * scaling

    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _fill_tables(tables, scaled, levels, jobs):  # pragma: no cover - compiled
        # Entry v of a job's table is sum_k levels[code_k(v)] * scaled[component + k]: built one code at
        # a time (the table of k codes extended by the (k+1)-th), one add per entry and code.
        width = tables.shape[1]
        for j in prange(jobs.shape[0]):
            scope, first, real, bits, per, row, at = jobs[j]
            entries = 1 << bits
            for v in range(entries):
                for w in range(width):
                    tables[row + v, w] = levels[at + v] * scaled[scope, first, w]
            size = entries
            for k in range(1, per):
                weight = np.float32(1.0) if k < real else np.float32(0.0)  # past the run: zero rows
                comp = first + k if k < real else first
                for code in range(entries - 1, -1, -1):  # code 0 last: it updates the entries in place
                    level = levels[at + code] * weight
                    for lo in range(size):
                        for w in range(width):
                            tables[row + code * size + lo, w] = tables[row + lo, w] + level * scaled[scope, comp, w]
                size *= entries

    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _value_bins(scores, hidden, v_codes, v_bits, n_groups, bins, lse):  # pragma: no cover - compiled
        batch, heads, rows, n = scores.shape
        entries = 1 << v_bits
        mask = entries - 1
        for job in prange(batch * heads):
            b, h = job // heads, job % heads
            for i in range(hidden.shape[2]):
                for r in range(rows):
                    scores[b, h, r, hidden[b, h, i]] = -np.inf
            for r in range(rows):
                top = -np.inf
                for t in range(n):
                    top = max(top, scores[b, h, r, t])
                if top == -np.inf:  # every token held exact elsewhere: this part contributes nothing
                    lse[b, h, r] = -np.inf
                    for t in range(n):
                        scores[b, h, r, t] = 0.0
                    continue
                total = np.float32(0.0)
                for t in range(n):
                    e = np.exp(scores[b, h, r, t] - top)
                    scores[b, h, r, t] = e
                    total += e
                lse[b, h, r] = top + np.log(total)
                inv = np.float32(1.0) / total
                for t in range(n):
                    scores[b, h, r, t] *= inv
            for t in range(n):
                for g in range(n_groups):
                    bit = g * v_bits
                    at, shift = bit >> 3, bit & 7
                    code = np.int32(v_codes[b, h, t, at])
                    if v_bits != 8:
                        if shift + v_bits > 8:
                            code |= np.int32(v_codes[b, h, t, at + 1]) << 8
                        code = (code >> shift) & mask
                    col = g * entries + code
                    for r in range(rows):
                        bins[b, h, r, col] += scores[b, h, r, t]


_thread_lock = threading.Lock()


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def code_attention(codes: torch.Tensor, plan, scaled: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, query: torch.Tensor, scaling: float, hidden: torch.Tensor | None,
                   v_codes: torch.Tensor, v_bits: int, n_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped ``query [B, H_kv, R, d]`` (float32, channels in RoPE pair order) over one
    block of ``n`` coded tokens, on CPU tensors.

    ``codes [B, S, n, bytes]`` uint8: the packed key codes of the ``S`` PCA scopes, decoded by ``plan``
    (a `codecs.table_decoder.SlotPlan`) from tables filled from ``scaled [S, r, W]`` (the scaled bases) starting
    at ``mean [S, W]`` (float32, columns in pair order, ``W = H_kv * d / S``);
    ``cos, sin [B, n, d/2]``: the tokens' RoPE; ``hidden [B, H_kv, m]`` int32: rows not attended (or
    None); ``v_codes [B, H_kv, n, bytes]``: ``n_groups`` value codes of ``v_bits`` bits per token.

    Returns ``(bins [B, H_kv, R, n_groups * 2**v_bits], lse [B, H_kv, R])``: the softmax probabilities
    summed per value group and codeword, and the log-sum-exp of the scores."""
    batch, heads, rows, _ = query.shape
    n = codes.shape[2]
    scores = np.empty((batch, heads, rows, n), np.float32)
    bins = np.zeros((batch, heads, rows, n_groups << v_bits), np.float32)
    lse = np.empty((batch, heads, rows), np.float32)
    held = np.zeros((batch, heads, 0), np.int32) if hidden is None else _numpy(hidden.to(torch.int32))
    slot_byte, slot_shift, slot_bits, slot_row, n_slots = plan.slots
    tables = np.empty((max(1, plan.rows), mean.shape[-1]), np.float32)
    with _thread_lock:  # numba's thread count is process-wide
        numba.set_num_threads(max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)))
        _fill_tables(tables, _numpy(scaled), plan.levels, plan.jobs)
        _key_scores(_numpy(codes), slot_byte, slot_shift, slot_bits, slot_row, n_slots, tables,
                    _numpy(mean), _numpy(cos), _numpy(sin), _numpy(query), np.float32(scaling),
                    heads // codes.shape[1], scores)
        _value_bins(scores, held, _numpy(v_codes), v_bits, n_groups, bins, lse)
    return torch.from_numpy(bins), torch.from_numpy(lse)


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels now, on a tiny input, so the first decode
    step is not charged with it."""
    if numba is None:
        return
    from .pca import PCACode
    from .table_decoder import slot_plan

    code = PCACode(mean=torch.zeros(2), basis_q=torch.zeros(2, 4, dtype=torch.int8), basis_scale=torch.ones(4),
                   coeff_step=torch.ones(4), codes=torch.zeros(1, 2, 1, dtype=torch.uint8), runs=[(2, 0, 4, 0, 1)])
    code_attention(code.codes.unsqueeze(1), slot_plan([code]), torch.zeros(1, 4, 2), torch.zeros(1, 2),
                   torch.ones(1, 2, 1), torch.zeros(1, 2, 1), torch.zeros(1, 1, 1, 2), 1.0, None,
                   torch.zeros(1, 1, 2, 1, dtype=torch.uint8), 8, 1)
