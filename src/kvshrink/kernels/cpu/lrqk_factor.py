"""LRQK's per-token decode update in one compiled call (numba), with the torch path as its oracle.

``decode_step`` does what ``lowrank.decode_factor_vectors`` followed by the two
``lowrank.line_search_basis_step`` calls do, for every factor head at once: the closed-form updates of
``q̂``/``k̂`` (float64, ``r x r`` solves by Gaussian elimination with partial pivoting, the same ridge)
and the bases' exact-line-search step. The work is a few
thousand flops per head; in torch it is ~150 small ops per layer and step, which cost ~30x the
arithmetic. ``resident_decode_step`` also makes the sums over the resident tokens (``AᵀA`` and
``(q·K)A``, the only parts that grow with the number of resident tokens) in the same call, reading the
resident rows where they lie (slots chosen last step, the window) instead of gathering them first.

Callers keep the torch functions where numba is missing (``numba_support.available()``). The kernel runs on one
thread per factor head (its work is too small to share further) and is compiled once per machine (``cache=True``;
``warm_up.lrqk`` loads it before anything is timed).
"""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy, _use_threads, scratch

_RIDGE = 1e-9          # lowrank._ridge_solve's relative ridge
_TINY = 1e-30


if numba_support.installed():
    from numba import njit, prange

    @njit(cache=True, fastmath=_FASTMATH)
    def _ridge_solve(lhs, rhs):  # pragma: no cover - compiled
        """``(lhs + ridge·I)⁻¹ rhs`` for ``lhs [n, n]``, ``rhs [n, m]`` (copies; float64)."""
        n, m = lhs.shape[0], rhs.shape[1]
        a = lhs.copy()
        x = rhs.copy()
        scale = 0.0
        for i in range(n):
            scale += abs(a[i, i])
        scale = max(scale / n, _TINY)
        for i in range(n):
            a[i, i] += _RIDGE * scale
        for c in range(n):
            p = c
            for i in range(c + 1, n):
                if abs(a[i, c]) > abs(a[p, c]):
                    p = i
            if p != c:
                for j in range(n):
                    a[c, j], a[p, j] = a[p, j], a[c, j]
                for j in range(m):
                    x[c, j], x[p, j] = x[p, j], x[c, j]
            for i in range(c + 1, n):
                f = a[i, c] / a[c, c]
                if f != 0.0:
                    for j in range(c + 1, n):
                        a[i, j] -= f * a[c, j]
                    for j in range(m):
                        x[i, j] -= f * x[c, j]
        for c in range(n - 1, -1, -1):
            for j in range(m):
                s = x[c, j]
                for i in range(c + 1, n):
                    s -= a[c, i] * x[i, j]
                x[c, j] = s / a[c, c]
        return x

    @njit(cache=True, fastmath=_FASTMATH)
    def _rows_times_rows_t(a, b):  # pragma: no cover - compiled
        """``a @ bᵀ`` for ``a [n, d]``, ``b [m, d]`` (float64)."""
        out = np.zeros((a.shape[0], b.shape[0]))
        for i in range(a.shape[0]):
            for j in range(b.shape[0]):
                s = 0.0
                for t in range(a.shape[1]):
                    s += a[i, t] * b[j, t]
                out[i, j] = s
        return out

    @njit(cache=True, fastmath=_FASTMATH)
    def _gram(a):  # pragma: no cover - compiled
        """``a @ aᵀ`` for ``a [n, d]`` (float64), each pair once (the product is symmetric)."""
        n = a.shape[0]
        out = np.empty((n, n))
        for i in range(n):
            for j in range(i, n):
                s = 0.0
                for t in range(a.shape[1]):
                    s += a[i, t] * a[j, t]
                out[i, j] = s
                out[j, i] = s
        return out

    @njit(cache=True, fastmath=_FASTMATH)
    def _line_search(basis, factors, targets):  # pragma: no cover - compiled
        """``lowrank.line_search_basis_step`` for one head: ``basis [r, d]`` float64, ``factors [G, r]``,
        ``targets [G, d]``; returns the new basis (float64). Every inner loop runs along ``d`` (contiguous,
        so it vectorises)."""
        g_rows, r = factors.shape
        d = basis.shape[1]
        resid = np.empty((g_rows, d))
        for g in range(g_rows):
            for t in range(d):
                resid[g, t] = -targets[g, t]
            for i in range(r):
                f = factors[g, i]
                for t in range(d):
                    resid[g, t] += f * basis[i, t]
        grad = np.zeros((r, d))
        for i in range(r):
            for g in range(g_rows):
                f = factors[g, i]
                for t in range(d):
                    grad[i, t] += f * resid[g, t]
        num = 0.0
        denom = 0.0
        along = np.empty(d)
        for g in range(g_rows):
            along[:] = 0.0
            for i in range(r):
                f = factors[g, i]
                for t in range(d):
                    along[t] += f * grad[i, t]
            for t in range(d):
                num += along[t] * resid[g, t]
                denom += along[t] * along[t]
        step = num / max(denom, _TINY) if denom > 0 else 0.0
        return basis - step * grad

    @njit(fastmath=_FASTMATH, inline="always")
    def _head_step(n, q, k, b_q, b_k, res_lhs, res_rhs, lam, iters, update_bases, q_hat, k_hat):  # pragma: no cover
        """One factor head ``n`` of ``_decode_step`` (``res_lhs [r, r]``, ``res_rhs [G, r]``: its resident sums)."""
        g_rows = q.shape[1]
        r = b_q.shape[1]
        qn = q[n].astype(np.float64)
        kn = k[n:n + 1].astype(np.float64)                       # [1, d]
        bq = b_q[n].astype(np.float64)
        bk = b_k[n].astype(np.float64)
        bq_gram = _gram(bq)
        bk_gram = _gram(bk)
        qk = _rows_times_rows_t(qn, kn)[:, 0]                   # [G] exact q·k
        rhs_base = lam * _rows_times_rows_t(qn, bq) + res_rhs.astype(np.float64)   # [G, r]
        lhs_base = lam * bq_gram + res_lhs.astype(np.float64)
        bk_k = _rows_times_rows_t(bk, kn)                          # [r, 1]
        kh = _ridge_solve(bk_gram, bk_k)[:, 0].copy()
        qh = np.zeros((g_rows, r))
        lhs = np.empty((r, r))
        rhs_t = np.empty((r, g_rows))                              # [r, G]: the solve's right-hand sides
        lhs_k = np.empty((r, r))
        rhs_k = np.empty((r, 1))
        for _ in range(iters):
            for i in range(r):
                for j in range(r):
                    lhs[i, j] = lhs_base[i, j] + kh[i] * kh[j]
                for g in range(g_rows):
                    rhs_t[i, g] = rhs_base[g, i] + qk[g] * kh[i]
            qh = _ridge_solve(lhs, rhs_t).T.copy()
            for i in range(r):
                rhs_k[i, 0] = lam * bk_k[i, 0]
                for j in range(r):
                    lhs_k[i, j] = lam * bk_gram[i, j]
            for g in range(g_rows):
                for i in range(r):
                    rhs_k[i, 0] += qk[g] * qh[g, i]
                    for j in range(r):
                        lhs_k[i, j] += qh[g, i] * qh[g, j]
            kh = _ridge_solve(lhs_k, rhs_k)[:, 0].copy()
        q_hat[n] = qh
        k_hat[n] = kh
        if update_bases:
            b_q[n] = _line_search(bq, qh, qn).astype(np.float32)
            b_k[n] = _line_search(bk, kh.reshape(1, r), kn).astype(np.float32)

    @njit(cache=True, fastmath=_FASTMATH)
    def _decode_step(q, k, b_q, b_k, res_lhs, res_rhs, lam, iters, update_bases, q_hat, k_hat):  # pragma: no cover
        for n in range(q.shape[0]):
            _head_step(n, q, k, b_q, b_k, res_lhs[n], res_rhs[n], lam, iters, update_bases, q_hat, k_hat)

    @njit(cache=True, fastmath=_FASTMATH)
    def _take_resident(q, a, key, column, a_t, scores):  # pragma: no cover - compiled
        """Resident token ``column``: its factor row ``a [r]`` into ``a_t [r, :]``, its scores ``q·key`` into
        ``scores [G, :]``."""
        for i in range(a.shape[0]):
            a_t[i, column] = a[i]
        score_into(q, key, scores, column)

    @njit(fastmath=_FASTMATH, inline="always")
    def score_into(q, key, scores, column):  # pragma: no cover - compiled
        """``scores[g, column] = q[g]·key`` for every query row ``g`` (float32)."""
        for g in range(q.shape[0]):
            acc = np.float32(0.0)
            for j in range(q.shape[1]):
                acc += q[g, j] * key[j]
            scores[g, column] = acc

    @njit(fastmath=_FASTMATH, inline="always")
    def _resident_sums(q, factors, slot_token, slot_chosen, slot_keys, win_keys, win_start, h):  # pragma: no cover
        """``AᵀA [r, r]`` and ``(q·Kᵀ)A [G, r]`` of one factor head (queries ``q [G, d]``, factor rows ``factors
        [n, r]``) over its KV row ``h``'s resident tokens: the slots chosen last step and the window (factor rows
        ``win_start..``). The rows are laid out along tokens first (``a_t [r, n]``, ``scores [G, n]``) so both sums
        are dot products along tokens (vectorised), float32 as the torch path's products."""
        g_rows, r = q.shape[0], factors.shape[1]
        n_slots, n_win = slot_token.shape[1], win_keys.shape[1]
        a_t = np.empty((r, n_slots + n_win), np.float32)
        scores = np.empty((g_rows, n_slots + n_win), np.float32)
        m = 0
        for s in range(n_slots):
            t = slot_token[h, s]
            if slot_chosen[h, s] and t >= 0:
                _take_resident(q, factors[t], slot_keys[h, s], m, a_t, scores)
                m += 1
        for w in range(n_win):
            _take_resident(q, factors[win_start + w], win_keys[h, w], m, a_t, scores)
            m += 1
        return resident_gram_sums(a_t, scores, m)

    @njit(fastmath=_FASTMATH, inline="always")
    def resident_gram_sums(a_t, scores, m):  # pragma: no cover - compiled
        """``AᵀA [r, r]`` and ``(q·Kᵀ)A [G, r]`` over the first ``m`` resident tokens, laid along tokens (factor rows
        ``a_t [r, n]``, scores ``scores [G, n]``): dot products along tokens (vectorised), float32 as the torch
        path's products."""
        r, g_rows = a_t.shape[0], scores.shape[0]
        lhs = np.empty((r, r), np.float32)
        rhs = np.empty((g_rows, r), np.float32)
        for i in range(r):
            for j in range(i, r):
                acc = np.float32(0.0)
                for c in range(m):
                    acc += a_t[i, c] * a_t[j, c]
                lhs[i, j] = acc
                lhs[j, i] = acc
        for g in range(g_rows):
            for i in range(r):
                acc = np.float32(0.0)
                for c in range(m):
                    acc += scores[g, c] * a_t[i, c]
                rhs[g, i] = acc
        return lhs, rhs

    @njit(cache=True, fastmath=_FASTMATH)
    def _resident_decode_step(q, k, b_q, b_k, factors, slot_token, slot_chosen, slot_keys, win_keys, win_start,
                              copies, lam, iters, update_bases, q_hat, k_hat):  # pragma: no cover - compiled
        """``_decode_step`` with each head's resident sums (``_resident_sums``) made here; factor head ``n``
        reads KV row ``n // copies``."""
        for n in range(q.shape[0]):
            lhs, rhs = _resident_sums(q[n], factors[n], slot_token, slot_chosen, slot_keys, win_keys, win_start,
                                      n // copies)
            _head_step(n, q, k, b_q, b_k, lhs, rhs, lam, iters, update_bases, q_hat, k_hat)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _resident_decode_step_parallel(q, k, b_q, b_k, factors, slot_token, slot_chosen, slot_keys, win_keys,
                                       win_start, copies, lam, iters, update_bases, q_hat,
                                       k_hat):  # pragma: no cover - compiled
        """``_resident_decode_step`` with the factor heads shared among numba's threads (each head's work is
        independent: the same numbers as the serial kernel)."""
        for n in prange(q.shape[0]):
            lhs, rhs = _resident_sums(q[n], factors[n], slot_token, slot_chosen, slot_keys, win_keys, win_start,
                                      n // copies)
            _head_step(n, q, k, b_q, b_k, lhs, rhs, lam, iters, update_bases, q_hat, k_hat)


def decode_step(query: torch.Tensor, key: torch.Tensor, b_q: torch.Tensor, b_k: torch.Tensor,
                resident_lhs: torch.Tensor, resident_rhs: torch.Tensor, lam: float, update_bases: bool,
                iters: int = 2, in_place: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q̂ [N, G, r]`` and ``k̂ [N, r]`` (float64) of one new token, and the bases after the
    line-search step (new float32 ``[N, r, d]`` tensors; the given ones when not ``update_bases``).
    ``in_place``: contiguous float32 bases take the step in place and are returned (a decode step's
    owner saves two copies per layer); other bases are copied as without it.

    CPU tensors: ``query [N, G, d]``, ``key [N, d]``, bases ``b_q``/``b_k`` ``[N, r, d]``;
    ``resident_lhs [N, r, r]`` = ``AᵀA`` and ``resident_rhs [N, G, r]`` = ``(q·Kᵀ)A`` over the
    resident tokens (zeros for none)."""
    n, g, _ = query.shape
    r = b_q.shape[1]
    q_hat = np.empty((n, g, r))
    k_hat = np.empty((n, r))
    new_b_q, new_b_k = (b if in_place and _is_kernel_basis(b) else _basis_copy(b) for b in (b_q, b_k))
    _decode_step(_array(query), _array(key), new_b_q.numpy(), new_b_k.numpy(), _array(resident_lhs),
                 _array(resident_rhs), float(lam), int(iters), bool(update_bases), q_hat, k_hat)
    if not update_bases:
        new_b_q, new_b_k = b_q, b_k
    return torch.from_numpy(q_hat), torch.from_numpy(k_hat), new_b_q, new_b_k


def resident_decode_step(query: torch.Tensor, key: torch.Tensor, b_q: torch.Tensor, b_k: torch.Tensor,
                         factors: torch.Tensor, slot_token: torch.Tensor, slot_chosen: torch.Tensor,
                         slot_keys: torch.Tensor, window_keys: torch.Tensor, window_start: int, copies: int,
                         lam: float, update_bases: bool, iters: int = 2
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``decode_step`` with the resident tokens' sums made in the same compiled call (saves the ~15 torch
    ops that gather and multiply them). Contiguous float32 bases take the step in place.

    ``factors [N, n, r]``: every token's key factors per factor head; the resident tokens are those of the
    slots ``slot_chosen [R, S]`` marks (token ``slot_token [R, S]``, key ``slot_keys [R, S, d]``) and the window
    (keys ``window_keys [R, W, d]``, factor rows ``window_start .. window_start + W - 1``); factor head ``n``
    reads row ``n // copies`` (R = N / copies). Float tensors are read as float32."""
    n, g, _ = query.shape
    r = b_q.shape[1]
    q_hat = np.empty((n, g, r))
    k_hat = np.empty((n, r))
    new_b_q, new_b_k = (b if _is_kernel_basis(b) else _basis_copy(b) for b in (b_q, b_k))
    kernel = _resident_decode_step_parallel if _use_threads() else _resident_decode_step
    kernel(_array(query), _array(key), new_b_q.numpy(), new_b_k.numpy(), _array(factors),
           slot_token.contiguous().numpy(), slot_chosen.contiguous().numpy(), _floats("lrqk slot keys", slot_keys),
           _floats("lrqk window keys", window_keys), int(window_start), int(copies), float(lam), int(iters), bool(update_bases), q_hat,
           k_hat)
    if not update_bases:
        new_b_q, new_b_k = b_q, b_k
    return torch.from_numpy(q_hat), torch.from_numpy(k_hat), new_b_q, new_b_k


def _is_kernel_basis(b: torch.Tensor) -> bool:
    return b.dtype == torch.float32 and b.is_contiguous() and not b.requires_grad


def _basis_copy(b: torch.Tensor) -> torch.Tensor:
    return b.detach().float().clone(memory_format=torch.contiguous_format)


def _array(x: torch.Tensor) -> np.ndarray:
    return _numpy(x if x.dtype == torch.float32 else x.float())


def _floats(name: str, x: torch.Tensor) -> np.ndarray:
    """``x`` as float32 numpy: itself if it is, else converted into the scratch buffer ``name`` (a few hundred KB
    per layer and step: a fresh allocation of that size is mapped and faulted in page by page)."""
    if x.dtype == torch.float32:
        return _numpy(x)
    return scratch(name, tuple(x.shape)).copy_(x).numpy()
