"""Attention kernels shared by every method, and the "kvshrink" attention function transformers calls.

Every layer answers a query with one or more *partials*: the softmax attention over a subset of the
tokens together with the log-sum-exp of its scores. Partials over disjoint token sets merge exactly
(the flash-attention identity), so a compressed store can answer each of its segments separately.

Queries stay grouped per KV head (GQA) so keys are never repeated to query heads: query heads
``j*G .. j*G+G-1`` share KV head ``j``, as in transformers' ``repeat_kv``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvshrink.kernels.backend import gpu_path

# Score elements computed at once per block (bounds the memory of prefill-with-past attention).
_BLOCK_ELEMENTS = 1 << 24


@dataclass
class Partial:
    """Softmax attention over one disjoint set of tokens.

    ``out`` is ``[B, H_q, q, d]`` (float32), normalised over this part's tokens only; ``lse`` is
    ``[B, H_q, q]``, the log-sum-exp of the part's scaled scores (``-inf`` where no token is visible).
    """

    out: torch.Tensor
    lse: torch.Tensor

    @classmethod
    def from_grouped(cls, out: torch.Tensor, lse: torch.Tensor, num_q_heads: int) -> "Partial":
        """The partial of grouped results ``out [B, H_kv, G*q, d]``, ``lse [B, H_kv, G*q]`` (see `group_queries`)."""
        return cls(ungroup(out, num_q_heads), ungroup(lse, num_q_heads))


def group_queries(query: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[B, H_q, q, d]`` -> ``[B, H_kv, G*q, d]`` (the G query heads of a KV head stacked)."""
    b, hq, q, d = query.shape
    if hq % num_kv_heads:
        raise ValueError(f"{hq} query heads are not a multiple of {num_kv_heads} KV heads")
    return query.reshape(b, num_kv_heads, (hq // num_kv_heads) * q, d)


def ungroup(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Inverse of :func:`group_queries` for outputs ``[B, H_kv, G*q, ...]`` -> ``[B, H_q, q, ...]``."""
    b, hkv, gq = x.shape[:3]
    q = gq * hkv // num_q_heads
    return x.reshape(b, num_q_heads, q, *x.shape[3:])


def visibility_mask(
    key_index: torch.Tensor | None,
    n_keys: int,
    query_index: torch.Tensor | None,
    pad_len: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor | None:
    """Boolean ``[B or 1, 1, q or 1, n]`` mask of visible keys, or None when everything is visible.

    A key is visible when it is not left padding (``index >= pad_len[b]``) and, if ``query_index`` is
    given, not in the future (``index <= query_index``). A query always sees its own token, so padded
    query rows never end up with an empty softmax (their outputs are discarded anyway).
    """
    if pad_len is None and query_index is None:
        return None
    if key_index is None:
        key_index = torch.arange(n_keys, device=device)
    kidx = key_index if key_index.dim() == 2 else key_index.unsqueeze(0)  # [B|1, n]
    kidx = kidx[:, None, None, :]
    mask = None
    if pad_len is not None:
        mask = kidx >= pad_len.to(device)[:, None, None, None]
    if query_index is not None:
        qidx = query_index.reshape(1, 1, -1, 1)
        causal = kidx <= qidx
        mask = causal if mask is None else mask & causal
        mask = mask | (kidx == qidx)
    return mask


def exact_partial(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    key_index: torch.Tensor | None = None,
    query_index: torch.Tensor | None = None,
    pad_len: torch.Tensor | None = None,
    return_probs: bool = False,
    key_start: int = 0,
) -> Partial | tuple[Partial, torch.Tensor]:
    """Exact attention of ``query [B, H_q, q, d]`` over ``key/value [B, H_kv, n, d]``.

    ``key_index`` (``[n]`` or ``[B, n]``) and ``query_index`` (``[q]``) are token indices used for
    padding and causality (see :func:`visibility_mask`); without ``key_index`` the keys are tokens
    ``key_start .. key_start+n-1``. With ``return_probs`` the attention probabilities ``[B, H_q, q, n]``
    (normalised within this part) are returned too.

    On the GPU path (``kvshrink.kernels.backend.gpu_path``) without ``return_probs`` this is the Triton
    kernel of ``kvshrink.kernels.exact_attention``: keys and values read in their stored dtype, fp32
    accumulation, masks computed in the kernel, no host synchronisation.
    """
    if not return_probs and gpu_path(query) and exact_kernel_trusted(query, key, value):
        from kvshrink.kernels.exact_attention import exact_attention

        out, lse = exact_attention(query, key, value, scaling, key_index=key_index, query_index=query_index,
                                   pad_len=pad_len, key_start=key_start)
        return Partial(out, lse)
    if key_index is None and key_start and (pad_len is not None or query_index is not None):
        key_index = torch.arange(key_start, key_start + key.shape[2], device=key.device)
    mask = visibility_mask(key_index, key.shape[2], query_index, pad_len, query.device)
    if not return_probs and _cpu_flash_available(query):
        return _flash_partial(query, key, value, scaling, mask)
    return _matmul_partial(query, key, value, scaling, mask, return_probs)


def self_partial(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> Partial:
    """`exact_partial` of one new token ``query [B, H_q, 1, d]`` over itself alone (``key/value [B, H_kv, 1, d]``):
    its value, and its scaled score as the log-sum-exp (a softmax over one token; a decode step's own token,
    two small ops instead of an attention kernel per layer)."""
    if gpu_path(query):
        return exact_partial(query, key, value, scaling)
    qg = group_queries(query.float(), key.shape[1])                          # [B, H_kv, G, d]
    lse = (qg @ key.float().transpose(-1, -2)).squeeze(-1) * scaling         # [B, H_kv, G]
    out = value.float().expand(*qg.shape)
    return Partial.from_grouped(out, lse, query.shape[1])


def _cpu_flash_available(query: torch.Tensor) -> bool:
    return query.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _grouped_mask(mask: torch.Tensor, groups: int, q: int) -> torch.Tensor:
    """Query-row mask ``[B|1, 1, q|1, n]`` -> ``[B|1, 1, G*q, n]`` for grouped queries."""
    return mask.expand(mask.shape[0], 1, q, mask.shape[3]).repeat(1, 1, groups, 1)


def _flash_partial(query, key, value, scaling, mask) -> Partial:
    """The CPU flash kernel, which also returns the log-sum-exp, on queries grouped per KV head."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    qg = group_queries(query, hkv).contiguous()
    # the CPU flash kernel silently gives wrong results for non-contiguous inputs (e.g. transposed keys)
    k, v = key.to(qg.dtype).contiguous(), value.to(qg.dtype).contiguous()
    bias = None
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=qg.dtype, device=qg.device).masked_fill_(~mask, float("-inf"))
        bias = _grouped_mask(bias, hq // hkv, q)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qg, k, v, 0.0, False, attn_mask=bias,
                                                                          scale=scaling)
    out, lse = out.float(), lse.float()
    if mask is None and k.shape[2]:  # every row sees every key: none is empty (and no host sync to find out)
        return Partial.from_grouped(out, lse, hq)
    empty = ~torch.isfinite(lse)
    if bool(empty.any()):  # rows that see no token: empty softmax, contributes nothing when merged
        out = out.masked_fill(empty[..., None], 0.0)
        lse = lse.masked_fill(empty, float("-inf"))
    return Partial.from_grouped(out, lse, hq)


def _matmul_partial(query, key, value, scaling, mask, return_probs):
    """Plain-matmul attention (any device), blocked over query rows to bound memory."""
    b, hq, q, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    qg = group_queries(query.float(), hkv)  # [B, Hkv, G*q, d]
    k = key.float()
    v = value.float()
    g = hq // hkv
    rows = max(1, _BLOCK_ELEMENTS // max(1, b * hkv * g * n))
    outs, lses, probs = [], [], []
    for start in range(0, q, rows):
        stop = min(q, start + rows)
        qb = qg.reshape(b, hkv, g, q, d)[:, :, :, start:stop].reshape(b, hkv, g * (stop - start), d)
        scores = torch.matmul(qb, k.transpose(-1, -2)) * scaling  # [B, Hkv, G*qb, n]
        if mask is not None:
            mb = mask[:, :, start:stop] if mask.shape[2] > 1 else mask
            scores = scores.masked_fill(~_grouped_mask(mb, g, stop - start), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1, keepdim=True)
        p = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0))
        outs.append(torch.matmul(p, v).reshape(b, hkv, g, stop - start, d))
        lses.append(lse.reshape(b, hkv, g, stop - start))
        if return_probs:
            probs.append(p.reshape(b, hkv, g, stop - start, n))
    out = torch.cat(outs, dim=3).reshape(b, hq, q, d)
    lse = torch.cat(lses, dim=3).reshape(b, hq, q)
    part = Partial(out, lse)
    if return_probs:
        return part, torch.cat(probs, dim=3).reshape(b, hq, q, n)
    return part


def merge_partials(parts: list[Partial], out_dtype: torch.dtype | None = None) -> Partial:
    """Combine partials over disjoint token sets into the softmax over their union (``out`` in
    ``out_dtype``, float32 when None: the GPU kernel writes it so, without a conversion after)."""
    if len(parts) == 1:
        return parts[0] if out_dtype is None else Partial(parts[0].out.to(out_dtype), parts[0].lse)
    if gpu_path(parts[0].lse) and _merge_kernel_trusted(parts[0].out, out_dtype):  # one kernel, not a few ops per part
        from kvshrink.kernels.exact_attention import merge_attention

        return Partial(*merge_attention([p.out for p in parts], [p.lse for p in parts], out_dtype))
    lses = torch.stack([p.lse for p in parts])  # [P, B, Hq, q]
    total = torch.logsumexp(lses, dim=0)
    weights = torch.exp(lses - total.masked_fill(torch.isinf(total), 0.0)).unsqueeze(-1)
    # one product and one sum over the stacked outputs (not two ops per part): a decode step merges
    # several partials per layer
    out = (torch.stack([p.out for p in parts]) * weights).sum(dim=0)
    return Partial(out if out_dtype is None else out.to(out_dtype), total)


# ---- the GPU path's kernels, checked against the torch path above on first use per device and signature ----

def exact_kernel_trusted(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the Triton exact-attention kernel agrees with the torch path on this device for these dtypes
    and head size (`kvshrink.kernels.selfcheck`); False: take the torch path."""
    from kvshrink.kernels import selfcheck

    signature = (query.dtype, key.dtype, value.dtype, query.shape[-1])
    return selfcheck.trusted("exact_attention", query.device, signature,
                             lambda: _compare_exact_kernel(query.device, *signature))


def _compare_exact_kernel(device: torch.device, q_dtype: torch.dtype, k_dtype: torch.dtype, v_dtype: torch.dtype,
                          d: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Both paths on a small padded, causal, GQA problem whose keys are split over two programs."""
    from kvshrink.kernels.exact_attention import exact_attention

    gen = torch.Generator().manual_seed(0)
    b, hq, hkv, q, n = 2, 4, 2, 3, 70
    query = torch.randn(b, hq, q, d, generator=gen).to(device, q_dtype)
    key = torch.randn(b, hkv, n, d, generator=gen).to(device, k_dtype)
    value = torch.randn(b, hkv, n, d, generator=gen).to(device, v_dtype)
    key_index = torch.arange(n, device=device).expand(b, n).contiguous()
    query_index = torch.arange(n - q, n, device=device)
    pad_len = torch.tensor([0, 5], device=device)
    scaling = d ** -0.5
    out, lse = exact_attention(query, key, value, scaling, key_index=key_index, query_index=query_index,
                               pad_len=pad_len, num_splits=2)
    mask = visibility_mask(key_index, n, query_index, pad_len, device)
    ref = _matmul_partial(query, key, value, scaling, mask, False)
    tolerance = 1e-3 if torch.float32 in (q_dtype, k_dtype, v_dtype) and q_dtype == torch.float32 else 3e-2
    return torch.cat([out.flatten(), lse.flatten()]), torch.cat([ref.out.flatten(), ref.lse.flatten()]), tolerance


def _merge_kernel_trusted(out: torch.Tensor, out_dtype: torch.dtype | None) -> bool:
    from kvshrink.kernels import selfcheck

    signature = (out.dtype, out_dtype, out.shape[-1])
    return selfcheck.trusted("merge_attention", out.device, signature,
                             lambda: _compare_merge_kernel(out.device, *signature))


def _compare_merge_kernel(device: torch.device, dtype: torch.dtype, out_dtype: torch.dtype | None,
                          d: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    from kvshrink.kernels.exact_attention import merge_attention

    gen = torch.Generator().manual_seed(0)
    parts = [Partial(torch.randn(2, 4, 3, d, generator=gen).to(device, dtype),
                     torch.randn(2, 4, 3, generator=gen).to(device)) for _ in range(3)]
    parts[1].lse[0, 0, 0] = float("-inf")  # a part that saw no token
    out, lse = merge_attention([p.out for p in parts], [p.lse for p in parts], out_dtype)
    lses = torch.stack([p.lse for p in parts])
    total = torch.logsumexp(lses, dim=0)
    ref = (torch.stack([p.out.float() for p in parts]) * torch.exp(lses - total).unsqueeze(-1)).sum(dim=0)
    tolerance = 1e-4 if out_dtype in (None, torch.float32) else 2e-2
    return torch.cat([out.float().flatten(), lse.flatten()]), torch.cat([ref.flatten(), total.flatten()]), tolerance


def causal_chunk_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float,
    pad_len: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention of a chunk over itself only (no past), through SDPA: ``[B, H_q, q, d]``.

    This is the prefill fast path: nothing to merge, so the log-sum-exp is not needed.
    """
    q = query.shape[2]
    # the framework passes pad_len only when some row is padded (KVShrinkCache._record_padding); on the
    # GPU path the mask is built without asking the device whether it is needed (no host sync)
    if pad_len is None or (not gpu_path(query) and not bool((pad_len > 0).any())):
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    idx = torch.arange(q, device=query.device)
    mask = visibility_mask(idx, q, idx, pad_len, query.device)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=True)
