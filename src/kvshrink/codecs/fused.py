"""Fused CPU kernels (numba) for attention computed on packed codes, with a clear fallback.

`code_attention` answers one block of Shard's compressed middle without materialising the block's keys
or values, a slice of tokens at a time:

1. per token: its PCA coefficients decoded from its packed key codes (one lookup per byte of a 2-, 4- or
   8-bit run, from a table of the levels each byte value packs; four 6-bit codes per three bytes);
2. the slice's pre-RoPE keys as one batched product of the scaled bases with those coefficients
   (torch's BLAS: the multiply-adds run at the machine's vector width, which hand-written loops
   over lookup tables did not reach, nor numba loops over L1-sized tiles of decoded coefficients, 2-2.5x
   slower than the BLAS product: ``docs/tried.md``), channel-major, kept only for
   the slice;
3. per tile of tokens: RoPE and the scores of four query rows at a time, one RoPE pair after another,
   each a loop over the tile's tokens (contiguous: it vectorises across tokens);
4. in one call: the softmax of all the block's scores (held rows masked; one pass a row, exp as a
   polynomial the loop vectorises), then per KV head its probabilities summed per value codeword and channel
   group (the value VQ codes) and, for a decode step (`StepParts.code`), turned into the attention output
   (one small product by the codebook, scales, rotation).

`turbo_attention` does the same for TurboQuant-coded tokens (Shard's decode stream) in one pass.

numba is optional: `available()` says whether it imported; callers keep their torch reference path
and use it when it did not. Steps 1, 3 and 4 have parallel variants (token chunks, tiles, heads) that
run when torch has more than one thread and numba's threading layer is OpenMP or TBB (a loop starts in
~2 us; its work queue, ~150 us a call, would cost more than it splits: ``docs/tried.md``), on as many
numba threads as torch's; the others are serial, on the calling thread.
They are compiled once per machine (``cache=True``; `warm_up` compiles them before anything is timed).
"""

from __future__ import annotations

import functools
import math
import threading
import weakref

import numpy as np
import torch

try:  # the fast path is optional: a missing or broken numba leaves the reference path
    import numba
    from llvmlite import ir as llvm_ir
    from numba import njit
    from numba.extending import intrinsic
    _IMPORT_ERROR: str | None = None
except Exception as exc:  # pragma: no cover - depends on the environment
    numba = None
    _IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = ["available", "unavailable_reason", "code_attention", "StepParts", "scaled_bases", "set_bit_positions",
           "turbo_attention", "turbo_supported",
           "nearest_codewords", "warm_up"]

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
_NO_TOKENS = np.zeros((1, 1, 0, 1), np.float32)
_NO_COLUMN = np.zeros((0, 0, 1), np.float32)
# No fastmath "nnan"/"ninf": masked scores are -inf.
_FASTMATH = {"reassoc", "contract", "nsz", "arcp"}


def available() -> bool:
    return numba is not None


def unavailable_reason() -> str | None:
    return _IMPORT_ERROR


def _native_half() -> bool:
    """Whether the machine numba compiles for converts float16 in one instruction (x86-64 with F16C, any arm64):
    elsewhere LLVM would call a library routine numba's JIT does not link, and the kernels keep the bit formula."""
    import platform

    from llvmlite import binding
    if numba is None or numba.config.CPU_NAME not in (None, "host"):
        return False
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    try:             # (LLVM cannot read the host's features on every platform: then the bit formula)
        return machine in ("x86_64", "amd64") and bool(binding.get_host_cpu_features().get("f16c"))
    except RuntimeError:
        return False


