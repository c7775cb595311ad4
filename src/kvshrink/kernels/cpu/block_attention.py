"""Attention over one block of Shard's compressed middle, straight from its packed codes (numba, CPU).

`code_attention` answers one block without materialising the block's keys or values, a slice of tokens at a time:

1. per token: its PCA coefficients decoded from its packed key codes (one lookup per byte of a 2-, 4- or
   8-bit run, from a table of the levels each byte value packs: `levels.byte_levels`; four 6-bit codes per three
   bytes);
2. the slice's pre-RoPE keys as one batched product of the scaled bases with those coefficients
   (torch's BLAS: the multiply-adds run at the machine's vector width, which hand-written loops
   over lookup tables did not reach, nor numba loops over L1-sized tiles of decoded coefficients, 2-2.5x
   slower than the BLAS product: ``docs/tried.md``), channel-major, kept only for
   the slice;
3. per tile of tokens: RoPE and the scores of four query rows at a time, one RoPE pair after another,
   each a loop over the tile's tokens (contiguous: it vectorises across tokens);
4. in one call: the softmax of all the block's scores (held rows masked; one pass a row, exp as a
   polynomial the loop vectorises), then per KV head its probabilities summed per value codeword and channel
   group (the value VQ codes) and, for a decode step (`step_parts.StepParts.code`), turned into the attention
   output (one small product by the codebook, scales, rotation).

Keys coded at their frames' positions (Shard's ``rope_frame``) skip steps 2 and 3: each frame's query rows are
turned back by its RoPE and projected on the bases once (`frame_projection`), and a token's scores are products of
its coefficients with its frame's projections (no key is rebuilt).

Steps 1, 3 and 4 and the projection have parallel variants (token chunks, tiles, heads) that run when torch has more than one
thread and numba's threading layer is OpenMP or TBB (a loop starts in ~2 us; its work queue, ~150 us a call,
would cost more than it splits: ``docs/tried.md``), on as many numba threads as torch's; the others are serial,
on the calling thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvshrink.codecs.pca import PCACode
from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.levels import byte_levels
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy, _use_threads, scratch
from kvshrink.kernels.cpu.softmax import _softmax_rows

# Tokens whose coefficients and keys are held at once (their keys stay in the core's cache: ~0.8 MB for
# three 64-channel scopes; 512..2048 measured within 5% at 8K).
_SLICE = 1024
# Tokens whose scores, keys and RoPE are worked on at once (a few KB each, in L1).
_TOKEN_TILE = 256
# Spare coefficient columns past the rank (an even row length: rows split into 8-byte words).
_SPARE = 4
# Rows of coefficients a thread decodes at once (a slice in a few chunks: each thread's share stays contiguous).
_DECODE_CHUNK = 256
_NO_ROWS = np.zeros(0, np.int64)
_NO_COLUMN = np.zeros((0, 0, 1), np.float32)


if numba_support.installed():
    import numba
    from numba import njit

    @njit(fastmath=_FASTMATH, inline="always")
    def _decode_rows(codes, runs, n_runs, lut, lut64, first, out, out64, lo, hi):  # pragma: no cover - compiled
        # rows lo .. hi-1 of tokens first .. first+m-1 of one scope's codes [n, bytes] -> out [m, r + spare]: each
        # component's unit level, exactly the components' columns written (out64: out as 8-byte words, two levels at
        # once where a 4- or 2-bit run starts at an even column); zeros past the runs. Run by run, every token in
        # each: the loops over a run's bytes then have one body and one trip count (token by token, with a branch
        # per run inside, took twice as long at 8K)
        rank = out.shape[1] - _SPARE
        top = 0
        for k in range(n_runs):
            top = max(top, runs[k, 1] + runs[k, 2])
        for k in range(n_runs):
            bits, a, n_codes, at = runs[k, 0], runs[k, 1], runs[k, 2], runs[k, 3]
            base = (bits - 1) * 256
            whole = 0                                   # codes decoded by the run's fast loop
            if bits == 8:
                whole = n_codes
                for i in range(lo, hi):
                    row, o = codes[first + i], out[i]
                    for c in range(n_codes):
                        o[a + c] = lut[base + row[at + c], 0]
            elif (bits == 4 or bits == 2) and a % 2 == 0:
                per = 8 // bits                         # a byte's codes: one or two 8-byte words of levels
                whole = n_codes // per * per
                if per == 2:
                    for i in range(lo, hi):
                        row, o64 = codes[first + i], out64[i]
                        for c in range(n_codes // 2):
                            o64[a // 2 + c] = lut64[base + row[at + c], 0]
                else:
                    for i in range(lo, hi):
                        row, o64 = codes[first + i], out64[i]
                        for c in range(n_codes // 4):
                            entry = base + row[at + c]
                            o64[a // 2 + 2 * c] = lut64[entry, 0]
                            o64[a // 2 + 2 * c + 1] = lut64[entry, 1]
            elif bits == 6:                             # four codes in every three bytes, no branch
                whole = n_codes // 4 * 4
                for i in range(lo, hi):
                    row, o = codes[first + i], out[i]
                    for c in range(n_codes // 4):
                        p = at + 3 * c
                        x = np.int32(row[p]) | (np.int32(row[p + 1]) << 8) | (np.int32(row[p + 2]) << 16)
                        o[a + 4 * c] = lut[base + (x & 63), 0]
                        o[a + 4 * c + 1] = lut[base + ((x >> 6) & 63), 0]
                        o[a + 4 * c + 2] = lut[base + ((x >> 12) & 63), 0]
                        o[a + 4 * c + 3] = lut[base + ((x >> 18) & 63), 0]
            if whole < n_codes:                         # the rest one code at a time (it may straddle bytes)
                mask = (1 << bits) - 1
                for i in range(lo, hi):
                    row, o = codes[first + i], out[i]
                    for c in range(whole, n_codes):
                        bit = c * bits
                        byte, shift = at + (bit >> 3), bit & 7
                        v = np.int32(row[byte])
                        if shift + bits > 8:
                            v |= np.int32(row[byte + 1]) << 8
                        o[a + c] = lut[base + ((v >> shift) & mask), 0]
        for i in range(lo, hi):
            for j in range(top, rank):
                out[i, j] = 0.0

    @njit(cache=True, fastmath=_FASTMATH)
    def _decode_scopes(scopes, runs, n_runs, lut, lut64, first, out, out64):  # pragma: no cover - compiled
        # `_decode_rows` of every scope (a tuple of codes [B, n, bytes]) and batch row: out [S, B, m, r + spare]
        # (one call per slice of the block, not one per scope and row)
        for s in range(len(scopes)):
            for b in range(out.shape[1]):
                _decode_rows(scopes[s][b], runs[s], n_runs[s], lut, lut64, first, out[s, b], out64[s, b], 0,
                             out.shape[2])

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _decode_scopes_parallel(scopes, runs, n_runs, lut, lut64, first, out, out64):  # pragma: no cover
        # `_decode_scopes`, each scope's and row's tokens in _DECODE_CHUNK-token chunks on numba's threads
        n_scopes, batch, m = out.shape[0], out.shape[1], out.shape[2]
        chunks = (m + _DECODE_CHUNK - 1) // _DECODE_CHUNK
        for job in numba.prange(n_scopes * batch * chunks):
            s, rest = job // (batch * chunks), job % (batch * chunks)
            b, lo = rest // chunks, (rest % chunks) * _DECODE_CHUNK
            _decode_rows(scopes[s][b], runs[s], n_runs[s], lut, lut64, first, out[s, b], out64[s, b], lo,
                         min(m, lo + _DECODE_CHUNK))

    @njit(cache=True, fastmath=_FASTMATH, inline="always")
    def _pair_scores(re_row, im_row, re_mean, im_mean, c, s, q, p, half, acc, w):  # pragma: no cover - compiled
        # one RoPE pair's share of four query rows' scores over w tokens: re/im rows and c/s their channel and
        # RoPE, contiguous over tokens (the loop vectorises across tokens)
        qa0, qb0, qa1, qb1 = q[0, p], q[0, half + p], q[1, p], q[1, half + p]
        qa2, qb2, qa3, qb3 = q[2, p], q[2, half + p], q[3, p], q[3, half + p]
        o0, o1, o2, o3 = acc[0], acc[1], acc[2], acc[3]
        for i in range(w):
            re = re_row[i] + re_mean
            im = im_row[i] + im_mean
            u = re * c[i] - im * s[i]
            v = re * s[i] + im * c[i]
            o0[i] += qa0 * u + qb0 * v
            o1[i] += qa1 * u + qb1 * v
            o2[i] += qa2 * u + qb2 * v
            o3[i] += qa3 * u + qb3 * v

    @njit(fastmath=_FASTMATH, inline="always")
    def _tile_scores(job, keys_t, mean, cos_t, sin_t, rows, q4, heads_per_scope, first, m, scores):  # pragma: no cover
        # `_block_scores` of one tile of TOKEN_TILE tokens of one batch row (job = row * tiles + tile)
        n_scopes = keys_t.shape[0]
        _, heads, groups, _, head_dim = q4.shape
        n_rows = scores.shape[2]
        half = head_dim // 2
        n_tiles = (m + _TOKEN_TILE - 1) // _TOKEN_TILE
        b, lo = job // n_tiles, job % n_tiles * _TOKEN_TILE
        acc = np.empty((4, _TOKEN_TILE), np.float32)
        c_tile = np.empty((half, _TOKEN_TILE), np.float32)
        s_tile = np.empty((half, _TOKEN_TILE), np.float32)
        gather = rows.shape[0] > 0
        w = min(m - lo, _TOKEN_TILE)
        t0, col = first + lo, b * m + lo
        for p in range(half):   # the tile's RoPE, shared by every scope and head
            for i in range(w):
                at = rows[t0 + i] if gather else t0 + i
                c_tile[p, i] = cos_t[b, p, at]
                s_tile[p, i] = sin_t[b, p, at]
        for s in range(n_scopes):
            for j in range(heads_per_scope):
                h = s * heads_per_scope + j
                for g in range(groups):
                    acc[:, :w] = 0.0
                    for p in range(half):
                        re, im = j * head_dim + p, j * head_dim + half + p
                        _pair_scores(keys_t[s, re, col:], keys_t[s, im, col:], mean[s, re], mean[s, im],
                                     c_tile[p], s_tile[p], q4[b, h, g], p, half, acc, w)
                    for k in range(min(4, n_rows - 4 * g)):
                        scores[b, h, 4 * g + k, t0:t0 + w] = acc[k, :w]

    @njit(cache=True, fastmath=_FASTMATH)
    def _block_scores(keys_t, mean, cos_t, sin_t, rows, q4, heads_per_scope, first, m, scores):  # pragma: no cover
        # keys_t [S, W, B*m]: pre-RoPE keys less their mean ``mean [S, W]``, channel-major (row b's tokens in
        # columns b*m ..; each head's channels as halves); cos_t, sin_t [B, d/2, N]: RoPE of the span's positions,
        # token i at position rows[i] (or i when rows is empty); q4 [B, H, G, 4, d]: scaled queries in groups of
        # four rows (zero rows past R) -> scores [B, H, R, n] of tokens first .. first+m-1
        for job in range(q4.shape[0] * ((m + _TOKEN_TILE - 1) // _TOKEN_TILE)):
            _tile_scores(job, keys_t, mean, cos_t, sin_t, rows, q4, heads_per_scope, first, m, scores)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _block_scores_parallel(keys_t, mean, cos_t, sin_t, rows, q4, heads_per_scope, first, m,
                               scores):  # pragma: no cover - compiled
        # `_block_scores`, its tiles on numba's threads
        for job in numba.prange(q4.shape[0] * ((m + _TOKEN_TILE - 1) // _TOKEN_TILE)):
            _tile_scores(job, keys_t, mean, cos_t, sin_t, rows, q4, heads_per_scope, first, m, scores)

    @njit(fastmath=_FASTMATH, inline="always")
    def _frame_token_scores(b, i, levels, index, rows, projected, bias, heads_per_scope, first,
                            scores):  # pragma: no cover - compiled
        # the scores of token first+i of row b (`_frame_scores`): one product of its coefficients with its frame's
        # projected query per head and row
        t = first + i
        f = index[b, rows[t] if rows.shape[0] > 0 else t]
        n_rows, rank = projected.shape[3], projected.shape[4]
        for s in range(levels.shape[0]):
            coefficients = levels[s, b, i]
            for j in range(heads_per_scope):
                h = s * heads_per_scope + j
                for row in range(n_rows):
                    a = projected[b, f, h, row]
                    acc = bias[b, f, h, row]
                    for k in range(rank):
                        acc += a[k] * coefficients[k]
                    scores[b, h, row, t] = acc

    @njit(cache=True, fastmath=_FASTMATH)
    def _frame_scores(levels, index, rows, projected, bias, heads_per_scope, first, m, scores):  # pragma: no cover
        # levels [S, B, m, >= r]: the coefficients of tokens first .. first+m-1; index [B, N]: the frame of each
        # token of the span (token i at span position rows[i], or i when rows is empty); projected [B, F, H, R, r]
        # and bias [B, F, H, R]: each frame's queries turned to its position and projected on the scaled bases and
        # on the mean -> scores [B, H, R, n] of those tokens
        for b in range(levels.shape[1]):
            for i in range(m):
                _frame_token_scores(b, i, levels, index, rows, projected, bias, heads_per_scope, first, scores)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _frame_scores_parallel(levels, index, rows, projected, bias, heads_per_scope, first, m,
                               scores):  # pragma: no cover - compiled
        # `_frame_scores`, its tiles of tokens on numba's threads
        tiles = (m + _TOKEN_TILE - 1) // _TOKEN_TILE
        for job in numba.prange(levels.shape[1] * tiles):
            b, lo = job // tiles, job % tiles * _TOKEN_TILE
            for i in range(lo, min(m, lo + _TOKEN_TILE)):
                _frame_token_scores(b, i, levels, index, rows, projected, bias, heads_per_scope, first, scores)

    @njit(fastmath=_FASTMATH, inline="always")
    def _project_frame(job, q, basis_t, mean, cos, sin, projected, bias):  # pragma: no cover - compiled
        # `_project_frames` of one frame of one batch row (job = row * F + frame)
        frames, heads, n_rows, rank = projected.shape[1], projected.shape[2], projected.shape[3], projected.shape[4]
        half = q.shape[3] // 2
        heads_per_scope = heads // basis_t.shape[0]
        b, f = job // frames, job % frames
        c, s = cos[b, f], sin[b, f]
        turned = np.empty(2 * half, np.float32)
        for h in range(heads):
            scope, first = h // heads_per_scope, (h % heads_per_scope) * 2 * half
            for row in range(n_rows):
                qr = q[b, h, row]
                for p in range(half):
                    turned[p] = qr[p] * c[p] + qr[half + p] * s[p]
                    turned[half + p] = qr[half + p] * c[p] - qr[p] * s[p]
                out = projected[b, f, h, row]
                out[:] = 0.0
                acc = np.float32(0.0)
                for ch in range(2 * half):
                    u = turned[ch]
                    acc += u * mean[scope, first + ch]
                    basis_row = basis_t[scope, first + ch]
                    for k in range(rank):
                        out[k] += u * basis_row[k]
                bias[b, f, h, row] = acc

    @njit(cache=True, fastmath=_FASTMATH)
    def _project_frames(q, basis_t, mean, cos, sin, projected, bias):  # pragma: no cover - compiled
        # q [B, H, >= R, d]: scaled queries (channels as halves); cos, sin [B, F, d/2]: each frame's RoPE;
        # basis_t [S, W, r], mean [S, W]: the scaled bases and the mean (head h: scope h // (H / S), its columns
        # in the scope's (h % (H / S))-th d) -> projected [B, F, H, R, r], bias [B, F, H, R]: each row turned back by
        # its frame's RoPE, times the bases and the mean
        for job in range(projected.shape[0] * projected.shape[1]):
            _project_frame(job, q, basis_t, mean, cos, sin, projected, bias)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _project_frames_parallel(q, basis_t, mean, cos, sin, projected, bias):  # pragma: no cover - compiled
        # `_project_frames`, its frames on numba's threads
        for job in numba.prange(projected.shape[0] * projected.shape[1]):
            _project_frame(job, q, basis_t, mean, cos, sin, projected, bias)

    @njit(cache=True)
    def _scale_bases(bases, factor, column, out):  # pragma: no cover - compiled (no fastmath: torch's order)
        # the S int8 bases [W, r_s] times factor [S, 1, r] (and column [S, W, 1] when it has S rows) -> out [S, W, r],
        # zero past each scope's rank: `BasisFactors.scaled_bases_t`'s products in the same order
        for s in range(len(bases)):
            basis = bases[s]
            rank = basis.shape[1]
            for w in range(out.shape[1]):
                for j in range(rank):
                    out[s, w, j] = np.float32(basis[w, j]) * factor[s, 0, j]
                for j in range(rank, out.shape[2]):
                    out[s, w, j] = 0.0
                if column.shape[0]:
                    for j in range(out.shape[2]):
                        out[s, w, j] *= column[s, w, 0]

    @njit(cache=True)
    def _set_bits(packed, n, out):  # pragma: no cover - compiled
        # the indices of the set bits among the first n of packed [ceil(n / 8)] (bit i: byte i // 8, bit i % 8)
        k = 0
        for i in range(n):
            if (packed[i >> 3] >> (i & 7)) & 1:
                out[k] = i
                k += 1
        return k

    @njit(cache=True, fastmath=_FASTMATH)
    def _hide(scores, hidden):  # pragma: no cover - compiled
        # scores [B, H, R, n]: the rows hidden [B, H, m] (held apart from the codes) scored -inf
        for b in range(scores.shape[0]):
            for h in range(scores.shape[1]):
                for i in range(hidden.shape[2]):
                    for r in range(scores.shape[2]):
                        scores[b, h, r, hidden[b, h, i]] = -np.inf

    @njit(cache=True, fastmath=_FASTMATH)
    def _bin_rows(probs, r0, v_codes, v_bits, n_groups, bins):  # pragma: no cover - compiled
        # probabilities of rows r0 .. r0+3 of probs [R, n] (rows past R weigh 0) summed per value group and
        # codeword into bins [groups * 2**v_bits, 4 * ceil(R / 4)] (the four rows side by side)
        rows, n = probs.shape
        flat = bins.ravel()
        stride = np.uint64(bins.shape[1])
        entries, mask = np.uint64(1 << v_bits), (1 << v_bits) - 1
        w1 = np.float32(1.0 if r0 + 1 < rows else 0.0)
        w2 = np.float32(1.0 if r0 + 2 < rows else 0.0)
        w3 = np.float32(1.0 if r0 + 3 < rows else 0.0)
        p0, p1, p2, p3 = probs[r0], probs[min(r0 + 1, rows - 1)], probs[min(r0 + 2, rows - 1)], probs[min(r0 + 3, rows - 1)]
        col = np.uint64(r0)
        for t in range(n):
            a, b, c, d = p0[t], p1[t] * w1, p2[t] * w2, p3[t] * w3
            row = v_codes[t]
            for g in range(n_groups):
                if v_bits == 8:
                    code = np.uint64(row[g])
                else:
                    bit = g * v_bits
                    at, shift = bit >> 3, bit & 7
                    v = np.int32(row[at])
                    if shift + v_bits > 8:
                        v |= np.int32(row[at + 1]) << 8
                    code = np.uint64((v >> shift) & mask)
                k = (np.uint64(g) * entries + code) * stride + col
                flat[k] += a
                flat[k + np.uint64(1)] += b
                flat[k + np.uint64(2)] += c
                flat[k + np.uint64(3)] += d

    @njit(fastmath=_FASTMATH, inline="always")
    def _head_values(bins, n_rows, codebook_t, scale, rotation, rows_first, rotated, out):  # pragma: no cover
        # one head's bins [groups * K, 4 * ceil(R / 4)] (rows last, `_bin_rows`) -> out [R, d]: (sum_k bins *
        # codebook[k]) * scale, then @ rotation.T (codebook_t [group, K]: every sum a contiguous dot product, over
        # the bins copied one row after another into rows_first [R, groups * K]: strided sums took 10x as long)
        group, k_entries = codebook_t.shape
        d = out.shape[1]
        for e in range(bins.shape[0]):
            for r in range(n_rows):
                rows_first[r, e] = bins[e, r]
        for r in range(n_rows):
            row = rows_first[r]
            for j in range(d):
                g, i = j // group, j % group
                part = row[g * k_entries:(g + 1) * k_entries]
                code = codebook_t[i]
                acc = np.float32(0.0)
                for k in range(k_entries):
                    acc += part[k] * code[k]
                rotated[j] = acc * scale[j]
            for e in range(d):
                back = rotation[e]
                acc = np.float32(0.0)
                for j in range(d):
                    acc += rotated[j] * back[j]
                out[r, e] = acc

    @njit(fastmath=_FASTMATH, inline="always")
    def _head_job(job, probs, v_codes, v_bits, n_groups, codebook_t, v_scale, rotation, bins,
                  out):  # pragma: no cover - compiled
        # one (batch row, head)'s probabilities [R, n] summed per value group and codeword (`_bin_rows`), into bins
        # [B, H, groups * K, 4 * ceil(R / 4)] when kept (else a local array), then its values into out [B, H, R, d]
        # when asked (out with rows)
        heads, n_rows = probs.shape[1], probs.shape[2]
        b, h = job // heads, job % heads
        kept = bins.shape[0] > 0
        held = bins[b, h] if kept else np.empty((n_groups << v_bits, (n_rows + 3) // 4 * 4), np.float32)
        held[...] = 0.0
        for r0 in range(0, n_rows, 4):
            _bin_rows(probs[b, h], r0, v_codes[b, h], v_bits, n_groups, held)
        if out.shape[0] > 0:
            _head_values(held, n_rows, codebook_t, v_scale[h], rotation,
                         np.empty((n_rows, held.shape[0]), np.float32), np.empty(out.shape[3], np.float32), out[b, h])

    @njit(cache=True, fastmath=_FASTMATH)
    def _block_values(scores, lse, hidden, v_codes, v_bits, n_groups, codebook_t, v_scale, rotation, bins,
                      out):  # pragma: no cover - compiled
        # a coded block's scores [B, H, R, n] -> its softmax (the held rows hidden; lse [B, H, R]), then per head
        # its bins and values (`_head_job`), in one call
        _hide(scores, hidden)
        _softmax_rows(scores.reshape(-1, scores.shape[3]), lse.reshape(-1))
        for job in range(scores.shape[0] * scores.shape[1]):
            _head_job(job, scores, v_codes, v_bits, n_groups, codebook_t, v_scale, rotation, bins, out)

    @njit(cache=True, fastmath=_FASTMATH, parallel=True)
    def _block_values_parallel(scores, lse, hidden, v_codes, v_bits, n_groups, codebook_t, v_scale, rotation, bins,
                               out):  # pragma: no cover - compiled
        # `_block_values`, its heads on numba's threads
        _hide(scores, hidden)
        _softmax_rows(scores.reshape(-1, scores.shape[3]), lse.reshape(-1))
        for job in numba.prange(scores.shape[0] * scores.shape[1]):
            _head_job(job, scores, v_codes, v_bits, n_groups, codebook_t, v_scale, rotation, bins, out)


@dataclass
class RunLayout:
    """The runs of equal code width of several `PCACode` (one per scope, same rows) as integers: what
    `code_attention` reads to decode a row's coefficients."""

    runs: object  # int32 numpy [S, max_runs, 4]: each scope's runs (bits, component, components, byte)
    run_counts: object  # int32 numpy [S]
    level_kind: str  # the codes' levels (`scalar_levels.COEFF_LEVELS`)
    widths: tuple  # the code widths the runs use, ascending

    def nbytes(self) -> int:
        return self.runs.nbytes + self.run_counts.nbytes


