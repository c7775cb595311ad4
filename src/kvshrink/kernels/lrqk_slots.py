"""LRQK's bookkeeping on the GPU path in Triton: the slot plan (one launch: which selected tokens miss, the
slot each takes, the policy state, and the packed miss plan that is the step's one copy to the host), and the
decode step's commit (one launch: the window shifted and the key factors appended, checked for float16's range,
the token staged for the slow tier). The missing rows, once on the device, are stored into their slots by the
attention that reads them (`lrqk_proxy.gathered_attention`'s ``fill``).

``slot_plan`` does what ``SlotTier.select_device``'s tensor ops did (about 50 launches per layer and step; they
stay as ``SlotTier._plan_torch``, the oracle of the tests, taken when ``SlotTier.plan_kernel`` is off). Per row
(one KV head of one batch row), one program:

- ``current[j]``: the slot holding selected token ``j``, or -1 (it misses); ``stays[s]``: slot ``s`` holds a
  selected token. Found by comparing the selection with the slots' tokens a tile at a time (no dense
  per-token map of the context's length: ``k·capacity`` comparisons, 4 M per row at top-k 2048; the ranks
  below as many);
- the eviction order: empty slots first, then by policy value, selected residents last, ties by slot
  (``argsort(stable=True)``), as each slot's rank among the row's priorities; the ``i``-th missing token (in
  selection order) takes the slot of rank ``i``;
- the tokens, policy values and chosen flags of the slots updated as the torch ops update them;
- the row's missing tokens' sources (a slow-tier row, or ``-1 - position`` in last step's prefetched rows)
  and destinations, and their count.

The last row program to finish (`kernels.tickets`) packs the rows' misses row-major into the plan (each row's
offset the sum of the counts before it), with the total, the overflow flag and the tokens to prefetch after them.
"""

from __future__ import annotations

import torch

from kvshrink.kernels import counting
from kvshrink.kernels.backend import triton as _load_triton
from kvshrink.kernels.lrqk_proxy import _FP16_MAX, _stored
from kvshrink.kernels.lrqk_proxy import pow2 as _pow2
from kvshrink.kernels.tickets import counters, last_to_arrive

triton = _load_triton()   # ImportError naming the extra when Triton is missing; the interpreter set up first
import triton.language as tl  # noqa: E402

__all__ = ["slot_plan", "commit_token"]

_POLICY_CODE = {"set": 0, "lru": 1, "attention": 2}
_TILE = 16     # tokens compared (or priorities ranked) per loop iteration