NATIVE_HALF = _native_half()


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

    @njit(inline="always")
    def _half_value(bits, pow2):  # pragma: no cover - compiled
        # the float16 whose bits are ``bits`` (uint16; finite): (1024 + mantissa) * 2**(exponent - 25), or for
        # exponent 0 (subnormal) mantissa * 2**-24 (pow2: those factors by exponent)
        exponent = (bits >> 10) & 31
        value = np.float32((bits & 1023) + (1024 if exponent else 0)) * pow2[exponent]
        return -value if bits & 0x8000 else value

    @njit(inline="always")
    def _half_float_bits(bits, pow2):  # pragma: no cover - compiled
        # `_half_value` for any float16 word: exponent 31 is inf (mantissa 0) or NaN
        if (bits >> 10) & 31 == 31:
            value = np.float32(np.inf) if bits & 1023 == 0 else np.float32(np.nan)
            return -value if bits & 0x8000 else value
        return _half_value(bits, pow2)

    @njit(inline="always")
    def _widen_half_rows_bits(words, n, pow2, bits):  # pragma: no cover - compiled
        # `_widen_half_rows` where the CPU has no float16 conversion instruction: the normal-range formula (exponent
        # rebiased, mantissa shifted) with each row's smallest and largest exponent tracked alongside, then word by
        # word (`_half_float_bits`) if the row has a zero, a subnormal, an infinity or a NaN. Over 2-D blocks: the
        # same loops over a row's 1-D views, one call per row, do not vectorise (~10x slower, measured)
        for t in range(n):
            low, high = 0x7C00, 0
            for j in range(words.shape[1]):
                w = np.int64(words[t, j])
                exponent = w & 0x7C00
                low, high = min(low, exponent), max(high, exponent)
                bits[t, j] = np.uint32(((w & 0x8000) << 16) | (((w & 0x7FFF) + 0x1C000) << 13))
            if low == 0 or high == 0x7C00:
                values = bits[t].view(np.float32)
                for j in range(words.shape[1]):
                    values[j] = _half_float_bits(words[t, j], pow2)

    @intrinsic
    def _half_to_float(typingctx, word):  # pragma: no cover - compiled
        # a float16 word (uint16) -> its float32 value in the CPU's conversion instruction (F16C's vcvtph2ps, arm64's
        # fcvt: exact for every value, subnormals, infinities and NaN included; LLVM vectorises the loops around it)
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())
        return numba.types.float32(numba.types.uint16), codegen

    @intrinsic
    def _half_to_float_word(typingctx, word):  # pragma: no cover - compiled
        # `_half_to_float`'s result as its float32 bits (uint32)
        def codegen(context, builder, signature, args):
            value = builder.fpext(builder.bitcast(args[0], llvm_ir.HalfType()), llvm_ir.FloatType())
            return builder.bitcast(value, llvm_ir.IntType(32))
        return numba.types.uint32(numba.types.uint16), codegen

    @intrinsic
    def _prefetch(typingctx, address):  # pragma: no cover - compiled
        # a hint to bring the cache line at ``address`` (an integer) in for reading (LLVM's prefetch: x86 prefetcht0,
        # arm64 prfm; nothing where the target has none); it never faults, so an address past an array is harmless
        def codegen(context, builder, signature, args):
            pointer = builder.inttoptr(args[0], llvm_ir.IntType(8).as_pointer())
            hint = builder.module.declare_intrinsic(
                "llvm.prefetch.p0", fnty=llvm_ir.FunctionType(llvm_ir.VoidType(), [pointer.type] + [llvm_ir.IntType(32)] * 3))
            builder.call(hint, [pointer] + [llvm_ir.Constant(llvm_ir.IntType(32), v) for v in (0, 3, 1)])
            return context.get_dummy_value()
        return numba.types.void(numba.types.intp), codegen

    @njit(inline="always")
    def prefetch_row(block, i, j):  # pragma: no cover - compiled
        """Ask for ``block[i, j]`` (the contiguous sub-array at those two leading indices) to be brought into the
        cache: scattered rows read later (LRQK's slow tier in DRAM, ~400 ns a row one at a time) arrive together."""
        start = block.ctypes.data + i * block.strides[0] + j * block.strides[1]
        for line in range(0, block.strides[1], 64):
            _prefetch(start + line)

    @njit(inline="always")
    def _half_float_native(bits, pow2):  # pragma: no cover - compiled
        return _half_to_float(np.uint16(bits))

    @njit(inline="always")
    def _widen_half_rows_native(words, n, pow2, bits):  # pragma: no cover - compiled
        # `_widen_half_rows` in the CPU's float16 conversion instruction (~4 us per 512 x 64 words against ~18 for
        # `_widen_half_rows_bits`)
        for t in range(n):
            for j in range(words.shape[1]):
                bits[t, j] = _half_to_float_word(words[t, j])

    # the first n rows of float16 words [S, d] -> the float32 bits of their values in bits [n, d]; one float16 word
    # (uint16) -> its float32 value
    _widen_half_rows = _widen_half_rows_native if NATIVE_HALF else _widen_half_rows_bits
    _half_float = _half_float_native if NATIVE_HALF else _half_float_bits

    @njit(inline="always")
    def _widen_rows(words, n, bf16, pow2, bits):  # pragma: no cover - compiled
        # the first n rows of 16-bit words [S, d] (float16, or bfloat16 with bf16) -> the float32 bits of their
        # values in bits [n, d]
        if bf16:
            for t in range(n):
                for j in range(words.shape[1]):
                    bits[t, j] = np.uint32(words[t, j]) << 16
        else:
            _widen_half_rows(words, n, pow2, bits)

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

    @njit(cache=True, fastmath=_FASTMATH)
    def _merge(outs, lses, out, total):  # pragma: no cover - compiled
        # outs [P, R, d], lses [P, R]: P partial softmaxes of R query rows -> their union's out [R, d] and
        # log-sum-exp total [R] (rows no part sees: zeros, -inf)
        parts, rows = lses.shape
        weight = np.empty(parts, np.float32)
        for r in range(rows):
            top = np.float32(-np.inf)
            for p in range(parts):
                top = max(top, lses[p, r])
            if top == -np.inf:
                out[r] = 0.0
                total[r] = -np.inf
                continue
            mass = np.float32(0.0)
            for p in range(parts):
                weight[p] = np.exp(lses[p, r] - top)
                mass += weight[p]
            out[r] = 0.0
            for p in range(parts):
                w = weight[p] / mass
                for j in range(out.shape[1]):
                    out[r, j] += w * outs[p, r, j]
            total[r] = top + np.log(mass)

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

    @njit(cache=True, parallel=True)
    def _start_threads(x):  # pragma: no cover - compiled
        # the smallest parallel loop: calling it starts numba's threading layer (`threading_layer_usable`)
        for i in numba.prange(x.shape[0]):
            x[i] = i

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

    @njit(cache=True, inline="always")
    def half_bits(x):  # pragma: no cover - compiled
        """float16 bits of the float32 whose bits are ``x`` (an int64), rounded to nearest even as torch's
        conversion rounds: overflow to inf, subnormals, signed zeros, NaN kept a (quiet) NaN (numba has no
        float16 type: kernels writing float16 write these words)."""
        sign = (x >> 16) & 0x8000
        a = x & 0x7FFFFFFF
        if a >= 0x7F800000:                     # inf, NaN
            return sign | (0x7E00 if a > 0x7F800000 else 0x7C00)
        if a >= 0x477FF000:                     # >= 65520: beyond float16's largest after rounding
            return sign | 0x7C00
        if a >= 0x38800000:                     # a normal float16: rebias the exponent, round the mantissa
            return sign | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)
        if a <= 0x33000000:                     # at most 2**-25: half the smallest subnormal rounds to 0
            return sign
        shift = 126 - (a >> 23)                 # a subnormal float16: the mantissa's 24 bits shifted
        m = (a & 0x7FFFFF) | 0x800000
        r = m >> shift
        rest = m & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rest > half or (rest == half and (r & 1) == 1):
            r += 1
        return sign | r

    @njit(cache=True, fastmath=True)
    def narrow_row(src, dst):  # pragma: no cover - compiled
        """``dst`` (float16 words) from ``src`` (float32 words): every word by the normal-range formula in one
        vectorised pass, then word by word (``half_bits``) if any lies outside that range (zeros, subnormals,
        overflow, inf, NaN: rare in keys and values). Returns the largest word without its sign."""
        largest = 0
        outside = False
        for t in range(src.shape[0]):
            x = np.int64(src[t])
            a = x & 0x7FFFFFFF
            largest = max(largest, a)
            outside |= (a < 0x38800000) | (a >= 0x477FF000)
            dst[t] = ((x >> 16) & 0x8000) | ((a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13)
        if outside:
            for t in range(src.shape[0]):
                dst[t] = half_bits(np.int64(src[t]))
        return largest

    @njit(inline="always")
    def largest_word(x):  # pragma: no cover - compiled
        """The largest of the float32 words ``x [m, n]`` (uint32) without its sign: their largest magnitude's bits (a
        NaN's above ``_F32_INF``), what a float16 range check compares."""
        largest = 0
        for i in range(x.shape[0]):
            for j in range(x.shape[1]):
                largest = max(largest, np.int64(x[i, j]) & 0x7FFFFFFF)
        return largest

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

    @njit(inline="always", fastmath=_FASTMATH - {"reassoc"})
    def _group_distance(c_sq, codebook_t, j, w0, w1, w2, w3):  # pragma: no cover - compiled
        # |c_j|^2 - 2 x.c_j of a 4-channel group, summed in `_nearest_codewords`'s order
        d = c_sq[j] + w0 * codebook_t[0, j]
        d = d + w1 * codebook_t[1, j]
        d = d + w2 * codebook_t[2, j]
        return d + w3 * codebook_t[3, j]

    @njit(inline="always")
    def _ordered(b, j):  # pragma: no cover - compiled
        # a distance's float bits as an integer of the same order (-0.0 == +0.0), its codeword index below
        order = b ^ ((b >> 31) & 0x7FFFFFFF)
        order += order < 0
        return (np.int64(order) << 8) | j

    @njit(cache=True, fastmath=_FASTMATH - {"reassoc"})
    def _nearest_codewords(x, codebook_t, c_sq, out):  # pragma: no cover - compiled
        # x [N, g], codebook_t [g, k <= 256]: out[i] = argmin_j ||c_j||^2 - 2 x_i.c_j (the first of equal
        # ones; a row holding NaN has the same NaN at every codeword and gets the first, as before)
        n, g = x.shape
        k = codebook_t.shape[1]
        chunks = (n + 1023) // 1024
        for job in range(chunks):
            dist = np.empty(k, np.float32)
            bits = dist.view(np.int32)
            for i in range(job * 1024, min(n, job * 1024 + 1024)):
                if g == 4:  # the default group: one pass over the codewords (2.5x faster than four)
                    w0, w1 = np.float32(-2.0) * x[i, 0], np.float32(-2.0) * x[i, 1]
                    w2, w3 = np.float32(-2.0) * x[i, 2], np.float32(-2.0) * x[i, 3]
                    for j in range(k):  # the same sum, in the same order, as the passes below
                        dist[j] = _group_distance(c_sq, codebook_t, j, w0, w1, w2, w3)
                else:
                    for j in range(k):
                        dist[j] = c_sq[j]
                    for e in range(g):
                        w = np.float32(-2.0) * x[i, e]
                        for j in range(k):
                            dist[j] += w * codebook_t[e, j]
                # the minimum as one integer reduction (vectorised; a compare-and-branch loop over the
                # floats stayed scalar and took 3/4 of the search): each distance's bits mapped to an
                # integer of the same order (-0.0 and +0.0 equal), its index below them so ties keep the
                # first codeword; k <= 256
                best = np.int64(0x7FFFFFFFFFFFFFFF)
                for j in range(k):
                    best = min(best, _ordered(bits[j], j))
                out[i] = best & 255

    @njit(cache=True, fastmath=_FASTMATH - {"reassoc"})
    def _codeword_cells(codebook_t, c_sq, lo, step, per_dim, margin):  # pragma: no cover - compiled
        # the candidates of each cell of a per_dim**4 grid over [lo, lo + per_dim * step)^4 (CSR: offsets
        # [cells + 1], codeword indices ascending): every codeword that no single other one beats by more than
        # margin everywhere in the cell, so the nearest codeword of any point in the cell is among them
        k = codebook_t.shape[1]
        cells = per_dim ** 4
        offsets = np.zeros(cells + 1, np.int64)
        out = np.empty(cells * k, np.uint8)
        near = np.empty(k, np.float32)
        low, high = np.empty(4, np.float32), np.empty(4, np.float32)
        used = 0
        for cell in range(cells):
            rest = cell
            for e in range(4):
                low[e] = lo + (rest % per_dim) * step
                high[e] = low[e] + step
                rest //= per_dim
            for j in range(k):  # rivals tried nearest-first: a dominated codeword is usually found at once
                near[j] = c_sq[j]
                for e in range(4):
                    near[j] -= (low[e] + high[e]) * codebook_t[e, j]
            rivals = np.argsort(near)
            for j in range(k):
                dominated = False
                for o in rivals:
                    if o == j:
                        continue
                    # the most d_o(x) - d_j(x) = |c_o|^2 - |c_j|^2 - 2 x.(c_o - c_j) gets in the cell
                    worst = c_sq[o] - c_sq[j]
                    for e in range(4):
                        a = np.float32(-2.0) * (codebook_t[e, o] - codebook_t[e, j])
                        worst += a * high[e] if a > 0 else a * low[e]
                    if worst < -margin:
                        dominated = True
                        break
                if not dominated:
                    out[used] = j
                    used += 1
            offsets[cell + 1] = used
        return offsets, out[:used].copy()

    @njit(cache=True, fastmath=_FASTMATH - {"reassoc"})
    def _nearest_in_cells(x, codebook_t, c_sq, lo, step, per_dim, offsets, candidates, out):  # pragma: no cover
        # `_nearest_codewords` for groups of 4 with the grid of `_codeword_cells`: the same distances, summed in
        # the same order, over the cell's candidates only; rows outside the grid (or holding NaN) try every one
        n, k = x.shape[0], codebook_t.shape[1]
        chunks = (n + 1023) // 1024
        for job in range(chunks):
            dist = np.empty(1, np.float32)
            bits = dist.view(np.int32)
            for i in range(job * 1024, min(n, job * 1024 + 1024)):
                cell, stride, inside = 0, 1, True
                for e in range(4):
                    f = (x[i, e] - lo) / step
                    if not (f >= 0.0 and f < per_dim):  # false for NaN too
                        inside = False
                        break
                    cell += int(f) * stride
                    stride *= per_dim
                w0, w1 = np.float32(-2.0) * x[i, 0], np.float32(-2.0) * x[i, 1]
                w2, w3 = np.float32(-2.0) * x[i, 2], np.float32(-2.0) * x[i, 3]
                best = np.int64(0x7FFFFFFFFFFFFFFF)
                if inside:
                    for c in range(offsets[cell], offsets[cell + 1]):
                        j = np.int64(candidates[c])
                        dist[0] = _group_distance(c_sq, codebook_t, j, w0, w1, w2, w3)
                        best = min(best, _ordered(bits[0], j))
                else:
                    for j in range(k):
                        dist[0] = _group_distance(c_sq, codebook_t, j, w0, w1, w2, w3)
                        best = min(best, _ordered(bits[0], j))
                out[i] = best & 255


    @njit(cache=True)
    def _level_codes(z, bounds, nan_last, out):  # pragma: no cover - compiled
        # out[i] = how many bounds (ascending) lie below z[i], bound by bound (the loop over values
        # vectorises: faster than a binary search up to 255 bounds); NaN: 0 as comparisons give it, or
        # with nan_last the number of bounds, as torch.bucketize gives it
        out[:] = 0
        for b in bounds:
            for i in range(z.shape[0]):
                out[i] += np.uint8(z[i] > b)
        if nan_last:
            for i in range(z.shape[0]):
                if z[i] != z[i]:
                    out[i] = bounds.shape[0]

_WORKSPACE = threading.local()
_THREADED_LAYERS = ("omp", "tbb")  # numba's pools that start a parallel kernel in microseconds
_threads_usable: bool | None = None
_threads_forced: bool | None = None  # `warm_up`'s choice of kernels, whatever the threads


def _use_threads() -> bool:
    """Whether the kernels with a parallel variant run it now: torch is given more than one thread (the eval's
    ``--threads``; numba's are set to as many, no more), and numba's threading layer starts a parallel loop in
    microseconds (OpenMP or TBB; its portable work queue costs ~150 us a call, more than the loops it would
    split: then the serial kernels run)."""
    if _threads_forced is not None:
        return _threads_forced
    threads = min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS)
    if threads < 2 or not threading_layer_usable():
        return False
    if getattr(_WORKSPACE, "numba_threads", None) != threads:
        numba.set_num_threads(threads)          # numba's count is per calling thread, as the workspace is
        _WORKSPACE.numba_threads = threads
    return True


