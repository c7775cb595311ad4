"""Fused CPU kernels (numba) for attention computed on packed codes, with a clear fallback.

`code_attention` answers one block of Shard's compressed middle without materialising the block's keys
or values, a slice of tokens at a time:

1. per token: its PCA coefficients decoded from its packed key codes (one lookup per byte of a
   byte-aligned run, from a table of the levels each byte value packs);
2. the slice's pre-RoPE keys as one batched product of those coefficients with the scaled bases
   (torch's BLAS: the multiply-adds run at the machine's vector width, which hand-written loops
   over lookup tables did not reach, ``docs/results.md``), kept only for the slice;
3. per token: RoPE (channels as two halves, real then imaginary parts: contiguous vector operations)
   and the scores against the grouped queries;
4. per KV head: the softmax of all the block's scores (held rows masked), and its probabilities
   summed per value codeword and channel group (the value VQ codes), so the caller finishes with one
   small product by the codebook.

numba is optional: `available()` says whether it imported; callers keep their torch reference path
and use it when it did not. The kernels run on one thread (`_kernel_threads`: next to torch's OpenMP
pool a second numba thread measured slower) and are compiled once per machine (``cache=True``;
`warm_up` compiles them before anything is timed).
"""

from __future__ import annotations

import functools
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

__all__ = ["available", "unavailable_reason", "code_attention", "nearest_codewords", "warm_up"]

# Tokens per parallel work item of the per-token passes (enough to amortise scheduling, small enough to share).
_CHUNK = 256
# Tokens whose coefficients and keys are held at once (a few MB; 512..8192 measured within 10% at 8K).
_SLICE = 4096
# No fastmath "nnan"/"ninf": masked scores are -inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def available() -> bool:
    return numba is not None


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR


@functools.lru_cache(maxsize=16)
def byte_levels(kind: str, widths: tuple[int, ...]) -> np.ndarray:
    """float32 ``[8 * 256, 8]``: for each code width ``w`` in ``widths`` (rows ``(w-1)*256 ..``; the other
    rows zero) and byte value, the unit levels of the codes it packs (code ``m`` of the byte in column
    ``m``) when ``w`` divides 8; for the other widths, the level of code value ``v`` in row ``v``, column 0.
    Only the widths asked for: a Lloyd-Max width not yet used costs about a second to compute."""
    from .scalar_levels import unit_levels

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


