"""Bit packing of small unsigned integer codes into uint8, along the last dim.

``pack_bits(codes, bits)`` stores ``n`` codes of ``bits`` bits (1..8) each in ``ceil(n*bits/8)`` bytes;
``unpack_bits(packed, bits, n)`` returns them as int64, exactly. Leading dims are kept.

Widths that divide 8 (1, 2, 4, 8) use shifts on whole bytes (fast: decode unpacks the compressed store
block by block on every step); other widths (3, 5, 6, 7) go through a bit-plane layout.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "unpack_bits", "packed_size", "byte_codes", "lookup_packed"]


def packed_size(n: int, bits: int) -> int:
    """Bytes that `pack_bits` uses for ``n`` codes of ``bits`` bits."""
    _check_bits(bits)
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer ``codes`` in ``[0, 2**bits)`` (any integer dtype) along the last dim into uint8."""
    _check_bits(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise ValueError(f"codes must be an integer tensor, got {codes.dtype}")
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    if bits == 8:
        return codes.to(torch.uint8)
    if 8 % bits == 0:
        # Whole bytes: every shifted code stays below 256 and they share no bit, so uint8 arithmetic
        # is exact (and a quarter of the memory of int32 on a layer's worth of codes).
        per = 8 // bits
        c = codes.to(torch.uint8)
        pad = (-n) % per
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*lead, -1, per)
        shifts = torch.arange(per, device=c.device, dtype=torch.uint8) * bits
        return (c << shifts).sum(dim=-1, dtype=torch.uint8)
    c = codes.to(torch.int32)
    # Bit-plane path: code j occupies bits [j*bits, (j+1)*bits) of the little-endian bit stream.
    shifts = torch.arange(bits, device=c.device, dtype=torch.int32)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*lead, n * bits)
    pad = (-stream.shape[-1]) % 8
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    stream = stream.reshape(*lead, -1, 8)
    weights = torch.arange(8, device=c.device, dtype=torch.int32)
    return (stream << weights).sum(dim=-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first ``n`` codes along the last dim, as int64."""
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed must be uint8, got {packed.dtype}")
    lead = packed.shape[:-1]
    if packed.shape[-1] < packed_size(n, bits):
        raise ValueError(f"{packed.shape[-1]} bytes cannot hold {n} codes of {bits} bits")
    if bits == 8:
        return packed[..., :n].long()
    p = packed.to(torch.int32)
    mask = (1 << bits) - 1
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=p.device, dtype=torch.int32) * bits
        return ((p.unsqueeze(-1) >> shifts) & mask).reshape(*lead, -1)[..., :n].long()
    weights = torch.arange(8, device=p.device, dtype=torch.int32)
    stream = ((p.unsqueeze(-1) >> weights) & 1).reshape(*lead, -1)[..., : n * bits]
    stream = stream.reshape(*lead, n, bits)
    shifts = torch.arange(bits, device=p.device, dtype=torch.int32)
    return (stream << shifts).sum(dim=-1).long()


def byte_codes(bits: int, device=None) -> torch.Tensor:
    """``[256, 8 // bits]`` int64: the codes `pack_bits` stores in each byte value (``bits`` dividing 8)."""
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"byte_codes needs bits dividing 8, got {bits!r}")
    per = 8 // bits
    byte = torch.arange(256, device=device).unsqueeze(1)
    return (byte >> (torch.arange(per, device=device) * bits)) & ((1 << bits) - 1)


def lookup_packed(packed: torch.Tensor, byte_values: torch.Tensor, n: int) -> torch.Tensor:
    """``values[unpack_bits(packed, bits, n)]`` in one gather: ``byte_values`` is ``values[byte_codes(bits)]``
    (``[256, 8 // bits]``), so each byte yields its codes' values at once, with no shifting or masking."""
    out = byte_values[packed.long()]                     # [..., bytes, 8/bits]
    return out.reshape(*out.shape[:-2], -1)[..., :n]
