"""A fresh layer run through a short prefill and a few decode steps of random tokens: what a method's self-check
compares between its GPU kernels and its torch path (`kvshrink.kernels.selfcheck`)."""

from __future__ import annotations

import torch

from kvshrink.cache.base import CacheLayer, StepContext

__all__ = ["random_steps"]


def random_steps(layer: CacheLayer, prefill: int, decode: int, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> torch.Tensor:
    """The outputs, flattened and concatenated, of ``layer`` (fresh, one row) over a ``prefill``-token step and
    ``decode`` one-token steps of seeded random keys, values and queries in ``dtype`` on ``device`` (the same
    tokens for the same seed, whatever path the layer takes)."""
    info = layer.info
    gen = torch.Generator().manual_seed(seed)
    offset = torch.zeros(1, dtype=torch.long, device=device)
    outs, past = [], 0
    for q_len in [prefill] + [1] * decode:
        key, value = (torch.randn(1, info.num_kv_heads, q_len, info.head_dim, generator=gen).to(device, dtype)
                      for _ in range(2))
        query = torch.randn(1, info.num_q_heads, q_len, info.head_dim, generator=gen).to(device, dtype)
        ctx = StepContext(past, q_len, info.head_dim ** -0.5, None, offset, info.rotary, info.dtype)
        layer.update(key, value)
        outs.append(layer.attend(query, ctx).float().flatten())
        past += q_len
    return torch.cat(outs)