def threading_layer_usable() -> bool:
    """Whether numba's threading layer is one that starts a parallel loop in microseconds (`_use_threads`), found
    once by starting it with a tiny parallel kernel (the warm-ups call it: that kernel is compiled then)."""
    global _threads_usable
    if _threads_usable is None:
        _start_threads(np.zeros(2, np.int64))
        _threads_usable = numba.threading_layer() in _THREADED_LAYERS
    return _threads_usable


def each_kernel_variant():
    """``for parallel in each_kernel_variant(): f()`` runs ``f`` with the serial kernels, then with their
    parallel variants, whatever the threads (the warm-ups compile both)."""
    global _threads_forced
    before = _threads_forced
    try:
        for forced in (False, True):
            _threads_forced = forced
            yield forced
    finally:
        _threads_forced = before


_VIEWS_KEPT = 256    # scratch views kept by (name, shape): a model's layers ask for a few shapes each step


def scratch(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 scratch tensor of ``shape``, the calling thread's, reused by the next call of the same ``name``
    (grown when too small): per-step operands are written in memory already mapped and warm, not in a fresh
    allocation (above glibc's mmap threshold, one that is mapped and faulted in page by page every time)."""
    try:
        return _WORKSPACE.views[name, shape]     # the common case: the shape of the last call (one dict lookup)
    except (AttributeError, KeyError):
        pass
    if not hasattr(_WORKSPACE, "views"):
        _WORKSPACE.buffers, _WORKSPACE.views = {}, {}
    buffers = _WORKSPACE.buffers
    numel = math.prod(shape)
    if name not in buffers or buffers[name].numel() < numel:
        buffers[name] = torch.empty(numel)
        _WORKSPACE.views = {key: v for key, v in _WORKSPACE.views.items() if key[0] != name}   # their memory is gone
    view = buffers[name][:numel].view(shape)
    if len(_WORKSPACE.views) < _VIEWS_KEPT:
        _WORKSPACE.views[name, shape] = view
    return view


def _numpy(t: torch.Tensor | np.ndarray) -> np.ndarray:
    # a dozen per layer and decode step: skip the calls that would return the tensor itself (arrays made once
    # and kept by the caller pass through)
    if isinstance(t, np.ndarray):
        return t
    if t.requires_grad:
        t = t.detach()
    return (t if t.is_contiguous() else t.contiguous()).numpy()


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
    (a `codecs.table_decoder.RunLayout`) says; a token's pre-RoPE key is ``mean[s] + levels @ scaled[s]``
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


_NO_HIDDEN = np.zeros((1, 1, 0), np.int32)
_NO_BINS = np.zeros((0, 0, 0, 0), np.float32)
_NO_OUT = np.zeros((0, 0, 0, 0), np.float32)
_NO_VALUES = (np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32), np.zeros((1, 1), np.float32))


def _block_attention(scopes, layout, basis_t: torch.Tensor, mean: torch.Tensor, cos_t: torch.Tensor,
                     sin_t: torch.Tensor, q4: np.ndarray, hidden, v_codes, v_bits: int, n_groups: int,
                     rows: torch.Tensor | np.ndarray | None, lse: np.ndarray, bins: np.ndarray | None = None,
                     values: tuple | None = None, out: np.ndarray | None = None) -> None:
    """`code_attention` (channels as two halves) of the scaled query quads ``q4`` (`_row_quads`) over one block: its
    log-sum-exp written into ``lse [B, H_kv, R]``; its bins into ``bins [B, H_kv, n_groups * 2**v_bits, 4 *
    ceil(R / 4)]`` (query rows last) unless None; with ``values`` (the value codebook transposed ``[group, K]``, the
    scales ``[H_kv, d]`` and the rotation ``[d, d]``, float32 numpy), the block's attention output into ``out [B,
    H_kv, R, d]``. ``basis_t [S, W, r]``: the scaled bases; the codes (``scopes``, ``v_codes``) and the int32
    ``hidden`` rows: tensors or numpy views. Per slice of tokens: their coefficients (one call), their keys (one
    batched product: torch's BLAS), their scores with RoPE (one call); then the softmax, bins and values (one
    call)."""
    batch, heads, n_rows = lse.shape
    scopes = tuple(_numpy(c) for c in scopes)
    n_scopes, n = len(scopes), scopes[0].shape[1]
    heads_per_scope = heads // n_scopes
    rank = basis_t.shape[2]
    basis_t = basis_t.float()                        # [S, W, r]: BLAS reads it as it is
    positions = _NO_ROWS if rows is None else rows if isinstance(rows, np.ndarray) else _numpy(rows.long())
    c_t, s_t, centre = _numpy(cos_t.float()), _numpy(sin_t.float()), _numpy(mean.float())
    scores = scratch("scores", (batch, heads, n_rows, n)).numpy()
    lut = byte_levels(layout.level_kind, layout.widths)
    lut64 = lut.view(np.int64)                       # a byte's levels as 8-byte words
    parallel = _use_threads()
    decode_scopes = _decode_scopes_parallel if parallel else _decode_scopes
    block_scores = _block_scores_parallel if parallel else _block_scores
    for first in range(0, n, _SLICE):
        m = min(_SLICE, n - first)
        levels = scratch("levels", (n_scopes, batch, m, rank + _SPARE + rank % 2))
        coefficients = levels.numpy()
        decode_scopes(scopes, layout.runs, layout.run_counts, lut, lut64, first, coefficients,
                      coefficients.view(np.int64))
        keys_t = scratch("keys", (n_scopes, basis_t.shape[1], batch * m))
        torch.bmm(basis_t, levels[..., :rank].view(n_scopes, batch * m, rank).transpose(1, 2), out=keys_t)
        block_scores(keys_t.numpy(), centre, c_t, s_t, positions, q4, heads_per_scope, first, m, scores)
    codebook_t, scale, rotation = _NO_VALUES if values is None else values
    (_block_values_parallel if parallel else _block_values)(
        scores, lse, _NO_HIDDEN if hidden is None else _numpy(hidden), _numpy(v_codes), v_bits, n_groups, codebook_t,
        scale, rotation, _NO_BINS if bins is None else bins, _NO_OUT if out is None else out)


def _outputs(shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Empty float32 ``out [B, H, R, d]`` and ``lse [B, H, R]`` of a grouped query's ``shape``."""
    return np.empty(tuple(shape), np.float32), np.empty(tuple(shape[:3]), np.float32)


def _exact_into(query: np.ndarray, keys: torch.Tensor, values: torch.Tensor, scaling: np.float32, out: np.ndarray,
                lse: np.ndarray) -> None:
    # torch converts half vectorised: numpy's astype took ~5x as long
    _exact_attention(query, _numpy(keys.float()), _numpy(values.float()), scaling, out, lse)


# float32 +inf's bits, and the smallest float32 bits beyond float16's largest value (65504)
_F32_INF = 0x7F800000
_F32_FP16_OVERFLOW = int(np.array(65504.0, dtype=np.float32).view(np.uint32)) + 1
_HALF_POW2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], np.float32)
_SPLIT = {torch.float16: 2.0 ** 13 + 1, torch.bfloat16: 2.0 ** 16 + 1}


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


