"""LRQK's per-token factor update for the GPU path in one Triton launch per layer.

What ``LRQKLayer`` does on the CPU path with numba (``kernels.cpu.lrqk_factor.resident_decode_step``) and what
its torch ops do otherwise (``_resident_sums``, ``lowrank.factor_vectors_from_sums`` and two
``lowrank.line_search_basis_step``): for each factor head, the sums over the resident tokens (the slots
chosen last step and the window) ``AᵀA`` and ``(q·Kᵀ)A`` in float32, then the alternating closed-form
updates of ``q̂`` and ``k̂`` (``r x r`` ridge solves, in float64 as the torch path's) and the bases'
exact-line-search step, written in place. On the GPU path the torch ops took ~150 launches per layer and step;
this is one.

One program per factor head; the ``r x r`` systems live in registers (``r`` <= 64). Runs on CUDA tensors, or
on CPU tensors in Triton's interpreter; its oracle is the torch path. In the interpreter a program takes a
few tenths of a second (the eliminations are hundreds of small numpy ops), which made the GPU path's
end-to-end tests 10x slower; there the GPU path keeps the torch ops unless a test asks for the kernel
(`in_interpreter`): the kernel's own tests, one end-to-end test and the launch count do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kvshrink.kernels import counting
from kvshrink.kernels.backend import interpreting
from kvshrink.kernels.backend import triton as _load_triton
from kvshrink.kernels.lrqk_proxy import pow2

triton = _load_triton()   # ImportError naming the extra when Triton is missing; the interpreter set up first
import triton.language as tl  # noqa: E402

__all__ = ["factor_step", "runs", "in_interpreter"]

_BLOCK_T = 32          # resident tokens summed per block


_interpreted = False


def runs() -> bool:
    """Whether the GPU path takes this kernel: always on a device; in the interpreter when a test asks."""
    return _interpreted or not interpreting()


@contextlib.contextmanager
def in_interpreter(enabled: bool = True) -> Iterator[None]:
    """Run the kernel in Triton's interpreter too, within the block (tests)."""
    global _interpreted
    before, _interpreted = _interpreted, enabled
    try:
        yield
    finally:
        _interpreted = before


@triton.jit
def _pick_row(x, rows, i):
    """Row ``i`` of ``x`` ``[P, M]`` as ``[M]``."""
    return tl.sum(tl.where(rows[:, None] == i, x, 0.0), 0)


@triton.jit
def _pick_col(x, cols, j):
    """Column ``j`` of ``x`` ``[P, M]`` as ``[P]``."""
    return tl.sum(tl.where(cols[None, :] == j, x, 0.0), 1)


@triton.jit
def _ridged(a, n, RP: tl.constexpr):
    """``a + ridge·I`` over the ``n x n`` system (``lowrank._ridge_solve``'s relative ridge), identity on the
    padding (``n..RP-1``) so the padded system is the real one beside ``x = 0``."""
    idx = tl.arange(0, RP)
    eye = idx[:, None] == idx[None, :]
    real = idx < n
    diag = tl.sum(tl.where(eye, a, 0.0), 1)
    scale = tl.maximum(tl.sum(tl.where(real, tl.abs(diag), 0.0), 0) / n, 1e-30)
    pad = eye & ~(real[:, None] & real[None, :])
    return tl.where(pad, 1.0, a + tl.where(eye & real[:, None], 1e-9 * scale, 0.0))   # rel_eps 1e-9, as there


@triton.jit
def _solve(a, x, RP: tl.constexpr):
    """``a⁻¹ x`` for ``a [RP, RP]``, ``x [RP, M]`` (float64) by Gauss-Jordan elimination without pivoting: every
    system here is symmetric positive definite (Gram matrices plus the ridge), where elimination in order is
    stable, as Cholesky is (the CPU paths pivot; the answers agree to float64 rounding)."""
    rows = tl.arange(0, RP)
    for c in range(RP):        # a loop, not unrolled: the kernel stays small to compile
        row_c = _pick_row(a, rows, c)
        x_c = _pick_row(x, rows, c)
        pivot = tl.sum(tl.where(rows == c, row_c, 0.0), 0)
        f = tl.where(rows != c, _pick_col(a, rows, c) / pivot, 0.0)
        a = a - f[:, None] * row_c[None, :]
        x = x - f[:, None] * x_c[None, :]
    diag = tl.sum(tl.where(rows[:, None] == rows[None, :], a, 0.0), 1)
    return x / diag[:, None]


