"""LRQK's decode kernels for the GPU path (Triton): proxy scores to per-KV-head attention mass, and an
attention that reads the selected slots by index (no gathered copy).

``proxy_mass``: the low-rank scores ``s = (q̂ · A_Kᵀ) · scaling`` of every candidate token for every query
of a factor head, turned into the estimated attention mass the selection ranks by: the softmax over the
candidates per query, summed over the queries of the group (``LRQKLayer._select``'s torch ops). Two
kernels over (row, block of tokens): the first writes each block's max and sum of exponentials per query,
and a row's last block to finish (`kernels.tickets`) combines them into the log-sum-exp; the second recomputes
the scores (r-long dot products, cheaper than storing them) and writes the mass once, ``[rows, n]`` float32, with each token's
ranking key (mass bits, then token index). ``torch.topk`` of the keys on the device then picks the top-k, ties
broken as on the CPU paths.

``gathered_attention``: exact attention of a KV head's query group over (1) the slots listed in
``slot_index`` (this step's selection, read by index inside the kernel), (2) a contiguous tail (the
window) and (3) the new token, with left padding hidden by token index; returns the output and the
log-sum-exp, float32.

Both run on CUDA tensors, or on CPU tensors in Triton's interpreter (tests, ``force_gpu_path``). Their
oracles are the torch ops of ``LRQKLayer`` (``kernel="reference"``); dot products run in IEEE float32.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvshrink.kernels import counting
from kvshrink.kernels.backend import triton as _load_triton
from kvshrink.kernels.tickets import counters, last_to_arrive

triton = _load_triton()   # ImportError naming the extra when Triton is missing; the interpreter set up first
import triton.language as tl  # noqa: E402

_FP16_MAX = tl.constexpr(65504.0)

__all__ = ["proxy_mass", "proxy_ranking", "proxy_mass_torch", "gathered_attention", "gathered_attention_torch",
           "SlotFill"]



def pow2(n: int, floor: int = 16) -> int:
    """The smallest power of two >= ``n`` and >= ``floor`` (Triton block sizes; ``tl.dot`` wants 16 or more)."""
    p = floor
    while p < n:
        p *= 2
    return p


@triton.jit
def _proxy_block(q_ptr, a_ptr, pad_ptr, row, blk, n, G, R, a_row_stride, a_tok_stride, scale,
                 HAS_PAD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Proxy scores ``[G, N]`` of one row's query group against token block ``blk`` (-inf where not
    visible), the block's token positions and their visibility."""
    g = tl.arange(0, BLOCK_G)
    r = tl.arange(0, BLOCK_R)
    t = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + row * G * R + g[:, None] * R + r[None, :], mask=(g[:, None] < G) & (r[None, :] < R),
                other=0.0).to(tl.float32)
    a = tl.load(a_ptr + row * a_row_stride + t[:, None] * a_tok_stride + r[None, :],
                mask=(t[:, None] < n) & (r[None, :] < R), other=0.0).to(tl.float32)
    s = tl.dot(q, tl.trans(a), input_precision="ieee") * scale          # [G, N]
    valid = t < n
    if HAS_PAD:
        valid = valid & (t >= tl.load(pad_ptr + row))
    return tl.where(valid[None, :], s, float("-inf")), t, valid