def turbo_supported(turbo) -> bool:
    """Whether `turbo_attention` reads this `codecs.lloyd_max.TurboQuantizer`'s codes: widths dividing a byte, no
    QJL sketch."""
    return available() and 8 % turbo.bits == 0 and not turbo.qjl


def turbo_attention(turbo, query: torch.Tensor, keys, values, scaling: float,
                    centre: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped ``query [B, H_kv, R, d]`` over TurboQuant-coded ``keys`` and ``values``
    (`codecs.lloyd_max.TurboCode` of ``[B, H_kv, n]`` vectors, each coded less its ``centre [2, B, H_kv, d]``:
    the keys', the values'; None: zero) on CPU, in one pass: ``(out [B, H_kv, R, d] float32, lse [B, H_kv, R])``,
    what ``turbo.inner_products``, a softmax and ``turbo.weighted_sum`` give with the centres added back,
    without decoding the codes into tensors (`turbo_supported` says when it applies)."""
    out, lse = _outputs(query.shape)
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


def ring_words(kv: torch.Tensor) -> np.ndarray:
    """A float16 ring buffer ``kv [2, B, H, S, d]`` (contiguous) as numpy words ``[2, B·H, S, d]`` (no copy)."""
    return kv.view(torch.int16).numpy().view(np.uint16).reshape(2, -1, kv.shape[-2], kv.shape[-1])


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


_TURBO_TABLES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class StepParts:
    """The partial softmaxes of one grouped decode query ``[B, H_kv, R, d]`` on CPU, each written in place by its
    kernel into one buffer (`exact`, `int8`, `turbo`, `code`) and all merged in one pass (`merged`): no tensor,
    `Partial` or stacked copy per part (a decode step has a handful of parts per layer, and each cost a few dozen
    small calls that way). Up to ``capacity`` parts."""

    def __init__(self, query: torch.Tensor, scaling: float, capacity: int):
        self.query = _numpy(query.float())
        self.scaling = np.float32(scaling)
        shape = self.query.shape
        self._outs = scratch("parts_out", (capacity, *shape)).numpy()
        self._lses = scratch("parts_lse", (capacity, *shape[:3])).numpy()
        self._quads = None
        self.count = 0

    def _next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.count == len(self._outs):
            raise RuntimeError(f"StepParts holds {self.count} parts, its capacity")
        self.count += 1
        return self._outs[self.count - 1], self._lses[self.count - 1]

    def exact(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Exact attention over ``keys/values [B, H_kv, m, d]`` (any float dtype, converted by torch), every one
        visible: one pass per head (a decode step's few dozen exact tokens: no attention kernel's setup)."""
        _exact_into(self.query, keys, values, self.scaling, *self._next())

    def int8(self, keys: tuple, values: tuple, dtype: torch.dtype) -> None:
        """Attention over token vectors held as 8-bit `codecs.groupwise.GroupCode`s (``keys/values`` as
        `int8_arrays`), every one visible, in one pass with no decoded copy; the codes decoded as
        ``dequantize_groups(code).to(dtype)`` gives them (rounded to ``dtype``'s mantissa)."""
        _int8_into(self.query, keys, values, self.scaling, dtype, *self._next())

    def turbo(self, turbo, keys: tuple, values: tuple, centre: np.ndarray | None = None) -> None:
        """`turbo_attention` over TurboQuant codes ``keys/values`` (`turbo_arrays`) less their ``centre``
        (`centre_array`; None: zero)."""
        if centre is None:
            centre = centre_array(None, self.query.shape)
        _turbo_into(turbo, self.query, keys, values, self.scaling, *self._next(), centre)

    def ring(self, kv: np.ndarray, live: int, dtype: torch.dtype, new: tuple[torch.Tensor, torch.Tensor] | None
             ) -> None:
        """`exact` over the first ``live`` rows of a 16-bit ring's words ``kv [2, B·H, S, d]`` (`ring_words`;
        ``dtype`` float16 or bfloat16) read in place, and ``new`` (float32 ``[B, H, m, d]`` keys and values), in one
        call: no float32 copy or concatenation of the ring's tokens."""
        new_k, new_v = (_NO_TOKENS, _NO_TOKENS) if new is None else (_numpy(x.float()) for x in new)
        if new is not None and new_k.shape[:2] != self.query.shape[:2]:
            raise ValueError(f"new tokens {new_k.shape} do not match the query {self.query.shape}")
        n, d = live + new_k.shape[2], kv.shape[3]
        _ring_attention(self.query, kv, live, dtype == torch.bfloat16, _HALF_POW2, new_k, new_v, self.scaling,
                        *self._next(), scratch("ring keys", (n, d)).numpy().view(np.uint32),
                        scratch("ring values", (n, d)).numpy().view(np.uint32),
                        scratch("ring scores", (self.query.shape[2] * n,)).numpy())

    def code(self, scopes, layout, basis_t: torch.Tensor, mean: torch.Tensor, cos_t: torch.Tensor,
             sin_t: torch.Tensor, hidden, v_codes, v_bits: int, n_groups: int, rows: torch.Tensor | np.ndarray | None,
             codebook: torch.Tensor, v_scale: torch.Tensor, rotation: torch.Tensor) -> None:
        """`code_attention` (``halves=True``; the scaled bases as ``basis_t [S, W, r]``; the codes and the int32
        ``hidden`` rows as tensors or numpy views) and the value pass (each group's probability-weighted codewords,
        times ``v_scale``, rotated back): a coded block's partial (`_block_attention`)."""
        if self._quads is None:
            self._quads = _row_quads(self.query, self.scaling)
        out, lse = self._next()
        values = (_numpy(codebook.float().T.contiguous()), _numpy(v_scale.float()), _numpy(rotation.float()))
        _block_attention(scopes, layout, basis_t, mean, cos_t, sin_t, self._quads, hidden, v_codes, v_bits, n_groups,
                         rows, lse, None, values, out)

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """A part computed elsewhere: grouped ``out [B, H_kv, R, d]``, ``lse [B, H_kv, R]``."""
        into_out, into_lse = self._next()
        into_out[...] = _numpy(out.float())
        into_lse[...] = _numpy(lse.float())

    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, H_kv, R, d], lse [B, H_kv, R])``: the softmax over every part's tokens (new tensors)."""
        out, lse = _outputs(self.query.shape)
        d, n = out.shape[-1], self.count
        _merge(self._outs[:n].reshape(n, -1, d), self._lses[:n].reshape(n, -1), out.reshape(-1, d), lse.reshape(-1))
        return torch.from_numpy(out), torch.from_numpy(lse)


