"""float16 and bfloat16 words in the numba kernels (numba has no 16-bit float type): widened to float32 by the
CPU's conversion instruction where it has one (`NATIVE_HALF`) or by the bit formula, narrowed back rounded as
torch rounds, and the float32 bits a float16 range check compares."""

from __future__ import annotations

import numpy as np

from kvshrink.kernels.cpu import numba_support


def _native_half() -> bool:
    """Whether the machine numba compiles for converts float16 in one instruction (x86-64 with F16C, any arm64):
    elsewhere LLVM would call a library routine numba's JIT does not link, and the kernels keep the bit formula."""
    if not numba_support.available() or numba_support.numba.config.CPU_NAME not in (None, "host"):
        return False
    import platform

    from llvmlite import binding
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    try:             # (LLVM cannot read the host's features on every platform: then the bit formula)
        return machine in ("x86_64", "amd64") and bool(binding.get_host_cpu_features().get("f16c"))
    except RuntimeError:
        return False


NATIVE_HALF = _native_half()

# float32 +inf's bits, and the smallest float32 bits beyond float16's largest value (65504)
_F32_INF = 0x7F800000
_F32_FP16_OVERFLOW = int(np.array(65504.0, dtype=np.float32).view(np.uint32)) + 1
_HALF_POW2 = np.array([2.0 ** -24] + [2.0 ** (e - 25) for e in range(1, 32)], np.float32)


if numba_support.installed():
    import numba
    from llvmlite import ir as llvm_ir
    from numba import njit
    from numba.extending import intrinsic

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
