"""LRQK's selection from its proxy logits in one compiled pass on the CPU (numba): scaled, padding hidden,
softmaxed per query row, summed per KV row, and the top-k taken with `lrqk.top_k_in_token_order`'s tie rule."""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy, _use_threads
from kvshrink.kernels.cpu.softmax import _softmax_rows

if numba_support.installed():
    from numba import njit, prange

    @njit(cache=True)
    def _ranked(mass):  # pragma: no cover - compiled
        """``mass`` with NaN as +inf: the order ``_top_k`` ranks by (``torch.topk`` takes NaN as the largest)."""
        a = mass.copy()
        for i in range(a.shape[0]):
            if a[i] != a[i]:
                a[i] = np.inf
        return a

    @njit(cache=True)
    def _kth_largest(a, k):  # pragma: no cover - compiled
        """The ``k``-th largest value of ``a`` (no NaN; reordered in place): quickselect with a median-of-three
        pivot (numba's ``np.partition`` takes about twice as long on a decode step's ~2K candidates)."""
        lo, hi, want = 0, a.shape[0] - 1, a.shape[0] - k       # its index in ascending order
        while lo < hi:
            x, y, z = a[lo], a[(lo + hi) >> 1], a[hi]
            pivot = max(min(x, y), min(max(x, y), z))
            i, j = lo, hi
            while i <= j:
                while a[i] < pivot:
                    i += 1
                while a[j] > pivot:
                    j -= 1
                if i <= j:
                    a[i], a[j] = a[j], a[i]
                    i += 1
                    j -= 1
            if want <= j:
                hi = j
            elif want >= i:
                lo = i
            else:
                break
        return a[want]

    @njit(cache=True)
    def _top_k(mass, k, selected, top_mass):  # pragma: no cover - compiled
        """The ``k`` largest of ``mass [n]`` (NaN ranked as +inf; of values tied with the k-th, the last ones, as
        `lrqk.top_k_in_token_order` takes them): their indices into ``selected [k]`` in index order, their values
        into ``top_mass [k]``."""
        ranked = _ranked(mass)
        kth = _kth_largest(ranked.copy(), k)
        skip = -k                 # tied values passed over, the earliest: (above + tied) - k
        for t in range(mass.shape[0]):
            skip += ranked[t] >= kth
        c = 0
        for t in range(mass.shape[0]):
            v = ranked[t]
            if v == kth and skip > 0:
                skip -= 1
            elif v >= kth:
                selected[c] = t
                c += 1
        for j in range(k):
            top_mass[j] = mass[selected[j]]

    @njit(fastmath=_FASTMATH, inline="always")
    def _proxy_top_k_row(h, logits, scaling, first, rows_per_kv, k, selected, top_mass, mass):  # pragma: no cover
        rows = logits[h * rows_per_kv: (h + 1) * rows_per_kv]
        for i in range(rows_per_kv):
            for t in range(rows.shape[1]):
                rows[i, t] = rows[i, t] * scaling if t >= first[h] else -np.inf
        _softmax_rows(rows, np.empty(rows_per_kv, np.float32))      # a row with every candidate hidden: zeros
        mass[h] = 0.0
        for i in range(rows_per_kv):
            for t in range(rows.shape[1]):
                mass[h, t] += rows[i, t]
        _top_k(mass[h], k, selected[h], top_mass[h])

    @njit(cache=True, fastmath=_FASTMATH)
    def _proxy_top_k(logits, scaling, first, rows_per_kv, k, selected, top_mass, mass):  # pragma: no cover
        """Per KV row ``h``: the softmax of its query rows' proxy logits ``logits [H·rows_per_kv, n]`` (scaled, the
        candidates before ``first[h]`` hidden as padding; in place), summed over those rows into ``mass [H, n]``,
        and its ``k`` largest (``_top_k``)."""
        for h in range(mass.shape[0]):
            _proxy_top_k_row(h, logits, scaling, first, rows_per_kv, k, selected, top_mass, mass)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _proxy_top_k_parallel(logits, scaling, first, rows_per_kv, k, selected, top_mass, mass):  # pragma: no cover
        """``_proxy_top_k`` with the KV rows shared among numba's threads (the same numbers)."""
        for h in prange(mass.shape[0]):
            _proxy_top_k_row(h, logits, scaling, first, rows_per_kv, k, selected, top_mass, mass)


def proxy_top_k(logits: torch.Tensor, scaling: float, first: torch.Tensor | None, kv_rows: int, k: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LRQK's selection from its proxy logits in one pass: ``logits [kv_rows·m, n]`` (float32, CPU; the ``m``
    query rows of each KV row together, unscaled, overwritten) scaled, the candidates before ``first [kv_rows]``
    hidden (left padding; None: none), softmaxed per row, summed per KV row into its estimated mass, and the
    ``k`` largest taken. Returns ``(selected [kv_rows, k] int64, top_mass [kv_rows, k], mass [kv_rows, n])``: what
    ``softmax``, ``sum`` and ``lrqk.top_k_in_token_order`` give, up to float rounding (the same tie rule); a NaN
    logit gives its candidate no mass (torch's softmax would give the whole row NaN)."""
    n = logits.shape[1]
    starts = np.zeros(kv_rows, np.int64) if first is None else _numpy_long(first)
    selected = np.empty((kv_rows, k), np.int64)
    top_mass = np.empty((kv_rows, k), np.float32)
    mass = np.empty((kv_rows, n), np.float32)
    kernel = _proxy_top_k_parallel if _use_threads() else _proxy_top_k
    kernel(_numpy(logits), np.float32(scaling), starts, logits.shape[0] // kv_rows, int(k), selected, top_mass,
           mass)
    return torch.from_numpy(selected), torch.from_numpy(top_mass), torch.from_numpy(mass)


def _numpy_long(x: torch.Tensor) -> np.ndarray:
    return x.detach().long().contiguous().numpy()