class NumpyViews:
    """Numpy views (no copy) of tensors that stay the same objects from step to step, each made again when its
    tensor is replaced: a view costs a few calls per layer and decode step otherwise. Never saved or copied
    (a copy makes its own)."""

    def __init__(self):
        self._held: dict = {}

    def get(self, name: str, tensor: torch.Tensor, make):
        """``make(tensor)``, kept under ``name`` while ``tensor`` is the same object."""
        held = self._held.get(name)
        if held is None or held[0] is not tensor:
            held = self._held[name] = (tensor, make(tensor))
        return held[1]

    def __getstate__(self) -> dict:
        return {"_held": {}}


def nearest_codewords(x: torch.Tensor, codebook: torch.Tensor) -> torch.Tensor:
    """int32 index of the nearest row of ``codebook [k, g]`` for each row of ``x [N, g]`` (CPU, float32):
    `codecs.vq.assign_codes` in one pass, no ``N x k`` distance block written to memory; over a few candidates
    per row when `index_codebook` has indexed this codebook (the same indices)."""
    c = codebook.float()
    out = np.empty(x.shape[0], np.int32)
    cells = _CELLS.get(_codebook_key(c))
    if cells is None:
        _nearest_codewords(_numpy(x.float()), _numpy(c.T), _numpy(c.pow(2).sum(1)), out)
    else:
        _nearest_in_cells(_numpy(x.float()), _numpy(c.T), _numpy(c.pow(2).sum(1)), np.float32(_CELL_LOW),
                          np.float32(_CELL_STEP), _CELLS_PER_DIM, *cells, out)
    return torch.from_numpy(out)