@triton.jit
def _line_search(basis, factors, targets):
    """``lowrank.line_search_basis_step`` of one head: ``basis [RP, DP]``, ``factors [GP, RP]``, ``targets
    [GP, DP]`` (float64) -> the new basis."""
    resid = tl.dot(factors, basis) - targets                                         # [GP, DP]
    grad = tl.dot(tl.trans(factors), resid)                                          # [RP, DP]
    a_grad = tl.dot(factors, grad)                                                   # [GP, DP]
    denom = tl.sum(tl.sum(a_grad * a_grad, 1), 0)
    num = tl.sum(tl.sum(a_grad * resid, 1), 0)
    step = tl.where(denom > 0, num / tl.maximum(denom, 1e-30), 0.0)
    return basis - step * grad


@triton.jit
def _resident_block(q, a_ptr, key_ptr, tokens, use, r_idx, d_idx, R, D, a_row_stride):
    """One block of resident tokens: their factor rows ``a [BT, RP]`` (read at ``tokens``) and scores ``q·key
    [GP, BT]`` (keys at ``key_ptr`` rows), float32, zero where not ``use``."""
    a = tl.load(a_ptr + tokens[:, None] * a_row_stride + r_idx[None, :], mask=use[:, None] & (r_idx < R)[None, :],
                other=0.0).to(tl.float32)
    keys = tl.load(key_ptr + d_idx[None, :], mask=use[:, None] & (d_idx < D)[None, :], other=0.0).to(tl.float32)
    return a, tl.dot(q, tl.trans(keys), input_precision="ieee")


