"""The Triton kernel behind ``kvshrink.kernels.exact_attention`` (imported only through ``_kernel()`` there;
``kvshrink.kernels.backend.triton().jit`` chooses the interpreter when no GPU is present)."""

from kvshrink.kernels.backend import triton as _load_triton

triton = _load_triton()
import triton.language as tl  # noqa: E402

# tl.reduce with the library's own combine functions is what tl.max / tl.sum do, and the interpreter
# recognises those (numpy, not a Python loop per element); the local ones are a fallback for a Triton
# without them.


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_SUM = getattr(tl.standard, "_sum_combine", _add_combine)


@triton.jit
def _tile_scores(q, k, scaling, COMPUTE_FP32: tl.constexpr):
    """``[M, N]`` scaled scores of queries ``q [M, D]`` against keys ``k [D, N]`` (fp32 accumulation)."""
    if COMPUTE_FP32:
        s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, k.to(q.dtype))
    return s * scaling


@triton.jit
def _online_softmax_tile(s, v, m_i, l_i, acc, COMPUTE_FP32: tl.constexpr):
    """The running row maximum ``m_i``, sum ``l_i`` and output ``acc`` after one tile of masked scores
    ``s [M, N]`` (``-inf`` where invisible) and its values ``v [N, D]`` (flash attention)."""
    m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
    if COMPUTE_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def _normalised(acc, l_i, m_i):
    """``(out, lse)`` of the rows; a row that saw no key gets ``out = 0`` and ``lse = -inf``."""
    seen_any = l_i > 0.0
    out = tl.where(seen_any[:, None], acc / tl.where(seen_any, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen_any, m_i + tl.log(tl.where(seen_any, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _exact_attention_kernel(
    Q, K, V, O, L, KIDX, PAD, QIDX, NK, NV,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_os, stride_om, stride_od,
    stride_lb, stride_lh, stride_ls, stride_lm,
    stride_ib, stride_in,
    stride_nkb, stride_nkh, stride_nkd, stride_nvb, stride_nvh, stride_nvd,
    n_kv_heads, groups, n_rows, q_len, n_keys, head_dim, keys_per_split, key_start, scaling,
    HAS_KIDX: tl.constexpr, HAS_PAD: tl.constexpr, HAS_QIDX: tl.constexpr, HAS_NEW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPUTE_FP32: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    b = pid_bh // n_kv_heads
    h = pid_bh % n_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # grouped query rows: head g = row // q_len
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    dim_ok = dims < head_dim
    q_head = h * groups + rows // q_len  # query head of each grouped row, and its query position
    q_ptrs = (Q + b * stride_qb + q_head[:, None] * stride_qh + (rows % q_len)[:, None] * stride_qm
              + dims[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if COMPUTE_FP32:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)

    if HAS_PAD:
        pad = tl.load(PAD + b).to(tl.int64)
    if HAS_QIDX:
        qidx = tl.load(QIDX + rows % q_len, mask=row_ok, other=0).to(tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)

    lo = pid_s * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_keys)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < hi
        k_ptrs = K + b * stride_kb + h * stride_kh + cols[None, :] * stride_kn + dims[:, None] * stride_kd
        k = tl.load(k_ptrs, mask=col_ok[None, :] & dim_ok[:, None], other=0.0)  # [D, N]
        v_ptrs = V + b * stride_vb + h * stride_vh + cols[:, None] * stride_vn + dims[None, :] * stride_vd
        v = tl.load(v_ptrs, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # [N, D]
        s = _tile_scores(q, k, scaling, COMPUTE_FP32)
        visible = row_ok[:, None] & col_ok[None, :]
        if HAS_KIDX or HAS_PAD or HAS_QIDX:
            if HAS_KIDX:
                kidx = tl.load(KIDX + b * stride_ib + cols * stride_in, mask=col_ok, other=0).to(tl.int64)
            else:
                kidx = (key_start + cols).to(tl.int64)
            seen = col_ok
            if HAS_PAD:
                seen = seen & (kidx >= pad)
            if HAS_QIDX:
                causal = (kidx[None, :] <= qidx[:, None]) & seen[None, :]
                own = kidx[None, :] == qidx[:, None]
                visible = visible & (causal | own)
            else:
                visible = visible & seen[None, :]
        m_i, l_i, acc = _online_softmax_tile(tl.where(visible, s, float("-inf")), v, m_i, l_i, acc, COMPUTE_FP32)

    if HAS_NEW:
        if pid_s == tl.num_programs(2) - 1:   # one key every row sees, in its own dtype, in fp32
            nk = tl.load(NK + b * stride_nkb + h * stride_nkh + dims * stride_nkd, mask=dim_ok, other=0.0)
            nv = tl.load(NV + b * stride_nvb + h * stride_nvh + dims * stride_nvd, mask=dim_ok, other=0.0)
            s_new = tl.reduce(q.to(tl.float32) * nk.to(tl.float32)[None, :], 1, _SUM) * scaling
            s_new = tl.where(row_ok, s_new, float("-inf"))
            m_new = tl.maximum(m_i, s_new)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p_new = tl.exp(s_new - m_safe)
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * nv.to(tl.float32)[None, :]
            m_i = m_new

    out, lse = _normalised(acc, l_i, m_i)
    o_ptrs = (O + b * stride_ob + q_head[:, None] * stride_oh + pid_s * stride_os
              + (rows % q_len)[:, None] * stride_om + dims[None, :] * stride_od)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    l_ptrs = L + b * stride_lb + q_head * stride_lh + pid_s * stride_ls + (rows % q_len) * stride_lm
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _dequantized_tile(CODES, STEP, ZERO, vec, vec_ok, dims, dim_ok, head_dim, KV_DTYPE: tl.constexpr):
    """``[N, D]``: the token vectors ``vec`` of an 8-bit code (``codes * step + zero`` in fp32, rounded to
    ``KV_DTYPE`` as ``SalientTokens.key_values`` rounds them); rows past the end are 0."""
    ok = vec_ok[:, None] & dim_ok[None, :]
    codes = tl.load(CODES + vec[:, None] * head_dim + dims[None, :], mask=ok, other=0).to(tl.float32)
    step = tl.load(STEP + vec, mask=vec_ok, other=0.0).to(tl.float32)
    zero = tl.load(ZERO + vec, mask=vec_ok, other=0.0).to(tl.float32)
    return _rounded(codes * step[:, None] + zero[:, None], KV_DTYPE)


@triton.jit
def _rounded(x, KV_DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to ``KV_DTYPE`` to nearest, ties to even, as torch rounds: bfloat16 by hand, since
    Triton's interpreter truncates to it (finite ``x``: decoded codes)."""
    if KV_DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(KV_DTYPE)


@triton.jit
def _int8_attention_kernel(
    Q, K_CODES, K_STEP, K_ZERO, V_CODES, V_STEP, V_ZERO, COUNTS, O, L,
    stride_qb, stride_qh, stride_qm, stride_qd,
    n_kv_heads, groups, n_rows, q_len, head_dim, scaling,
    NUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    COMPUTE_FP32: tl.constexpr, KV_DTYPE: tl.constexpr,
):
    """Attention of the grouped queries of one KV head over ``NUM`` sets of token vectors held as 8-bit
    codes (tuples: ``K_CODES[i]`` ``[B, H_kv, COUNTS[i], d]`` uint8 contiguous, ``K_STEP[i]``/``K_ZERO[i]``
    ``[B, H_kv, COUNTS[i]]`` fp16, the same for values), decoded in registers: no decoded copy in memory.
    Every key is visible (middle tokens: never padding, never in the future). ``O [B, H_q, q, d]`` and
    ``L [B, H_q, q]`` float32, contiguous."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    h = pid_bh % n_kv_heads
    b = pid_bh // n_kv_heads

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    dim_ok = dims < head_dim
    q_head = h * groups + rows // q_len
    q_ptrs = (Q + b * stride_qb + q_head[:, None] * stride_qh + (rows % q_len)[:, None] * stride_qm
              + dims[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) if COMPUTE_FP32 else q.to(KV_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for i in tl.static_range(NUM):
        count = COUNTS[i]
        first = pid_bh.to(tl.int64) * count  # this head's first vector in the [B, H_kv, count] layout
        for start in range(0, count, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_ok = cols < count
            vec = first + cols
            k = _dequantized_tile(K_CODES[i], K_STEP[i], K_ZERO[i], vec, col_ok, dims, dim_ok, head_dim, KV_DTYPE)
            v = _dequantized_tile(V_CODES[i], V_STEP[i], V_ZERO[i], vec, col_ok, dims, dim_ok, head_dim, KV_DTYPE)
            s = _tile_scores(q, tl.trans(k), scaling, COMPUTE_FP32)
            s = tl.where(row_ok[:, None] & col_ok[None, :], s, float("-inf"))
            m_i, l_i, acc = _online_softmax_tile(s, v, m_i, l_i, acc, COMPUTE_FP32)

    out, lse = _normalised(acc, l_i, m_i)
    flat = (b * n_kv_heads * groups + q_head) * q_len + rows % q_len   # (b, query head, query) row of O
    tl.store(O + flat[:, None] * head_dim + dims[None, :], out, mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(L + flat, lse, mask=row_ok)


@triton.jit
def _combine_splits_kernel(
    OP, LP, O, L,
    stride_pb, stride_ps, stride_ph, stride_pm, stride_pd,
    stride_qb, stride_qs, stride_qh, stride_qm,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    n_splits, n_heads, q_len, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program per (row, query head, query): merge the key splits' partials by log-sum-exp."""
    pid = tl.program_id(0)
    t = pid % q_len
    h = (pid // q_len) % n_heads
    b = pid // (q_len * n_heads)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < n_splits
    d_ok = d < head_dim
    lse = tl.load(LP + b * stride_qb + s * stride_qs + h * stride_qh + t * stride_qm, mask=s_ok, other=float("-inf"))
    m = tl.reduce(lse, 0, _MAX)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)  # a split that saw nothing (lse -inf) weighs 0
    total = tl.reduce(w, 0, _SUM)
    o = tl.load(OP + b * stride_pb + s[:, None] * stride_ps + h * stride_ph + t * stride_pm + d[None, :] * stride_pd,
                mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    acc = tl.reduce(o * w[:, None], 0, _SUM)
    seen = total > 0.0
    out = tl.where(seen, acc / tl.where(seen, total, 1.0), 0.0)
    lse_all = tl.where(seen, m_safe + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    tl.store(O + b * stride_ob + h * stride_oh + t * stride_om + d * stride_od, out.to(O.dtype.element_ty), mask=d_ok)
    tl.store(L + b * stride_lb + h * stride_lh + t * stride_lm, lse_all)


@triton.jit
def _merge_partials_kernel(OUTS, LSES, O, L, rows, head_dim, NUM: tl.constexpr, BLOCK_R: tl.constexpr,
                           BLOCK_D: tl.constexpr):
    """``NUM`` partials over disjoint token sets (``OUTS``: a tuple of ``[rows, d]`` float32, ``LSES`` of
    ``[rows]``) merged into the softmax over their union, as ``cache.attention.merge_partials`` does:
    the log-sum-exp of the lses (maximum first), then the outputs weighted by ``exp(lse_i - lse)``."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    r_ok = r < rows
    ok = r_ok[:, None] & (d < head_dim)[None, :]
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for i in tl.static_range(NUM):
        top = tl.maximum(top, tl.load(LSES[i] + r, mask=r_ok, other=float("-inf")))
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.full((BLOCK_R,), 0.0, tl.float32)
    for i in tl.static_range(NUM):
        total += tl.exp(tl.load(LSES[i] + r, mask=r_ok, other=float("-inf")) - shift)
    seen = total > 0.0
    lse = tl.where(seen, shift + tl.log(tl.where(seen, total, 1.0)), float("-inf"))
    base = tl.where(seen, lse, 0.0)   # a row no part saw: every weight 0
    acc = tl.full((BLOCK_R, BLOCK_D), 0.0, tl.float32)
    for i in tl.static_range(NUM):
        w = tl.exp(tl.load(LSES[i] + r, mask=r_ok, other=float("-inf")) - base)
        acc += tl.load(OUTS[i] + r[:, None] * head_dim + d[None, :], mask=ok, other=0.0) * w[:, None]
    tl.store(O + r[:, None] * head_dim + d[None, :], acc.to(O.dtype.element_ty), mask=ok)
    tl.store(L + r, lse, mask=r_ok)
