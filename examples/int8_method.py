"""A complete kvshrink method in a few dozen lines: every token's keys and values in int8.

Each new token's key and value vectors are quantized per (row, head, token) to int8 with one fp16
scale (absmax / 127): about 3.8x smaller than an fp32 cache, 1.9x smaller than fp16. Attention over
the stored tokens dequantizes them and uses the framework's exact kernel, which handles grouped
queries, left padding and the log-sum-exp the framework needs to merge it with the new tokens.

Register it by importing this file, then use it like any built-in method:

    import int8_method                       # runs @register_method
    cache = kvshrink.make_cache("int8-example", model, scale_dtype="float16")

tests/test_example_method.py runs it against ``full`` on a tiny model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.store import STORAGE_DTYPES, held_bytes


def quantize(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., d]`` -> int8 codes and one scale per vector (symmetric, absmax / 127)."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-8) / 127
    codes = torch.round(x.float() / scale).clamp(-127, 127).to(torch.int8)
    return codes, scale.to(scale_dtype)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.float() * scale.float()


@dataclass
class Int8Options:  # each field is an option: make_cache(..., scale_dtype="float32"), `kvshrink methods`
    scale_dtype: str = option("float16", "dtype of the per-vector scales", choices=tuple(STORAGE_DTYPES))


@register_method("int8-example", "worked example: int8 keys and values, one scale per vector", options=Int8Options)
class Int8Layer(CacheLayer):
    commit_needs_attention = False  # commit() only stores: a shared prefill may skip this layer's attention

    def __init__(self, spec: LayerSpec, options: Int8Options):
        super().__init__(spec)
        self.scale_dtype = STORAGE_DTYPES[options.scale_dtype]
        self.clear()

    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if not self.parts:
            return []
        keys, values = (dequantize(*self.parts[name]).to(query.dtype) for name in ("key", "value"))
        # every stored token is in the query's past: token indices only matter for left padding
        index = torch.arange(keys.shape[2], device=keys.device)
        return [exact_partial(query, keys, values, ctx.scaling, key_index=index, pad_len=ctx.pad_len)]

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        for name, x in (("key", key), ("value", value)):
            codes, scale = quantize(x, self.scale_dtype)
            if name in self.parts:
                old_codes, old_scale = self.parts[name]
                codes, scale = torch.cat([old_codes, codes], 2), torch.cat([old_scale, scale], 2)
            self.parts[name] = (codes, scale)

    def nbytes(self) -> int:
        return held_bytes(t for pair in self.parts.values() for t in pair)

    def breakdown(self) -> dict[str, int]:
        return {f"{name} {kind}": held_bytes([t]) for name, pair in self.parts.items()
                for kind, t in zip(("codes", "scales"), pair)}

    def clear(self) -> None:
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