def level_codes(z: torch.Tensor, bounds: torch.Tensor, nan_last: bool) -> torch.Tensor:
    """uint8 codes ``[...]`` of ``z`` (CPU, float32) among ascending float32 ``bounds`` (at most 255): the number
    of bounds below each value, what `scalar_levels.quantize_unit`'s torch ops give (NaN: 0 as its comparisons
    give it, or with ``nan_last`` the number of bounds, as `torch.bucketize`), with no temporary per bound."""
    out = np.empty(z.numel(), np.uint8)
    _level_codes(_numpy(z.float()).reshape(-1), _numpy(bounds.float()), nan_last, out)
    return torch.from_numpy(out).view(z.shape)

# `index_codebook`'s grid: 10 cells per channel over [-3, 3) (the values' groups are scaled to unit RMS);
# a cell holds 4.6 candidates of 256 on average for the default Gaussian codebook, and a row outside it is
# searched in full. A candidate must be beaten by more than _CELL_MARGIN everywhere in its cell to be left
# out: far above float32 rounding of the distances (~1e-6), so the search picks what the full one does.
_CELLS_PER_DIM, _CELL_LOW, _CELL_MARGIN = 10, -3.0, 1e-3
_CELL_STEP = -2 * _CELL_LOW / _CELLS_PER_DIM
_CELLS: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}


