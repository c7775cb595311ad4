"""Exact partial attention on the GPU path: a Triton flash-decode kernel returning ``out`` and ``lse``.

``exact_attention(query, key, value, scaling, ...)`` is the GPU-path twin of
``kvshrink.cache.attention.exact_partial`` (its oracle in the tests): attention of ``query [B, H_q, q, d]``
over ``key/value [B, H_kv, n, d]`` read in their stored dtype (fp16, bf16 or fp32; scores, softmax and
the output accumulated in fp32), with the same visibility rules as ``visibility_mask``:

- key ``t`` of row ``b`` is left padding (invisible) when its token index is ``< pad_len[b]``;
- with ``query_index`` a key is invisible when its index is ``> query_index`` (the future), but a query
  always sees its own token;
- a query row that sees no key gets ``lse = -inf`` and ``out = 0`` (it contributes nothing when merged).

Token indices of the keys are ``key_start + t`` (a contiguous store: nothing is read) or an int tensor
``key_index`` (``[n]`` or ``[B, n]``). GQA: one program handles the ``G`` query heads of a KV head
together (queries grouped as in ``group_queries``), so every key is read once per program and never
repeated per query head. The key axis is split over ``num_splits`` programs when one row of programs
would leave the GPU idle (decode: few queries, many keys); a second small kernel combines the splits by
log-sum-exp (two launches in all, whatever the number of splits).

No host synchronisation: every size is a host-known shape, every mask is computed on the device.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kvshrink.codecs.groupwise import GroupCode
from kvshrink.kernels import counting
from kvshrink.kernels.backend import interpreting, triton

__all__ = ["exact_attention", "int8_attention", "merge_attention"]

# Code sets attended by one launch of the int8 kernel (compiled per count: a longer context adds launches,
# not compilations).
_INT8_MOST = 8

# Partials merged by one launch (a kernel is compiled per count; more are merged in rounds).
_MERGE_MOST = 8

_BLOCK_N = 64


@functools.lru_cache(maxsize=None)
def _kernel():
    triton()  # imports Triton (in its interpreter without a GPU) or raises ImportError naming the extra
    from kvshrink.kernels._exact_attention_triton import (_combine_splits_kernel, _exact_attention_kernel,
                                                          _int8_attention_kernel, _merge_partials_kernel)

    return _exact_attention_kernel, _combine_splits_kernel, _merge_partials_kernel, _int8_attention_kernel


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _splits(n: int, programs: int, device: torch.device) -> int:
    """Key splits: enough programs to fill the GPU, each with at least four key blocks."""
    if device.type != "cuda" or interpreting():
        return 1
    most = max(1, -(-n // (4 * _BLOCK_N)))
    want = max(1, -(-2 * _sm_count(device) // max(1, programs)))
    return min(most, want, 64)


def _compute_fp32(*dtypes: torch.dtype) -> bool:
    """Whether the tiles are multiplied in fp32: when any input is fp32 (exact, no tf32); Triton's
    interpreter cannot tl.dot bfloat16 (it holds them as uint16), so there bf16 tiles are widened first."""
    return torch.float32 in dtypes or (interpreting() and torch.bfloat16 in dtypes)


def _tiles(rows: int, d: int, compute_fp32: bool) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_D)`` for ``rows`` grouped query rows of ``d`` channels."""
    block_m = 16 if rows <= 16 else (32 if rows <= 32 else 64)
    block_d = max(16, 1 << (d - 1).bit_length())
    # fp32 tiles of 64 keys x 128 dims need ~140 KB of shared memory: halve the key block there
    block_n = 32 if compute_fp32 and block_d >= 128 else _BLOCK_N
    return block_m, block_n, block_d


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
                    key_index: torch.Tensor | None = None, query_index: torch.Tensor | None = None,
                    pad_len: torch.Tensor | None = None, key_start: int = 0,
                    num_splits: int | None = None,
                    out: torch.Tensor | None = None,
                    new: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H_q, q, d] float32, lse [B, H_q, q] float32)`` of ``query`` over ``key/value``.

    ``key_index`` (``[n]`` or ``[B, n]`` ints) gives the token index of each key; without it the keys are
    tokens ``key_start .. key_start+n-1``. ``query_index`` (``[q]``) and ``pad_len`` (``[B]``) as in
    ``kvshrink.cache.attention.visibility_mask``. ``num_splits`` overrides the split of the key axis.
    ``new``: one more key and value ``[B, H_kv, 1, d]`` that every query row sees, read in their own dtype
    (a decode step's own token of an fp32 model beside a 16-bit store: attended in the same launch, not
    rounded to the store's dtype and not by a kernel of its own).
    """
    b, hq, q, d = query.shape
    hkv, n = key.shape[1], key.shape[2]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if key.shape[0] != b and key.shape[0] == 1:
        key, value = key.expand(b, -1, -1, -1), value.expand(b, -1, -1, -1)
    rows = (hq // hkv) * q
    compute_fp32 = _compute_fp32(query.dtype, key.dtype, value.dtype)
    block_m, block_n, block_d = _tiles(rows, d, compute_fp32)
    grid_m = -(-rows // block_m)
    splits = num_splits or _splits(n, b * hkv * grid_m, query.device)
    splits = max(1, min(splits, max(1, -(-n // block_n))))
    per_split = -(-max(n, 1) // splits)
    per_split = -(-per_split // block_n) * block_n
    splits = max(1, -(-n // per_split)) if n else 1
    if splits == 1 and out is not None:  # the caller's buffer [B, H_q, q, d] (any strides and float dtype)
        o_buf, o_strides = out, (out.stride(0), out.stride(1), 0, out.stride(2), out.stride(3))
    else:
        o_buf = torch.empty(b, splits, hq, q, d, device=query.device, dtype=torch.float32)
        o_strides = (o_buf.stride(0), o_buf.stride(2), o_buf.stride(1), o_buf.stride(3), o_buf.stride(4))
    lse = torch.empty(b, splits, hq, q, device=query.device, dtype=torch.float32)
    l_strides = (lse.stride(0), lse.stride(2), lse.stride(1), lse.stride(3))

    kidx = key_index
    if kidx is not None:
        if kidx.dim() == 1:
            stride_ib, stride_in = 0, kidx.stride(0)
        else:
            stride_ib, stride_in = kidx.stride(0), kidx.stride(1)
    else:
        stride_ib = stride_in = 0
    dummy = lse  # a pointer for the arguments a specialisation never reads
    new_k, new_v = new if new is not None else (dummy, dummy)
    if new is not None and (new_k.shape[:2] != (b, hkv) or new_k.shape[2] != 1 or new_v.shape != new_k.shape):
        raise ValueError(f"the new key and value must be [B, H_kv, 1, d] = [{b}, {hkv}, 1, {d}], got "
                         f"{tuple(new_k.shape)} and {tuple(new_v.shape)}")
    new_strides = ((new_k.stride(0), new_k.stride(1), new_k.stride(3), new_v.stride(0), new_v.stride(1),
                    new_v.stride(3)) if new is not None else (0,) * 6)
    pad = pad_len.to(query.device) if pad_len is not None else None
    qidx = query_index.to(query.device) if query_index is not None else None
    with counting.kernel_launch("exact_attention"):
        _kernel()[0][(b * hkv, grid_m, splits)](
            query, key, value, o_buf, lse,
            kidx if kidx is not None else dummy, pad if pad is not None else dummy,
            qidx if qidx is not None else dummy, new_k, new_v,
            *query.stride(), *key.stride(), *value.stride(), *o_strides, *l_strides,
            stride_ib, stride_in, *new_strides,
            hkv, hq // hkv, rows, q, n, d, per_split, key_start, float(scaling),
            HAS_KIDX=kidx is not None, HAS_PAD=pad is not None, HAS_QIDX=qidx is not None, HAS_NEW=new is not None,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, COMPUTE_FP32=compute_fp32,
        )
    if splits == 1:
        return (o_buf if out is not None else o_buf.reshape(b, hq, q, d)), lse.reshape(b, hq, q)
    final = out if out is not None else torch.empty(b, hq, q, d, device=query.device, dtype=torch.float32)
    final_lse = torch.empty(b, hq, q, device=query.device, dtype=torch.float32)
    with counting.kernel_launch("exact_attention_combine"):
        _kernel()[1][(b * hq * q,)](
            o_buf, lse, final, final_lse,
            *o_buf.stride(), *lse.stride(), *final.stride(), *final_lse.stride(),
            splits, hq, q, d,
            BLOCK_S=max(2, 1 << (splits - 1).bit_length()), BLOCK_D=block_d,
        )
    return final, final_lse


def merge_attention(outs: list[torch.Tensor], lses: list[torch.Tensor], out_dtype: torch.dtype | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H_q, q, d] in out_dtype (float32 when None), lse [B, H_q, q] float32)``: partials over
    disjoint token sets (``outs`` and ``lses`` of those shapes) merged into the softmax over their union in
    one launch (up to ``_MERGE_MOST`` partials), the GPU-path twin of
    ``kvshrink.cache.attention.merge_partials``."""
    while len(outs) > _MERGE_MOST:   # rare (many middle blocks): merge the first ones into one partial
        first = merge_attention(outs[:_MERGE_MOST], lses[:_MERGE_MOST])
        outs, lses = [first[0], *outs[_MERGE_MOST:]], [first[1], *lses[_MERGE_MOST:]]
    shape, d = outs[0].shape, outs[0].shape[-1]
    rows = outs[0].numel() // max(1, d)
    out = torch.empty(shape, device=outs[0].device, dtype=out_dtype or torch.float32)
    lse = torch.empty(shape[:-1], device=outs[0].device, dtype=torch.float32)
    block_r = 16
    with counting.kernel_launch("merge_partials"):
        _kernel()[2][(max(1, -(-rows // block_r)),)](
            tuple(o.float().contiguous() for o in outs), tuple(x.float().contiguous() for x in lses), out, lse,
            rows, d, NUM=len(outs), BLOCK_R=block_r, BLOCK_D=max(16, 1 << (d - 1).bit_length()))
    return out, lse


def _vector_code(code: GroupCode, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(codes [B, H_kv, m, d] uint8, step, zero [B, H_kv, m] fp16)``, contiguous, of 8-bit codes with one
    group per token vector (what the int8 kernel reads)."""
    if code.bits != 8 or code.group_size != d or code.codes.shape[-2] != 1:
        raise ValueError(f"the int8 kernel reads 8-bit codes in groups of {d} (one per token vector), got "
                         f"{code.bits} bits in groups of {code.group_size}")
    return code.codes.squeeze(-2).contiguous(), code.scale.squeeze(-1).contiguous(), code.zero.squeeze(-1).contiguous()


def _tl_dtype(dtype: torch.dtype):
    tl = triton().language
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def int8_attention(query: torch.Tensor, keys: Sequence[GroupCode], values: Sequence[GroupCode], scaling: float,
                   dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Partials ``(out [B, H_q, q, d] float32, lse [B, H_q, q] float32)`` of ``query [B, H_q, q, d]`` over
    the token vectors of every ``keys[i]``/``values[i]`` (8-bit `GroupCode`s of ``[B, H_kv, m_i, d]``, one
    group per vector; the ``m_i`` may differ), every key visible: one launch per `_INT8_MOST` code sets.
    The codes are decoded in registers and rounded to ``dtype``, as ``exact_partial`` over
    ``dequantize_groups(code).to(dtype)`` would see them; scores and output accumulate in fp32."""
    parts = []
    for first in range(0, len(keys), _INT8_MOST):
        parts.append(_int8_attention_launch(query, keys[first:first + _INT8_MOST],
                                            values[first:first + _INT8_MOST], scaling, dtype))
    return parts


def _int8_attention_launch(query: torch.Tensor, keys: Sequence[GroupCode], values: Sequence[GroupCode],
                           scaling: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, q, d = query.shape
    hkv = keys[0].codes.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    k_sets = [_vector_code(code, d) for code in keys]
    v_sets = [_vector_code(code, d) for code in values]
    rows = (hq // hkv) * q
    compute_fp32 = _compute_fp32(query.dtype, dtype)
    block_m, block_n, block_d = _tiles(rows, d, compute_fp32)
    out = torch.empty(b, hq, q, d, device=query.device, dtype=torch.float32)
    lse = torch.empty(b, hq, q, device=query.device, dtype=torch.float32)
    with counting.kernel_launch("int8_attention"):
        _kernel()[3][(b * hkv, -(-rows // block_m))](
            query, *(tuple(code[part] for code in k_sets) for part in range(3)),
            *(tuple(code[part] for code in v_sets) for part in range(3)),
            tuple(code[0].shape[2] for code in k_sets), out, lse, *query.stride(),
            hkv, hq // hkv, rows, q, d, float(scaling),
            NUM=len(k_sets), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, COMPUTE_FP32=compute_fp32,
            KV_DTYPE=_tl_dtype(dtype),
        )
    return out, lse
