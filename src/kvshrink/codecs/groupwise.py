"""Asymmetric integer quantization in groups along the last dim (KIVI-style), bit-packed.

Each group of ``group_size`` consecutive values along the last dim gets its own zero point (the group
minimum) and step (``(max - min) / (2**bits - 1)``), both stored as fp16; the codes are
``round((x - zero) / step)`` in ``[0, 2**bits)``, packed with :mod:`kvshrink.codecs.bitpack`.

The fp16 zero point and step are rounded *before* the codes are chosen, so decoding with the stored
values gives an error of at most ``step / 2`` per element (plus the fp16 rounding of the zero point,
about ``2**-11 * |min|``).

KIVI quantizes keys per channel (a group = one channel over ``group_size`` tokens) and values per
token (a group = ``group_size`` channels of one token): callers choose the layout by putting the
grouped axis last (``keys.transpose(-1, -2)`` for per-channel groups).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .bitpack import pack_bits, packed_size, unpack_bits

__all__ = ["GroupCode", "quantize_groups", "dequantize_groups", "GROUPWISE_BITS", "group_code_bytes"]

GROUPWISE_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


@dataclass
class GroupCode:
    """Codes of a tensor ``[..., n]`` quantized in groups of ``group_size`` along the last dim."""

    codes: torch.Tensor  # [..., n // group_size, packed_size(group_size, bits)] uint8
    scale: torch.Tensor  # [..., n // group_size] fp16 step
    zero: torch.Tensor  # [..., n // group_size] fp16 group minimum
    bits: int
    group_size: int

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scale, self.zero]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def group_code_bytes(numel: int, bits: int, group_size: int) -> int:
    """Bytes a :class:`GroupCode` of ``numel`` values uses (codes + fp16 step and zero per group)."""
    groups = numel // group_size
    return groups * (packed_size(group_size, bits) + 4)


def _check(x: torch.Tensor, bits: int, group_size: int) -> None:
    if bits not in GROUPWISE_BITS:
        raise ValueError(f"groupwise bits must be one of {GROUPWISE_BITS}, got {bits!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if x.shape[-1] % group_size:
        raise ValueError(f"last dim {x.shape[-1]} is not a multiple of group_size {group_size}")
    if not x.dtype.is_floating_point:
        raise ValueError(f"expected a floating-point tensor, got {x.dtype}")


def quantize_groups(x: torch.Tensor, bits: int, group_size: int) -> GroupCode:
    """Asymmetric ``bits``-bit quantization of ``x [..., n]`` in groups of ``group_size`` along the last dim."""
    _check(x, bits, group_size)
    lead = x.shape[:-1]
    g = x.float().reshape(*lead, -1, group_size)
    lo = g.amin(dim=-1)
    hi = g.amax(dim=-1)
    levels = (1 << bits) - 1
    zero = lo.to(torch.float16)
    scale = ((hi - zero.float()) / levels).to(torch.float16)
    step = scale.float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    codes = torch.round((g - zero.float().unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, levels)
    return GroupCode(pack_bits(codes.to(torch.uint8), bits), scale, zero, bits, group_size)


def dequantize_groups(code: GroupCode, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The tensor ``[..., n]`` a :class:`GroupCode` stands for."""
    q = unpack_bits(code.codes, code.bits, code.group_size).to(dtype)
    x = q * code.scale.to(dtype).unsqueeze(-1) + code.zero.to(dtype).unsqueeze(-1)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])  # not -1: a set of no vectors is valid