@triton.jit
def _factor_step_kernel(q_ptr, k_ptr, bq_ptr, bk_ptr, a_ptr, tok_ptr, chosen_ptr, sk_ptr, wk_ptr, qh_ptr, kh_ptr,
                        G, D, R, S, W, win_start, copies, a_head_stride, a_row_stride, lam,
                        ITERS: tl.constexpr, UPDATE: tl.constexpr, GP: tl.constexpr, DP: tl.constexpr,
                        RP: tl.constexpr, BLOCK_T: tl.constexpr):
    n = tl.program_id(0)
    h = n // copies
    g = tl.arange(0, GP)
    dd = tl.arange(0, DP)
    rr = tl.arange(0, RP)
    gm, dm, rm = g < G, dd < D, rr < R
    q = tl.load(q_ptr + (n * G + g[:, None]) * D + dd[None, :], mask=gm[:, None] & dm[None, :],
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + n * D + dd, mask=dm, other=0.0).to(tl.float32)
    a_head = a_ptr + n * a_head_stride
    # resident sums over the slots chosen last step and the window (float32, as the torch path's products)
    lhs_res = tl.zeros((RP, RP), tl.float32)
    rhs_res = tl.zeros((GP, RP), tl.float32)
    for t0 in range(0, S, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        inside = t < S
        tok = tl.load(tok_ptr + h * S + t, mask=inside, other=-1)
        use = inside & (tl.load(chosen_ptr + h * S + t, mask=inside, other=0) != 0) & (tok >= 0)
        a, scores = _resident_block(q, a_head, sk_ptr + ((h * S + t) * D)[:, None], tl.where(use, tok, 0), use,
                                    rr, dd, R, D, a_row_stride)
        lhs_res += tl.dot(tl.trans(a), a, input_precision="ieee")
        rhs_res += tl.dot(scores, a, input_precision="ieee")
    for t0 in range(0, W, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        use = t < W
        a, scores = _resident_block(q, a_head, wk_ptr + ((h * W + t) * D)[:, None], win_start + t, use,
                                    rr, dd, R, D, a_row_stride)
        lhs_res += tl.dot(tl.trans(a), a, input_precision="ieee")
        rhs_res += tl.dot(scores, a, input_precision="ieee")
    # the r x r updates in float64 (factor_vectors_from_sums)
    qd, kd = q.to(tl.float64), k.to(tl.float64)
    basis = (rr[:, None] * D + dd[None, :])
    bmask = rm[:, None] & dm[None, :]
    bq = tl.load(bq_ptr + n * R * D + basis, mask=bmask, other=0.0).to(tl.float64)
    bk = tl.load(bk_ptr + n * R * D + basis, mask=bmask, other=0.0).to(tl.float64)
    bq_gram = tl.dot(bq, tl.trans(bq))
    bk_gram = tl.dot(bk, tl.trans(bk))
    qk = tl.sum(qd * kd[None, :], 1)                                                 # [GP]
    rhs_base = lam * tl.dot(qd, tl.trans(bq)) + rhs_res.to(tl.float64)              # [GP, RP]
    lhs_base = lam * bq_gram + lhs_res.to(tl.float64)
    bk_k = tl.sum(bk * kd[None, :], 1)                                               # [RP]
    first = (g == 0)[None, :]                                                        # a vector as column 0
    kh = tl.sum(tl.where(first, _solve(_ridged(bk_gram, R, RP), tl.where(first, bk_k[:, None], 0.0), RP), 0.0), 1)
    qh = tl.zeros((GP, RP), tl.float64)
    for _ in tl.static_range(ITERS):
        lhs = lhs_base + kh[:, None] * kh[None, :]
        rhs_t = tl.trans(rhs_base) + kh[:, None] * qk[None, :]                        # [RP, GP]
        qh = tl.trans(_solve(_ridged(lhs, R, RP), rhs_t, RP))                          # [GP, RP]
        lhs_k = tl.dot(tl.trans(qh), qh) + lam * bk_gram
        rhs_k = tl.sum(qk[:, None] * qh, 0) + lam * bk_k
        kh = tl.sum(tl.where(first, _solve(_ridged(lhs_k, R, RP), tl.where(first, rhs_k[:, None], 0.0), RP), 0.0), 1)
    tl.store(qh_ptr + (n * G + g[:, None]) * R + rr[None, :], qh, mask=gm[:, None] & rm[None, :])
    tl.store(kh_ptr + n * R + rr, kh, mask=rm)
    if UPDATE:
        tl.store(bq_ptr + n * R * D + basis, _line_search(bq, qh, qd).to(tl.float32), mask=bmask)
        kh_rows = tl.where((g == 0)[:, None], kh[None, :], 0.0)                       # [GP, RP]: k̂ in row 0
        k_rows = tl.where((g == 0)[:, None], kd[None, :], 0.0)
        tl.store(bk_ptr + n * R * D + basis, _line_search(bk, kh_rows, k_rows).to(tl.float32), mask=bmask)


_READ_AS_FLOAT = (torch.float32, torch.bfloat16, torch.float16)   # (exactly, as ``.float()`` would)


def factor_step(query: torch.Tensor, key: torch.Tensor, b_q: torch.Tensor, b_k: torch.Tensor, factors: torch.Tensor,
                slot_token: torch.Tensor, slot_chosen: torch.Tensor, slot_keys: torch.Tensor,
                window_keys: torch.Tensor, window_start: int, copies: int, lam: float, update_bases: bool,
                iters: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernels.cpu.lrqk_factor.resident_decode_step`` in one launch: ``(q̂ [N, G, r], k̂ [N, r])`` float64; the float32
    contiguous bases ``b_q``/``b_k`` ``[N, r, d]`` take the line-search step in place when ``update_bases``.

    ``query [N, G, d]``, ``key [N, d]`` (float32, or the model's 16-bit dtype: read as float32); ``factors [N, T, r]`` (any float dtype, last dim contiguous):
    every token's key factors per factor head; the resident tokens are the slots ``slot_chosen [R, S]`` marks
    (tokens ``slot_token [R, S]``, keys ``slot_keys [R, S, d]``) and the window (keys ``window_keys [R, W, d]``,
    factor rows ``window_start ..``); factor head ``n`` reads KV row ``n // copies``."""
    n, g, d = query.shape
    r = b_q.shape[1]
    if not (b_q.is_contiguous() and b_k.is_contiguous() and b_q.dtype == b_k.dtype == torch.float32):
        raise ValueError("factor_step: the bases must be contiguous float32 (they are updated in place)")
    if r > 64:
        raise ValueError(f"factor_step: rank {r} is above the kernel's 64")
    if factors.stride(-1) != 1:
        factors = factors.contiguous()
    device = query.device
    q_hat = torch.empty(n, g, r, dtype=torch.float64, device=device)
    k_hat = torch.empty(n, r, dtype=torch.float64, device=device)
    s, w = slot_token.shape[1], window_keys.shape[1]
    with counting.kernel_launch("lrqk_factor_step"):
        _factor_step_kernel[(n,)](
            *(x.contiguous() if x.dtype in _READ_AS_FLOAT else x.float().contiguous() for x in (query, key)), b_q, b_k, factors, slot_token.contiguous(),
            slot_chosen.contiguous().view(torch.uint8), slot_keys.contiguous(), window_keys.contiguous(),
            q_hat, k_hat, g, d, r, s, w, int(window_start), int(copies), factors.stride(0), factors.stride(1),
            float(lam), ITERS=int(iters), UPDATE=bool(update_bases), GP=pow2(g), DP=pow2(d), RP=pow2(r),
            BLOCK_T=_BLOCK_T)
    return q_hat, k_hat