def run_layout(codes: list[PCACode]) -> RunLayout:
    """The `RunLayout` of ``codes``, which share their level kind."""
    kinds = {code.levels for code in codes}
    if len(kinds) != 1:
        raise ValueError(f"codes of one block share their levels, got {sorted(kinds)}")
    runs = np.zeros((len(codes), max(1, max(len(c.runs) for c in codes)), 4), np.int32)
    for i, code in enumerate(codes):
        for k, (bits, a, b, byte_a, _) in enumerate(code.runs):
            runs[i, k] = (bits, a, b - a, byte_a)
    return RunLayout(runs, np.array([len(c.runs) for c in codes], np.int32), kinds.pop(),
                     tuple(sorted({run[0] for code in codes for run in code.runs})))


def _half_split(head_dim: int) -> torch.Tensor:
    """Channel order taking pair order (``re0, im0, re1, im1, ...``) to halves (``re0, re1, ..., im0, im1, ...``)."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def code_attention(codes: torch.Tensor, layout, scaled: torch.Tensor, mean: torch.Tensor, cos_t: torch.Tensor,
                   sin_t: torch.Tensor, query: torch.Tensor, scaling: float, hidden: torch.Tensor | None,
                   v_codes: torch.Tensor, v_bits: int, n_groups: int, halves: bool = False,
                   rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped ``query [B, H_kv, R, d]`` (float32, channels in RoPE pair order, or with
    ``halves=True`` as two halves, the model's order) over one block of ``n`` coded tokens, on CPU tensors.

    ``codes [B, S, n, bytes]`` uint8 (or the ``S`` scopes' ``[B, n, bytes]`` apart, as the block holds them):
    the packed key codes of the ``S`` PCA scopes, laid out as ``layout``
    (a `RunLayout`) says; a token's pre-RoPE key is ``mean[s] + levels @ scaled[s]``
    (``scaled [S, r, W]`` the scaled bases, ``mean [S, W]``, float32, columns in pair order,
    ``W = H_kv * d / S``; with ``halves=True`` in the query's order too); ``cos_t, sin_t [B, d/2, N]``: the
    RoPE of each pair at the positions of the block's span, token ``i`` at position ``rows[i]`` (int, ``[n]``;
    None: position ``i``); ``hidden [B, H_kv, m]`` int32: rows not attended (or None); ``v_codes [B, H_kv, n,
    bytes]``: ``n_groups`` value codes of ``v_bits`` bits per token.

    Returns ``(bins [B, H_kv, R, n_groups * 2**v_bits], lse [B, H_kv, R])``: the softmax probabilities
    summed per value group and codeword, and the log-sum-exp of the scores."""
    batch, heads, n_rows, d = query.shape
    if not halves:
        split = _half_split(d)
        heads_per_scope = heads // (codes.shape[1] if isinstance(codes, torch.Tensor) else len(codes))
        columns = torch.cat([j * d + split for j in range(heads_per_scope)])
        scaled, mean, query = scaled[..., columns], mean[:, columns], query[..., split]
    scopes = codes.unbind(1) if isinstance(codes, torch.Tensor) else codes
    lse = np.empty((batch, heads, n_rows), np.float32)
    bins = np.empty((batch, heads, n_groups << v_bits, -(-n_rows // 4) * 4), np.float32)
    hidden = None if hidden is None else hidden.to(torch.int32)
    _block_attention(scopes, layout, scaled.transpose(1, 2), mean, cos_t, sin_t, _row_quads(_numpy(query.float()),
                     scaling), hidden, v_codes, v_bits, n_groups, rows, lse, bins)
    return torch.from_numpy(bins)[..., :n_rows].transpose(2, 3), torch.from_numpy(lse)


def _row_quads(query: np.ndarray, scaling: float) -> np.ndarray:
    """Grouped float32 queries ``[B, H, R, d]`` times ``scaling``, as ``[B, H, ceil(R/4), 4, d]`` (zero rows
    past ``R``): the score kernel reads four rows at once."""
    batch, heads, n_rows, d = query.shape
    q4 = np.zeros((batch, heads, -(-n_rows // 4) * 4, d), np.float32)
    q4[:, :, :n_rows] = query * np.float32(scaling)
    return q4.reshape(batch, heads, -1, 4, d)


def frame_projection(q4: np.ndarray, basis_t: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The scaled query quads ``q4 [B, H, G, 4, d]`` (channels as two halves) turned back by each frame's RoPE
    (``cos, sin [B, F, d/2]``): with ``k`` a key coded at its frame's position, ``q . RoPE_frame(k) =
    RoPE_frame^-1(q) . k``, so one projection per frame on the scaled bases ``basis_t [S, W, r]`` and on the
    ``mean [S, W]`` replaces rebuilding the frame's keys. Returns float32 ``(projected [B, F, H, R, r], bias [B, F,
    H, R])`` of the first ``n_rows`` rows (scratch arrays, valid until the next call)."""
    batch, heads = q4.shape[:2]
    frames, rank = cos.shape[1], basis_t.shape[2]
    projected = scratch("frame_projected", (batch, frames, heads, n_rows, rank)).numpy()
    bias = scratch("frame_bias", (batch, frames, heads, n_rows)).numpy()
    project = _project_frames_parallel if _use_threads() else _project_frames
    project(q4.reshape(batch, heads, -1, q4.shape[-1]), _numpy(basis_t.float().contiguous()), _numpy(mean.float()),
            _numpy(cos), _numpy(sin), projected, bias)
    return projected, bias


_NO_HIDDEN = np.zeros((1, 1, 0), np.int32)
_NO_BINS = np.zeros((0, 0, 0, 0), np.float32)
_NO_OUT = np.zeros((0, 0, 0, 0), np.float32)
_NO_VALUES = (np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))


def _block_attention(scopes, layout, basis_t: torch.Tensor, mean: torch.Tensor, cos_t: torch.Tensor,
                     sin_t: torch.Tensor, q4: np.ndarray, hidden, v_codes, v_bits: int, n_groups: int,
                     rows: torch.Tensor | np.ndarray | None, lse: np.ndarray, bins: np.ndarray | None = None,
                     values: tuple | None = None, out: np.ndarray | None = None, frames: tuple | None = None) -> None:
    """`code_attention` (channels as two halves) of the scaled query quads ``q4`` (`_row_quads`) over one block: its
    log-sum-exp written into ``lse [B, H_kv, R]``; its bins into ``bins [B, H_kv, n_groups * 2**v_bits, 4 *
    ceil(R / 4)]`` (query rows last) unless None; with ``values`` (the value codebook transposed ``[group, K]``, the
    scales ``[H_kv, d]`` and the rotation ``[d, d]``, float32 numpy), the block's attention output into ``out [B,
    H_kv, R, d]``. ``basis_t [S, W, r]``: the scaled bases; the codes (``scopes``, ``v_codes``) and the int32
    ``hidden`` rows: tensors or numpy views. Per slice of tokens: their coefficients (one call), their keys (one
    batched product: torch's BLAS), their scores with RoPE (one call); then the softmax, bins and values (one
    call). With ``frames`` (`ShardShared.frames`: each token's frame and each frame's RoPE; keys coded at their
    frames' positions, ``cos_t``, ``sin_t`` unread), the queries are projected once per frame
    (`frame_projection`) and each token's scores are products with its coefficients: no key is rebuilt."""
    batch, heads, n_rows = lse.shape
    scopes = tuple(_numpy(c) for c in scopes)
    n_scopes, n = len(scopes), scopes[0].shape[1]
    heads_per_scope = heads // n_scopes
    rank = basis_t.shape[2]
    basis_t = basis_t.float()                        # [S, W, r]: BLAS reads it as it is
    positions = _NO_ROWS if rows is None else rows if isinstance(rows, np.ndarray) else _numpy(rows.long())
    centre = _numpy(mean.float())
    if frames is None:
        c_t, s_t = _numpy(cos_t.float()), _numpy(sin_t.float())
    scores = scratch("scores", (batch, heads, n_rows, n)).numpy()
    lut = byte_levels(layout.level_kind, layout.widths)
    lut64 = lut.view(np.int64)                       # a byte's levels as 8-byte words
    parallel = _use_threads()
    decode_scopes = _decode_scopes_parallel if parallel else _decode_scopes
    block_scores = _block_scores_parallel if parallel else _block_scores
    if frames is not None:
        frame_index = _numpy(frames[0])
        projected, bias = frame_projection(q4, basis_t, mean, frames[1], frames[2], n_rows)
    for first in range(0, n, _SLICE):
        m = min(_SLICE, n - first)
        levels = scratch("levels", (n_scopes, batch, m, rank + _SPARE + rank % 2))
        coefficients = levels.numpy()
        decode_scopes(scopes, layout.runs, layout.run_counts, lut, lut64, first, coefficients,
                      coefficients.view(np.int64))
        if frames is not None:
            (_frame_scores_parallel if parallel else _frame_scores)(
                coefficients, frame_index, positions, projected, bias, heads_per_scope, first, m, scores)
            continue
        keys_t = scratch("keys", (n_scopes, basis_t.shape[1], batch * m))
        torch.bmm(basis_t, levels[..., :rank].view(n_scopes, batch * m, rank).transpose(1, 2), out=keys_t)
        block_scores(keys_t.numpy(), centre, c_t, s_t, positions, q4, heads_per_scope, first, m, scores)
    codebook_t, scale, rotation = _NO_VALUES if values is None else values
    (_block_values_parallel if parallel else _block_values)(
        scores, lse, _NO_HIDDEN if hidden is None else _numpy(hidden), _numpy(v_codes), v_bits, n_groups, codebook_t,
        scale, rotation, _NO_BINS if bins is None else bins, _NO_OUT if out is None else out)


def scaled_bases(bases: tuple, factor: torch.Tensor, column: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[S, W, r]`` (a scratch tensor, valid until the next call): the int8 ``bases`` (numpy ``[W, r_s]``, one
    per scope, contiguous) times ``factor [S, 1, r]`` and ``column [S, W, 1]`` (or None), zero past each scope's rank:
    `methods.shard.segments.BasisFactors.scaled_bases_t`, bit for bit, in one call instead of a few torch ops."""
    out = scratch("scaled_bases", (len(bases), bases[0].shape[0], factor.shape[-1]))
    _scale_bases(bases, _numpy(factor), _NO_COLUMN if column is None else _numpy(column), out.numpy())
    return out


def set_bit_positions(packed: torch.Tensor | np.ndarray, n: int) -> np.ndarray:
    """int64 indices (numpy) of the set bits among the first ``n`` of ``packed`` (uint8, CPU; `codecs.bitpack`
    order), in one pass: what ``unpack_bits(packed, 1, n).nonzero()`` gives, in microseconds, not a few torch ops."""
    out = np.empty(n, np.int64)
    return out[:_set_bits(_numpy(packed), n, out)]