@triton.jit
def _proxy_stats(q_ptr, a_ptr, pad_ptr, m_ptr, l_ptr, lse_ptr, arrived_ptr, n, G, R, a_row_stride, a_tok_stride,
                 scale, n_blocks, HAS_PAD: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    # each block's max and sum of exponentials per query; the row's last block to finish combines them
    row = tl.program_id(0)
    blk = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    s, t, valid = _proxy_block(q_ptr, a_ptr, pad_ptr, row, blk, n, G, R, a_row_stride, a_tok_stride, scale,
                               HAS_PAD, BLOCK_G, BLOCK_R, BLOCK_N)
    m = tl.max(s, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l_sum = tl.sum(tl.exp(s - m_safe[:, None]), axis=1)
    out = (row * n_blocks + blk) * BLOCK_G + g
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l_sum)
    if last_to_arrive(arrived_ptr + row, n_blocks):
        _row_lse(m_ptr, l_ptr, lse_ptr, row, n_blocks, BLOCK_G, BLOCK_B)


@triton.jit
def _row_lse(m_ptr, l_ptr, lse_ptr, row, n_blocks, BLOCK_G: tl.constexpr, BLOCK_B: tl.constexpr):
    # one row's per-block maxima m and sums l [n_blocks, G] (other programs': read from L2) -> the log-sum-exp
    # over the row [G] (-inf where no candidate is visible)
    g = tl.arange(0, BLOCK_G)
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for b0 in range(0, n_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        m = tl.load(m_ptr + (row * n_blocks + b[:, None]) * BLOCK_G + g[None, :], mask=(b < n_blocks)[:, None],
                    other=float("-inf"), cache_modifier=".cg")
        top = tl.maximum(top, tl.max(m, 0))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros((BLOCK_G,), tl.float32)
    for b0 in range(0, n_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        at = (row * n_blocks + b[:, None]) * BLOCK_G + g[None, :]
        m = tl.load(m_ptr + at, mask=(b < n_blocks)[:, None], other=float("-inf"), cache_modifier=".cg")
        l_sum = tl.load(l_ptr + at, mask=(b < n_blocks)[:, None], other=0.0, cache_modifier=".cg")
        total += tl.sum(l_sum * tl.exp(m - top[None, :]), 0)
    tl.store(lse_ptr + row * BLOCK_G + g, top + tl.log(total))


@triton.jit
def _proxy_mass_kernel(q_ptr, a_ptr, pad_ptr, lse_ptr, mass_ptr, key_ptr, n, G, R, a_row_stride, a_tok_stride,
                      scale, HAS_PAD: tl.constexpr, COPIES: tl.constexpr, BLOCK_G: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # one KV row's mass over a token block, summed over its COPIES factor rows, and each token's ranking key:
    # the mass's float bits (NaN as inf: tied with it, as the CPU rule ranks it) above the token index, so a
    # top-k of the keys takes, of masses tied with the k-th, the latest tokens (`lrqk.top_k_in_token_order`)
    kv_row = tl.program_id(0)
    blk = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    total = tl.zeros((BLOCK_N,), tl.float32)
    for c in tl.static_range(COPIES):
        row = kv_row * COPIES + c
        s, t, valid = _proxy_block(q_ptr, a_ptr, pad_ptr, row, blk, n, G, R, a_row_stride, a_tok_stride, scale,
                                   HAS_PAD, BLOCK_G, BLOCK_R, BLOCK_N)
        lse = tl.load(lse_ptr + row * BLOCK_G + g)
        live = (g < G) & (lse > float("-inf"))
        keep = live[:, None] & valid[None, :]
        p = tl.where(keep, tl.exp(tl.where(keep, s, 0.0) - tl.where(live, lse, 0.0)[:, None]), 0.0)
        total += tl.sum(p, axis=0)
    t = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(mass_ptr + kv_row * n + t, total, mask=t < n)
    ranked = tl.where(total != total, float("inf"), total).to(tl.int32, bitcast=True).to(tl.int64)
    tl.store(key_ptr + kv_row * n + t, (ranked << 32) | t.to(tl.int64), mask=t < n)

@triton.jit
def _attend_block(acc, m_i, l_i, q, k, v, valid, scale):
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale        # [G, N]
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return acc, m_new, l_i

@triton.jit
def _bf16_bits(x):
    """bfloat16 bits (int16) of ``x``, rounded to nearest even as ``torch``'s ``.to(bfloat16)`` (NaN: 0x7FC0),
    in integer arithmetic: Triton's interpreter truncates some values when it converts."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _stored(x, dtype: tl.constexpr, BF16: tl.constexpr):
    """``x`` as a tensor of ``dtype`` stores it (bfloat16 as its int16 bits with ``BF16``)."""
    if BF16:
        return _bf16_bits(x)
    return x.to(dtype)


@triton.jit
def _as_float(x, BF16: tl.constexpr):
    """A stored value in float32 (``BF16``: from bfloat16's int16 bits)."""
    if BF16:
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _gathered_attention_kernel(q_ptr, sk_ptr, sv_ptr, sidx_ptr, stok_ptr, tk_ptr, tv_ptr, nk_ptr, nv_ptr,
                               pad_ptr, fill_ptr, rank_ptr, foff_ptr, ovf_ptr, out_ptr, lse_ptr, acc_ptr, ml_ptr,
                               arrived_ptr, G, D, S, n_sel, n_tail, tail_start, split_len, n_splits, scale,
                               HAS_PAD: tl.constexpr, HAS_FILL: tl.constexpr, CHECK: tl.constexpr,
                               BF16: tl.constexpr, SPLIT: tl.constexpr, BLOCK_G: tl.constexpr,
                               BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row, split): the selected slots ``split*split_len ..`` of the row; split 0 also the tail
    and the new token. ``HAS_FILL``: a selected token that missed (``rank >= 0``) is read from the filled rows
    (``fill [m, 2, D]``, the row's misses from ``foff[row]`` on), stored into its slot in the slots' dtype
    (``BF16``: slots as int16 bits; ``CHECK``: narrowing to float16, beyond its range sets ``ovf``) and
    attended as stored. One split: the normalised output and the log-sum-exp; several: each split's
    unnormalised sum, max and sum of exponentials, merged by the row's last split to finish."""
    row = tl.program_id(0)
    sp = tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    gm = g < G
    q = tl.load(q_ptr + row * G * D + g[:, None] * D + d[None, :], mask=gm[:, None] & dmask[None, :],
                other=0.0).to(tl.float32)
    first = 0
    if HAS_PAD:
        first = tl.load(pad_ptr + row)
    acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_G,), dtype=tl.float32)
    # (1) the selected slots, read by index (a miss: from the filled rows, then stored into its slot)
    lo = sp * split_len
    hi = tl.minimum(n_sel, lo + split_len)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        jm = j < hi
        slot = tl.load(sidx_ptr + row * n_sel + j, mask=jm, other=0)
        tok = tl.load(stok_ptr + row * n_sel + j, mask=jm, other=-1)
        off = (row * S + slot)[:, None] * D + d[None, :]
        km = jm[:, None] & dmask[None, :]
        if HAS_FILL:
            nth = tl.load(rank_ptr + row * n_sel + j, mask=jm, other=-1)
            miss = km & (nth >= 0)[:, None]
            held = km & (nth < 0)[:, None]
            at = (tl.load(foff_ptr + row) + nth)[:, None] * 2 * D + d[None, :]
            fk = tl.load(fill_ptr + at, mask=miss, other=0.0)
            fv = tl.load(fill_ptr + at + D, mask=miss, other=0.0)
            if CHECK:
                top = tl.max(tl.max(tl.maximum(tl.abs(fk.to(tl.float32)), tl.abs(fv.to(tl.float32))), axis=1), axis=0)
                tl.store(ovf_ptr, tl.full([], 1, tl.int8), mask=top > _FP16_MAX)
            fk = _stored(fk, sk_ptr.dtype.element_ty, BF16)
            fv = _stored(fv, sv_ptr.dtype.element_ty, BF16)
            tl.store(sk_ptr + off, fk, mask=miss)
            tl.store(sv_ptr + off, fv, mask=miss)
            k = tl.where(miss, _as_float(fk, BF16), _as_float(tl.load(sk_ptr + off, mask=held, other=0), BF16))
            v = tl.where(miss, _as_float(fv, BF16), _as_float(tl.load(sv_ptr + off, mask=held, other=0), BF16))
        else:
            k = _as_float(tl.load(sk_ptr + off, mask=km, other=0), BF16)
            v = _as_float(tl.load(sv_ptr + off, mask=km, other=0), BF16)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k, v, jm & (tok >= first), scale)
    if sp == 0:
        # (2) the contiguous tail (the window): token index tail_start + j
        for start in range(0, n_tail, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jm = j < n_tail
            off = (row * n_tail + j)[:, None] * D + d[None, :]
            km = jm[:, None] & dmask[None, :]
            k = tl.load(tk_ptr + off, mask=km, other=0.0).to(tl.float32)
            v = tl.load(tv_ptr + off, mask=km, other=0.0).to(tl.float32)
            acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k, v, jm & (tail_start + j >= first), scale)
        # (3) the new token (always visible: it follows the prompt's left padding)
        j = tl.arange(0, BLOCK_N)
        jm = j < 1
        off = row * D + (j * 0)[:, None] * D + d[None, :]
        km = jm[:, None] & dmask[None, :]
        k = tl.load(nk_ptr + off, mask=km, other=0.0).to(tl.float32)
        v = tl.load(nv_ptr + off, mask=km, other=0.0).to(tl.float32)
        acc, m_i, l_i = _attend_block(acc, m_i, l_i, q, k, v, jm, scale)
    if SPLIT:
        part = row * n_splits + sp
        tl.store(acc_ptr + (part * G + g[:, None]) * D + d[None, :], acc, mask=gm[:, None] & dmask[None, :])
        tl.store(ml_ptr + (part * 2) * G + g, m_i, mask=gm)
        tl.store(ml_ptr + (part * 2 + 1) * G + g, l_i, mask=gm)
        if last_to_arrive(arrived_ptr + row, n_splits):
            _merge_splits(acc_ptr, ml_ptr, out_ptr, lse_ptr, row, n_splits, G, D, BLOCK_G, BLOCK_D)
    else:
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * G * D + g[:, None] * D + d[None, :], out, mask=gm[:, None] & dmask[None, :])
        tl.store(lse_ptr + row * G + g, m_i + tl.log(l_i), mask=gm)


@triton.jit
def _merge_splits(acc_ptr, ml_ptr, out_ptr, lse_ptr, row, n_splits, G, D, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    # a row's splits' partial softmax sums (other programs': read from L2) merged: split 0 holds the new token, so
    # the maximum is finite; a split with nothing visible weighs 0
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    top = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    for sp in range(0, n_splits):
        top = tl.maximum(top, tl.load(ml_ptr + ((row * n_splits + sp) * 2) * G + g, mask=gm, other=0.0,
                                      cache_modifier=".cg"))
    total = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for sp in range(0, n_splits):
        part = row * n_splits + sp
        w = tl.exp(tl.load(ml_ptr + (part * 2) * G + g, mask=gm, other=0.0, cache_modifier=".cg") - top)
        total += w * tl.load(ml_ptr + (part * 2 + 1) * G + g, mask=gm, other=0.0, cache_modifier=".cg")
        acc += w[:, None] * tl.load(acc_ptr + (part * G + g[:, None]) * D + d[None, :],
                                    mask=gm[:, None] & (d < D)[None, :], other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + row * G * D + g[:, None] * D + d[None, :], (acc / total[:, None]).to(out_ptr.dtype.element_ty),
             mask=gm[:, None] & (d < D)[None, :])
    tl.store(lse_ptr + row * G + g, top + tl.log(total), mask=gm)


def _get() -> dict:
    return {"stats": _proxy_stats, "mass": _proxy_mass_kernel,
            "attention": _gathered_attention_kernel}


def proxy_mass(q_hat: torch.Tensor, a_k: torch.Tensor, candidates: int, scaling: float,
               first: torch.Tensor | None = None, block_n: int = 64) -> torch.Tensor:
    """Estimated attention mass ``[rows, n]`` (float32) of tokens ``0..n-1`` (n = ``candidates``).

    ``q_hat`` ``[rows, G, r]``: the query factors of each factor head (row); ``a_k`` ``[rows, T, r]``
    (``T >= n``, any float dtype, last dim contiguous): the key factors; ``first`` ``[rows]``: the first
    visible token of each row (left padding), or None. The mass is the softmax of the scores over the
    candidates per query, summed over the row's G queries (0 where a row has no visible candidate)."""
    return proxy_ranking(q_hat, a_k, candidates, scaling, first, block_n=block_n)[0]


def proxy_ranking(q_hat: torch.Tensor, a_k: torch.Tensor, candidates: int, scaling: float,
                  first: torch.Tensor | None = None, copies: int = 1, block_n: int = 64
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``proxy_mass`` summed over each KV row's ``copies`` consecutive factor rows (``[rows / copies, n]``), and
    each token's ranking key ``[rows / copies, n]`` int64 (`lrqk.token_order_keys`: the mass's bits above the
    token index), written by the same kernel: ``torch.topk`` of the keys is the CPU paths' tie rule at no
    extra launch."""
    kern = _get()
    rows, groups, rank = q_hat.shape
    if not (q_hat.dtype in (torch.float32, torch.float64) and q_hat.is_contiguous()):
        q_hat = q_hat.float().contiguous()   # (the kernels read float64 as float32, as `.float()` rounds it)
    if a_k.stride(-1) != 1:
        a_k = a_k.contiguous()
    bg, br = pow2(groups), pow2(rank)
    n_blocks = -(-candidates // block_n)
    dev = q_hat.device
    m = torch.empty(rows, n_blocks, bg, dtype=torch.float32, device=dev)
    l_sum = torch.empty_like(m)
    has_pad = first is not None
    pad = first.to(dev, torch.int64).contiguous() if has_pad else q_hat     # dummy pointer without padding
    lse = torch.empty(rows, bg, dtype=torch.float32, device=dev)
    with counting.kernel_launch("lrqk_stats"):
        kern["stats"][(rows, n_blocks)](
            q_hat, a_k, pad, m, l_sum, lse, counters(dev, rows), candidates, groups, rank, a_k.stride(0),
            a_k.stride(1), float(scaling), n_blocks, HAS_PAD=has_pad, BLOCK_G=bg, BLOCK_R=br, BLOCK_N=block_n,
            BLOCK_B=32)
    mass = torch.empty(rows // copies, candidates, dtype=torch.float32, device=dev)
    keys = torch.empty(rows // copies, candidates, dtype=torch.int64, device=dev)
    with counting.kernel_launch("lrqk_mass"):
        kern["mass"][(rows // copies, n_blocks)](
            q_hat, a_k, pad, lse, mass, keys, candidates, groups, rank, a_k.stride(0), a_k.stride(1),
            float(scaling), HAS_PAD=has_pad, COPIES=copies, BLOCK_G=bg, BLOCK_R=br, BLOCK_N=block_n)
    return mass, keys


def proxy_mass_torch(q_hat: torch.Tensor, a_k: torch.Tensor, candidates: int, scaling: float,
                     first: torch.Tensor | None = None) -> torch.Tensor:
    """The oracle of ``proxy_mass`` (``LRQKLayer._select``'s torch ops)."""
    logits = (q_hat.float() @ a_k[:, :candidates].float().transpose(-1, -2)) * scaling   # [rows, G, n]
    if first is not None:
        pad = torch.arange(candidates, device=logits.device)[None, :] < first.to(logits.device)[:, None]
        logits = logits.masked_fill(pad[:, None, :], float("-inf"))
    return torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(1)


class SlotFill(NamedTuple):
    """The rows a decode step's selection missed, for `gathered_attention` to store into their slots as it reads
    them: ``rows [m, 2, d]`` (key, value; any float dtype), ``rank [rows, k]`` each selected token's place among
    its row's misses (-1: held), ``offset [rows]`` the row's first entry in ``rows``, and ``overflow`` (0-dim
    bool) set where narrowing to float16 overflows (`kernels.lrqk_slots.slot_plan` writes rank and offset)."""

    rows: torch.Tensor
    rank: torch.Tensor
    offset: torch.Tensor
    overflow: torch.Tensor


def gathered_attention(query: torch.Tensor, slot_k: torch.Tensor, slot_v: torch.Tensor, slot_index: torch.Tensor,
                       slot_token: torch.Tensor, tail_k: torch.Tensor | None, tail_v: torch.Tensor | None,
                       new_k: torch.Tensor, new_v: torch.Tensor, tail_start: int, scaling: float,
                       first: torch.Tensor | None = None, block_n: int = 32,
                       splits: int | None = None, fill: SlotFill | None = None,
                       out_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``query [rows, G, d]`` over the slots ``slot_index [rows, k]`` of ``slot_k/slot_v
    [rows, S, d]`` (holding tokens ``slot_token [rows, k]``), the tail ``[rows, n, d]`` (tokens
    ``tail_start..``) and the new token ``[rows, d]``; tokens before ``first [rows]`` are hidden.
    Returns ``(out [rows, G, d]`` in ``out_dtype``, ``lse [rows, G]`` float32), in one launch; sums in float32.

    ``splits``: programs per row over the selected slots (split-K, for few rows and many slots: a decode
    step of one sequence has only B*H_kv rows); the row's last split to finish merges their partial sums.
    Default: enough to give the device ~128 programs, at least 64 slots each.

    ``fill``: the selection's misses, stored into their slots (contiguous ``slot_k/slot_v``, updated in place) in
    the slots' dtype as they are read (`SlotFill`)."""
    kern = _get()
    rows, groups, dim = query.shape
    q = query.contiguous()
    if fill is not None and not (slot_k.is_contiguous() and slot_v.is_contiguous()):
        raise ValueError("gathered_attention fills the slots in place: contiguous slot keys and values")
    slot_k, slot_v = slot_k.contiguous(), slot_v.contiguous()
    n_sel = slot_index.shape[1] if slot_index is not None else 0
    if n_sel:
        sidx, stok = slot_index.contiguous(), slot_token.contiguous()
    else:
        sidx = stok = torch.zeros(rows, 1, dtype=torch.int64, device=q.device)
    n_tail = tail_k.shape[1] if tail_k is not None else 0
    if n_tail:
        tk, tv = tail_k.contiguous(), tail_v.contiguous()
    else:
        tk, tv = new_k, new_v
    nk, nv = new_k.reshape(rows, dim).contiguous(), new_v.reshape(rows, dim).contiguous()
    if splits is None:
        splits = max(1, min(128 // max(rows, 1), -(-n_sel // 64)))
    split_len = -(-max(n_sel, 1) // max(1, splits))
    split_len = -(-split_len // block_n) * block_n
    splits = max(1, -(-n_sel // split_len))
    out = torch.empty(rows, groups, dim, dtype=out_dtype, device=q.device)
    lse = torch.empty(rows, groups, dtype=torch.float32, device=q.device)
    acc = torch.empty(rows, splits, groups, dim, dtype=torch.float32, device=q.device) if splits > 1 else out
    ml = torch.empty(rows, splits, 2, groups, dtype=torch.float32, device=q.device) if splits > 1 else lse
    has_pad = first is not None
    pad = first.to(q.device, torch.int64).contiguous() if has_pad else sidx
    has_fill = fill is not None and n_sel > 0 and fill.rows.shape[0] > 0
    stored = slot_k.dtype
    check = has_fill and stored == torch.float16 and fill.rows.dtype != torch.float16
    bf16 = stored == torch.bfloat16 and has_fill and fill.rows.dtype != torch.bfloat16   # rounded in integers
    if bf16:
        slot_k, slot_v = slot_k.view(torch.int16), slot_v.view(torch.int16)
    fill_rows, rank, offset, overflow = (fill.rows.contiguous(), fill.rank.contiguous(), fill.offset,
                                         fill.overflow.view(torch.int8)) if has_fill else (sidx,) * 4
    arrived = counters(q.device, rows) if splits > 1 else sidx
    with counting.kernel_launch("lrqk_attention"):
        kern["attention"][(rows, splits)](
            q, slot_k, slot_v, sidx, stok, tk, tv, nk, nv, pad, fill_rows, rank, offset, overflow, out, lse, acc,
            ml, arrived, groups, dim, slot_k.shape[1], n_sel, n_tail, int(tail_start), split_len, splits,
            float(scaling), HAS_PAD=has_pad, HAS_FILL=has_fill, CHECK=check, BF16=bf16, SPLIT=splits > 1,
            BLOCK_G=pow2(groups), BLOCK_D=pow2(dim), BLOCK_N=block_n)
    return out, lse


def gathered_attention_torch(query, slot_k, slot_v, slot_index, slot_token, tail_k, tail_v, new_k, new_v,
                             tail_start, scaling, first=None):
    """The oracle of ``gathered_attention``: a gathered copy, then plain softmax attention (float32)."""
    rows, _, dim = query.shape
    keys, values, index = [], [], []
    if slot_index is not None and slot_index.shape[1]:
        keys.append(slot_k.gather(1, slot_index[..., None].expand(-1, -1, dim)))
        values.append(slot_v.gather(1, slot_index[..., None].expand(-1, -1, dim)))
        index.append(slot_token)
    if tail_k is not None and tail_k.shape[1]:
        keys.append(tail_k)
        values.append(tail_v)
        index.append(torch.arange(tail_start, tail_start + tail_k.shape[1], device=query.device).expand(rows, -1))
    keys.append(new_k.reshape(rows, 1, dim))
    values.append(new_v.reshape(rows, 1, dim))
    index.append(torch.full((rows, 1), 1 << 62, device=query.device))
    k, v, idx = torch.cat(keys, 1).float(), torch.cat(values, 1).float(), torch.cat(index, 1)
    s = (query.float() @ k.transpose(-1, -2)) * scaling
    if first is not None:
        s = s.masked_fill((idx < first.to(idx.device)[:, None])[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.softmax(s, -1) @ v, lse
