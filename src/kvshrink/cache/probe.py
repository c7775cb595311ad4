"""A fresh layer run through a short prefill and a few decode steps of random tokens: what a method's self-check
compares between its GPU kernels and its torch path (`kvshrink.kernels.selfcheck`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvshrink.cache.base import CacheLayer, StepContext
from kvshrink.kernels import selfcheck

__all__ = ["random_steps", "step_trusted"]


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


def step_trusted(layer: CacheLayer, kind: str, device: torch.device, options,
                 make_probe: Callable[[], CacheLayer], prefill: int) -> bool:
    """Whether ``layer``'s decode step through its Triton kernels agrees with its torch path on ``device``, for the
    layer's model dtype, head shapes and ``options`` (checked once per process, `kvshrink.kernels.selfcheck`).
    A probe layer (``make_probe()``, fresh, same options) runs ``prefill`` tokens and three decode steps once with
    ``kernels_verdict`` True (the kernels, unchecked) and once False (the torch path)."""
    if layer.kernels_verdict is not None:
        return layer.kernels_verdict
    signature = layer.__dict__.get("_kernel_signature")
    if signature is None:
        info = layer.info
        signature = layer.__dict__["_kernel_signature"] = (
            info.dtype, info.head_dim, info.num_kv_heads, info.num_q_heads, selfcheck.options_signature(options))

    def compare() -> tuple[torch.Tensor, torch.Tensor, float]:
        outs = []
        for verdict in (True, False):
            probe = make_probe()
            probe.kernels_verdict = verdict
            try:
                outs.append(random_steps(probe, prefill, 3, device, layer.info.dtype))
            finally:
                probe.close()
        # a broken kernel is off by the outputs' own size; rounding that picks another code or ranks two close
        # tokens apart, far less
        return outs[0], outs[1], 1e-2 if layer.info.dtype == torch.float32 else 5e-2

    return selfcheck.trusted(kind, device, signature, compare)