def _codebook_key(codebook: torch.Tensor) -> bytes:
    return bytes(str(tuple(codebook.shape)), "ascii") + _numpy(codebook.float()).tobytes()


def index_codebook(codebook: torch.Tensor) -> None:
    """Index a fixed codebook ``[k <= 256, 4]`` for `nearest_codewords` (0.1-0.3 s, once per process and
    codebook): per cell of a grid over the scaled groups, the codewords that can be nearest to a point in it.
    The search then reads ~5 codewords per row instead of all (1.8x faster in place at 8K; the same indices).
    Other group sizes and codebooks (``v_fit="kmeans"`` fits one per block) keep the full search."""
    if numba is None or codebook.shape[-1] != 4 or codebook.shape[0] > 256:
        return
    c = codebook.detach().float().cpu()
    key = _codebook_key(c)
    if key not in _CELLS:
        _CELLS[key] = _codeword_cells(_numpy(c.T), _numpy(c.pow(2).sum(1)), np.float32(_CELL_LOW),
                                      np.float32(_CELL_STEP), _CELLS_PER_DIM, np.float32(_CELL_MARGIN))


_warmed: set = set()   # what `warm_up` has compiled or loaded in this process: scope counts, and "rest"


def warm_up(scopes: int = 1) -> None:
    """Compile (or load from numba's cache) the kernels now, on a tiny input, so the first decode
    step is not charged with it. ``scopes``: the caller's number of PCA scopes per layer (the kernels over a
    tuple of scopes are compiled once per tuple length: ~4 s each on a fresh machine, measured)."""
    if numba is None:
        return
    threading_layer_usable()
    for count in sorted({1, scopes} - _warmed):
        _warm_up_scopes(count)
        _warmed.add(count)
    if "rest" not in _warmed:
        _warm_up_rest()
        _warmed.add("rest")


