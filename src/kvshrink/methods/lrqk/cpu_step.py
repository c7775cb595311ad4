"""LRQK's whole CPU decode step for one layer in one compiled call (numba), ``kernel="fast"``'s default path.

Per KV row (one KV head of one batch row; rows are independent, so numba's threads share them), in the
order of ``LRQKLayer``'s reference path:

1. the scores ``q·k`` of the tokens resident before the step (slots, window), read from their float16 words;
2. the factor update (``kernels.cpu.lrqk_factor._head_step``) over the resident sums made from those scores;
3. the proxy scores ``q̂·A_K`` of every candidate, their softmax summed over the group, the top-k
   (``kernels.cpu.lrqk_proxy._proxy_top_k_row``: the same tie rule);
4. the slot fill (``tiers.plan_fill_row``: the ``set`` policy's slots), the missing rows read from the
   slow tier and narrowed into the slots;
5. exact attention over the selected slots, the window and the new token. A slot whose token stayed keeps
   the score of step 1 (the same query, the same key): only the rows that entered are scored again;
6. once every row has attended, the new token stored: the windows shifted, its key factors written, its
   K/V into the slow tier's next row (``LRQKLayer.commit``'s work on the path this one replaces).

What each step reads stays in the core's caches between steps; the per-phase path reads the slots' keys and
the factors as float32 copies made first, and calls six kernels with tensor ops between them.

``LRQKLayer._compiled_layout`` says where it applies (numba; a CPU layer in its default layout: float16 slots, window and
factors with room for the new token's, a float32 slow tier in host memory, factors per KV head, the ``set``
policy without prefetch);
everywhere else the layer keeps its per-phase path. Oracle: ``tests/test_lrqk_fast.py`` (the reference
path), the same tokens and data movement.
"""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.methods.lrqk.tiers import _F32_FP16_OVERFLOW_BITS, _F32_INF_BITS

__all__ = ["decode_step", "warm_up"]

# float16 words widened to float32 at a time: a 16 KB tile that stays in L1 while it is read (whole float32 copies
# of a row's slots, window and factors, ~450 KB at 2K, cost ~1.2 ms per 2K decode step in a model, measured)
TILE_WORDS = 4096