if numba is not None:
    @njit(cache=True, fastmath=_FASTMATH)
    def _decode_rows(codes, runs, n_runs, lut, first, last, out):  # pragma: no cover - compiled
        # coefficients (unit levels) of tokens first..last-1 of one scope into out[0 .. last-first]
        top = 0
        for k in range(n_runs):
            bits, a, m, at = runs[k, 0], runs[k, 1], runs[k, 2], runs[k, 3]
            base = (bits - 1) * 256
            top = max(top, a + m)
            # 2- and 4-bit runs (what the bit allocation picks most) are written out by hand: a loop over
            # a byte's codes with a run-time count measured slower than these fixed ones (numba 0.68)
            if bits == 2 and m % 4 == 0:
                for t in range(first, last):
                    for q in range(m // 4):
                        v = base + codes[t, at + q]
                        c = a + 4 * q
                        out[t - first, c] = lut[v, 0]
                        out[t - first, c + 1] = lut[v, 1]
                        out[t - first, c + 2] = lut[v, 2]
                        out[t - first, c + 3] = lut[v, 3]
            elif bits == 4 and m % 2 == 0:
                for t in range(first, last):
                    for q in range(m // 2):
                        v = base + codes[t, at + q]
                        c = a + 2 * q
                        out[t - first, c] = lut[v, 0]
                        out[t - first, c + 1] = lut[v, 1]
            elif 8 % bits == 0:
                per = 8 // bits
                for t in range(first, last):
                    for i in range(m):
                        out[t - first, a + i] = lut[base + codes[t, at + i // per], i % per]
            else:  # codes straddle bytes
                mask = (1 << bits) - 1
                for t in range(first, last):
                    for i in range(m):
                        bit = i * bits
                        byte, shift = at + (bit >> 3), bit & 7
                        v = np.int32(codes[t, byte])
                        if shift + bits > 8:
                            v |= np.int32(codes[t, byte + 1]) << 8
                        out[t - first, a + i] = lut[base + ((v >> shift) & mask), 0]
        for t in range(first, last):
            for j in range(top, out.shape[1]):
                out[t - first, j] = 0.0

    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _coefficients(codes, runs, n_runs, lut, first, coef):  # pragma: no cover - compiled
        # one scope's codes [B, n, bytes] -> coef [B, m, r]: the unit levels of tokens first .. first+m-1
        batch, m = codes.shape[0], coef.shape[1]
        chunks = (m + _CHUNK - 1) // _CHUNK
        for job in prange(batch * chunks):
            b = job // chunks
            lo = first + (job % chunks) * _CHUNK
            hi = min(first + m, lo + _CHUNK)
            _decode_rows(codes[b], runs, n_runs, lut, lo, hi, coef[b, lo - first:])

    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _rope_scores(keys, cos, sin, query, scaling, heads_per_scope, first, scores):  # pragma: no cover
        # keys [S, B, m, W] pre-RoPE (each head's channels as halves: real parts, then imaginary parts)
        # of tokens first .. first+m-1 -> scores [B, H, R, n]
        n_scopes, batch, m = keys.shape[0], keys.shape[1], keys.shape[2]
        rows, head_dim = query.shape[2], query.shape[3]
        half = head_dim // 2
        chunks = (m + _CHUNK - 1) // _CHUNK
        for job in prange(batch * n_scopes * chunks):
            b = job // (n_scopes * chunks)
            s = (job // chunks) % n_scopes
            lo = (job % chunks) * _CHUNK
            rotated = np.empty(head_dim, np.float32)
            for i in range(lo, min(m, lo + _CHUNK)):
                t = first + i
                c, si = cos[b, t], sin[b, t]
                for j in range(heads_per_scope):
                    h = s * heads_per_scope + j
                    key = keys[s, b, i, j * head_dim:(j + 1) * head_dim]
                    for p in range(half):
                        re, im = key[p], key[half + p]
                        rotated[p] = re * c[p] - im * si[p]
                        rotated[half + p] = re * si[p] + im * c[p]
                    for r in range(rows):
                        q = query[b, h, r]
                        dot = np.float32(0.0)
                        for e in range(head_dim):
                            dot += q[e] * rotated[e]
                        scores[b, h, r, t] = dot * scaling

    @njit(cache=True, fastmath=_FASTMATH)
    def _softmax_rows(scores, lse):  # pragma: no cover - compiled
        # scores [R, n] -> probabilities in place, lse [R]
        for r in range(scores.shape[0]):
            row = scores[r]
            top = -np.inf
            for t in range(row.shape[0]):
                top = max(top, row[t])
            if top == -np.inf:  # every token held exact elsewhere: this part contributes nothing
                lse[r] = -np.inf
                row[:] = 0.0
                continue
            total = np.float32(0.0)
            for t in range(row.shape[0]):
                e = np.exp(row[t] - top)
                row[t] = e
                total += e
            lse[r] = top + np.log(total)
            inv = np.float32(1.0) / total
            for t in range(row.shape[0]):
                row[t] *= inv

    @njit(cache=True, fastmath=_FASTMATH)
    def _bin_rows(probs, v_codes, v_bits, n_groups, bins):  # pragma: no cover - compiled
        # probs [R, n], v_codes [n, bytes] -> bins [groups * 2**v_bits, R] (rows last: one cache line)
        rows, n = probs.shape
        entries = 1 << v_bits
        mask = entries - 1
        p = np.empty(rows, np.float32)
        for t in range(n):
            for r in range(rows):
                p[r] = probs[r, t]
            for g in range(n_groups):
                if v_bits == 8:
                    code = np.int32(v_codes[t, g])
                else:
                    bit = g * v_bits
                    at, shift = bit >> 3, bit & 7
                    code = np.int32(v_codes[t, at])
                    if shift + v_bits > 8:
                        code |= np.int32(v_codes[t, at + 1]) << 8
                    code = (code >> shift) & mask
                col = g * entries + code
                for r in range(rows):
                    bins[col, r] += p[r]

    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _value_bins(scores, hidden, v_codes, v_bits, n_groups, bins, lse):  # pragma: no cover - compiled
        # scores [B, H, R, n] -> probabilities; bins [B, H, groups * 2**v_bits, R], lse [B, H, R]
        batch, heads, rows, n = scores.shape
        for job in prange(batch * heads):
            b, h = job // heads, job % heads
            for i in range(hidden.shape[2]):
                for r in range(rows):
                    scores[b, h, r, hidden[b, h, i]] = -np.inf
            _softmax_rows(scores[b, h], lse[b, h])
            _bin_rows(scores[b, h], v_codes[b, h], v_bits, n_groups, bins[b, h])


    @njit(parallel=True, cache=True, fastmath=_FASTMATH)
    def _nearest_codewords(x, codebook_t, c_sq, out):  # pragma: no cover - compiled
        # x [N, g], codebook_t [g, k]: out[i] = argmin_j ||c_j||^2 - 2 x_i.c_j (the first of equal ones)
        n, g = x.shape
        k = codebook_t.shape[1]
        chunks = (n + 1023) // 1024
        for job in prange(chunks):
            dist = np.empty(k, np.float32)
            for i in range(job * 1024, min(n, job * 1024 + 1024)):
                for j in range(k):
                    dist[j] = c_sq[j]
                for e in range(g):
                    w = np.float32(-2.0) * x[i, e]
                    for j in range(k):
                        dist[j] += w * codebook_t[e, j]
                best, arg = dist[0], 0
                for j in range(1, k):
                    if dist[j] < best:
                        best, arg = dist[j], j
                out[i] = arg


_thread_lock = threading.Lock()


def _kernel_threads() -> int:
    """numba's threads for a kernel: one. With torch's two OpenMP threads on a 2-core machine, numba's
    second thread made Shard's decode 1.5x slower (`kvshrink eval cost`, 2K: 410 against 271 ms/token
    with one; docs/results.md, "Session 9"): torch's pool keeps its cores between the batched products
    and the kernels around them."""
    return 1


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().contiguous().numpy()


def _half_split(head_dim: int) -> torch.Tensor:
    """Channel order taking pair order (``re0, im0, re1, im1, ...``) to halves (``re0, re1, ..., im0, im1, ...``)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def code_attention(codes: torch.Tensor, plan, scaled: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, query: torch.Tensor, scaling: float, hidden: torch.Tensor | None,
                   v_codes: torch.Tensor, v_bits: int, n_groups: int,
                   halves: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped ``query [B, H_kv, R, d]`` (float32, channels in RoPE pair order, or with
    ``halves=True`` as two halves, the model's order) over one block of ``n`` coded tokens, on CPU tensors.

    ``codes [B, S, n, bytes]`` uint8 (or the ``S`` scopes' ``[B, n, bytes]`` apart, as the block holds them):
    the packed key codes of the ``S`` PCA scopes, laid out as ``plan``
    (a `codecs.table_decoder.SlotPlan`) says; a token's pre-RoPE key is ``mean[s] + levels @ scaled[s]``
    (``scaled [S, r, W]`` the scaled bases, ``mean [S, W]``, float32, columns in pair order,
    ``W = H_kv * d / S``; with ``halves=True`` in the query's order too); ``cos, sin [B, n, d/2]``: the tokens' RoPE; ``hidden [B, H_kv, m]`` int32:
    rows not attended (or None); ``v_codes [B, H_kv, n, bytes]``: ``n_groups`` value codes of ``v_bits``
    bits per token.

    Returns ``(bins [B, H_kv, R, n_groups * 2**v_bits], lse [B, H_kv, R])``: the softmax probabilities
    summed per value group and codeword, and the log-sum-exp of the scores."""
    batch, heads, rows, d = query.shape
    scopes = [_numpy(c) for c in (codes.unbind(1) if isinstance(codes, torch.Tensor) else codes)]
    n_scopes, n = len(scopes), scopes[0].shape[1]
    heads_per_scope = heads // n_scopes
    if not halves:
        split = _half_split(d)
        columns = torch.cat([j * d + split for j in range(heads_per_scope)])
        scaled, mean, query = scaled[..., columns], mean[:, columns], query[..., split]
    basis, start = scaled.contiguous(), mean.unsqueeze(1).contiguous()
    rank, width = basis.shape[1], basis.shape[2]
    scores = np.empty((batch, heads, rows, n), np.float32)
    bins = np.zeros((batch, heads, n_groups << v_bits, rows), np.float32)
    lse = np.empty((batch, heads, rows), np.float32)
    held = np.zeros((batch, heads, 0), np.int32) if hidden is None else _numpy(hidden.to(torch.int32))
    lut = byte_levels(plan.level_kind, plan.widths)
    q, c, s = _numpy(query), _numpy(cos), _numpy(sin)
    with _thread_lock:  # numba's thread count is process-wide
        numba.set_num_threads(_kernel_threads())
        for first in range(0, n, _SLICE):
            m = min(_SLICE, n - first)
            coef = torch.empty(n_scopes, batch, m, rank)
            for scope, (code, coef_s) in enumerate(zip(scopes, coef.numpy())):
                _coefficients(code, plan.runs[scope], plan.run_counts[scope], lut, first, coef_s)
            keys = torch.baddbmm(start, coef.view(n_scopes, batch * m, rank), basis)
            _rope_scores(keys.view(n_scopes, batch, m, width).numpy(), c, s, q, np.float32(scaling),
                         heads_per_scope, first, scores)
        _value_bins(scores, held, _numpy(v_codes), v_bits, n_groups, bins, lse)
    return torch.from_numpy(bins).transpose(2, 3), torch.from_numpy(lse)


def nearest_codewords(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """int32 index of the nearest row of ``codebook [k, g]`` for each row of ``x [N, g]`` (CPU, float32):
    `codecs.vq.assign_codes` in one pass, no ``N x k`` distance block written to memory."""
    c = codebook.float()
    out = np.empty(x.shape[0], np.int32)
    with _thread_lock:
        numba.set_num_threads(_kernel_threads())
        _nearest_codewords(_numpy(x.float()), _numpy(c.T), _numpy(c.pow(2).sum(1)), out)
    return torch.from_numpy(out)


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
    nearest_codewords(torch.zeros(1, 2), torch.zeros(2, 2))
