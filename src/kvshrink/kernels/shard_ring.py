"""Triton kernel for Shard's exact ring buffer on the GPU path (`methods/shard/ring.py`): `put_token` stores
a decode step's key and value into their slot in one launch, converting them to the ring's dtype, and
raises the cache's deferred fp16-overflow maximum in place when the conversion narrows to float16
(`kernels.deferred.deferred_peak_slot`), instead of a stack, a norm, a maximum and a copy in torch."""

from __future__ import annotations

import torch

from kvshrink.kernels.deferred import deferred_peak_slot, storage_overflow_check
from kvshrink.kernels import counting
from kvshrink.kernels.backend import triton as _load_triton

triton = _load_triton()
tl = triton.language

__all__ = ["put_token"]


@triton.jit
def _put_kernel(key_ptr, value_ptr, kv_ptr, peak_ptr, rows, heads, dim, key_b, key_h, value_b, value_h,
                kv_half, kv_row, at, CHECK: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)     # rows b * heads + h
    i = tl.arange(0, DP)
    ok = (m < rows)[:, None] & (i < dim)[None, :]
    b = m // heads
    h = m % heads
    k = tl.load(key_ptr + (b * key_b + h * key_h)[:, None] + i[None, :], mask=ok, other=0.0)
    v = tl.load(value_ptr + (b * value_b + h * value_h)[:, None] + i[None, :], mask=ok, other=0.0)
    slot = kv_ptr + (m * kv_row + at * dim)[:, None] + i[None, :]
    tl.store(slot, k.to(kv_ptr.dtype.element_ty), mask=ok)
    tl.store(slot + kv_half, v.to(kv_ptr.dtype.element_ty), mask=ok)
    if CHECK:
        # magnitudes compared as their bits: non-negative floats order as integers, and NaN above inf
        bits = tl.maximum(tl.abs(k.to(tl.float32)).to(tl.int32, bitcast=True),
                          tl.abs(v.to(tl.float32)).to(tl.int32, bitcast=True))
        tl.atomic_max(peak_ptr, tl.max(tl.max(tl.where(ok, bits, 0), 1), 0))


def put_token(kv: torch.Tensor, at: int, key: torch.Tensor, value: torch.Tensor) -> None:
    """``kv[0/1, :, :, at] = key/value`` (``kv [2, B, H, slots, d]`` contiguous, ``key``/``value``
    ``[B, H, 1, d]`` with unit channel stride), converted to ``kv``'s dtype, in one launch."""
    _, batch, heads, slots, dim = kv.shape
    check = storage_overflow_check(key, kv.dtype)
    peak = deferred_peak_slot(kv.device) if check else kv
    block_m = 16
    rows = batch * heads
    with counting.kernel_launch("shard_ring_put"):
        _put_kernel[(triton.cdiv(rows, block_m),)](
            key, value, kv, peak.view(torch.int32) if check else kv, rows, heads, dim, key.stride(0), key.stride(1),
            value.stride(0), value.stride(1), kv.stride(0), kv.stride(2), at, CHECK=check,
            DP=max(16, triton.next_power_of_2(dim)), BLOCK_M=block_m)
