"""``kivi`` (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache").

Keys are quantized per channel (one zero point and step per channel over each group of ``group``
tokens), values per token (one per ``group`` channels of a token), both asymmetric at ``bits`` bits and
bit-packed (``codecs/groupwise.py``). The most recent tokens wait in an exact fp16 residual: once it
holds more than ``residual`` tokens, the oldest whole groups of ``group`` tokens beyond it are
quantized, so it holds ``residual`` to ``residual + group - 1`` tokens.

Attention reads the packed form block by block (``block`` tokens dequantized at a time, one partial
per block, merged by log-sum-exp), never the whole history at once.

Also home of :class:`ExactTail`, the exact recent-token segment KIVI and TurboQuant share.
"""

from __future__ import annotations

import torch

from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.registry import Option, register_method
from kvshrink.cache.store import held_bytes, to_storage
from kvshrink.codecs.groupwise import GroupCode, dequantize_groups, quantize_groups
from kvshrink.methods.h2o import storage_dtype

# Tokens dequantized at once when attending over a packed segment.
DEQUANT_BLOCK = 1024


class ExactTail:
    """The newest tokens ``[B, H_kv, n, d]`` kept exactly; their indices are ``start .. start+n-1``."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.clear()

    def clear(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.start = 0

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        key, value = to_storage(key, self.dtype), to_storage(value, self.dtype)
        if self.keys is None:
            self.keys, self.values = key.contiguous(), value.contiguous()
        else:
            self.keys = torch.cat([self.keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)

    def pop_oldest(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the ``n`` oldest tokens."""
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        # clone, not contiguous(): a slice that is already contiguous would keep the old storage alive
        rest = len(self) - n
        self.keys = self.keys[:, :, n:].clone() if rest else None
        self.values = self.values[:, :, n:].clone() if rest else None
        self.start += n
        return k, v

    def partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if not len(self):
            return []
        index = torch.arange(self.start, self.start + len(self), device=self.keys.device)
        return [exact_partial(query, self.keys, self.values, ctx.scaling, key_index=index, pad_len=ctx.pad_len)]

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.keys, self.values]

    def nbytes(self) -> int:
        return held_bytes(self.tensors())


def fill_padding(x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """A copy of ``x [B, H, q, d]`` (this step's tokens) whose left-padding tokens repeat the row's first
    real token, so padding never widens a quantization range shared with real tokens."""
    if ctx.pad_len is None:
        return x
    b, h, q, d = x.shape
    is_pad = ctx.new_index[None, :] < ctx.pad_len[:, None]  # [B, q]
    first_real = (ctx.pad_len - ctx.past_len).clamp(0, q - 1)
    source = x.gather(2, first_real[:, None, None, None].expand(b, h, 1, d))
    return torch.where(is_pad[:, None, :, None], source, x)


def _cat_codes(a: GroupCode | None, b: GroupCode, dim: int) -> GroupCode:
    """Concatenate codes along token dim ``dim`` of the scale tensors (codes have one more dim)."""
    if a is None:
        return b
    dim_codes = dim if dim >= 0 else dim - 1
    return GroupCode(torch.cat([a.codes, b.codes], dim=dim_codes), torch.cat([a.scale, b.scale], dim=dim),
                     torch.cat([a.zero, b.zero], dim=dim), b.bits, b.group_size)


def _slice_codes(c: GroupCode, dim: int, start: int, stop: int) -> GroupCode:
    dim_codes = dim if dim >= 0 else dim - 1
    return GroupCode(c.codes.narrow(dim_codes, start, stop - start), c.scale.narrow(dim, start, stop - start),
                     c.zero.narrow(dim, start, stop - start), c.bits, c.group_size)


@register_method(
    "kivi",
    "KIVI: asymmetric 2/4-bit quantization, keys per channel and values per token in groups, exact recent residual",
    options={
        "bits": Option(2, "bits per key and value element", choices=(2, 4)),
        "group": Option(32, "group size: tokens per key group (per channel), channels per value group (per token)"),
        "residual": Option(128, "most recent tokens kept exactly (fp16) until whole groups beyond them form"),
    },
)
class KiviLayer(CacheLayer):
    commit_needs_attention = False  # quantizing needs only the keys and values
    def __init__(self, spec: LayerSpec, bits: int = 2, group: int = 32, residual: int = 128):
        super().__init__(spec)
        if group < 1 or residual < 0:
            raise ValueError(f"kivi needs group >= 1 and residual >= 0, got group={group}, residual={residual}")
        if self.info.head_dim % group:
            raise NotImplementedError(
                f"kivi groups values per token in groups of {group} channels; head size {self.info.head_dim} is "
                "not a multiple of it (choose a group that divides the head size)"
            )
        self.bits, self.group, self.residual = bits, group, residual
        self.tail = ExactTail(storage_dtype(self.info.dtype))
        self.clear()

    def clear(self) -> None:
        self.tail.clear()
        self.key_codes: GroupCode | None = None  # scale [B, H, d, groups]: per channel, per token group
        self.value_codes: GroupCode | None = None  # scale [B, H, tokens, d // group]: per token
        self.quantized = 0

    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        parts = []
        step = max(self.group, DEQUANT_BLOCK // self.group * self.group)
        for start in range(0, self.quantized, step):
            stop = min(self.quantized, start + step)
            key, value = self._dequantize(start, stop)
            index = torch.arange(start, stop, device=key.device)
            parts.append(exact_partial(query, key, value, ctx.scaling, key_index=index, pad_len=ctx.pad_len))
        return parts + self.tail.partials(query, ctx)

    def _dequantize(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        keys = dequantize_groups(_slice_codes(self.key_codes, -1, start // g, stop // g)).transpose(-1, -2)
        values = dequantize_groups(_slice_codes(self.value_codes, 2, start, stop))
        return keys, values

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        self.tail.append(fill_padding(key, ctx), fill_padding(value, ctx))
        flush = (len(self.tail) - self.residual) // self.group * self.group
        if flush > 0:
            k, v = self.tail.pop_oldest(flush)
            self.key_codes = _cat_codes(self.key_codes, quantize_groups(k.transpose(-1, -2), self.bits, self.group), -1)
            self.value_codes = _cat_codes(self.value_codes, quantize_groups(v, self.bits, self.group), 2)
            self.quantized += flush

    def _code_tensors(self) -> list[torch.Tensor]:
        return [t for c in (self.key_codes, self.value_codes) if c is not None for t in c.tensors()]

    def nbytes(self) -> int:
        return held_bytes(self._code_tensors()) + self.tail.nbytes()

    def breakdown(self) -> dict[str, int]:
        codes = [c.codes for c in (self.key_codes, self.value_codes) if c is not None]
        scales = [t for c in (self.key_codes, self.value_codes) if c is not None for t in (c.scale, c.zero)]
        return {"codes": held_bytes(codes), "scales": held_bytes(scales), "exact": self.tail.nbytes()}

    def stats(self) -> dict[str, float]:
        return {"quantized_tokens": float(self.quantized), "exact_tokens": float(len(self.tail))}