def _warm_up_scopes(scopes: int) -> None:
    # the coded-block kernels over ``scopes`` PCA scopes of one head each
    from .pca import PCACode
    from .table_decoder import run_layout

    code = PCACode(mean=torch.zeros(2), basis_q=torch.zeros(2, 4, dtype=torch.int8), basis_scale=torch.ones(4),
                   coeff_step=torch.ones(4), codes=torch.zeros(1, 2, 1, dtype=torch.uint8), runs=[(2, 0, 4, 0, 1)])
    layout, codes = run_layout([code] * scopes), [code.codes] * scopes
    scaled, mean = torch.zeros(scopes, 4, 2), torch.zeros(scopes, 2)
    v_codes = torch.zeros(1, scopes, 2, 1, dtype=torch.uint8)
    for _ in each_kernel_variant():
        code_attention(torch.stack(codes, 1), layout, scaled, mean, torch.ones(1, 1, 2), torch.zeros(1, 1, 2),
                       torch.zeros(1, scopes, 1, 2), 1.0, None, v_codes, 8, 1, rows=torch.arange(2))
        parts = StepParts(torch.zeros(1, scopes, 1, 2), 1.0, 2)   # the decode step's layouts of the same kernels
        hidden = torch.zeros(1, scopes, 1, dtype=torch.int32)    # a row held apart (Shard's salient tokens)
        parts.code(codes, layout, scaled.transpose(1, 2), mean, torch.ones(1, 1, 2), torch.zeros(1, 1, 2), hidden, v_codes, 8, 1,
                   torch.arange(2), torch.zeros(256, 2), torch.ones(scopes, 2), torch.eye(2))
        parts.add(torch.zeros(1, scopes, 1, 2), torch.zeros(1, scopes, 1))
        parts.merged()
    scaled_bases((np.zeros((2, 1), np.int8),) * scopes, torch.ones(scopes, 1, 1), None)


def _warm_up_rest() -> None:
    # the kernels whose types do not depend on the scopes
    from .groupwise import quantize_groups
    from .lloyd_max import TurboCode, TurboQuantizer

    vectors = quantize_groups(torch.ones(1, 1, 1, 2), 8, 2)
    turbo = TurboQuantizer(4, 4)
    code = turbo.encode(torch.ones(1, 2, 1, 4))
    buffer = TurboCode(norm=torch.ones(2, 1, 2, 3, dtype=torch.float16),   # two heads: its first tokens' views
                       codes=torch.zeros(2, 1, 2, 3, 2, dtype=torch.uint8))  # are not contiguous, as in a step
    codes, norm = turbo_arrays(buffer)
    parts = StepParts(torch.zeros(1, 1, 1, 2), 1.0, 6)
    for dtype in (torch.float32, torch.float16):
        parts.exact(torch.zeros(1, 1, 1, 2, dtype=dtype), torch.zeros(1, 1, 1, 2, dtype=dtype))
    parts.int8(int8_arrays(vectors), int8_arrays(vectors), torch.float16)
    ring = ring_words(torch.zeros(2, 1, 1, 2, 2, dtype=torch.float16))
    parts.ring(ring, 2, torch.float16, None)
    parts.ring(ring, 2, torch.bfloat16, (torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)))
    parts = StepParts(torch.ones(1, 2, 1, 4), 1.0, 2)          # the stream: compact codes and a buffer's views
    parts.turbo(turbo, turbo_arrays(code), turbo_arrays(code))
    parts.turbo(turbo, (codes[0, ..., :1, :], norm[0, ..., :1]), (codes[1, ..., :1, :], norm[1, ..., :1]))
    turbo_encode_into(turbo, torch.ones(1, 1, 4), torch.zeros(1, 1, 2, dtype=torch.uint8),
                      torch.zeros(1, 1, dtype=torch.float16), 0)
    ring_step(turbo, ring_words(torch.zeros(2, 1, 2, 2, 4, dtype=torch.float16)), 0, torch.zeros(1, 2, 1, 4),
              torch.zeros(1, 2, 1, 4), *stream_words(buffer.codes, buffer.norm), 0)
    nearest_codewords(torch.zeros(1, 2), torch.zeros(2, 2))
    corners = torch.tensor([[-1.0] * 4, [1.0] * 4])
    index_codebook(corners)
    nearest_codewords(torch.zeros(1, 4), corners)