@triton.jit
def _slot_plan_rows(SEL, TOK, SCORE, CHOSEN, MASS, PF, PRIO, ORDER, SLOT, SRC, DST, COUNT, RANK, OFFSET,
                    OVF, AHEAD, PLAN, DEST, ARRIVED, rows, k, cap, e, slow_rows, step, n_ahead,
                    POLICY: tl.constexpr, HAS_MASS: tl.constexpr, HAS_PF: tl.constexpr, HAS_OVF: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, TILE: tl.constexpr, BLOCK_A: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    j_ok = j < k
    s = tl.arange(0, BLOCK_C)
    s_ok = s < cap
    t = tl.arange(0, TILE)
    sel = tl.load(SEL + row * k + j, mask=j_ok, other=-2)
    tok = tl.load(TOK + row * cap + s, mask=s_ok, other=-1)
    score = tl.load(SCORE + row * cap + s, mask=s_ok, other=0.0)
    # membership, a tile of slots (of selected tokens) at a time
    current = tl.full([BLOCK_K], -1, tl.int64)
    for c0 in range(0, cap, TILE):
        c = c0 + t
        held = tl.load(TOK + row * cap + c, mask=c < cap, other=-1)
        hit = (sel[:, None] == held[None, :]) & (held[None, :] >= 0) & j_ok[:, None]
        current = tl.maximum(current, tl.max(tl.where(hit, c[None, :].to(tl.int64), -1), axis=1))
    stays = tl.zeros([BLOCK_C], tl.int32)
    for j0 in range(0, k, TILE):
        jj = j0 + t
        chosen_tok = tl.load(SEL + row * k + jj, mask=jj < k, other=-2)
        hit = (tok[:, None] == chosen_tok[None, :]) & (tok[:, None] >= 0) & s_ok[:, None]
        stays = tl.maximum(stays, tl.max(hit.to(tl.int32), axis=1))
    # eviction order: each slot's rank among the row's priorities (ties by slot: a stable argsort)
    prio = tl.where(tok < 0, float("-inf"), tl.where(stays > 0, float("inf"), score))
    tl.store(PRIO + row * cap + s, prio, mask=s_ok)
    tl.debug_barrier()
    rank = tl.zeros([BLOCK_C], tl.int32)
    for c0 in range(0, cap, TILE):
        c = c0 + t
        other = tl.load(PRIO + row * cap + c, mask=c < cap, other=float("inf"))
        before = (other[None, :] < prio[:, None]) | ((other[None, :] == prio[:, None]) & (c[None, :] < s[:, None]))
        rank += tl.sum((before & (c[None, :] < cap)).to(tl.int32), axis=1)
    tl.store(ORDER + row * cap + rank, s, mask=s_ok)
    tl.debug_barrier()
    # the i-th missing token takes the slot of rank i
    missing = j_ok & (current < 0)
    nth = tl.cumsum(missing.to(tl.int32), axis=0) - 1
    slot = tl.where(missing, tl.load(ORDER + row * cap + nth, mask=missing, other=0).to(tl.int64), current)
    tl.store(SLOT + row * k + j, slot, mask=j_ok)
    # the policy state of the chosen slots (distinct: the selection's tokens are)
    kept = tl.load(SCORE + row * cap + slot, mask=j_ok, other=0.0)
    new_score = tl.where(missing, 0.0, kept)
    if POLICY == 1:
        new_score = tl.zeros([BLOCK_K], tl.float32) + step
    if POLICY == 2:
        if HAS_MASS:
            new_score = new_score + tl.load(MASS + row * k + j, mask=j_ok, other=0.0)
    tl.debug_barrier()
    tl.store(SCORE + row * cap + slot, new_score, mask=j_ok)
    tl.store(TOK + row * cap + slot, sel, mask=j_ok)
    tl.store(CHOSEN + row * cap + s, tl.zeros([BLOCK_C], tl.int8), mask=s_ok)
    tl.debug_barrier()
    tl.store(CHOSEN + row * cap + slot, tl.full([BLOCK_K], 1, tl.int8), mask=j_ok)
    # where each missing row comes from: last step's prefetched rows, else the slow tier
    src = sel * slow_rows + row
    if HAS_PF:
        found = tl.full([BLOCK_K], -1, tl.int64)
        for p0 in range(0, e, TILE):
            p = p0 + t
            pf = tl.load(PF + row * e + p, mask=p < e, other=-1)
            hit = (sel[:, None] == pf[None, :]) & (pf[None, :] >= 0)
            found = tl.maximum(found, tl.max(tl.where(hit, p[None, :].to(tl.int64), -1), axis=1))
        src = tl.where(found >= 0, -1 - (row * e + found), src)
    tl.store(SRC + row * k + nth, src, mask=missing)
    tl.store(DST + row * k + nth, row * cap + slot, mask=missing)
    tl.store(RANK + row * k + j, tl.where(missing, nth, -1).to(tl.int64), mask=j_ok)
    tl.store(COUNT + row, tl.sum(missing.to(tl.int64), axis=0))
    if last_to_arrive(ARRIVED, rows):
        _pack_plan(SRC, DST, COUNT, OFFSET, OVF, AHEAD, PLAN, DEST, rows, k, n_ahead, HAS_OVF, BLOCK_K, BLOCK_A)


@triton.jit
def _pack_plan(SRC, DST, COUNT, OFFSET, OVF, AHEAD, PLAN, DEST, rows, k, n_ahead,
               HAS_OVF: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_A: tl.constexpr):
    """The rows' misses packed row-major into the plan and ``DEST`` (each row's first place in ``OFFSET``), then
    their total, the overflow flag (-1 without one) and the tokens to prefetch; by the last row program to finish
    (the rows' entries read from L2)."""
    j = tl.arange(0, BLOCK_K)
    offset = tl.zeros([], tl.int64)
    for row in range(0, rows):
        tl.store(OFFSET + row, offset)
        mine = tl.load(COUNT + row, cache_modifier=".cg")
        ok = j < mine
        tl.store(PLAN + offset + j, tl.load(SRC + row * k + j, mask=ok, other=0, cache_modifier=".cg"), mask=ok)
        tl.store(DEST + offset + j, tl.load(DST + row * k + j, mask=ok, other=0, cache_modifier=".cg"), mask=ok)
        offset += mine
    n = rows * k
    tl.store(PLAN + n, offset)
    if HAS_OVF:
        tl.store(PLAN + n + 1, tl.load(OVF).to(tl.int64))
    else:
        tl.store(PLAN + n + 1, -1)
    a = tl.arange(0, BLOCK_A)
    tl.store(PLAN + n + 2 + a, tl.load(AHEAD + a, mask=a < n_ahead, other=0), mask=a < n_ahead)


def slot_plan(selected: torch.Tensor, token: torch.Tensor, score: torch.Tensor, chosen: torch.Tensor, policy: str,
              step: int, slow_rows: int, mass: torch.Tensor | None = None, overflow: torch.Tensor | None = None,
              prefetched_tokens: torch.Tensor | None = None, ahead: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``SlotTier.select_device``'s bookkeeping in one launch (see the module's docstring). ``selected [rows, k]``
    (int64, distinct per row), the slots' ``token [rows, S]`` (int64, -1: empty), ``score [rows, S]`` (float32)
    and ``chosen [rows, S]`` (bool), contiguous, updated in place; ``mass [rows, k]`` (the ``attention``
    policy's masses), ``overflow`` (0-dim bool), ``prefetched_tokens [rows, e]`` and ``ahead [rows, a]`` or
    None. Returns ``(slot [rows, k], plan [rows·k + 2 + a], dest [rows·k], rank [rows, k], offset [rows])``, int64:
    the plan holds the misses' sources row-major in its first entries, then their count, the overflow flag (-1
    without one) and ``ahead``; ``dest`` their flat slot rows (``row · S + slot``), in the same order; ``rank``
    each selected token's place among its row's misses (-1: held) and ``offset`` each row's first place in the
    plan (`lrqk_proxy.SlotFill`: the fill is stored into the slots by the attention that reads them)."""
    rows, k = selected.shape
    cap = token.shape[1]
    device = token.device
    if not (token.is_contiguous() and score.is_contiguous() and chosen.is_contiguous()):
        raise ValueError("slot_plan updates the slots' token, score and chosen tensors in place: contiguous ones")
    sel = selected.contiguous()
    slot = torch.empty(rows, k, dtype=torch.long, device=device)
    prio = torch.empty(rows, cap, dtype=torch.float32, device=device)
    order = torch.empty(rows, cap, dtype=torch.int32, device=device)
    src = torch.empty(rows, k, dtype=torch.long, device=device)
    dst = torch.empty(rows, k, dtype=torch.long, device=device)
    count = torch.empty(rows, dtype=torch.long, device=device)
    rank = torch.empty(rows, k, dtype=torch.long, device=device)
    offset = torch.empty(rows, dtype=torch.long, device=device)
    e = prefetched_tokens.shape[1] if prefetched_tokens is not None else 0
    n_ahead = ahead.numel() if ahead is not None else 0
    plan = torch.empty(rows * k + 2 + n_ahead, dtype=torch.long, device=device)
    dest = torch.empty(rows * k, dtype=torch.long, device=device)
    has_mass = policy == "attention" and mass is not None
    with counting.kernel_launch("lrqk_slot_plan"):
        _slot_plan_rows[(rows,)](
            sel, token, score, chosen.view(torch.int8), mass.float().contiguous() if has_mass else score,
            prefetched_tokens.contiguous() if e else sel, prio, order, slot, src, dst, count, rank, offset,
            overflow if overflow is not None else count, ahead.reshape(-1).contiguous() if n_ahead else count,
            plan, dest, counters(device, 1), rows, k, cap, e, slow_rows, float(step), n_ahead,
            POLICY=_POLICY_CODE[policy], HAS_MASS=has_mass, HAS_PF=e > 0, HAS_OVF=overflow is not None,
            BLOCK_K=_pow2(k), BLOCK_C=_pow2(cap), TILE=_TILE, BLOCK_A=_pow2(n_ahead, 2),
            num_warps=4 if max(k, cap) <= 1024 else 8)
    return slot, plan, dest, rank, offset


@triton.jit
def _commit_rows(KEY, VALUE, KHAT, WK, WV, AK, OVF, STAGE, win_rows, heads, W, d, r, a_cap, a_len,
                 key_b, key_h, value_b, value_h,
                 CHECK_KV: tl.constexpr, CHECK_A: tl.constexpr, WIN_BF16: tl.constexpr, A_BF16: tl.constexpr,
                 HAS_STAGE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    pid = tl.program_id(0)
    if pid < win_rows:      # a window row (b, h): every token one place older, the new one last
        b = pid // heads
        h = pid % heads
        w = tl.arange(0, BLOCK_W)
        c = tl.arange(0, BLOCK_D)
        stay = (w[:, None] < W - 1) & (c[None, :] < d)
        base = pid * W * d
        k_old = tl.load(WK + base + (w[:, None] + 1) * d + c[None, :], mask=stay)
        v_old = tl.load(WV + base + (w[:, None] + 1) * d + c[None, :], mask=stay)
        tl.debug_barrier()
        tl.store(WK + base + w[:, None] * d + c[None, :], k_old, mask=stay)
        tl.store(WV + base + w[:, None] * d + c[None, :], v_old, mask=stay)
        k = tl.load(KEY + b * key_b + h * key_h + c, mask=c < d, other=0.0)
        v = tl.load(VALUE + b * value_b + h * value_h + c, mask=c < d, other=0.0)
        if HAS_STAGE:   # the token as the slow tier holds it, [row, 2, d], for one copy to the host
            tl.store(STAGE + pid * 2 * d + c, k, mask=c < d)
            tl.store(STAGE + pid * 2 * d + d + c, v, mask=c < d)
        if CHECK_KV:
            top = tl.max(tl.maximum(tl.abs(k.to(tl.float32)), tl.abs(v.to(tl.float32))), axis=0)
            tl.store(OVF, tl.full([], 1, tl.int8), mask=top > _FP16_MAX)
        tl.store(WK + base + (W - 1) * d + c, _stored(k, WK.dtype.element_ty, WIN_BF16), mask=c < d)
        tl.store(WV + base + (W - 1) * d + c, _stored(v, WV.dtype.element_ty, WIN_BF16), mask=c < d)
    else:                   # a factor row (b, f): the new token's key factors after the a_len held
        i = pid - win_rows
        j = tl.arange(0, BLOCK_R)
        x = tl.load(KHAT + i * r + j, mask=j < r, other=0.0).to(tl.float32)   # as torch narrows float64
        if CHECK_A:
            tl.store(OVF, tl.full([], 1, tl.int8), mask=tl.max(tl.abs(x), axis=0) > _FP16_MAX)
        tl.store(AK + (i * a_cap + a_len) * r + j, _stored(x, AK.dtype.element_ty, A_BF16), mask=j < r)


def commit_token(key: torch.Tensor, value: torch.Tensor, k_hat: torch.Tensor, win_k: torch.Tensor,
                 win_v: torch.Tensor, a_k: torch.Tensor, a_len: int, overflow: torch.Tensor,
                 stage: torch.Tensor | None = None) -> None:
    """A decode step's token committed in one launch: the full window ``win_k/win_v [B, H, W, d]`` shifted by one
    with ``key/value [B, H, 1, d]`` last, and ``k_hat [B, F, r]`` written as key factors ``a_k[:, :, a_len]``
    (``a_k [B, F, capacity, r]``, ``a_len < capacity``), all in place and converted to the stored dtypes; a value
    beyond float16's range where one narrows to it sets ``overflow`` (``LRQKLayer._defer_range_check``,
    ``_update_window`` and ``_append_factors`` in tensor ops). ``stage [1, B·H, 2, d]`` (the key's dtype, contiguous)
    or None: also takes the token as the slow tier holds it (`SlowTier.append_rows`)."""
    if stage is not None and not (stage.is_contiguous() and stage.dtype == key.dtype
                                  and stage.shape == (1, key.shape[0] * key.shape[1], 2, key.shape[-1])):
        raise ValueError("commit_token stages the token as [1, B*H, 2, d] in the key's dtype, contiguous")
    b, h, w, d = win_k.shape
    f, cap, r = a_k.shape[1], a_k.shape[2], a_k.shape[3]
    if not (win_k.is_contiguous() and win_v.is_contiguous() and a_k.is_contiguous() and a_len < cap):
        raise ValueError("commit_token writes a full, contiguous window and factor buffer with room for a row")
    check_kv = key.dtype != win_k.dtype and win_k.dtype == torch.float16
    check_a = k_hat.dtype != a_k.dtype and a_k.dtype == torch.float16
    win_bf16 = win_k.dtype == torch.bfloat16 and key.dtype != torch.bfloat16
    a_bf16 = a_k.dtype == torch.bfloat16
    wk, wv = (x.view(torch.int16) if win_bf16 else x for x in (win_k, win_v))
    with counting.kernel_launch("lrqk_commit"):
        _commit_rows[(b * h + b * f,)](
            key, value, k_hat.contiguous(), wk, wv, a_k.view(torch.int16) if a_bf16 else a_k,
            overflow.view(torch.int8), stage if stage is not None else key, b * h, h, w, d, r, cap, a_len,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            CHECK_KV=check_kv, CHECK_A=check_a, WIN_BF16=win_bf16, A_BF16=a_bf16, HAS_STAGE=stage is not None,
            BLOCK_W=_pow2(w), BLOCK_D=_pow2(d), BLOCK_R=_pow2(r))