if numba_support.installed():
    from numba import njit, prange

    from kvshrink.kernels.cpu.half_words import _HALF_POW2, _widen_rows, narrow_row
    from kvshrink.kernels.cpu.lrqk_factor import _head_step, resident_gram_sums, score_into
    from kvshrink.kernels.cpu.lrqk_proxy import _proxy_top_k_row
    from kvshrink.kernels.cpu.numba_support import _FASTMATH, prefetch_row
    from kvshrink.kernels.cpu.softmax import _softmax_rows
    from kvshrink.methods.lrqk.tiers import _shift_in_narrowed, plan_fill_row

    @njit(inline="always")
    def _tile_rows(width, tile_words):  # pragma: no cover - compiled
        return max(1, tile_words // width)

    @njit(inline="always")
    def _new_tile(width, tile_words):  # pragma: no cover - compiled
        """A tile of ``tile_words`` float32 words (whole rows of ``width``): its row count, its bits, its values."""
        tile = np.empty((_tile_rows(width, tile_words), width), np.uint32)
        return tile.shape[0], tile, tile.view(np.float32)

    @njit(inline="always")
    def _widen_tile(words, t0, n, pow2, tile):  # pragma: no cover - compiled
        """Rows ``t0 ..`` of float16 words ``words`` (up to ``n`` and the tile's size) widened into ``tile``; how many."""
        m = min(tile.shape[0], n - t0)
        _widen_rows(words[t0: t0 + m], m, False, pow2, tile)
        return m

    @njit(fastmath=_FASTMATH, inline="always")
    def _score_rows(q, words, n, live, pow2, tile_words, scores, column):  # pragma: no cover - compiled
        """``scores[g, column + s] = q[g]·key_s`` for the first ``n`` rows of float16 words ``words [*, d]`` where
        ``live[s]`` (others untouched), widened ``tile_words`` at a time (a tile that stays in L1 while it is read)."""
        step, tile, keys = _new_tile(words.shape[1], tile_words)
        for s0 in range(0, n, step):
            for i in range(_widen_tile(words, s0, n, pow2, tile)):
                if live[s0 + i]:
                    score_into(q, keys[i], scores, column + s0 + i)

    @njit(fastmath=_FASTMATH, inline="always")
    def _add_values(probs, column, words, n, pow2, tile_words, total):  # pragma: no cover - compiled
        """``total [G, d] += probs[:, column + t] · value_t`` over the first ``n`` rows of float16 words ``words
        [*, d]``, widened a tile at a time."""
        g_rows, d = total.shape
        step, tile, values = _new_tile(d, tile_words)
        for t0 in range(0, n, step):
            for i in range(_widen_tile(words, t0, n, pow2, tile)):
                for g in range(g_rows):
                    p = probs[g, column + t0 + i]
                    for j in range(d):
                        total[g, j] += p * values[i, j]

    @njit(fastmath=_FASTMATH, inline="always")
    def _resident_fit_sums(q, a_words, token, chosen, win_start, slot_scores, win_scores, pow2):  # pragma: no cover
        """``AᵀA [r, r]`` and ``(q·Kᵀ)A [G, r]`` over Ω (the slots chosen last step, then the window), from the
        scores already made and the factor rows' float16 words ``a_words [n, r]``: the sums
        ``kernels.cpu.lrqk_factor._resident_sums`` makes."""
        g_rows, n_slots, n_win, r = q.shape[0], token.shape[0], win_scores.shape[1] - 1, a_words.shape[1]
        a_t = np.empty((r, n_slots + n_win), np.float32)
        scores = np.empty((g_rows, n_slots + n_win), np.float32)
        row = np.empty((1, r), np.uint32)
        factor = row[0].view(np.float32)
        m = 0
        for c in range(n_slots + n_win):
            if c < n_slots:
                t = token[c]
                if not chosen[c] or t < 0:
                    continue
            else:
                t = win_start + c - n_slots
            _widen_rows(a_words[t: t + 1], 1, False, pow2, row)
            for i in range(r):
                a_t[i, m] = factor[i]
            for g in range(g_rows):
                scores[g, m] = slot_scores[g, c] if c < n_slots else win_scores[g, c - n_slots]
            m += 1
        return resident_gram_sums(a_t, scores, m)

    @njit(fastmath=_FASTMATH, inline="always")
    def _proxy_logits(q_hat, a_words, n, pow2, tile_words, logits):  # pragma: no cover - compiled
        """``logits [G, n]`` = ``q̂`` (float64, taken as float32 as the torch path does) times the first ``n``
        factor rows, read from their float16 words ``a_words [*, r]`` a tile at a time (widened as one flat run:
        rows of 16 words are too short to vectorise alone)."""
        r = q_hat.shape[1]
        qf = q_hat.astype(np.float32)
        step = _tile_rows(r, tile_words)
        tile = np.empty((1, step * r), np.uint32)
        factors = tile.view(np.float32).reshape((step, r))
        for t0 in range(0, n, step):
            m = min(step, n - t0)
            _widen_rows(a_words[t0: t0 + m].reshape((1, m * r)), 1, False, pow2, tile)
            for i in range(m):
                for g in range(qf.shape[0]):
                    acc = np.float32(0.0)
                    for c in range(r):
                        acc += qf[g, c] * factors[i, c]
                    logits[g, t0 + i] = acc

    @njit(cache=True, fastmath=_FASTMATH)
    def _row_step(h, q, k_new, v_new, b_q, b_k, a_words, a_len, token, score, chosen, slot_k, slot_v, win_k, win_v,
                  slow, span, candidates, k, first, past, scaling, lam, iters, update_bases, fit_resident, pow2, tile_words,
                  logits, mass, selected, top_mass, q_hat, k_hat, out, missed, largest):  # pragma: no cover - compiled
        g_rows, d = q.shape[1], q.shape[2]
        capacity, n_win = token.shape[1], win_k.shape[1]
        qh = q[h]
        if fit_resident:       # the fit's factor rows, scattered, arrive while the scores are made
            for s in range(capacity):
                if chosen[h, s] and token[h, s] >= 0:
                    prefetch_row(a_words, h, token[h, s])
        # 1. the scores of what is resident before the fill (the fit's Ω and most of this step's attention)
        slot_scores = np.empty((g_rows, capacity), np.float32)
        _score_rows(qh, slot_k[h], capacity, token[h] >= 0, pow2, tile_words, slot_scores, 0)
        win_scores = np.empty((g_rows, n_win + 1), np.float32)
        _score_rows(qh, win_k[h], n_win, np.ones(n_win, np.bool_), pow2, tile_words, win_scores, 0)
        score_into(qh, k_new[h], win_scores, n_win)
        # 2. the factor update
        if fit_resident:
            lhs, rhs = _resident_fit_sums(qh, a_words[h], token[h], chosen[h], a_len - n_win, slot_scores,
                                          win_scores, pow2)
        else:
            lhs, rhs = np.zeros((b_q.shape[1], b_q.shape[1]), np.float32), np.zeros((g_rows, b_q.shape[1]), np.float32)
        _head_step(h, q, k_new, b_q, b_k, lhs, rhs, lam, iters, update_bases, q_hat, k_hat)
        # 3. the selection
        _proxy_logits(q_hat[h], a_words[h], candidates, pow2, tile_words, logits[h * g_rows: (h + 1) * g_rows])
        _proxy_top_k_row(h, logits, scaling, first, g_rows, k, selected, top_mass, mass)
        # 4. the fill: the missing rows narrowed from the slow tier's float32 words into their slots
        entered = np.empty(k, np.int64)
        m = plan_fill_row(h, token, score, selected[h], chosen, np.full(span + 1, -1, np.int64),
                          np.zeros(span + 1, np.bool_), np.empty(capacity, np.float64), entered)
        for i in range(m):          # the rows' reads overlap instead of waiting on each other
            prefetch_row(slow, token[h, entered[i]], h)
        top = 0
        row = np.empty((1, d), np.uint32)
        for i in range(m):
            s = entered[i]
            src = slow[token[h, s], h]
            top = max(top, narrow_row(src[0], slot_k[h, s]), narrow_row(src[1], slot_v[h, s]))
            _widen_rows(slot_k[h, s: s + 1], 1, False, pow2, row)
            score_into(qh, row[0].view(np.float32), slot_scores, s)
        missed[h], largest[h] = m, top
        # 5. attention over the chosen slots, the window and the new token (hidden: before `first`, left padding)
        n_all = capacity + n_win + 1
        probs = np.empty((g_rows, n_all), np.float32)
        for s in range(capacity):
            visible = chosen[h, s] and token[h, s] >= first[h]
            for g in range(g_rows):
                probs[g, s] = slot_scores[g, s] * scaling if visible else -np.inf
        for w in range(n_win + 1):
            visible = past - n_win + w >= first[h]
            for g in range(g_rows):
                probs[g, capacity + w] = win_scores[g, w] * scaling if visible else -np.inf
        _softmax_rows(probs, np.empty(g_rows, np.float32))
        total = np.zeros((g_rows, d), np.float32)
        _add_values(probs, 0, slot_v[h], capacity, pow2, tile_words, total)
        _add_values(probs, capacity, win_v[h], n_win, pow2, tile_words, total)
        for g in range(g_rows):
            p = probs[g, n_all - 1]
            for j in range(d):
                out[h, g, j] = total[g, j] + p * v_new[h, j]

    @njit(cache=True)
    def _store_token(k_new, v_new, a_words, a_len, win_k, win_v, slow, span, k_hat, largest):  # pragma: no cover
        """The step's token stored once every row has attended (``LRQKLayer.commit``'s work): unless a slot row
        overflowed (``largest``), the windows shifted and the key factors written (``_shift_in_narrowed``: nothing
        on overflow), then its float32 words into the slow tier's row ``span``. Returns the largest word narrowed
        (0: nothing tried)."""
        for h in range(largest.shape[0]):     # row by row: a NaN's word, larger, must not hide an overflow
            if _F32_FP16_OVERFLOW_BITS <= largest[h] <= _F32_INF_BITS:
                return 0
        top = _shift_in_narrowed(k_new, v_new, win_k, win_v, k_hat, a_words, a_len)
        if _F32_FP16_OVERFLOW_BITS <= top <= _F32_INF_BITS:
            return top
        key_words, value_words = k_new.view(np.uint32), v_new.view(np.uint32)
        for h in range(k_new.shape[0]):
            slow[span, h, 0] = key_words[h]
            slow[span, h, 1] = value_words[h]
        return top

    @njit(inline="always")
    def _step_scratch(rows, g_rows, candidates, k):  # pragma: no cover - compiled
        """The step's per-row working arrays (allocated here: a dozen Python-side allocations cost more)."""
        return (np.empty((rows * g_rows, candidates), np.float32), np.empty((rows, candidates), np.float32),
                np.empty((rows, k), np.int64), np.empty((rows, k), np.float32), np.empty(rows, np.int64),
                np.empty(rows, np.int64))

    @njit(inline="always")
    def _step_result(missed, largest, stored):  # pragma: no cover - compiled
        """``(rows read from the slow tier, the first word narrowed beyond float16's range: a filled row's, else the
        new token's; 0 for none)``."""
        for h in range(largest.shape[0]):
            if _F32_FP16_OVERFLOW_BITS <= largest[h] <= _F32_INF_BITS:
                return missed.sum(), largest[h]
        return missed.sum(), stored if _F32_FP16_OVERFLOW_BITS <= stored <= _F32_INF_BITS else 0

    @njit(cache=True, fastmath=_FASTMATH)
    def _decode_step(q, k_new, v_new, b_q, b_k, a_words, a_len, token, score, chosen, slot_k, slot_v, win_k, win_v,
                     slow, span, candidates, k, first, past, scaling, lam, iters, update_bases, fit_resident, pow2,
                     tile_words, q_hat, k_hat, out):  # pragma: no cover - compiled
        logits, mass, selected, top_mass, missed, largest = _step_scratch(q.shape[0], q.shape[1], candidates, k)
        for h in range(q.shape[0]):
            _row_step(h, q, k_new, v_new, b_q, b_k, a_words, a_len, token, score, chosen, slot_k, slot_v, win_k,
                      win_v, slow, span, candidates, k, first, past, scaling, lam, iters, update_bases, fit_resident, pow2,
                      tile_words, logits, mass, selected, top_mass, q_hat, k_hat, out, missed, largest)
        stored = _store_token(k_new, v_new, a_words, a_len, win_k, win_v, slow, span, k_hat, largest)
        return _step_result(missed, largest, stored)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _decode_step_parallel(q, k_new, v_new, b_q, b_k, a_words, a_len, token, score, chosen, slot_k, slot_v, win_k,
                              win_v, slow, span, candidates, k, first, past, scaling, lam, iters, update_bases, fit_resident,
                              pow2, tile_words, q_hat, k_hat, out):  # pragma: no cover - compiled
        """``_decode_step`` with the KV rows shared among numba's threads (the same numbers)."""
        logits, mass, selected, top_mass, missed, largest = _step_scratch(q.shape[0], q.shape[1], candidates, k)
        for h in prange(q.shape[0]):
            _row_step(h, q, k_new, v_new, b_q, b_k, a_words, a_len, token, score, chosen, slot_k, slot_v, win_k,
                      win_v, slow, span, candidates, k, first, past, scaling, lam, iters, update_bases, fit_resident, pow2,
                      tile_words, logits, mass, selected, top_mass, q_hat, k_hat, out, missed, largest)
        stored = _store_token(k_new, v_new, a_words, a_len, win_k, win_v, slow, span, k_hat, largest)
        return _step_result(missed, largest, stored)


def decode_step(query: np.ndarray, key: np.ndarray, value: np.ndarray, b_q: np.ndarray, b_k: np.ndarray,
                factor_words: np.ndarray, a_len: int, token: np.ndarray, score: np.ndarray, chosen: np.ndarray,
                slot_words: tuple[np.ndarray, np.ndarray], window_words: tuple[np.ndarray, np.ndarray],
                slow_words: np.ndarray, candidates: int, k: int, first: np.ndarray, past: int, scaling: float,
                lam: float, update_bases: bool, fit_resident: bool, iters: int = 2):
    """One layer's decode step (module docstring), the new token stored last. Arrays, all CPU and updated in place
    where they are state:

    ``query [R, G, d]``, ``key``/``value [R, d]`` float32 (the new token); bases ``b_q``/``b_k [R, r, d]`` float32
    (the line-search step in place); ``factor_words [R, cap, r]`` (float16 words; rows ``a_len - W ..`` are the
    window's, row ``a_len`` takes the new token's); the slots' ``token``/``score``/``chosen [R, S]`` and
    ``slot_words`` (keys, values ``[R, S, d]`` float16 words); ``window_words`` (``[R, W, d]``); ``slow_words
    [T + 1, R, 2, d]`` (the slow tier's float32 words: its ``T`` tokens and room for the new one); ``first [R]``: the
    first real token of each row (left padding before it).

    Returns ``(out [R, G, d] float32, q_hat [R, G, r], k_hat [R, r] float64, missed, beyond)``: the attention
    output, the factor vectors, the rows read from the slow tier (all rows), and the first float32 word narrowed to
    float16 beyond its range (a filled row's, else the new token's; 0 for none: the caller raises with it, as the
    per-phase path does). The token is not stored when a filled row or the token itself overflowed."""
    rows, g, d = query.shape
    r = b_q.shape[1]
    out = np.empty((rows, g, d), np.float32)
    q_hat, k_hat = np.empty((rows, g, r)), np.empty((rows, r))
    kernel = _decode_step_parallel if numba_support._use_threads() else _decode_step
    missed, beyond = kernel(query, key, value, b_q, b_k, factor_words, int(a_len), token, score, chosen, *slot_words,
                    *window_words, slow_words, slow_words.shape[0] - 1, int(candidates), int(k), first, int(past),
                    np.float32(scaling), float(lam), int(iters), bool(update_bases), bool(fit_resident), _HALF_POW2,
                    int(TILE_WORDS), q_hat, k_hat, out)
    return out, q_hat, k_hat, missed, beyond


def warm_up() -> None:
    """Compile (or load from numba's cache) the step now, on a tiny layer: the serial or the parallel variant,
    whichever the current thread count runs (the other is compiled on first use if the count changes)."""
    if not numba_support.available():
        return
    half = np.zeros((1, 2, 2), np.uint16)
    decode_step(np.ones((1, 1, 2), np.float32), np.ones((1, 2), np.float32), np.ones((1, 2), np.float32),
                np.eye(1, 2, dtype=np.float32)[None].copy(), np.eye(1, 2, dtype=np.float32)[None].copy(),
                np.zeros((1, 4, 1), np.uint16), 3, np.array([[0, -1]]), np.zeros((1, 2), np.float32),
                np.zeros((1, 2), np.bool_), (half.copy(), half.copy()), (half[:, :1].copy(), half[:, :1].copy()),
                np.zeros((4, 1, 2, 2), np.uint32), 2, 1, np.zeros(1, np.int64), 3, 1.0, 1.0, True, True)
